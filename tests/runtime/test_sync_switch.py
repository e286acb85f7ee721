"""DDP's `no_sync()`, nanoGPT's `require_backward_grad_sync` and FSDP2's `set_requires_gradient_sync`
on a sharded model (runtime/sync_switch.py [Note: no_sync on a sharded model]).

A DDP/FSDP2 loop accumulating 2 micro-steps with each switch, `grad_accum_steps = 2`, world 2,
stages 0-3: bitwise the run of the same loop without switches (they change nothing), and within
2e-5 of plain PyTorch on the whole batch (before, `model.no_sync()` raised AttributeError). A
switch that contradicts `grad_accum_steps` stops at the backward that shows it, naming the
setting; a loop that never uses one is not checked.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, plain_weights

STYLES = ["no_sync", "require_backward_grad_sync", "set_requires_gradient_sync"]
ACCUM, STEPS = 2, 3


def _switch(model: torch.nn.Module, style: str, last: bool) -> contextlib.AbstractContextManager[Any]:
    if style == "no_sync":
        return contextlib.nullcontext() if last else model.no_sync()
    if style == "require_backward_grad_sync":
        model.require_backward_grad_sync = last  # as nanoGPT sets DDP's flag
    else:
        model.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def _train(model: torch.nn.Module, opt: Any, rank: int, world: int, style: str | None) -> list[float]:
    per = 8 // world // ACCUM
    losses = []
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[rank * per * ACCUM : (rank + 1) * per * ACCUM], y[rank * per * ACCUM : (rank + 1) * per * ACCUM]
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            with _switch(model, style, last) if style is not None else contextlib.nullcontext():
                loss = model(x[micro * per : (micro + 1) * per], y[micro * per : (micro + 1) * per]) / ACCUM
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _runs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (0, 1, 2, 3):
        for style in [None, *STYLES]:
            torch.manual_seed(0)
            cfg = zeroinf.Config(stage=stage, grad_accum_steps=ACCUM, persist_threshold_bytes=0)
            model = zeroinf.shard(build_model(), cfg)
            opt = zeroinf.AdamW(model, lr=LR)
            losses = _train(model, opt, rank, world, style)
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            out[f"{stage}-{style}"] = {"losses": losses, "weights": weights}
            zeroinf.engine_of(model).close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_runs, 2, timeout_s=240)


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_ddp_or_fsdp2_accumulation_loop_trains_as_plain_pytorch(results, stage: int, style: str) -> None:
    plain = plain_weights(STEPS)
    for rank, runs in enumerate(results):
        switched, counted = runs[f"{stage}-{style}"], runs[f"{stage}-None"]
        assert switched["losses"] == counted["losses"], (rank, stage, style)
        assert all(torch.equal(v, counted["weights"][k]) for k, v in switched["weights"].items()), (rank, stage)
        # plain PyTorch sums the whole batch at once: the micro-steps' and ranks' order rounds otherwise
        worst = max((switched["weights"][k] - v).abs().max().item() for k, v in plain.items())
        assert worst <= 2e-5, (rank, stage, style, worst)


@pytest.mark.parametrize("style", STYLES)
def test_a_switch_against_grad_accum_steps_is_refused_naming_it(style: str) -> None:
    for configured, shows in ((1, "inside model.no_sync()"), (3, "marked the step's last")):
        torch.manual_seed(0)
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, grad_accum_steps=configured))
        opt = zeroinf.AdamW(model, lr=LR)
        try:
            if style == "no_sync" and configured == 3:
                # the last backward runs outside no_sync, where the loop says nothing: the step tells
                with pytest.raises(RuntimeError, match="optimizer.step\\(\\) after 2 backward passes"):
                    _train(model, opt, 0, 1, style)
                continue
            with pytest.raises(RuntimeError, match=f"{shows}.*grad_accum_steps = {configured}") as info:
                _train(model, opt, 0, 1, style)
            assert "set grad_accum_steps to the number of backward passes per optimizer step" in str(info.value)
        finally:
            zeroinf.engine_of(model).close()


def test_without_a_switch_nothing_is_checked_and_a_model_keeps_its_own_no_sync() -> None:
    class OwnNoSync(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def no_sync(self) -> str:
            return "mine"

    model = zeroinf.shard(OwnNoSync(), zeroinf.Config(stage=3))
    try:
        assert model.no_sync() == "mine"
        assert callable(model.set_requires_gradient_sync)
    finally:
        zeroinf.engine_of(model).close()
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, grad_accum_steps=ACCUM))
    opt = zeroinf.AdamW(model, lr=LR)
    try:
        assert len(_train(model, opt, 0, 1, None)) == STEPS * ACCUM
    finally:
        zeroinf.engine_of(model).close()
