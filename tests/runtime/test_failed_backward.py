"""A backward pass that raises midway, and the loop goes on (runtime/failed_backward.py).

The loop of a user who skips a batch whose backward fails (out of memory, a bad sample): the
failing attempt raises in backward, the loop calls `zero_grad()` and trains on. The engine used to
stay "in backward" for good after such a raise: every later `step()` stopped with "optimizer.step()
after 0 backward passes". Against plain PyTorch on the same batches (torch's fused AdamW, the kernel
zeroinf.AdamW runs; clipping by `clip_grad_norm_`), a 4-block model whose backward raises either
after block 3's gradients (the first unit done) or after all four blocks' (every unit done but the
root, several of them stepped inside backward):
- world 1, stages 1-3, parameters and optimizer states on device / host / NVMe, the step after
  backward and the speculative step inside it (undone: `rollbacks` counts it): the same losses and
  weights, to 1e-6;
- without `zero_grad` after the raise, the next backward and `step()` stop, naming `zero_grad`,
  which then recovers;
- a final step inside backward (the default without clipping) that had stepped units: `zero_grad`,
  `step`, `state_dict` and `zeroinf.save` stop, saying the model is partly updated and how many
  units; `zeroinf.load` of the checkpoint before it restores the run, which then trains as the
  plain loop that skipped the batch;
- gradient accumulation (2 micro-steps, the second one failing, the loop redoing the step): the
  same losses and weights on device / host / NVMe;
- the end-of-backward callback raising (a collective or a gradient write failing there): the same
  recovery after `zero_grad`, the same refusal after a final step inside backward;
- world 2 (one spawned group), every rank failing alike: the same as world 1, at stage 2 on the
  device, stage 3 on the host and stage 3 with everything on NVMe.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests.test_several_models import Block  # a residual LayerNorm-Linear-tanh block

TOL = 1e-6
STEPS = 5
FAILING = {1: 3, 3: 0}  # step -> the block before which the failing attempt's backward raises


class Raise(torch.autograd.Function):
    """Identity forward; its backward raises, as an out-of-memory error midway through backward does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward failed on purpose")


class Net(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, d), nn.Linear(d, 8)
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))
        self.raise_before: int | None = None  # backward raises once it reaches the input of this block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            x = block(Raise.apply(x) if i == self.raise_before else x)
        return self.out(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(world: int = 1, rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)) for _ in range(STEPS)]
    per = 8 // world
    return [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in batches]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).pow(2).mean()


def _train_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, losses: list[float]) -> None:
    """One step of a sharded model's loop, its loss appended to `losses`."""
    loss = _loss(model, x, y)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())


