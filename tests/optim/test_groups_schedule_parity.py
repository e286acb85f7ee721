"""Parameter groups, an LR schedule and frozen parameters together, against plain PyTorch, at world 3.

What a fine-tuning loop does: no weight decay and half the learning rate for norms, biases and the
position table; `torch.optim.lr_scheduler.LambdaLR` (warm-up, then a drop) stepped after every
`opt.step()`; some parameters frozen before `zeroinf.shard`. The step inside backward reads each
group's learning rate while the next backward runs, after the scheduler changed it; the optimizer
on the host or NVMe steps runs of parameters cut by group boundaries inside units whose shards
(world 3) do not divide evenly. One group of 3 ranks runs every case against
`torch.optim.AdamW` + `LambdaLR` on the whole batch, with tests/test_parity.py's fp32 tolerances.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch
from tests.test_parity import assert_matches_reference

WORLD, BATCH, STEPS = 3, 12, 6
FROZEN = ("blocks.1.fc.", "pos")  # name prefixes frozen before sharding (a whole Linear, a root parameter)
# name -> (stage, offload fields, extra Config fields, micro-steps, clip, frozen)
CASES: dict[str, tuple[int, dict[str, Any], dict[str, Any], int, float | None, bool]] = {
    "s1-onvme-accum2": (1, {"optimizer": "nvme"}, {}, 2, None, True),
    "s2-ohost-clip": (2, {"optimizer": "host"}, {}, 1, 0.02, False),
    "s3-device": (3, {}, {"persist_threshold_bytes": 0}, 1, None, True),
    "s3-pnvme-ohost-thread-ckpt": (
        3, {"params": "nvme", "optimizer": "host", "gradients": "host", "step_thread": True},
        {"persist_threshold_bytes": 0, "activation_checkpointing": True}, 2, None, True,
    ),
    "s3-phost-onvme-clip": (3, {"params": "host", "optimizer": "nvme"}, {"persist_threshold_bytes": 0}, 1, 0.5, True),
    "s3-pnvme-onvme-accum2-clip": (3, {"params": "nvme", "optimizer": "nvme"}, {}, 2, 0.02, False),
}


def lr_factor(step: int) -> float:
    """Warm-up over 3 steps, then half the learning rate from step 4."""
    return min(1.0, (step + 1) / 3) * (0.5 if step >= 4 else 1.0)


def freeze(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)
    return model


def groups(model: nn.Module) -> list[dict[str, Any]]:
    """Matrix weights decay at LR; norms, biases and the position table do not, at LR / 2."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decayed = [p for n, p in named if n.endswith("weight") and ".ln" not in n and not n.startswith("ln")]
    ids = {id(p) for p in decayed}
    rest = [p for _, p in named if id(p) not in ids]
    return [{"params": decayed}, {"params": rest, "weight_decay": 0.0, "lr": LR / 2}]


def reference(accum: int, clip: float | None, frozen: bool) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = build_model()
    if frozen:
        freeze(model)
    opt = torch.optim.AdamW(groups(model), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    micro = BATCH // accum
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, batch=BATCH)
        total = 0.0
        for m in range(accum):
            loss = model(x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]) / accum
            loss.backward()
            total += loss.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, [g["lr"] for g in opt.param_groups]


def run_case(rank: int, world: int, case: str, swap_root: str) -> dict[str, Any]:
    import zeroinf

    stage, offload, extra, accum, clip, frozen = CASES[case]
    if "nvme" in offload.values():
        offload = {**offload, "nvme_dir": tempfile.mkdtemp(dir=swap_root)}
    cfg = zeroinf.Config(
        stage=stage, grad_accum_steps=accum, grad_clip_norm=clip, offload=zeroinf.OffloadConfig(**offload), **extra
    )
    model = build_model()
    model = zeroinf.shard(freeze(model) if frozen else model, cfg)
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1, param_groups=groups(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    per_rank = BATCH // world
    micro = per_rank // accum
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step, batch=BATCH)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        total = torch.zeros(())
        for m in range(accum):
            loss = model(x[m * micro : (m + 1) * micro], y[m * micro : (m + 1) * micro]) / accum
            opt.backward(loss)
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        sched.step()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / world)
    state = model.state_dict()  # a collective at stage 3
    out = {
        "losses": losses,
        "weights": {n: t.float().clone() for n, t in state.items()} if rank == 0 else None,
        "lrs": [g["lr"] for g in opt.param_groups],
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def run_all(rank: int, world: int, swap_root: str) -> dict[str, dict[str, Any]]:
    return {case: run_case(rank, world, case, swap_root) for case in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    per_rank = run_ranks(run_all, WORLD, str(tmp_path_factory.mktemp("swap")), timeout_s=300)
    return {case: [r[case] for r in per_rank] for case in CASES}


@pytest.mark.parametrize("case", CASES)
def test_matches_plain_pytorch(results: dict[str, list[dict[str, Any]]], case: str) -> None:
    _, _, _, accum, clip, frozen = CASES[case]
    ref_losses, ref_weights, ref_lrs = reference(accum, clip, frozen)
    ours = results[case]
    assert_matches_reference(f"{case} world {WORLD}", ours, ref_losses, ref_weights, "fp32")
    assert ours[0]["lrs"] == pytest.approx(ref_lrs), "the schedule left other learning rates"
    if frozen:  # frozen parameters kept their initial values exactly
        initial = dict(build_model().named_parameters())
        for name, value in ours[0]["weights"].items():
            if name.startswith(FROZEN):
                assert torch.equal(value, initial[name].detach()), name
