"""A user's own accelerate loop around a sharded model: `accelerator.prepare(model, opt, loader)`.

`zeroinf.shard` and `zeroinf.AdamW` carry accelerate's prepared flag, so `prepare` hands them back
unchanged (integrations/trainer.py [Note: accelerate and the sharded model]). Before, accelerate
moved the model (world 2: wrapped it in DDP too) and the next forward stopped with the engine's
"converted after zeroinf.shard" error. World 2 (one spawned group), a tiny Hugging Face Llama,
`accelerator.backward` and the prepared optimizer, against plain PyTorch on the whole batch: the
same losses, weights within 1e-6, at stage 0 and at stage 3 with parameters and optimizer on the host.
Then `accelerator.accumulate(model)` over 2 batches (`Config.grad_accum_steps=2`), `step()` and
`zero_grad()` called on every batch as accelerate's examples do: they act on the second only
(integrations/accelerate_loop.py), as plain PyTorch accumulating the two, and
`accelerator.clip_grad_norm_` on the last returns plain PyTorch's norm (optim/torch_clip.py) and the
step clips with it (`Config.grad_clip_norm`); and an Accelerator that
accumulates over 2 batches beside `grad_accum_steps=1` is refused at the step, naming both.

`accelerator.prepare(model, opt, scheduler)` stopped in accelerate (`'AdamW' object has no attribute
'optimizer'`); now the scheduler is prepared and steps with the optimizer. `accelerator.save_state` /
`load_state` stopped in safetensors at stages 0-2 (the parameters share their unit's buffer:
partition/state_entries.py); then at stage 3 accelerate wrote rank 0's optimizer shard alone and the
load was refused. Now (integrations/accelerate_loop.py [Note: accelerate's save_state of sharded
states]) a world-2 run saved after 2 steps resumes in new processes bitwise at stage 0, stage 3 on
the host, and stage 3 on NVMe in bf16 (the fp32 masters ride along); at world 1 from world 2's file;
and across: a plain accelerate run (DDP, torch AdamW) continues under zeroinf, a zeroinf run as a
plain one, each continuing as the run that saved.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroinf

STAGES = [(0, "device"), (3, "host")]
CLIP = 0.8  # clips the first step, not the second


def _loop(rank: int, world: int, stage: int, tier: str) -> dict[str, Any]:
    from accelerate import Accelerator

    from tests._hf import build

    accelerator = Accelerator(cpu=True)
    plain = build("llama", 0)
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier) if stage == 3 else zeroinf.OffloadConfig()
    model = zeroinf.shard(copy.deepcopy(plain), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    prepared_model, prepared_opt = accelerator.prepare(model, opt)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = x[rank * 4 // world : (rank + 1) * 4 // world]
    losses = []
    for _ in range(3):
        loss = prepared_model(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        prepared_opt.step()
        prepared_opt.zero_grad()
        plain_loss = plain(input_ids=x, labels=x).loss
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean.item() / world, plain_loss.item()))
    state = model.state_dict()
    out = {
        "unchanged": prepared_model is model and prepared_opt is opt, "losses": losses,
        "diff": max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def _accumulate(rank: int, world: int) -> dict[str, Any]:
    from accelerate import Accelerator

    from tests._hf import build
    from zeroinf.integrations.accelerate_loop import AccelerateAccumulationError

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    plain = build("llama", 0)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, grad_accum_steps=2, grad_clip_norm=CLIP)
    sharded = zeroinf.shard(copy.deepcopy(plain), cfg)
    model, opt = accelerator.prepare(sharded, zeroinf.AdamW(sharded, lr=1e-3))
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(1)
    norms = []
    for _ in range(2):  # optimizer steps
        for _ in range(2):  # batches accumulated into each
            x = torch.randint(0, 128, (4, 16), generator=g)
            rows = x[rank * 4 // world : (rank + 1) * 4 // world]
            with accelerator.accumulate(model):
                accelerator.backward(model(input_ids=rows, labels=rows).loss)
                if accelerator.sync_gradients:  # as accelerate's examples clip
                    norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
            (plain(input_ids=x, labels=x).loss / 2).backward()
        norms.append((norm.item(), torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP).item()))
        plain_opt.step()
        plain_opt.zero_grad()
    state = model.state_dict()
    out: dict[str, Any] = {
        "diff": max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items()), "norms": norms
    }
    opt.close()
    zeroinf.engine_of(model).close()
    mismatched = zeroinf.shard(build("llama", 0), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    mismatched_opt = zeroinf.AdamW(mismatched, lr=1e-3)
    accelerator.backward(mismatched(input_ids=rows, labels=rows).loss)
    try:
        mismatched_opt.step()
    except AccelerateAccumulationError as exc:
        out["mismatch_error"] = str(exc)
    return out


# save_state / load_state cases: (who saves, who loads, stage, placement, parameter dtype). "plain" is
# accelerate's own path (DDP over a torch AdamW), the others a zeroinf model and zeroinf.AdamW.
SAVE_CASES = {
    "stage0": ("zeroinf", "zeroinf", 0, "device", "fp32"),
    "stage3-host": ("zeroinf", "zeroinf", 3, "host", "fp32"),
    "stage3-nvme-bf16": ("zeroinf", "zeroinf", 3, "nvme", "bf16"),
    "plain-to-zeroinf": ("plain", "zeroinf", 3, "host", "fp32"),
    "zeroinf-to-plain": ("zeroinf", "plain", 3, "host", "fp32"),
    # zeroinf.integrations.sharded_save_state: every rank writes its piece with zeroinf.save
    "stage3-nvme-bf16-sharded": ("zeroinf", "zeroinf", 3, "nvme", "bf16"),
    "stage3-host-sharded": ("zeroinf", "zeroinf", 3, "host", "fp32"),
}


def _prepared(accelerator: Any, kind: str, stage: int, tier: str, dtype: str, nvme: str) -> tuple[Any, Any, Any]:
    from tests._hf import build

    model = build("llama", 0)
    if kind == "plain":
        opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    else:
        offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=nvme if tier == "nvme" else None)
        cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, param_dtype=dtype, offload=offload)
        model = zeroinf.shard(model, cfg)
        opt = zeroinf.AdamW(model, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return accelerator.prepare(model, opt, scheduler)


def _step(accelerator: Any, model: Any, opt: Any, scheduler: Any, rows: torch.Tensor, world: int) -> float:
    """One training step through accelerate; the loss averaged over the ranks."""
    loss = model(input_ids=rows, labels=rows).loss
    accelerator.backward(loss)
    opt.step()
    scheduler.step()
    opt.zero_grad()
    mean = loss.detach().float().clone()
    dist.all_reduce(mean)
    return mean.item() / world


def _save_or_load(rank: int, world: int, folder: str, nvme: str, load: bool, case: str) -> dict[str, Any]:
    """Two steps, `accelerator.save_state`, two more (load=False); or `load_state` of that folder in
    new processes (any world size), then two steps."""
    from accelerate import Accelerator

    saver, loader, stage, tier, dtype = SAVE_CASES[case]
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = x[rank * 4 // world : (rank + 1) * 4 // world]
    accelerator = Accelerator(cpu=True)
    model, opt, scheduler = _prepared(accelerator, loader if load else saver, stage, tier, dtype, nvme)
    if case.endswith("-sharded"):
        from zeroinf.integrations import sharded_save_state

        sharded_save_state(accelerator)

    def step() -> float:
        return _step(accelerator, model, opt, scheduler, rows, world)

    result: dict[str, Any] = {}
    try:
        if load:  # mmap: each rank reads the pages of its own pieces (README); one case, the default elsewhere
            accelerator.load_state(folder, load_kwargs={"mmap": True} if case == "stage3-nvme-bf16" else None)
        else:
            result["before"] = [step(), step()]
            accelerator.save_state(folder)
            accelerator.wait_for_everyone()  # rank 0 writes accelerate's files
            result["files"] = sorted(os.listdir(folder))
            result["optimizer_bytes"] = os.path.getsize(os.path.join(folder, "optimizer.bin"))
        result["after"] = [step(), step()]
        result["lr"] = scheduler.get_last_lr()
    except (ValueError, RuntimeError) as exc:
        result["refused"] = f"{type(exc).__name__}: {exc}"
    if isinstance(opt, zeroinf.AdamW):
        opt.close()
        zeroinf.engine_of(model).close()
    return result


def _saved_and_loaded(rank: int, world: int, root: str, load: bool, cases: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for case in cases:
        nvme = os.path.join(root, f"{case}-nvme-{'load' if load else 'save'}-{world}")
        os.makedirs(nvme, exist_ok=True)
        out[case] = _save_or_load(rank, world, os.path.join(root, case), nvme, load, case)
    return out


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("accelerate")
    from tests._harness import run_ranks

    root = str(tmp_path_factory.mktemp("accelerate-state"))
    cases = list(SAVE_CASES)
    return {
        "saved": run_ranks(_saved_and_loaded, 2, root, False, cases, timeout_s=300)[0],
        "loaded": run_ranks(_saved_and_loaded, 2, root, True, cases, timeout_s=300)[0],
        "loaded-world1": run_ranks(
            _saved_and_loaded, 1, root, True, ["stage3-host", "stage3-host-sharded"], timeout_s=300
        )[0],
    }


@pytest.mark.parametrize("case", ["stage0", "stage3-host", "stage3-nvme-bf16", "stage3-nvme-bf16-sharded"])
def test_accelerate_save_state_resumes_bitwise_at_any_stage_and_placement(saved_states: dict, case: str) -> None:
    """Sharded states (stage 3: each rank holds a piece) resume exactly: accelerate writes rank 0's
    dict, which holds the whole state with its fp32 masters (accelerate_loop.py [Note: accelerate's
    save_state of sharded states]). Before, rank 0's shard alone was written and the load refused."""
    saved, loaded = saved_states["saved"][case], saved_states["loaded"][case]
    assert "refused" not in saved and "refused" not in loaded, (saved, loaded)
    assert saved["before"][1] < saved["before"][0], saved
    assert loaded["after"] == saved["after"] and loaded["lr"] == saved["lr"], (saved, loaded)


