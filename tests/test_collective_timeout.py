"""`collective_timeout_s` holds over a process group the loop made itself (comm.py [Note: the collective
timeout over a process group made elsewhere]).

The spawned ranks' group is made by the harness with a 180 s timeout, as a DDP script makes its own
(gloo's default is 30 minutes). Stage 3 with `collective_timeout_s = 5`: rank 0 runs an evaluation
forward alone (under `if rank == 0`) while rank 1 trains on; both ranks stop with a CollectiveError
that names `if rank == 0` and the evaluation, within seconds of the configured 5, not the group's
180 (they used to wait for the group's). At stage 2 the same loop is fine (no collective in forward):
the evaluation runs and both ranks train on with the losses of a loop without it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import zeroinf
from tests._harness import run_ranks
from tests.test_several_models import Block  # a residual LayerNorm-Linear-tanh block

TIMEOUT_S = 5.0


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)
        self.blocks = torch.nn.ModuleList(Block(32) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _loop(rank: int, world: int, stage: int, evaluate: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, unit_classes=["Block"], collective_timeout_s=TIMEOUT_S)
    model = zeroinf.shard(Net(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)) for _ in range(4 * world)]
    losses: list[float] = []
    started = time.monotonic()
    try:
        for step in range(4):
            x, y = batches[step * world + rank]
            loss = (model(x) - y).pow(2).mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if evaluate and step == 1 and rank == 0:
                with torch.no_grad():
                    model(x)
    except zeroinf.CollectiveError as e:  # exported at the top level, as CheckpointError
        return {"error": str(e), "after_s": time.monotonic() - started, "losses": losses}
    return {"error": None, "losses": losses}


def _both(rank: int, world: int) -> list[dict[str, Any]]:
    return [_loop(rank, world, 2, evaluate=True), _loop(rank, world, 2, evaluate=False), _loop(rank, world, 3, True)]


def test_an_evaluation_on_rank_0_alone_fails_within_the_configured_timeout() -> None:
    by_rank = run_ranks(_both, 2, timeout_s=180)
    for rank, (stage2_eval, stage2_plain, stage3_eval) in enumerate(by_rank):
        assert stage2_eval["error"] is None and stage2_eval["losses"] == stage2_plain["losses"], rank
        error = stage3_eval["error"]
        assert error is not None, f"rank {rank}: no error at stage 3"
        assert "collective_timeout_s" in error and "if rank == 0" in error and "an evaluation too" in error, error
        assert stage3_eval["after_s"] < 60, f"rank {rank} waited {stage3_eval['after_s']:.0f} s (the group's is 180)"
