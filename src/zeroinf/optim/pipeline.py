"""The sub-group pipeline: swap in sub-group k+1 and swap out k-1 while k is updated.

The optimizer step walks its sub-groups in order. For each one it needs the states in memory
(`start_swap_in`), runs the update, and puts them back (`start_swap_out`). With states on NVMe
those swaps are disk reads and writes, so the pipeline issues them early and waits for them late:

    k-1: ---- update ---- | swap_out ...........
    k  :  swap_in ....... | ---- update ---- | swap_out .........
    k+1:                    swap_in ........ | ---- update ---- | ...

A store lends at most `staging_slots` sub-groups of memory at once. A slot is taken by a swap-in
and given back when the matching swap-out finishes. Before a swap-in needs a slot and none is
free, the pipeline waits for the oldest swap-out. With 3 slots that is the swap-out of k-2 while
k is about to be updated, so the write of k-1 and the read of k+1 stay in flight during the
update of k; with more slots the reads run further ahead (`staging_slots - 2` sub-groups). In-memory
stores (`staging_slots` None) complete every swap at once and run the same code.

Errors: a failed or timed-out transfer raises from `run` after every other transfer in flight has
finished (a buffer is never handed back while the disk may still write into it) and the store is
told (`store.fail`), since its states are now a mix of old and new.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from zeroinf.aio.buffers import PoolBuffer, round_up
from zeroinf.aio.engine import AioHandle
from zeroinf.partition.flat_buffer import ALIGN_NUMEL
from zeroinf.telemetry import phase_scope

_ALIGN_NUMEL = 1024  # split points of a unit fall on 4 KiB of fp32


class StateViews(NamedTuple):
    """The three states of one sub-group (1-D, same numel, same device): the fp32 master, and the
    moments in the store's moment dtype (fp32, or bf16: optim/moments.py)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


@dataclass(frozen=True)
class SubGroup:
    """A contiguous piece [start, end) of one unit's owned range (owned-local), stepped as one."""

    index: int
    unit_index: int
    start: int
    end: int
    unit_numel: int  # the unit's whole owned numel

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def key(self) -> str:
        """Its name in the swap layout."""
        return f"unit{self.unit_index}@{self.start}"

    @property
    def whole_unit(self) -> bool:
        return self.start == 0 and self.end == self.unit_numel


def plan_sub_groups(owned_numels: Sequence[int], max_numel: int | None) -> list[SubGroup]:
    """Cut each unit's owned range into near-equal pieces of at most `max_numel` (None: whole units).

    Pure. Units with nothing owned get no sub-group. Split points are multiples of 1024 elements
    (4 KiB of fp32) when `max_numel` allows, else of 64 (partition/flat_buffer.py [Note: why every
    parameter starts on 64 elements]: a cut elsewhere changes the rounding of the elements before it).
    """
    groups: list[SubGroup] = []
    align = next((a for a in (_ALIGN_NUMEL, ALIGN_NUMEL) if max_numel is not None and max_numel >= a), 1)
    cap = None if max_numel is None else max_numel // align * align
    for ui, numel in enumerate(owned_numels):
        pieces = 1 if cap is None else math.ceil(numel / cap)
        step = numel if pieces <= 1 else round_up(math.ceil(numel / pieces), align)  # <= cap
        for start in range(0, numel, max(step, 1)):
            groups.append(SubGroup(len(groups), ui, start, min(start + step, numel), numel))
    return groups


class Staged:
    """A sub-group's states in memory, ready to update; owns its staging buffer (nvme) until swapped out."""

    def __init__(self, sub_group: SubGroup, views: StateViews, buffer: PoolBuffer | None = None) -> None:
        self.sub_group, self.views, self.buffer = sub_group, views, buffer

    def release(self) -> None:
        """Give the staging buffer back to its pool (idempotent; no-op for resident states)."""
        if self.buffer is not None:
            self.buffer.pool.release(self.buffer)
            self.buffer = None


class Pending:
    """Swaps in flight for one sub-group; `wait()` finishes them and returns the `Staged` states.

    When the transfers end, the staging buffer goes back to its pool if `release_when_done` (a
    swap-out) or if one of them failed; a transfer that timed out keeps it out of the pool for
    good, since the disk may still write into it.
    """

    def __init__(
        self, op: str, staged: Staged, handles: Sequence[AioHandle] = (), release_when_done: bool = False
    ) -> None:
        self.op, self.staged, self.handles, self.release_when_done = (
            op,
            staged,
            list(handles),
            release_when_done,
        )
        self.finished = False
        self._error: BaseException | None = None

    def wait(self, timeout_s: float | None = None) -> Staged:
        if not self.finished:
            self._finish(timeout_s)
        if self._error is not None:
            raise self._error
        return self.staged

    def settle(self, timeout_s: float | None = None) -> bool:
        """Finish without raising (cleanup after another failure); True when every transfer ended."""
        if not self.finished and self._error is None:
            self._finish(timeout_s)
        return self.finished

    def _finish(self, timeout_s: float | None) -> None:
        for handle in self.handles:
            try:
                handle.wait(timeout_s)
            except TimeoutError as exc:
                self._error = exc
                return
            except BaseException as exc:  # noqa: BLE001 - the first error is raised, the rest finish
                self._error = self._error or exc
        self.finished = True
        if self.release_when_done or self._error is not None:
            self.staged.release()


