"""Gradient buffers reused within a backward (partition/grad_pool.py [Note: why gradient buffers
are pooled within a backward]): the pool hands a freed buffer to the next unit of its size only
while a backward runs, holds nothing outside one, and training is bit for bit what it is with every
buffer freshly allocated, at world 1 and between gloo ranks, in the placements whose buffers it
recycles (the world-1 adopted shard, unsharded buffers, reduce-scatter outputs, device shards)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, Block, TinyGPT, bitwise_equal, train_micro_steps
from zeroinf.partition.grad_pool import GradBufferPool
from zeroinf.topology import Topology


def test_a_buffer_given_back_during_a_backward_serves_the_next_request_of_its_size() -> None:
    pool = GradBufferPool(torch.device("cpu"))
    pool.open()
    first = pool.take(1024, torch.float32)
    pool.give(first)
    assert pool.held_bytes == 4096
    assert pool.take(512, torch.float32).data_ptr() != first.data_ptr()  # another size: a new buffer
    assert pool.take(1024, torch.bfloat16).data_ptr() != first.data_ptr()  # another dtype too
    again = pool.take(1024, torch.float32)
    assert again.data_ptr() == first.data_ptr() and pool.reused == 1 and pool.held_bytes == 0


def test_outside_a_backward_the_pool_keeps_nothing() -> None:
    pool = GradBufferPool(torch.device("cpu"))
    buffer = pool.take(1024, torch.float32)
    pool.give(buffer)  # not opened: dropped
    assert pool.held_bytes == 0
    pool.open()
    pool.give(pool.take(1024, torch.float32))
    pool.close()  # the backward ended: what it kept is freed
    assert pool.held_bytes == 0 and pool.reused == 0
    pool.give(pool.take(1024, torch.float32))
    assert pool.held_bytes == 0


def test_on_an_accelerator_the_pool_only_allocates() -> None:
    """The caching allocator reuses device memory (and orders reuse after pending copies) itself."""
    pool = GradBufferPool(torch.device("meta"))
    pool.open()
    buffer = pool.take(1024, torch.float32)
    assert buffer.device.type == "meta"
    pool.give(buffer)
    assert pool.held_bytes == 0 and not pool.enabled


CASES: dict[str, dict[str, Any]] = {  # Config fields; each recycles different buffers
    # world 1: the unsharded buffer adopted as the shard, freed once stepped inside backward
    # world 2: unsharded buffers and reduce-scatter outputs, freed once stepped
    "stage3-optimizer-host": dict(stage=3, offload=zeroinf.OffloadConfig(optimizer="host")),
    # device shards handed to the optimizer inside backward, then to the next unit's reduction
    "stage3-device": dict(stage=3),
    # two micro-steps: the second reduces into a fresh output that is added to the shard
    "stage3-accum2-bf16": dict(stage=3, param_dtype="bf16", grad_accum_steps=2),
    "stage2-grads-host": dict(stage=2, offload=zeroinf.OffloadConfig(optimizer="host", gradients="host")),
}


class DeepTinyGPT(TinyGPT):
    """Six blocks: between ranks backward leaves two reductions running before it finishes the
    oldest, so only a deeper model frees a block's buffers before another block asks for its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(6)])


def _train(fields: dict[str, Any], rank: int, world: int, pooled: bool) -> dict[str, Any]:
    cfg = zeroinf.Config(**fields)
    torch.manual_seed(0)
    model = zeroinf.shard(DeepTinyGPT(), cfg, Topology.current(device=torch.device("cpu")))
    engine = zeroinf.engine_of(model)
    engine.grad_pool.enabled = pooled
    opt = zeroinf.AdamW(model, lr=LR)
    held_after_backward: list[int] = []
    losses = train_micro_steps(
        model, opt, rank, world, cfg.grad_accum_steps,
        after_backward=lambda: held_after_backward.append(engine.grad_pool.held_bytes),
    )
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    engine.close()
    return {"losses": losses, "weights": weights, "reused": engine.grad_pool.reused, "held": held_after_backward}


def _compare(rank: int, world: int) -> dict[str, dict[str, Any]]:
    out = {}
    for name, fields in CASES.items():
        pooled, fresh = _train(fields, rank, world, True), _train(fields, rank, world, False)
        out[name] = {
            "reused": pooled["reused"], "fresh_reused": fresh["reused"], "held": pooled["held"],
            "losses_equal": pooled["losses"] == fresh["losses"],
            "weights_bitwise": bitwise_equal(pooled["weights"], fresh["weights"]),
        }
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_pooled_gradient_buffers_train_bitwise_as_fresh_ones(world: int) -> None:
    results = [_compare(0, 1)] if world == 1 else run_ranks(_compare, world)
    for rank, cases in enumerate(results):
        for name, r in cases.items():
            assert r["losses_equal"] and r["weights_bitwise"], (world, rank, name)
            assert r["reused"] > 0 and r["fresh_reused"] == 0, (world, rank, name, r)
            assert set(r["held"]) == {0}, (world, rank, name, r)  # nothing kept once a backward ended
