"""The unsharded gradient buffer in the compute dtype (unit.py [Note: gradient accumulation
buffer]): between gloo ranks on the CPU, a bf16/fp16 model whose buffers hold one backward's
gradients keeps them in its own dtype and trains bit for bit as with fp32 buffers; a buffer that
accumulates micro-steps keeps fp32, and one that gets a second gradient in a backward is widened.
That happens with reentrant activation checkpointing (a backward per segment inside the backward),
which these tests also check against non-reentrant checkpointing and plain PyTorch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import zeroinf
import zeroinf.planner.unit_plan as unit_plan
from tests._harness import run_ranks
from tests._parity import LR, bitwise_equal, build_model, train_micro_steps
from zeroinf.topology import Topology

CASES = {  # name: (Config fields, the buffer dtype the rule must choose)
    "stage3-bf16": (dict(stage=3, param_dtype="bf16"), torch.bfloat16),
    "stage3-fp16": (dict(stage=3, param_dtype="fp16"), torch.float16),
    "stage3-bf16-accum2": (dict(stage=3, param_dtype="bf16", grad_accum_steps=2), torch.bfloat16),
    "stage2-bf16": (dict(stage=2, param_dtype="bf16"), torch.bfloat16),
    "stage2-bf16-accum2": (dict(stage=2, param_dtype="bf16", grad_accum_steps=2), torch.float32),
    "stage1-bf16": (dict(stage=1, param_dtype="bf16"), torch.float32),
}


@contextlib.contextmanager
def _fp32_buffers() -> Iterator[None]:
    """The reference: every gradient buffer in `reduce_dtype`, as before the rule."""
    original = unit_plan.gradient_buffer_dtype
    unit_plan.gradient_buffer_dtype = lambda cfg, world, device: cfg.reduce_dtype  # type: ignore[assignment]
    try:
        yield
    finally:
        unit_plan.gradient_buffer_dtype = original


def _train(cfg: zeroinf.Config, rank: int, world: int) -> tuple[list[float], dict[str, torch.Tensor], set]:
    model = zeroinf.shard(build_model(), cfg, Topology.current(device=torch.device("cpu")))
    engine = zeroinf.engine_of(model)
    allocated: set[torch.dtype] = set()
    for unit in engine.units:  # record the dtype of every gradient buffer a backward allocates
        ensure = unit._ensure_grad_flat

        def recording(ensure: Any = ensure) -> torch.Tensor:
            flat = ensure()
            allocated.add(flat.dtype)
            return flat

        unit._ensure_grad_flat = recording  # type: ignore[method-assign]
    opt = zeroinf.AdamW(model, lr=LR)
    losses = train_micro_steps(model, opt, rank, world, cfg.grad_accum_steps)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    engine.close()
    return losses, weights, allocated


def _compare(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (fields, expected) in CASES.items():
        cfg = zeroinf.Config(**fields)
        losses, weights, allocated = _train(cfg, rank, world)
        with _fp32_buffers():
            ref_losses, ref_weights, ref_allocated = _train(cfg, rank, world)
        out[name] = {
            "allocated": allocated, "expected": {expected}, "reference_allocated": ref_allocated,
            "losses_equal": losses == ref_losses,
            "weights_bitwise": bitwise_equal(weights, ref_weights),
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_compute_dtype_gradient_buffers_train_bitwise_as_fp32_ones(world: int) -> None:
    for rank, cases in enumerate(run_ranks(_compare, world)):
        for name, r in cases.items():
            assert r["allocated"] == r["expected"], (rank, name, r)
            assert r["reference_allocated"] == {torch.float32}, (rank, name, r)
            assert r["losses_equal"] and r["weights_bitwise"], (rank, name, r)


class SharedAcrossSegments(torch.nn.Module):
    """One weight used in two reentrant checkpoint segments, each running a backward of its own: the
    weight's gradient arrives twice in one backward. With `first` its unit (the root) also holds
    the input layer, whose gradient comes last, so both arrive before the unit is reduced."""

    def __init__(self, first: bool = True, reentrant: bool = True) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.first = torch.nn.Linear(16, 16) if first else torch.nn.Identity()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])
        self.shared = torch.nn.Parameter(torch.randn(16, 16) * 0.1)

    def segment(self, x: torch.Tensor, block: torch.nn.Module) -> torch.Tensor:
        return torch.tanh(block(x) @ self.shared)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(self.segment, x, block, use_reentrant=self.reentrant)
        return x.float().pow(2).mean()


def _reentrant(rank: int, world: int) -> dict[str, Any]:
    """World 1, fp32, stages 2 and 3: reentrant checkpointing trains bit for bit as non-reentrant,
    and like plain PyTorch within the parity matrix's fp32 tolerances (tests/test_parity.py). World
    2, bf16: a compute-dtype buffer widened by the shared weight's second gradient trains bit for bit
    as fp32 buffers."""
    topo = Topology.current(device=torch.device("cpu"))

    def batch(step: int) -> torch.Tensor:
        return torch.randn(4 * world, 16, generator=torch.Generator().manual_seed(100 + step))[rank * 4 : rank * 4 + 4]

    def train(cfg: zeroinf.Config | None, reentrant: bool = True) -> tuple[list[float], dict[str, torch.Tensor], set]:
        torch.manual_seed(0)
        model = SharedAcrossSegments(reentrant=reentrant)
        widened: set[torch.dtype] = set()
        if cfg is None:  # plain PyTorch, one process
            opt: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            model = zeroinf.shard(model, cfg, topo)
            opt = zeroinf.AdamW(model, lr=1e-2)
            for unit in zeroinf.engine_of(model).units:
                widen = unit._widen_grad_flat

                def recording(widen: Any = widen) -> None:
                    widen()
                    widened.add(torch.float32)

                unit._widen_grad_flat = recording  # type: ignore[method-assign]
        losses = []
        for step in range(3):
            x = batch(step)
            loss = model(x if cfg is None or cfg.param_dtype == "fp32" else x.bfloat16())
            if cfg is None:
                loss.backward()
            else:
                opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weights = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
        if cfg is not None:
            opt.close()
            zeroinf.engine_of(model).close()
        return losses, weights, widened

    out: dict[str, Any] = {}
    if world == 1:
        ref_losses, ref_weights, _ = train(None)
        for stage in (2, 3):
            losses, weights, _ = train(zeroinf.Config(stage=stage))
            plain_losses, plain_weights, _ = train(zeroinf.Config(stage=stage), reentrant=False)
            out[f"stage{stage}_bitwise_as_non_reentrant"] = losses == plain_losses and all(
                torch.equal(weights[k], plain_weights[k]) for k in weights
            )
            out[f"stage{stage}_close_to_plain_pytorch"] = losses == pytest.approx(ref_losses, rel=1e-5) and all(
                torch.allclose(weights[k], ref_weights[k], rtol=1e-5, atol=5e-5) for k in ref_weights
            )
        return out
    cfg = zeroinf.Config(stage=3, param_dtype="bf16")
    losses, weights, widened = train(cfg)
    with _fp32_buffers():
        ref_losses, ref_weights, _ = train(cfg)
    out["widened"] = widened == {torch.float32}
    out["bitwise_as_fp32_buffers"] = losses == ref_losses and all(
        torch.equal(weights[k], ref_weights[k]) for k in ref_weights
    )
    return out


def test_a_gradient_after_its_unit_was_reduced_names_the_cause() -> None:
    """Without `first` the shared weight's unit is complete (reduced, stepped) after the first
    segment's backward: the second gradient is refused with the fix named, not added or lost."""
    cpu = Topology.single(torch.device("cpu"))
    model = zeroinf.shard(SharedAcrossSegments(first=False), zeroinf.Config(stage=3), cpu)
    opt = zeroinf.AdamW(model, lr=1e-2)
    loss = model(torch.randn(4, 16, requires_grad=True))
    with pytest.raises(RuntimeError, match="shared got a second gradient in one backward.*use_reentrant=False"):
        opt.backward(loss)
    opt.close()
    zeroinf.engine_of(model).close()