class SwapStore(Protocol):
    """The part of an optimizer state store the pipeline drives (see optim/states.py)."""

    sub_groups: list[SubGroup]

    @property  # read only: a store's class may fix it (None)
    def staging_slots(self) -> int | None: ...

    def swaps(self, index: int) -> bool: ...  # False: in memory, takes no staging slot

    def start_swap_in(self, index: int) -> Pending: ...

    def start_swap_out(self, staged: Staged) -> Pending: ...

    def fail(self, error: BaseException) -> None: ...


class SubGroupPipeline:
    """Runs `update(staged)` over sub-groups with swaps overlapped (module docstring).

    Two ways to drive it: `run(order, update)` updates a known order at once (the step after
    backward); `open(expected)` returns a `SubGroupStream` that updates sub-groups one call at a
    time in whatever order they become ready (the step inside backward), prefetching along the
    order it expects.

    `trace`, when a list, receives (event, sub-group index) in the order things happen:
    "swap_in" and "swap_out" when issued, "update" when the update starts, "swap_out_done" when
    a swap-out has been waited for (its slot is free again), "dropped" when a prefetched sub-group
    was given back unused.
    """

    def __init__(self, store: SwapStore, timeout_s: float | None = None, trace: list | None = None) -> None:
        self.store, self.timeout_s, self.trace = store, timeout_s, trace
        slots = store.staging_slots
        if slots is not None and slots < 2:
            raise ValueError(f"the sub-group pipeline needs at least 2 staging slots, the store has {slots}")
        self.lookahead = 1 if slots is None else max(1, slots - 2)
        # Telemetry: seconds the step blocked on swaps, and seconds swaps were in flight (the whole
        # run of a store that swaps: its transfers are issued back to back).
        self.io_wait_s = 0.0
        self.io_busy_s = 0.0

    def _note(self, event: str, index: int) -> None:
        if self.trace is not None:
            self.trace.append((event, index))

    def open(self, expected: Sequence[int], lookahead: int | None = None) -> SubGroupStream:
        """A stream that will update (some of) `expected`, most likely in that order; it reads
        `lookahead` sub-groups ahead (default: every slot but the two of the update and a write)."""
        return SubGroupStream(self, expected, self.lookahead if lookahead is None else max(1, lookahead))

    def run(self, order: Sequence[int], update: Callable[[Staged], None]) -> None:
        """Update the sub-groups `order` (indices into store.sub_groups) in that order."""
        stream = self.open(order)
        for index in order:
            stream.update(index, update)
        stream.finish()


