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
partition/state_entries.py); now a world-2 stage-0 run saved after 2 steps resumes in new processes
bitwise, and at stage 3, where accelerate saves rank 0's optimizer shard alone, loading is refused
naming zeroinf.save / zeroinf.load.
"""

from __future__ import annotations

import copy
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


def _state(rank: int, world: int, folder: str, stage: int, load: bool) -> dict[str, Any]:
    """Two steps, `accelerator.save_state`, two more (load=False); or `load_state`, then two steps."""
    from accelerate import Accelerator

    from tests._hf import build

    accelerator = Accelerator(cpu=True)
    model = zeroinf.shard(build("llama", 0), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, scheduler = accelerator.prepare(model, opt, scheduler)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = x[rank * 4 // world : (rank + 1) * 4 // world]

    def step() -> float:
        loss = model(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        opt.step()
        scheduler.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / world

    out: dict[str, Any] = {}
    try:
        if load:
            accelerator.load_state(folder)
        else:
            out["before"] = [step(), step()]
            accelerator.save_state(folder)
        out["after"] = [step(), step()]
        out["lr"] = scheduler.get_last_lr()
    except ValueError as exc:
        out["refused"] = str(exc)
    return out


@pytest.fixture(scope="module")
def states(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    pytest.importorskip("accelerate")
    from tests._harness import run_ranks

    out = {}
    for stage in (0, 3):
        folder = str(tmp_path_factory.mktemp(f"accelerate-state-{stage}"))
        saved = run_ranks(_state, 2, folder, stage, False, timeout_s=240)[0]
        out[stage] = (saved, run_ranks(_state, 2, folder, stage, True, timeout_s=240)[0])
    return out


def test_accelerate_prepares_the_scheduler_and_save_state_resumes_bitwise(states: dict) -> None:
    saved, loaded = states[0]
    assert saved["before"][1] < saved["before"][0], saved
    assert loaded["after"] == saved["after"] and loaded["lr"] == saved["lr"], (saved, loaded)


def test_accelerate_load_state_of_sharded_optimizer_states_is_refused_with_the_fix(states: dict) -> None:
    saved, loaded = states[3]
    assert "after" in saved, saved
    assert "each rank's state holds only its own shard" in loaded["refused"], loaded
    assert "zeroinf.save / zeroinf.load" in loaded["refused"], loaded


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
