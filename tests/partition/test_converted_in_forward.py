"""A parameter the model converts to fp32 in its own forward, as Switch Transformers' and NLLB-MoE's
routers do (`self.classifier = self.classifier.to(float32)`), under a bf16 compute dtype
(partition/unit_grads.py [Note: a parameter the model converts in its own forward]).

Before: stages 0-2 refused the second forward as if the user had assigned `p.data = t`; stage 3
trained, rounding the router's fp32 gradient into the unit's bf16 buffer. Now every stage trains,
the gradient is kept in fp32, and the run says once which parameter it saw converted. The reference
is that semantics by hand at one and two ranks: fp32 masters, each step a bf16 copy (`.to`) whose
router converts itself in forward, gradients widened to fp32 (the router's already are) and averaged
over the ranks, fused AdamW on the masters: bitwise."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from tests._harness import run_ranks
from tests._parity import masters_by_hand, sharded_on_rows

STEPS, LR = 3, 1e-2
STAGES = (1, 2, 3)


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(8, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.classifier = self.classifier.to(torch.float32)  # "selective precision", as Switch's router
        return self.classifier(x.float()).softmax(-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.router, self.out = nn.Linear(8, 8), Router(), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(self.router(self.inp(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def _zeroinf(stage: int, rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    import zeroinf

    torch.manual_seed(0)
    model = zeroinf.shard(Net(), zeroinf.Config(stage=stage, param_dtype="bf16", persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
    losses = sharded_on_rows(model, opt, rank, world, STEPS)
    state = {k: v.float().clone() for k, v in model.state_dict().items()}
    opt.close()
    zeroinf.engine_of(model).close()
    return losses, state


def _by_hand(rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    master = Net()
    # each step a bf16 copy, whose router converts itself in forward
    losses = masters_by_hand(master, lambda: copy.deepcopy(master).to(torch.bfloat16), rank, world, STEPS, LR)
    rounded = copy.deepcopy(master).to(torch.bfloat16)  # what the sharded model holds: masters in bf16
    return losses, {k: v.float().clone() for k, v in rounded.state_dict().items()}


def _every_stage(rank: int, world: int) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    out = {f"stage{stage}": _zeroinf(stage, rank, world) for stage in STAGES}
    out["by-hand"] = _by_hand(rank, world)
    return out


def _assert_bitwise(runs: dict[str, tuple[list[float], dict[str, torch.Tensor]]]) -> None:
    losses, state = runs["by-hand"]
    assert losses[-1] < losses[0], "the reference must learn"
    for stage in STAGES:
        ours_losses, ours = runs[f"stage{stage}"]
        assert ours_losses == losses, stage
        assert ours.keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(ours[name], tensor), (stage, name)


def test_a_router_that_converts_itself_trains_at_every_stage(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="zeroinf"):
        _assert_bitwise(_every_stage(0, 1))
    said = [r.getMessage() for r in caplog.records if "converted this parameter" in r.getMessage()]
    # once per parameter name, for the whole process: the two routers' classifiers
    assert sorted(m.split(":")[0] for m in said) == [f"blocks.{i}.router.classifier.weight" for i in (0, 1)], said


def test_a_router_that_converts_itself_trains_at_two_ranks() -> None:
    for rank, runs in enumerate(run_ranks(_every_stage, 2, timeout_s=240)):
        _assert_bitwise(runs)
        assert rank in (0, 1)