@pytest.mark.parametrize("case", ["stage3-host", "stage3-host-sharded"])
def test_accelerate_save_state_of_two_ranks_resumes_on_one(saved_states: dict, case: str) -> None:
    """The file is indexed by parameter, not by shard (or is a zeroinf checkpoint, which reshards):
    world 2's checkpoint continues at world 1 (the same batch whole on one rank: equal within fp32
    reduction order)."""
    saved, loaded = saved_states["saved"][case], saved_states["loaded-world1"][case]
    assert "refused" not in loaded, loaded
    assert loaded["after"] == pytest.approx(saved["after"], rel=1e-5), (saved, loaded)
    # (The schedulers part here: accelerate's prepared scheduler advances once per process at each
    # step, so the learning rates after the load differ from world 2's by accelerate's design.)


def test_sharded_save_state_writes_each_ranks_piece_beside_a_small_optimizer_file(saved_states: dict) -> None:
    """zeroinf.integrations.sharded_save_state: the optimizer's file names the zeroinf checkpoint (a
    few hundred bytes), which holds both ranks' pieces; without it the file holds the whole state."""
    sharded, whole = saved_states["saved"]["stage3-host-sharded"], saved_states["saved"]["stage3-host"]
    assert "zeroinf_optimizer_0" in sharded["files"] and "zeroinf_optimizer_0" not in whole["files"], sharded
    assert sharded["optimizer_bytes"] < 2000 < whole["optimizer_bytes"], (sharded, whole)


