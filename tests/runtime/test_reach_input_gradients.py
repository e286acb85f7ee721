"""Backward passes for the inputs' gradients (runtime/reach.py [Note: a backward for the inputs' gradients]).

`torch.autograd.grad(loss, x)` runs the model's backward without giving any parameter a gradient:
adversarial training (FGSM: train on `x + eps * sign(grad_x)`) and gradient penalties (WGAN-GP:
the penalty on `|grad_x D|` joins the loss through `create_graph=True`). Before, such a pass counted
as a micro-step ("backward pass 2 since the last optimizer step" at the training backward after it)
and at stage 3 read released parameters. World 2, one spawned group, 4 steps against plain PyTorch
on the same per-rank batches (loss = mean of the ranks' losses): FGSM at stages 0-3, on host and
NVMe, with activation checkpointing and with accumulation; WGAN-GP at stages 0-2; weights within
1e-6. At stage 3 a penalty (`create_graph=True`) is refused with the fix: its graph reads the
parameters again in the training backward, after stage 3 released them. A training backward that
reaches no trainable parameter on one rank only (its input needs a gradient) stays a training
backward there (the ranks agree on the kind), at stages 0 and 2; so is one whose parameters all run
inside reentrant checkpoints (reached only by the checkpoints' own backwards), at stages 0 and 3.
FGSM on experts routed per rank (tests/runtime/test_reach_conditional_compute.py's model), at stages 0 and 3.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests._parity import max_diff_then_close

DIM = 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def _build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), Block(), Block(), Block(), nn.Linear(DIM, 1))


def _fgsm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad((model(x) - y).pow(2).mean(), x)
    return (model(x.detach() + 0.1 * grad.sign()) - y).pow(2).mean()


def _wgan_gp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    return out.mean() + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()


LOSSES = {"fgsm": _fgsm_loss, "wgan-gp": _wgan_gp_loss}


def _case(
    rank: int, world: int, loss_name: str, stage: int, tier: str, checkpointing: bool, accum: int, folder: str
) -> float:
    loss_fn = LOSSES[loss_name]
    plain = _build()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=folder) if tier != "device" else None
    cfg = zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, unit_classes=[Block], grad_accum_steps=accum,
        activation_checkpointing=checkpointing, offload=offload or zeroinf.OffloadConfig(),
    )
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for _ in range(accum):
            x, y = torch.randn(world, 2, DIM, generator=g), torch.randn(world, 2, 1, generator=g)
            (sum(loss_fn(plain, x[r], y[r]) for r in range(world)) / (world * accum)).backward()
            (loss_fn(model, x[rank], y[rank]) / accum).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


def _penalty_at_stage_3(rank: int, world: int) -> str:
    model = zeroinf.shard(_build(), zeroinf.Config(stage=3, persist_threshold_bytes=0, unit_classes=[Block]))
    opt = zeroinf.AdamW(model, lr=1e-2)
    try:
        _wgan_gp_loss(model, torch.randn(2, DIM), torch.randn(2, 1)).backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        opt.close()
        zeroinf.engine_of(model).close()
    return "no error"


class Branches(nn.Module):
    """A trainable branch and a frozen one; each rank's batch takes one of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trained, self.frozen = nn.Linear(DIM, 1), nn.Linear(DIM, 1).requires_grad_(False)

    def forward(self, x: torch.Tensor, trained: bool) -> torch.Tensor:
        return (self.trained if trained else self.frozen)(x)