@pytest.mark.parametrize("world", [1, 2])
def test_reentrant_checkpointing_trains_like_plain_pytorch(world: int) -> None:
    """Each reentrant segment runs a backward of its own inside the outer one: the engine's pass
    spans the outer backward, and the weight shared by both segments gets two gradients."""
    for rank, result in enumerate(run_ranks(_reentrant, world)):
        assert result and all(result.values()), (rank, result)


def test_the_plan_counts_the_buffer_the_engine_allocates() -> None:
    from zeroinf.planner.unit_plan import UnitShape

    shape = UnitShape("blocks.0", (("blocks.0.w", (64, 64)),))
    for fields, world, device, expected in [
        (dict(stage=3, param_dtype="bf16"), 2, "cpu", "bf16"),
        (dict(stage=3, param_dtype="bf16"), 2, "cuda", "fp32"),  # NCCL wants one dtype: cast first
        (dict(stage=3, param_dtype="bf16"), 1, "cpu", "fp32"),  # world 1 adopts the buffer as the shard
        (dict(stage=3, param_dtype="fp32"), 2, "cpu", "fp32"),
        (dict(stage=3, param_dtype="bf16", reduce_dtype="bf16"), 2, "cpu", "bf16"),
        (dict(stage=2, param_dtype="bf16", grad_accum_steps=2), 2, "cpu", "fp32"),
        (dict(stage=2, param_dtype="bf16", grad_accum_steps=2, sync_every_micro_step=True), 2, "cpu", "bf16"),
        (dict(stage=1, param_dtype="fp16"), 2, "cpu", "fp32"),
    ]:
        cfg = zeroinf.Config(**fields)
        plan = unit_plan.plan_units([shape], cfg, world, device)
        assert plan.grad_buffer_dtype == expected, (fields, world, device)
        unit = plan.units[0]
        itemsize = {"bf16": 2, "fp32": 4}[expected]
        assert unit.grad_unsharded_bytes == unit.layout.padded_numel * itemsize, (fields, world, device)