@pytest.mark.parametrize("case", ["plain-to-zeroinf", "zeroinf-to-plain"])
def test_accelerate_save_state_moves_between_plain_and_zeroinf(saved_states: dict, case: str) -> None:
    """A plain accelerate run (DDP, torch AdamW) continues under zeroinf at stage 3 from its own
    save_state, and a zeroinf run's continues as a plain one: the file is torch.optim's format. The
    continued losses are those of the run that saved, continuing (fp32 parity tolerance)."""
    saved, loaded = saved_states["saved"][case], saved_states["loaded"][case]
    assert "refused" not in saved and "refused" not in loaded, (saved, loaded)
    assert loaded["after"] == pytest.approx(saved["after"], rel=1e-5), (saved, loaded)
    assert loaded["lr"] == saved["lr"], (saved, loaded)


def run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {f"{stage} {tier}": _loop(rank, world, stage, tier) for stage, tier in STAGES}
    out["accumulate"] = _accumulate(rank, world)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    pytest.importorskip("accelerate")
    from tests._harness import run_ranks

    return run_ranks(run, 2, timeout_s=240)


@pytest.mark.parametrize(("stage", "tier"), STAGES)
def test_accelerate_prepare_returns_the_sharded_model_and_it_trains(
    results: list[dict[str, Any]], stage: int, tier: str
) -> None:
    for rank, r in enumerate(results):
        case = r[f"{stage} {tier}"]
        assert case["unchanged"], rank
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in case["losses"]), (rank, case["losses"])
        assert case["diff"] <= 1e-6, (rank, case["diff"])