class SubGroupStream:
    """One step's updates through a pipeline, one `update(index, fn)` at a time, then `finish()`.

    Reads run `lookahead` sub-groups ahead along the expected order (skipping those already done);
    a sub-group asked for out of that order is read on demand, evicting the prefetched read that
    is expected last when every slot is taken. Any error marks the store (`store.fail`) after
    every transfer in flight has finished.
    """

    def __init__(self, pipeline: SubGroupPipeline, expected: Sequence[int], lookahead: int) -> None:
        self.pipeline, self.store, self.lookahead = pipeline, pipeline.store, lookahead
        self.expected = list(expected)
        self._rank = {index: pos for pos, index in enumerate(self.expected)}
        self._cursor = 0  # expected[:cursor] are all done
        self.done: set[int] = set()
        self._reads: dict[int, Pending] = {}  # sub-group -> swap-in in flight or finished, not yet used
        self._writes: deque[tuple[int, Pending]] = deque()  # swap-outs holding a slot, oldest first
        self._held = 0  # slots taken: swapping in, being updated, or swapping out
        self._started = time.perf_counter()
        self.closed = False

    # -- slots ------------------------------------------------------------------------------------------
    def _wait(self, pending: Pending) -> Staged:
        t0 = time.perf_counter()
        try:
            return pending.wait(self.pipeline.timeout_s)
        finally:
            self.pipeline.io_wait_s += time.perf_counter() - t0

    def _finish_oldest_write(self) -> None:
        index, pending = self._writes[0]
        self._wait(pending)  # before it leaves the queue: after a raise, `abort` settles it and frees its slot
        self._writes.popleft()
        self._held -= 1
        self.pipeline._note("swap_out_done", index)

    def _drop_read(self, index: int) -> None:
        """Give back a prefetched sub-group unused (read-only: nothing to write)."""
        staged = self._wait(self._reads[index])  # before it leaves `_reads`, as `_finish_oldest_write`
        del self._reads[index]
        staged.release()
        self._held -= self.store.swaps(index)
        self.pipeline._note("dropped", index)

    def _free_slot(self, keep: tuple[int, ...]) -> None:
        slots = self.store.staging_slots
        while slots is not None and self._held >= slots:
            if self._writes:
                self._finish_oldest_write()
            else:  # every slot holds a prefetched read: drop the one expected last
                last = len(self._rank)
                victim = max((i for i in self._reads if i not in keep), key=lambda i: self._rank.get(i, last))
                self._drop_read(victim)

    def _issue_read(self, index: int, keep: tuple[int, ...] = ()) -> None:
        slot = self.store.swaps(index)
        if slot:
            self._free_slot(keep=(index, *keep))
        self._reads[index] = self.store.start_swap_in(index)
        self._held += slot
        self.pipeline._note("swap_in", index)

    def _upcoming(self, after: int) -> list[int]:
        """The next `lookahead` expected sub-groups that swap (in memory ones need no read ahead), not
        done, other than `after`."""
        while self._cursor < len(self.expected) and self.expected[self._cursor] in self.done:
            self._cursor += 1
        found: list[int] = []
        pos = self._cursor
        while pos < len(self.expected) and len(found) < self.lookahead:
            index = self.expected[pos]
            if index not in self.done and index != after and self.store.swaps(index):
                found.append(index)
            pos += 1
        return found

    def _reap_writes(self) -> None:
        """Give back the slots of swap-outs that have finished, oldest first, without waiting."""
        while self._writes and all(h.done() for h in self._writes[0][1].handles):
            self._finish_oldest_write()

    # -- the protocol -------------------------------------------------------------------------------------
    def prefetch(self, indices: Sequence[int]) -> int:
        """Start reading `indices` now, in that order, into slots that are free without waiting (a
        hint: what finds no slot is read when it is updated). Returns how many reads it started."""
        if self.closed:
            return 0
        started = 0
        try:
            self._reap_writes()
            slots = self.store.staging_slots
            for index in indices:
                if index in self.done or index in self._reads or not self.store.swaps(index):
                    continue
                if slots is not None and self._held >= slots:
                    break
                self._issue_read(index)
                started += 1
        except BaseException as error:
            self.abort(error, None)
            raise
        return started

    def update(self, index: int, fn: Callable[[Staged], None]) -> None:
        """Swap sub-group `index` in (or take its prefetched read), run `fn`, start its swap-out."""
        if self.closed:
            raise RuntimeError("this optimizer step's sub-group stream is already finished")
        if index in self.done:
            raise RuntimeError(f"sub-group {index} was already updated in this step")
        current: Staged | None = None
        try:
            if index not in self._reads:
                self._issue_read(index)
            for ahead in self._upcoming(index):
                if ahead not in self._reads:
                    self._issue_read(ahead, keep=(index,))
            with phase_scope("zeroinf::wait_io.optimizer"):
                current = self._wait(self._reads.pop(index))
            self.pipeline._note("update", index)
            with phase_scope("zeroinf::optimizer_update"):
                fn(current)
            pending = self.store.start_swap_out(current)
            current = None
            self.done.add(index)
            self.pipeline._note("swap_out", index)
            if self.store.swaps(index):
                self._writes.append((index, pending))
            else:  # in memory: complete at once, no slot to give back
                self._wait(pending)
                self.pipeline._note("swap_out_done", index)
        except BaseException as error:
            self.abort(error, current)
            raise

    def finish(self) -> None:
        """Wait for every write; give back prefetched sub-groups that were never updated."""
        if self.closed:
            return
        try:
            with phase_scope("zeroinf::wait_io.optimizer"):
                while self._writes:
                    self._finish_oldest_write()
                for index in list(self._reads):
                    self._drop_read(index)
        except BaseException as error:
            self.abort(error, None)
            raise
        self.closed = True
        if self.store.staging_slots is not None:
            self.pipeline.io_busy_s += time.perf_counter() - self._started

    def abort(self, error: BaseException, current: Staged | None = None) -> None:
        """After an error: let every transfer in flight finish (without raising), free its slot, mark the store."""
        if self.closed:
            return
        self.closed = True
        for pending in [*self._reads.values(), *(p for _, p in self._writes)]:
            if pending.settle(self.pipeline.timeout_s):  # a timed-out transfer keeps its buffer out of the pool
                pending.staged.release()
        if current is not None:
            current.release()
        self._reads.clear()
        self._writes.clear()
        self.store.fail(error)
