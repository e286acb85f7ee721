"""Collectives at world size 1: copies (or nothing) behind the same handles, shapes still checked."""

from __future__ import annotations

import pytest
import torch

from zeroinf.comm import DoneHandle, all_gather_into, all_reduce, reduce_scatter_into
from zeroinf.topology import Topology

TOPO = Topology.single(torch.device("cpu"))


def test_single_topology() -> None:
    assert TOPO.rank == 0 and TOPO.world_size == 1 and not TOPO.is_distributed and TOPO.group is None


@pytest.mark.parametrize("async_op", [True, False])
def test_all_gather_copies_shard(async_op: bool) -> None:
    shard = torch.randn(10)
    unsharded = torch.zeros(10)
    handle = all_gather_into(unsharded, shard, TOPO, async_op=async_op)
    handle.wait()
    handle.wait()  # idempotent
    assert torch.equal(unsharded, shard) and unsharded.data_ptr() != shard.data_ptr()


def test_all_gather_in_place_is_a_no_op() -> None:
    flat = torch.randn(8)
    before = flat.clone()
    all_gather_into(flat, flat, TOPO).wait()
    assert torch.equal(flat, before)


@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("async_op", [True, False])
def test_reduce_scatter_copies_unsharded(average: bool, async_op: bool) -> None:
    unsharded = torch.randn(12)
    shard = torch.zeros(12)
    reduce_scatter_into(shard, unsharded, TOPO, average=average, async_op=async_op).wait()
    assert torch.equal(shard, unsharded)  # averaging over one rank divides by nothing


def test_collectives_across_dtypes_cast() -> None:
    shard = torch.randn(6, dtype=torch.float32)
    unsharded = torch.zeros(6, dtype=torch.bfloat16)
    all_gather_into(unsharded, shard, TOPO).wait()
    assert torch.equal(unsharded, shard.to(torch.bfloat16))


def test_all_reduce_is_identity() -> None:
    t = torch.randn(5)
    before = t.clone()
    handle = all_reduce(t, TOPO, average=True)
    assert isinstance(handle, DoneHandle)
    handle.wait()
    assert torch.equal(t, before)


def test_numel_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="all-gather: unsharded numel 9 != shard numel 8 x world 1"):
        all_gather_into(torch.zeros(9), torch.zeros(8), TOPO)
    with pytest.raises(ValueError, match="reduce-scatter: unsharded numel 7 != shard numel 8 x world 1"):
        reduce_scatter_into(torch.zeros(8), torch.zeros(7), TOPO)