def test_accelerate_accumulate_steps_on_the_last_batch(results: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(results):
        assert r["accumulate"]["diff"] <= 1e-6, (rank, r["accumulate"]["diff"])
        norms = r["accumulate"]["norms"]
        assert all(ours == pytest.approx(plain, rel=1e-5) for ours, plain in norms), (rank, norms)
        assert any(plain > CLIP for _, plain in norms), (rank, norms)  # clipping triggered


def test_accelerate_accumulating_over_other_batches_than_the_engine_is_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        message = r["accumulate"].get("mismatch_error", "")
        assert "gradient_accumulation_steps=2" in message and "grad_accum_steps is 1" in message, message


def _each_node(rank: int, world: int, root: str, load: bool) -> dict[str, Any]:
    """`sharded_save_state` with accelerate's `save_on_each_node`: each rank a machine of its own
    (torchrun's GROUP_RANK and LOCAL_RANK) with its own folder; two steps, save_state, two more; or
    load_state from its own folder in new processes, then two steps."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from zeroinf.integrations import sharded_save_state

    os.environ["GROUP_RANK"], os.environ["LOCAL_RANK"] = str(rank), "0"
    folder, nvme = os.path.join(root, f"machine{rank}", "state"), os.path.join(root, f"machine{rank}", "nvme")
    os.makedirs(nvme, exist_ok=True)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = x[rank * 4 // world : (rank + 1) * 4 // world]
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(save_on_each_node=True))
    model, opt, scheduler = _prepared(accelerator, "zeroinf", 3, "nvme", "bf16", nvme)
    sharded_save_state(accelerator)
    result: dict[str, Any] = {}
    if load:
        accelerator.load_state(folder)
    else:
        result["before"] = [_step(accelerator, model, opt, scheduler, rows, world) for _ in range(2)]
        accelerator.save_state(folder)
        accelerator.wait_for_everyone()
        result["files"] = sorted(os.listdir(os.path.join(folder, "zeroinf_optimizer_0", "step_00000002")))
    result["after"] = [_step(accelerator, model, opt, scheduler, rows, world) for _ in range(2)]
    opt.close()
    zeroinf.engine_of(model).close()
    return result


def test_sharded_save_state_on_each_node_keeps_each_machines_piece_on_its_disk(tmp_path) -> None:
    """accelerate's `save_on_each_node` with `sharded_save_state`: each machine's folder holds its
    own rank's piece (node-local, checkpoint/saving.py [Note: node-local checkpoints]), and new
    processes resume from their own folders bitwise (stage 3 on NVMe, bf16)."""
    pytest.importorskip("accelerate")
    from tests._harness import run_ranks

    saved = run_ranks(_each_node, 2, str(tmp_path), False, timeout_s=300)
    loaded = run_ranks(_each_node, 2, str(tmp_path), True, timeout_s=300)
    for rank in range(2):
        assert saved[rank]["files"] == ["manifest.json", "module_state.bin", f"rank{rank:05d}.bin"], saved[rank]
        assert loaded[rank]["after"] == saved[rank]["after"], (rank, saved[rank], loaded[rank])
