"""`model.load_state_dict` on a sharded model (partition/load_state.py).

World 2 (one spawned group, every case in it): one step on other weights, then `load_state_dict`
of new weights, then more steps: losses and weights equal plain PyTorch doing the same with
`torch.optim.AdamW` (whose moments a model load leaves alone, as ours are): stages 0, 2 and 3, fp32
and bf16, parameters and optimizer states on the host and NVMe, and the zoo model (a weight tied
across units, frozen parameters). Before this, the masters kept the old values and the next step
undid the load (stages 0-2), or stage 3 refused it with a size mismatch.
World 1 in process: bf16 masters take the loaded fp32 values unrounded; `strict=False` with one
block's keys changes that block alone; a load into a submodule reaches its unit; `assign=True` is
refused; a shape mismatch is PyTorch's error and leaves the model usable; HF weights and PEFT
adapters load; a load between `zeroinf.init` and `shard` is refused; a resume from `torch.save`d
state dicts is bit for bit in either order.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, train_rank_slices

STEPS = 4  # step 0 on the weights built, the load, steps 1-3 on the loaded weights
TOLERANCES = {"fp32": (1e-5, 5e-5), "bf16": (2e-2, 0.5 * LR * STEPS)}  # as tests/test_parity.py
CASES = [  # (name, model, stage, dtype, params tier, optimizer tier)
    ("s0-fp32", "tiny_gpt", 0, "fp32", "device", "device"),
    ("s2-bf16-opt-host", "tiny_gpt", 2, "bf16", "device", "host"),
    ("s3-fp32-nvme", "tiny_gpt", 3, "fp32", "nvme", "nvme"),
    ("s3-bf16-nvme", "tiny_gpt", 3, "bf16", "nvme", "nvme"),
    ("s3-bf16-host", "tiny_gpt", 3, "bf16", "host", "host"),
    ("zoo-s3-fp32-nvme", "zoo", 3, "fp32", "nvme", "host"),
]


def loaded_weights(model_name: str) -> dict[str, torch.Tensor]:
    """The state dict loaded after step 0: another seed's model, with values finer than bf16's grid
    (tied weights stay tied: one value under each of their names)."""
    model = build_model(model_name, seed=7)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4 * torch.randn(p.shape, generator=gen))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _cfg(stage: int, dtype: str, params: str, optimizer: str, folder: str) -> zeroinf.Config:
    nvme = folder if "nvme" in (params, optimizer) else None
    return zeroinf.Config(
        stage=stage, param_dtype=dtype, persist_threshold_bytes=0,
        offload=zeroinf.OffloadConfig(params=params, optimizer=optimizer, nvme_dir=nvme),
    )


def _rank_cases(rank: int, world: int, root: str) -> dict[str, Any]:
    out = {}
    for name, model_name, stage, dtype, params, optimizer in CASES:
        folder = os.path.join(root, f"{name}-rank{rank}")
        model = zeroinf.shard(build_model(model_name, seed=1), _cfg(stage, dtype, params, optimizer, folder))
        opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
        losses = train_rank_slices(model, opt, rank, world, 0, 1)
        result = model.load_state_dict(loaded_weights(model_name))
        assert not result.missing_keys and not result.unexpected_keys, result
        losses += train_rank_slices(model, opt, rank, world, 1, STEPS)
        full = model.state_dict()  # a collective: every rank
        names = {n for n, _ in model.named_parameters()}
        out[name] = {
            "losses": losses,
            "weights": {n: t.float() for n, t in full.items() if n in names} if rank == 0 else None,
        }
        opt.close()
    return out


def reference(model_name: str, dtype: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch, whole global batch: fp32 masters, a compute copy in `dtype`; the same load."""
    master = build_model(model_name, seed=1)
    opt = torch.optim.AdamW(master.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        if step == 1:
            master.load_state_dict(loaded_weights(model_name))
        compute = master if dtype == "fp32" else copy.deepcopy(master).to(torch.bfloat16)
        loss = compute(*global_batch(step))
        loss.backward()
        if compute is not master:
            for c, m in zip(compute.parameters(), master.parameters(), strict=True):
                m.grad = None if c.grad is None else c.grad.float()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in master.named_parameters()}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("load-state"))
    per_rank = run_ranks(_rank_cases, 2, root, timeout_s=300)
    return {name: [r[name] for r in per_rank] for name, *_ in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_a_load_between_steps_matches_plain_pytorch(results: dict[str, Any], case: tuple) -> None:
    name, model_name, _, dtype, *_ = case
    ref_losses, ref_weights = reference(model_name, dtype)
    loss_rtol, weight_atol = TOLERANCES[dtype]
    ours = results[name][0]
    assert ours["losses"] == pytest.approx(ref_losses, rel=loss_rtol), f"{name}: {ours['losses']} vs {ref_losses}"
    assert results[name][1]["losses"] == ours["losses"]
    for n, ref in ref_weights.items():
        torch.testing.assert_close(
            ours["weights"][n], ref, rtol=loss_rtol if dtype == "fp32" else 0, atol=weight_atol,
            msg=lambda m, n=n: f"{name}: weight {n}: {m}",
        )


def _built(tmp_path: Any, stage: int = 3, dtype: str = "bf16") -> tuple[torch.nn.Module, zeroinf.AdamW]:
    params = "nvme" if stage == 3 else "device"
    model = zeroinf.shard(build_model(seed=1), _cfg(stage, dtype, params, "nvme", str(tmp_path)))
    opt = zeroinf.AdamW(model, lr=LR)
    train_rank_slices(model, opt, 0, 1, 0, 1)
    return model, opt


def check_bf16_masters_take_the_loaded_fp32_values(model: torch.nn.Module, opt: zeroinf.AdamW) -> None:
    """Load fp32 weights finer than bf16's grid into a bf16 model: every fp32 master equals them bit
    for bit, and the model's (bf16) state dict is their rounding. On the model's device (the CUDA
    tests call this too)."""
    sd = loaded_weights("tiny_gpt")
    model.load_state_dict(sd)
    assert all(torch.equal(v.cpu(), sd[k].to(v.dtype)) for k, v in model.state_dict().items())
    engine = zeroinf.engine_of(model)
    for ui, unit in enumerate(engine.units):
        expected = torch.zeros(unit.owned_end - unit.owned_start)
        for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
            flat = sd[unit.param_names[piece.slot_index]].reshape(-1)
            expected[piece.start - unit.owned_start : piece.end - unit.owned_start] = flat[
                piece.param_offset : piece.param_offset + piece.numel
            ]
        master = opt.states.read_unit(ui).master.cpu()
        assert torch.equal(master, expected), f"unit {unit.name}: masters differ from the loaded fp32 values"
        assert not torch.equal(master, master.bfloat16().float()), "the values must be finer than bf16's grid"


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_masters_take_the_loaded_fp32_values_unrounded(tmp_path: Any, stage: int) -> None:
    model, opt = _built(tmp_path, stage)
    check_bf16_masters_take_the_loaded_fp32_values(model, opt)
    opt.close()


def test_a_partial_load_changes_only_its_keys(tmp_path: Any) -> None:
    model, opt = _built(tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = {k: v for k, v in loaded_weights("tiny_gpt").items() if k.startswith("blocks.1.")}
    result = model.load_state_dict(new, strict=False)
    assert not result.unexpected_keys and len(result.missing_keys) == len(before) - len(new)
    after = model.state_dict()
    for k, v in after.items():
        expected = new[k].to(v.dtype) if k in new else before[k]
        assert torch.equal(v, expected), k
    opt.close()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_load_into_a_submodule_reaches_its_unit(tmp_path: Any, stage: int) -> None:
    """`model.ln_f.load_state_dict(...)` (a module inside the root unit) and
    `model.blocks[1].ln1.load_state_dict(...)` (inside a block's unit) survive a step with lr 0."""
    model = zeroinf.shard(build_model(seed=1), _cfg(stage, "fp32", "device", "host", str(tmp_path)))
    opt = zeroinf.AdamW(model, lr=0.0, weight_decay=0.0)
    train_rank_slices(model, opt, 0, 1, 0, 1)
    norm = {"weight": torch.full((32,), 2.0), "bias": torch.full((32,), 0.5)}
    model.ln_f.load_state_dict(norm)
    model.blocks[1].ln1.load_state_dict(norm)
    train_rank_slices(model, opt, 0, 1, 1, 2)
    after = model.state_dict()
    for prefix in ("ln_f.", "blocks.1.ln1."):
        assert all(torch.equal(after[prefix + k], v) for k, v in norm.items()), prefix
    opt.close()


def test_assign_true_is_refused(tmp_path: Any) -> None:
    model, opt = _built(tmp_path)
    with pytest.raises(RuntimeError, match=r"assign=True\) on a model sharded by zeroinf"):
        model.load_state_dict(loaded_weights("tiny_gpt"), assign=True)
    opt.close()


def test_a_shape_mismatch_is_pytorchs_error_and_the_model_stays_usable(tmp_path: Any) -> None:
    model, opt = _built(tmp_path)
    sd = loaded_weights("tiny_gpt")
    sd["blocks.0.ln1.weight"] = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"size mismatch for blocks\.0\.ln1\.weight"):
        model.load_state_dict(sd)
    engine = zeroinf.engine_of(model)
    assert all(not u.user_writer and u.user_gathers == 0 for u in engine.all_units)
    assert torch.isfinite(torch.tensor(train_rank_slices(model, opt, 0, 1, 1, 2))).all()
    opt.close()


def test_hugging_face_weights_and_lora_adapters_load_at_stage_3(tmp_path: Any) -> None:
    """A Llama's full state dict into a stage-3 model with parameters on NVMe, and LoRA adapters
    through PEFT's `set_peft_model_state_dict` (a `strict=False` load) into a sharded PEFT model:
    the logits equal the source model's."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from tests._hf import build

    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    source = build("llama", seed=3)
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path))
    model = zeroinf.shard(build("llama", seed=0), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    result = model.load_state_dict(source.state_dict())
    assert not result.missing_keys and not result.unexpected_keys
    torch.testing.assert_close(model(ids).logits, source(ids).logits, rtol=1e-5, atol=1e-6)

    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    trained = get_peft_model(build("llama", seed=0), lora)
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:  # zero at init: give the adapters an effect
                p.normal_(generator=torch.Generator().manual_seed(5))
    stage3 = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    sharded = zeroinf.shard(get_peft_model(build("llama", seed=0), lora), stage3)
    loaded = set_peft_model_state_dict(sharded, get_peft_model_state_dict(trained))
    assert not loaded.unexpected_keys
    torch.testing.assert_close(sharded(ids).logits, trained(ids).logits, rtol=1e-5, atol=1e-6)


def test_a_load_between_zeroinf_init_and_shard_is_refused_and_one_inside_the_block_works() -> None:
    """After the `with zeroinf.init()` block the parameters are parked meta placeholders, into which
    PyTorch's copy is a no-op with only a warning: refused with the fix. Inside the block the
    construction mode unparks them for the copy; after `shard` the units load."""
    sd = loaded_weights("tiny_gpt")
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0)
    with zeroinf.init(cfg):
        outside = build_model(seed=1)
    with pytest.raises(RuntimeError, match=r"not sharded yet \(pos\).* Load after `model = zeroinf\.shard"):
        outside.load_state_dict(sd)
    outside = zeroinf.shard(outside, cfg)
    outside.load_state_dict(sd)
    with zeroinf.init(cfg):
        inside = build_model(seed=1)
        inside.load_state_dict(sd)
    inside = zeroinf.shard(inside, cfg)
    for model in (outside, inside):
        assert all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("order", ["model-first", "optimizer-first"])
@pytest.mark.parametrize("stage", [2, 3])
def test_resuming_from_torch_state_dicts_continues_bitwise(stage: int, order: str) -> None:
    """`torch.save({"model": model.state_dict(), "opt": opt.state_dict()})` and back, in bf16, in
    either order: the resumed run equals the uninterrupted one bit for bit. The model's bf16 values
    must not round the fp32 masters the optimizer's state restored."""
    import io

    cfg = zeroinf.Config(stage=stage, param_dtype="bf16", persist_threshold_bytes=0)
    runs = []
    for resumed in (False, True):
        model = zeroinf.shard(build_model(seed=1), cfg)
        opt = zeroinf.AdamW(model, lr=LR)
        train_rank_slices(model, opt, 0, 1, 0, 2)
        if resumed:
            saved = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
            saved.seek(0)
            state = torch.load(saved, weights_only=False)
            model = zeroinf.shard(build_model(seed=5), cfg)
            opt = zeroinf.AdamW(model, lr=LR)
            if order == "model-first":
                model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            if order == "optimizer-first":
                model.load_state_dict(state["model"])
        losses = train_rank_slices(model, opt, 0, 1, 2, 4)
        runs.append((losses, model.state_dict()))
    (losses, weights), (resumed_losses, resumed_weights) = runs
    assert resumed_losses == losses
    assert all(torch.equal(resumed_weights[k], v) for k, v in weights.items())
