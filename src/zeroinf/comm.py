"""Collectives over flat buffers, with async handles; world size 1 turns them into copies.

Stateless functions taking the topology as an argument. gloo has no AVG reduction, so averaging
is a SUM followed by a division, on every backend alike (one code path, identical numerics).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from zeroinf.topology import Topology


class Handle(Protocol):
    def wait(self) -> None: ...


class DoneHandle:
    """The handle of a collective that finished synchronously (or was skipped at world size 1)."""

    def wait(self) -> None:
        return None


class WorkHandle:
    """Wraps a torch.distributed Work and runs a completion step (e.g. averaging) after wait()."""

    def __init__(self, work: dist.Work, then: torch.Tensor | None = None, divisor: int = 1) -> None:
        self._work = work
        self._then = then
        self._divisor = divisor
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        self._work.wait()
        if self._then is not None and self._divisor != 1:
            self._then.div_(self._divisor)
        self._done = True


def all_gather_into(unsharded: torch.Tensor, shard: torch.Tensor, topo: Topology, async_op: bool = True) -> Handle:
    """unsharded[r * shard.numel() : (r + 1) * shard.numel()] = shard of rank r, for every r."""
    if unsharded.numel() != shard.numel() * topo.world_size:
        raise ValueError(
            f"all-gather: unsharded numel {unsharded.numel()} != shard numel {shard.numel()} x world {topo.world_size}"
        )
    if not topo.is_distributed:
        if unsharded.data_ptr() != shard.data_ptr():
            unsharded.copy_(shard)
        return DoneHandle()
    work = dist.all_gather_into_tensor(unsharded, shard, group=topo.group, async_op=async_op)
    return WorkHandle(work) if async_op else DoneHandle()


def reduce_scatter_into(
    shard: torch.Tensor, unsharded: torch.Tensor, topo: Topology, average: bool = True, async_op: bool = True
) -> Handle:
    """shard = (sum over ranks of unsharded)[my slice], divided by world size when `average`."""
    if unsharded.numel() != shard.numel() * topo.world_size:
        raise ValueError(
            f"reduce-scatter: unsharded numel {unsharded.numel()} != "
            f"shard numel {shard.numel()} x world {topo.world_size}"
        )
    if not topo.is_distributed:
        if unsharded.data_ptr() != shard.data_ptr():
            shard.copy_(unsharded)
        return DoneHandle()
    work = dist.reduce_scatter_tensor(shard, unsharded, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    handle = WorkHandle(work, then=shard, divisor=topo.world_size if average else 1)
    if not async_op:
        handle.wait()
    return handle


def all_reduce(tensor: torch.Tensor, topo: Topology, average: bool = False, async_op: bool = True) -> Handle:
    """tensor = sum (or mean) over ranks of tensor, in place."""
    if not topo.is_distributed:
        return DoneHandle()
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    handle = WorkHandle(work, then=tensor, divisor=topo.world_size if average else 1)
    if not async_op:
        handle.wait()
    return handle
