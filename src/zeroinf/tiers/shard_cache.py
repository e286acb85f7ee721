"""Host memory as a cache for parameter shards on NVMe (`offload.param_cache_bytes`).

A fixed set of aligned slots, allocated once, each the size of the largest shard. A shard read from
NVMe lands straight in a slot when it is admitted (no staging copy), stays there for its next uses,
and leaves only when a slot is needed for a shard used sooner. Eviction is Belady's rule on the
traced order: of the shards held, the one whose next use along the cyclic sequence of loads
(forward order, then backward order, then the next step's forward) is farthest away goes; a shard
whose own next use is farther than every held one's is not admitted and is read through staging as
without a cache. Before the order is traced (the first step) the least recently used shard goes.
Where the cache holds every shard, each is read from NVMe once, on its first use, and never again.

Updated shards are written to the slot and to the file together (`NvmeHome.store`), so the file is
always current (checkpoints, a restart) and a slot is never dirty; a slot with a write in flight is
not reused before that write is waited. `simulate_reads` is the same policy as a pure function, for
the planner's byte counts and the tests.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence

from zeroinf.aio import AioHandle, BufferPool, PoolBuffer
from zeroinf.memory import Ledger

CACHE_TAG = "param_cache"


class _Policy:
    """Who goes when the cache is full: the pure part of `ShardCache`, shared with `simulate_reads`."""

    def __init__(self) -> None:
        self._positions: dict[str, list[int]] = {}
        self._length = 0
        self._now = 0
        self._clock = 0
        self._last_use: dict[str, int] = {}

    def set_order(self, order: Sequence[str]) -> None:
        """The cyclic sequence of loads of one training step (forward order, then backward order)."""
        self._positions = {}
        for i, name in enumerate(order):
            self._positions.setdefault(name, []).append(i)
        self._length = len(order)
        self._now = -1  # before the first load of the next step

    def use(self, name: str) -> None:
        """`name` is loaded now: the position moves to its next occurrence in the sequence."""
        self._clock += 1
        self._last_use[name] = self._clock
        positions = self._positions.get(name)
        if positions:
            i = bisect.bisect_right(positions, self._now)
            self._now = positions[i] if i < len(positions) else positions[0]

    def distance(self, name: str) -> int:
        """Loads until `name` is next used after the current one (the sequence wraps; never: infinity)."""
        positions = self._positions.get(name)
        if not self._length:  # no order yet: least recently used first
            return -self._last_use.get(name, 0)
        if not positions:
            return 2 * self._length
        i = bisect.bisect_right(positions, self._now)
        nxt = positions[i] if i < len(positions) else positions[0] + self._length
        return nxt - self._now

    def victim(self, held: Sequence[str], incoming: str) -> str | None:
        """The held shard to drop for `incoming`, or None when `incoming` is the one to leave out."""
        if not held:
            return None
        farthest = max(held, key=self.distance)
        if self._length and self.distance(farthest) <= self.distance(incoming):
            return None
        return farthest


class ShardCache:
    """`slots` aligned host buffers of `slot_bytes`, each holding one unit's shard (module docstring)."""

    def __init__(self, slots: int, slot_bytes: int, alignment_bytes: int, ledger: Ledger) -> None:
        self._pool = BufferPool(slots, slot_bytes, alignment_bytes=alignment_bytes, ledger=ledger, tag=CACHE_TAG)
        self._held: dict[str, PoolBuffer] = {}
        self._writes: dict[str, AioHandle] = {}  # unit -> write from its slot still in flight
        self._loaded: set[str] = set()  # units whose slot is lent out between load and end of use
        self.policy = _Policy()
        self.timeout_s: float | None = None
        self.waiter: Callable[[AioHandle], object] = lambda handle: handle.wait(self.timeout_s)  # the owner's, timed
        self.hits = self.misses = 0

    @property
    def slots(self) -> int:
        return self._pool.count

    @property
    def held(self) -> int:
        return len(self._held)

    def get(self, name: str) -> PoolBuffer | None:
        """The slot holding `name`'s current shard (a hit), or None; either way, `name` is used now."""
        self.policy.use(name)
        buf = self._held.get(name)
        if buf is None:
            self.misses += 1
        else:
            self.hits += 1
            self._loaded.add(name)
        return buf

    def admit(self, name: str) -> PoolBuffer | None:
        """A slot for `name`'s shard, about to be read into it; None: read it through staging instead."""
        if self._pool.free_count == 0:
            candidates = [u for u in self._held if u not in self._loaded]
            victim = self.policy.victim(candidates, name)
            if victim is None:
                return None
            self._drop(victim)
        buf = self._pool.reserve(timeout_s=self.timeout_s)
        self._held[name] = buf
        self._loaded.add(name)
        return buf

    def done(self, name: str) -> None:
        """The unit gathered its shard from the slot: the slot may be evicted again."""
        self._loaded.discard(name)

    def slot(self, name: str) -> PoolBuffer | None:
        return self._held.get(name)

    def writing(self, name: str, handle: AioHandle) -> None:
        """A write of `name`'s shard from its slot is in flight: the slot is not reused before it ends."""
        self._writes[name] = handle

    def wait_write(self, name: str) -> None:
        handle = self._writes.pop(name, None)
        if handle is not None:
            self.waiter(handle)

    def _drop(self, name: str) -> None:
        self.wait_write(name)
        self._pool.release(self._held.pop(name))

    def close(self) -> None:
        for name in list(self._held):
            self._drop(name)
        self._pool.close()


def simulate_reads(
    order: Sequence[str], slots: int, steps: int = 3, sizes: Mapping[str, int] | None = None
) -> list[int]:
    """Shards read from NVMe in each of `steps` training steps whose loads follow `order` (forward
    then backward), with a cache of `slots` shards under the policy above (the first step sees no
    order, as a run's first step does); with `sizes`, the bytes read (shards differ in size once
    a model's embedding and head are units of their own)."""
    policy, reads = _Policy(), []
    held: list[str] = []
    for step in range(steps):
        if step == 1:
            policy.set_order(order)  # as the engine does once the first step is traced
        count = 0
        for name in order:
            policy.use(name)
            if name in held:
                continue
            count += sizes[name] if sizes is not None else 1
            if slots == 0:
                continue
            if len(held) < slots:
                held.append(name)
                continue
            victim = policy.victim(held, name)
            if victim is not None:
                held[held.index(victim)] = name
        reads.append(count)
    return reads
