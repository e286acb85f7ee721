"""The gloo all-gather and reduce-scatter sent as point-to-point messages (comm.py [Note: gloo's
all-gather and reduce-scatter as point-to-point messages]) against torch.distributed's own, at
worlds 2 and 3: the same values (bitwise at world 2), overlapping collectives kept apart by their
tags, in-place and dtype-casting gathers, reduce-scatters of bf16/fp16 inputs into fp32 shards bit
for bit equal to casting first, and the inputs left unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests._harness import run_ranks
from zeroinf.comm import PeerHandle, all_gather_into, reduce_scatter_into
from zeroinf.topology import Topology


def _collectives(rank: int, world: int) -> dict[str, bool]:
    topo = Topology.current(device=torch.device("cpu"))
    n = 1000 + 3  # odd shard length: no alignment is assumed
    gen = torch.Generator().manual_seed(rank)
    out: dict[str, bool] = {}

    # Two gathers and two reduce-scatters in flight at once, waited in reverse order.
    shards = [torch.randn(n, generator=gen) for _ in range(2)]
    fulls = [torch.full((n * world,), float("nan")) for _ in range(2)]
    grads = [torch.randn(n * world, generator=gen) for _ in range(2)]
    grads_before = [g.clone() for g in grads]
    reduced = [torch.empty(n) for _ in range(2)]
    handles = [all_gather_into(f, s, topo) for f, s in zip(fulls, shards, strict=True)]
    handles += [reduce_scatter_into(r, g, topo, average=True) for r, g in zip(reduced, grads, strict=True)]
    out["messages"] = all(isinstance(h, PeerHandle) for h in handles)
    for h in reversed(handles):
        h.wait()
        h.wait()  # idempotent
    for f, s in zip(fulls, shards, strict=True):
        expected = torch.empty_like(f)
        dist.all_gather_into_tensor(expected, s)
        out.setdefault("gather_equal", True)
        out["gather_equal"] &= torch.equal(f, expected)
    for r, g in zip(reduced, grads, strict=True):
        expected = torch.empty(n)
        dist.reduce_scatter_tensor(expected, g.clone())
        expected.div_(world)
        close = torch.equal(r, expected) if world == 2 else torch.allclose(r, expected, rtol=1e-6, atol=1e-6)
        out.setdefault("reduce_equal", True)
        out["reduce_equal"] &= close
    out["inputs_unchanged"] = all(torch.equal(g, b) for g, b in zip(grads, grads_before, strict=True))

    # In place (the shard is this rank's slot of the output), and a gather that casts fp32 to bf16.
    flat = torch.zeros(n * world)
    flat[rank * n : (rank + 1) * n] = rank + 1.0
    all_gather_into(flat, flat[rank * n : (rank + 1) * n], topo).wait()
    out["in_place"] = torch.equal(flat, torch.arange(1.0, world + 1).repeat_interleave(n))
    half = torch.zeros(n * world, dtype=torch.bfloat16)
    all_gather_into(half, shards[0], topo, async_op=False)
    expected = torch.empty(n * world)
    dist.all_gather_into_tensor(expected, shards[0])
    out["cast"] = torch.equal(half, expected.to(torch.bfloat16))

    # A sum without averaging, of integers (exact in any order).
    ints = torch.arange(n * world, dtype=torch.float32) * (rank + 1)
    total = torch.empty(n)
    reduce_scatter_into(total, ints, topo, average=False, async_op=False)
    scale = world * (world + 1) / 2
    out["sum"] = torch.equal(total, torch.arange(rank * n, (rank + 1) * n, dtype=torch.float32) * scale)

    # A bf16/fp16 input reduced into an fp32 shard: the narrow bytes are sent and summed in fp32, bit
    # for bit what the fp32 path gives for the input cast first (values across many binades, so a sum
    # rounded in the narrow dtype anywhere would differ); two in flight at once, waited in reverse.
    for dtype in (torch.bfloat16, torch.float16):
        narrow = [(torch.randn(n * world, generator=gen) * 2.0 ** torch.randint(-8, 8, (n * world,), generator=gen))
                  .to(dtype) for _ in range(2)]
        before = [g.clone() for g in narrow]
        wide = [torch.empty(n) for _ in range(2)]
        pending = [
            reduce_scatter_into(w, g, topo, average=avg) for w, g, avg in zip(wide, narrow, (True, False), strict=True)
        ]
        out[f"{dtype}_messages"] = all(isinstance(h, PeerHandle) for h in pending)
        for h in reversed(pending):
            h.wait()
        for w, g, avg in zip(wide, narrow, (True, False), strict=True):
            expected = torch.empty(n)
            reduce_scatter_into(expected, g.float(), topo, average=avg, async_op=False)
            out[f"{dtype}_{avg}_bitwise"] = torch.equal(w, expected)
            out[f"{dtype}_{avg}_not_narrow_sum"] = world == 2 or not torch.equal(
                w, _narrow_sum(g, topo, avg).float()
            )
        out[f"{dtype}_inputs_unchanged"] = all(torch.equal(g, b) for g, b in zip(narrow, before, strict=True))
    return out


def _narrow_sum(g: torch.Tensor, topo: Topology, average: bool) -> torch.Tensor:
    """The same reduce-scatter summed in the input's own dtype (what the widening must not do)."""
    out = torch.empty(g.numel() // topo.world_size, dtype=g.dtype)
    dist.reduce_scatter_tensor(out, g.clone())
    return out.div_(topo.world_size) if average else out


@pytest.mark.parametrize("world", [2, 3])
def test_messages_match_torch_collectives(world: int) -> None:
    for rank, result in enumerate(run_ranks(_collectives, world)):
        assert all(result.values()), (rank, result)
