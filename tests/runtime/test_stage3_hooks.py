"""Stage 3's unit hooks inside activation checkpoints (runtime/stage3_hooks.py [Note: a reentrant
checkpoint around a unit's hooks]).

`checkpoint(block, x, use_reentrant=True)` runs the block's hooks under no_grad, then again in the
recompute inside backward (transformers up to 5.17 checkpoints its layers' `__call__` this way). That
recompute is the unit's pre-backward: every steady step gathers each unit once, as without
checkpoints and with non-reentrant ones (before, every block but the last was gathered again), the
backward trace holds every unit, and training equals plain PyTorch with the same checkpoints, with
the optimizer on the device, and on the host and on NVMe with its step inside backward (whose
preparation of a unit's states the recompute now starts). World 1, in process.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import zeroinf

DIM, BLOCKS, STEPS = 16, 4, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, checkpointing: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.checkpointing = checkpointing
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpointing == "none":
                x = block(x)
            else:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")
        return self.head(x).pow(2).mean()


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(step))


def _train(checkpointing: str, optimizer: str, nvme_dir: str) -> dict:
    plain = Net(checkpointing)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    offload = zeroinf.OffloadConfig(optimizer=optimizer, gradients=optimizer,
                                    nvme_dir=nvme_dir if optimizer == "nvme" else None)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, unit_classes=[Block], offload=offload)
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    gathers, losses, plain_losses = [], [], []
    try:
        for step in range(STEPS):
            x = _batch(step).requires_grad_(True)  # a reentrant checkpoint needs an input with grad
            loss = plain(x)
            loss.backward()
            plain_opt.step(), plain_opt.zero_grad()
            plain_losses.append(loss.item())
            before = engine.counter.total.get("all_gather", 0)
            loss = model(_batch(step).requires_grad_(True))
            opt.backward(loss)
            opt.step(), opt.zero_grad()
            losses.append(loss.item())
            gathers.append(engine.counter.total.get("all_gather", 0) - before)
        assert engine.scheduler is not None
        backward_order = list(engine.scheduler.backward_trace.order)
        diff = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(),
                                                             plain.state_dict().values(), strict=True))
    finally:
        opt.close()
        engine.close()
    return {"gathers": gathers, "losses": losses, "plain_losses": plain_losses, "diff": diff,
            "backward_order": backward_order, "units": len(engine.units)}


@pytest.mark.parametrize("optimizer", ["device", "host", "nvme"])
def test_a_unit_inside_a_reentrant_checkpoint_is_gathered_once_a_step(optimizer: str, tmp_path: Any) -> None:
    runs = {mode: _train(mode, optimizer, str(tmp_path / mode)) for mode in ("none", "non-reentrant", "reentrant")}
    for mode, run in runs.items():
        assert run["losses"] == pytest.approx(run["plain_losses"], rel=1e-6, abs=1e-7), mode
        assert run["diff"] < 1e-6, (mode, run["diff"])
    steady = runs["none"]["gathers"][1:]
    assert steady == [steady[0]] * (STEPS - 1) and steady[0] >= BLOCKS, runs["none"]
    for mode in ("non-reentrant", "reentrant"):
        assert runs[mode]["gathers"][1:] == steady, (mode, runs[mode]["gathers"], steady)
    # the backward visits every block, last first, in each mode
    assert runs["reentrant"]["backward_order"] == runs["none"]["backward_order"], runs
    assert len(set(runs["reentrant"]["backward_order"])) >= BLOCKS, runs["reentrant"]