def _closed_run(model: nn.Module, opt: Any, losses: list[float]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The run's losses and gathered weights; the optimizer and engine closed (swap files removed)."""
    got = (losses, model.state_dict())
    opt.close()
    zeroinf.engine_of(model).close()
    return got


def _attempt_that_fails(model: Net, x: torch.Tensor, y: torch.Tensor, block: int) -> None:
    model.raise_before = block
    try:
        with pytest.raises(ValueError, match="on purpose"):
            _loss(model, x, y).backward()
    finally:
        model.raise_before = None


def _plain(clip: float | None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The plain loop: a failing attempt leaves partial gradients in p.grad, zero_grad drops them."""
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step in FAILING:
            _attempt_that_fails(model, x, y, FAILING[step])
            opt.zero_grad()
        loss = _loss(model, x, y)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _config(stage: int, tier: str, mode: str, folder: str) -> zeroinf.Config:
    """mode: "after" (the step after backward), "speculative" (inside it, undone), "final" (inside it)."""
    offload: dict[str, Any] = {"step_in_backward": mode != "after"}
    if tier != "device":
        offload.update(params=tier, optimizer=tier, nvme_dir=folder)
    return zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, unit_classes=["Block"], offload=offload,
        grad_clip_norm=1e6 if mode == "speculative" else None,  # never triggers: the step stays speculative
    )


def _sharded_run(cfg: zeroinf.Config, world: int = 1, rank: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = zeroinf.shard(_net(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    losses = []
    try:
        for step, (x, y) in enumerate(_batches(world, rank)):
            if step in FAILING:
                _attempt_that_fails(model, x, y, FAILING[step])
                opt.zero_grad()
            loss = _loss(model, x, y)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            if world > 1:  # the whole batch's loss, as the plain loop computes it
                dist.all_reduce(loss := loss.detach().clone())
                loss /= world
            losses.append(loss.item())
        assert opt.step_mode != "speculative" or opt.rollbacks == len(FAILING)  # each failed step was undone
        return losses, model.state_dict()
    finally:
        opt.close()
        zeroinf.engine_of(model).close()


def _assert_equal_runs(got: tuple[list[float], dict[str, torch.Tensor]],
                       want: tuple[list[float], dict[str, torch.Tensor]], case: str) -> None:
    torch.testing.assert_close(
        torch.tensor(got[0]), torch.tensor(want[0]), atol=TOL, rtol=0, msg=lambda m: f"{case}: {m}"
    )
    for name, value in want[1].items():
        torch.testing.assert_close(got[1][name], value, atol=TOL, rtol=0, msg=lambda m, n=name: f"{case} {n}: {m}")


CASES = [(1, "device"), (2, "device"), (3, "device"), (3, "host"), (3, "nvme")]


@pytest.mark.parametrize("mode", ["after", "speculative"])
@pytest.mark.parametrize(("stage", "tier"), CASES, ids=[f"stage{s}-{t}" for s, t in CASES])
def test_a_loop_skipping_failed_backwards_trains_as_plain_pytorch(
    stage: int, tier: str, mode: str, tmp_path: Path
) -> None:
    want = _plain(clip=1e6 if mode == "speculative" else None)
    _assert_equal_runs(_sharded_run(_config(stage, tier, mode, str(tmp_path))), want, f"stage {stage} {tier} {mode}")


def test_without_zero_grad_the_next_backward_and_step_name_it(tmp_path: Path) -> None:
    model = zeroinf.shard(_net(), _config(3, "host", "after", str(tmp_path)))
    opt = zeroinf.AdamW(model, lr=1e-2)
    (x, y), = _batches()[:1]
    _attempt_that_fails(model, x, y, 0)
    with pytest.raises(RuntimeError, match=r"last backward pass raised midway.*optimizer\.zero_grad\(\)"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"last backward pass raised midway.*optimizer\.zero_grad\(\)"):
        _loss(model, x, y).backward()
    model.zero_grad()  # the model's zero_grad recovers as the optimizer's does
    _loss(model, x, y).backward()
    opt.step()
    opt.close()
    zeroinf.engine_of(model).close()


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_partly_stepped_model_is_refused_until_a_checkpoint_is_loaded(tier: str, tmp_path: Path) -> None:
    folder = tmp_path / "swap"
    folder.mkdir()
    model = zeroinf.shard(_net(), _config(3, tier, "final", str(folder)))
    opt = zeroinf.AdamW(model, lr=1e-2)
    assert opt.step_mode == "final"
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step == 1:
            zeroinf.save(tmp_path / "ckpt", model, opt, step=1)
            _attempt_that_fails(model, x, y, 0)  # every block done: units stepped inside backward
            partly = r"raised midway after offload\.step_in_backward had already stepped [1-4] of 5 units.*load"
            save = lambda: zeroinf.save(tmp_path / "no", model, opt, step=9)  # noqa: E731
            for call in (opt.zero_grad, opt.step, opt.state_dict, save):
                with pytest.raises(RuntimeError, match=partly):
                    call()
            assert not (tmp_path / "no").exists()
            zeroinf.load(tmp_path / "ckpt", model, opt)  # back to the state before the failed attempt
            opt.zero_grad()
        _train_step(model, opt, x, y, losses)
    got = _closed_run(model, opt, losses)
    want = _plain(clip=None)
    _assert_equal_runs(got, want, f"final {tier}")


WORLD2_CASES = [(2, "device", "after"), (3, "nvme", "speculative"), (3, "host", "after")]


def _world2_runs(rank: int, world: int, folder: str) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    return [
        _sharded_run(_config(stage, tier, mode, f"{folder}/{stage}-{tier}-{mode}"), world, rank)
        for stage, tier, mode in WORLD2_CASES
    ]


def test_every_rank_failing_alike_at_world_2(tmp_path: Path) -> None:
    for stage, tier, mode in WORLD2_CASES:
        (tmp_path / f"{stage}-{tier}-{mode}").mkdir()
    by_rank = run_ranks(_world2_runs, 2, str(tmp_path))
    for i, (stage, tier, mode) in enumerate(WORLD2_CASES):
        want = _plain(clip=1e6 if mode == "speculative" else None)
        for rank in range(2):
            _assert_equal_runs(by_rank[rank][i], want, f"world 2 rank {rank} stage {stage} {tier} {mode}")


@pytest.mark.parametrize("mode", ["after", "final"])
def test_an_error_at_the_end_of_backward_ends_the_pass_too(mode: str, tmp_path: Path, monkeypatch: Any) -> None:
    """The end-of-backward callback raising (a collective or a gradient write failing there) is a
    backward that raised midway as well: the same recovery, the same refusal."""
    model = zeroinf.shard(_net(), _config(3, "host", mode, str(tmp_path)))
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step == 1:
            with monkeypatch.context() as patch:
                patch.setattr(engine, "_reduce_all", lambda: (_ for _ in ()).throw(OSError("lost on purpose")))
                with pytest.raises(OSError, match="on purpose"):
                    _loss(model, x, y).backward()
            if mode == "final":
                with pytest.raises(RuntimeError, match=r"already stepped [1-5] of 5 units"):
                    opt.zero_grad()
                break
            with pytest.raises(RuntimeError, match=r"last backward pass raised midway"):
                opt.step()
            opt.zero_grad()
        _train_step(model, opt, x, y, losses)
    got = _closed_run(model, opt, losses)
    if mode == "after":
        _assert_equal_runs(got, _plain(clip=None), "an error at the end of backward")


def _accumulating_loop(model: Net, opt: Any, backward: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two micro-steps a step; at step 2 the second one's backward fails: the loop drops the step's
    gradients and redoes both micro-steps."""
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step == 2:
            backward(_loss(model, x[:4], y[:4]) / 2)
            _attempt_that_fails(model, x[4:], y[4:], 1)
            opt.zero_grad()
        total = 0.0
        for half in (slice(0, 4), slice(4, 8)):
            loss = _loss(model, x[half], y[half]) / 2
            backward(loss)
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_a_failed_micro_step_of_an_accumulating_loop(tier: str, tmp_path: Path) -> None:
    plain = _net()
    want = _accumulating_loop(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True), torch.Tensor.backward)
    cfg = dataclasses.replace(_config(3, tier, "final", str(tmp_path)), grad_accum_steps=2)
    model = zeroinf.shard(_net(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    try:
        _assert_equal_runs(_accumulating_loop(model, opt, opt.backward), want, f"accumulating {tier}")
    finally:
        opt.close()
        zeroinf.engine_of(model).close()