def test_a_second_gradient_widens_the_buffer_and_adds_in_fp32() -> None:
    """A weight shared across reentrant checkpoint segments gets two gradients in one backward: the
    buffer is widened to fp32 before the second is added, so the sum is the fp32 one, not bf16's."""
    from zeroinf.memory import Ledger
    from zeroinf.partition.unit import ShardedUnit, ShardingPolicy
    from zeroinf.telemetry import CollectiveCounter

    p = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    ledger = Ledger()
    unit = ShardedUnit(
        "u", [("w", p)], Topology.single(torch.device("cpu")), ShardingPolicy(3), torch.bfloat16, torch.float32,
        ledger, 2**20, CollectiveCounter(), resident=True, grad_buffer_dtype=torch.bfloat16,
    )
    first = torch.full((8,), 1.0, dtype=torch.bfloat16)
    second = torch.full((8,), 2.0**-9, dtype=torch.bfloat16)  # below half a bf16 ulp of 1: lost if added in bf16
    p.grad = first.clone()
    unit.accumulate_grad(0)
    assert unit.grad_flat is not None and unit.grad_flat.dtype == torch.bfloat16
    p.grad = second.clone()
    unit.accumulate_grad(0)
    assert unit.grad_flat.dtype == torch.float32
    assert torch.equal(unit.grad_flat[:8], first.float() + second.float())
    assert (first + second).float()[0] == 1.0  # what a bf16 add would have kept
    live = ledger.snapshot()["device"]["by_tag"]["grad_unsharded"]
    assert live == unit.grad_flat.numel() * 4  # the ledger follows the widened buffer