def _one_rank_reaches_nothing(rank: int, world: int, stage: int) -> float:
    """Rank 1's loss reaches no trainable parameter (its input needs a gradient, so its backward
    runs), rank 0's does: both must take it for a training backward, or rank 0 would reduce alone."""
    plain = Branches()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    model = zeroinf.shard(copy.deepcopy(plain), zeroinf.Config(stage=stage, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world, 2, DIM, generator=g)
        (sum(plain(x[r].requires_grad_(True), r == 0).pow(2).mean() for r in range(world)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model(x[rank].requires_grad_(True), rank == 0).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


class ReentrantBlocks(nn.Module):
    """Every parameter inside a reentrant checkpoint: the backward reaches none of them when it
    starts (LoRA adapters in layers checkpointed with `use_reentrant=True`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        return x.pow(2).mean()


def _all_inside_reentrant_checkpoints(rank: int, world: int, stage: int) -> float:
    plain = ReentrantBlocks()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, unit_classes=[Block])
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(world, 2, DIM, generator=g)
        (sum(plain(x[r].requires_grad_(True)) for r in range(world)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        model(x[rank].requires_grad_(True)).backward()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


def _fgsm_on_experts(rank: int, world: int, stage: int) -> float:
    """FGSM on tests/runtime/test_reach_conditional_compute.py's mixture of experts, routed per rank: the input pass
    (whose kind the ranks agree on at stage 3) leaves the next training backward its own agreement."""
    from tests.runtime import test_reach_conditional_compute as moe

    torch.manual_seed(0)
    plain = moe.Net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, unit_classes=[moe.MoELayer])
    model = zeroinf.shard(copy.deepcopy(plain), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)

    def adversarial(net: nn.Module, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(net(x, route), x)
        return net(x.detach() + 0.1 * grad.sign(), route)

    g = torch.Generator().manual_seed(1)
    for routes in moe.ROUTES:
        x = torch.randn(world, moe.TOKENS, moe.DIM, generator=g)
        (sum(adversarial(plain, x[r], moe._route(routes[r])) for r in range(world)) / world).backward()
        plain_opt.step()
        plain_opt.zero_grad()
        adversarial(model, x[rank], moe._route(routes[rank])).backward()
        opt.step()
        opt.zero_grad()
    return max_diff_then_close(model, opt, plain)


CASES = [
    # (loss, stage, tier, activation_checkpointing, grad_accum_steps)
    ("fgsm", 0, "device", False, 1), ("fgsm", 1, "device", False, 2), ("fgsm", 2, "device", False, 1),
    ("fgsm", 3, "device", False, 1), ("fgsm", 3, "host", False, 1), ("fgsm", 3, "nvme", False, 1),
    ("fgsm", 3, "device", True, 1), ("fgsm", 3, "nvme", True, 2),
    ("wgan-gp", 0, "device", False, 1), ("wgan-gp", 1, "device", False, 2), ("wgan-gp", 2, "device", True, 1),
]


def run(rank: int, world: int, root: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for case in CASES:
        folder = os.path.join(root, "-".join(map(str, case)))
        os.makedirs(folder, exist_ok=True)
        loss_name, stage, tier, checkpointing, accum = case
        out[str(case)] = _case(rank, world, loss_name, stage, tier, checkpointing, accum, folder)
    out["penalty at stage 3"] = _penalty_at_stage_3(rank, world)
    for stage in (0, 2):
        out[f"one rank reaches nothing, stage {stage}"] = _one_rank_reaches_nothing(rank, world, stage)
    for stage in (0, 3):
        out[f"reentrant, stage {stage}"] = _all_inside_reentrant_checkpoints(rank, world, stage)
        out[f"experts, stage {stage}"] = _fgsm_on_experts(rank, world, stage)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-input-grads-") as root:
        return run_ranks(run, 2, root, timeout_s=300)


IDS = [f"{n}-stage{s}-{t}{'-ckpt' if c else ''}-accum{a}" for n, s, t, c, a in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_input_gradient_passes_train_as_plain_pytorch(results: list[dict[str, object]], case: tuple) -> None:
    for rank, r in enumerate(results):
        assert r[str(case)] <= 1e-6, (rank, r)  # type: ignore[operator]


def test_a_gradient_penalty_at_stage_3_is_refused_with_the_fix(results: list[dict[str, object]]) -> None:
    for r in results:
        message = str(r["penalty at stage 3"])
        assert "create_graph=True" in message and "Use stage 2" in message, message


@pytest.mark.parametrize("stage", [0, 2])
def test_a_backward_reaching_no_parameter_on_one_rank_only_is_a_training_backward(
    results: list[dict[str, object]], stage: int
) -> None:
    for rank, r in enumerate(results):
        assert r[f"one rank reaches nothing, stage {stage}"] <= 1e-6, (rank, r)  # type: ignore[operator]


@pytest.mark.parametrize("stage", [0, 3])
def test_parameters_all_inside_reentrant_checkpoints_train(results: list[dict[str, object]], stage: int) -> None:
    for rank, r in enumerate(results):
        assert r[f"reentrant, stage {stage}"] <= 1e-6, (rank, r)  # type: ignore[operator]


@pytest.mark.parametrize("stage", [0, 3])
def test_adversarial_training_of_experts_routed_per_rank(results: list[dict[str, object]], stage: int) -> None:
    for rank, r in enumerate(results):
        assert r[f"experts, stage {stage}"] <= 1e-6, (rank, r)  # type: ignore[operator]
