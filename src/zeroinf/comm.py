"""Collectives over flat buffers, with async handles; world size 1 turns them into copies.

Stateless functions taking the topology as an argument. gloo has no AVG reduction, so averaging
is a SUM followed by a division, on every backend alike (one code path, identical numerics).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist

from zeroinf.topology import Topology


class CollectiveError(RuntimeError):
    """A collective failed or timed out (a rank died, hung, or called another collective); the message
    names the collective, its size, this rank and the world."""


@contextlib.contextmanager
def naming_failures(kind: str, numel: int, topo: Topology) -> Iterator[None]:
    """Re-raise a backend error from starting or waiting on a collective as a CollectiveError that says
    which collective and which world (gloo's own message names only a socket or a timeout)."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as exc:  # DistBackendError and gloo's errors are RuntimeErrors
        raise CollectiveError(
            f"zeroinf: {kind} of {numel} elements failed on rank {topo.rank} of a world of {topo.world_size}: "
            f"{str(exc).strip()} (another rank died, hung past collective_timeout_s, or ran a different collective)"
        ) from exc


class Handle(Protocol):
    def wait(self) -> None: ...


class DoneHandle:
    """The handle of a collective that finished synchronously (or was skipped at world size 1)."""

    def wait(self) -> None:
        return None


class WorkHandle:
    """Wraps a torch.distributed Work and runs a completion step (e.g. averaging) after wait()."""

    def __init__(
        self, work: dist.Work, kind: str, topo: Topology, numel: int, then: torch.Tensor | None = None,
        divisor: int = 1,
    ) -> None:
        self._work = work
        self._kind, self._topo, self._numel = kind, topo, numel
        self._then = then
        self._divisor = divisor
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        with naming_failures(self._kind, self._numel, self._topo):
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
    with naming_failures("all-gather", unsharded.numel(), topo):
        work = dist.all_gather_into_tensor(unsharded, shard, group=topo.group, async_op=async_op)
    return WorkHandle(work, "all-gather", topo, unsharded.numel()) if async_op else DoneHandle()


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
    with naming_failures("reduce-scatter", unsharded.numel(), topo):
        work = dist.reduce_scatter_tensor(shard, unsharded, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    handle = WorkHandle(
        work, "reduce-scatter", topo, unsharded.numel(), then=shard, divisor=topo.world_size if average else 1
    )
    if not async_op:
        handle.wait()
    return handle


def all_reduce(tensor: torch.Tensor, topo: Topology, average: bool = False, async_op: bool = True) -> Handle:
    """tensor = sum (or mean) over ranks of tensor, in place."""
    if not topo.is_distributed:
        return DoneHandle()
    with naming_failures("all-reduce", tensor.numel(), topo):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=topo.group, async_op=True)
    divisor = topo.world_size if average else 1
    handle = WorkHandle(work, "all-reduce", topo, tensor.numel(), then=tensor, divisor=divisor)
    if not async_op:
        handle.wait()
    return handle
