"""The prefetch planner: a pure function from a traced unit order, sizes and budgets to actions.

For each position i of the order (unit u_i is about to run) the plan says which units to start
all-gathering now, ahead of use, and whether u_i may be released after it runs. Rules:
- a unit is prefetched when it is among the next units, the bytes gathered ahead of the current
  position stay within `prefetch_bytes`, and all unsharded bytes stay within `max_live_bytes`;
- a unit is kept unsharded after use when it runs again within `reuse_window` positions and
  keeping it fits the live budget ("reused soon"); otherwise it is released;
- resident units (the root, tiny units) are never planned: they are always unsharded;
- `release_lag` 1 models backward, where a unit's pre-backward hook fires (through the residual
  path) while the unit after it is still finishing its backward: a release takes effect only once
  the next unit has been gathered.
- a unit that encloses nested units (a block around its TiledLinear's tiles) stays gathered while
  the nested units that follow it run: its release takes effect only after the last of them.
- across the boundary of a training step's two passes, the forward's last units that the backward
  plan gathers at its first step anyway (its unit and that step's prefetches) are kept gathered
  instead of released and gathered again (`kept_for_backward`).
The runtime only executes the plan, so the memory bound is a property of this function, tested
without processes: the simulated live bytes never exceed `max_live_bytes`, except that the unit
about to run is always allowed (a single unit larger than the budget still runs, alone).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    unit: int
    prefetch: tuple[int, ...]  # start these all-gathers once `unit` is unsharded
    release_after: bool  # reshard `unit` after it ran


@dataclass(frozen=True)
class PrefetchPlan:
    steps: tuple[Step, ...]
    peak_live_bytes: int  # simulated peak of unsharded non-resident bytes
    live_bytes: tuple[int, ...] = ()  # per step: unsharded non-resident bytes while its unit runs

    @property
    def order(self) -> tuple[int, ...]:
        return tuple(s.unit for s in self.steps)


def plan_prefetch(
    order: list[int],
    sizes: dict[int, int],
    resident: set[int],
    prefetch_bytes: int,
    max_live_bytes: int,
    reuse_window: int = 2,
    release_lag: int = 0,
    nested: dict[int, frozenset[int]] | None = None,
) -> PrefetchPlan:
    """Plan one pass (forward or backward) over `order` (unit ids as they ran when traced)."""
    live: set[int] = set()
    steps: list[Step] = []
    pending: list[tuple[int, int]] = []  # (unit, step index at which the release takes effect)
    closing: dict[int, list[int]] = {}  # step index -> enclosing units released once that step ran
    peak = 0
    running: list[int] = []

    def live_bytes() -> int:
        return sum(sizes[u] for u in live)

    for i, unit in enumerate(order):
        if unit in resident:
            steps.append(Step(unit, (), False))
            running.append(live_bytes())
            continue
        live.add(unit)  # gathered now if not prefetched: always allowed
        peak = max(peak, live_bytes())
        for done in [u for u, at in pending if at <= i]:
            if done != unit:
                live.discard(done)
        pending = [(u, at) for u, at in pending if at > i]
        ahead = 0
        prefetch: list[int] = []
        for nxt in order[i + 1 :]:
            if nxt in resident or nxt == unit:
                continue
            if nxt in live:
                ahead += sizes[nxt]
                continue
            if ahead + sizes[nxt] > prefetch_bytes or live_bytes() + sizes[nxt] > max_live_bytes:
                break
            prefetch.append(nxt)
            live.add(nxt)
            ahead += sizes[nxt]
        peak = max(peak, live_bytes())
        running.append(live_bytes())
        upcoming = [u for u in order[i + 1 :] if u not in resident][:reuse_window]
        release = unit not in upcoming or live_bytes() > max_live_bytes
        if not release:  # keeping it must leave room for the units gathered before its reuse
            between = set(upcoming[: upcoming.index(unit)]) - live
            release = live_bytes() + sum(sizes[u] for u in between) > max_live_bytes
        span_end = i  # the nested units running right after `unit` keep it gathered
        inner = nested.get(unit, frozenset()) if nested else frozenset()
        while span_end + 1 < len(order) and order[span_end + 1] in inner:
            span_end += 1
        if release and span_end > i and release_lag == 0:
            closing.setdefault(span_end, []).append(unit)
        elif release and span_end > i:
            pending.append((unit, span_end + release_lag))
        elif release and release_lag == 0:
            live.discard(unit)
        elif release:
            pending.append((unit, i + release_lag))
        steps.append(Step(unit, tuple(prefetch), release))
        for done in closing.pop(i, []):  # its last nested unit ran: the enclosing unit's post-forward
            live.discard(done)
    return PrefetchPlan(tuple(steps), peak, tuple(running))


def kept_for_backward(
    forward: PrefetchPlan,
    backward: PrefetchPlan,
    resident: set[int],
    staged: Set[int] = frozenset(),
    sizes: Mapping[int, int] | None = None,
) -> frozenset[int]:
    """Units whose last forward use keeps them gathered into the backward: the longest tail of the
    forward order lying within what the backward plan holds at its first step (its unit and that
    step's prefetches). The backward would gather exactly these at once, so keeping them adds no
    peak: while the tail runs, the live units are tail units (kept before, running, prefetched
    after), bounded like the backward's first step by one unit plus `prefetch_bytes` and by
    `max_live_bytes`. It saves one all-gather (and on `nvme`, one read) of each (98M GPT, 2 ranks:
    all 12 blocks with the default 256 MiB).

    A `staged` unit (its shard on NVMe) prefetched at that first step is only read there and
    gathered at the next event, once the first unit is released (runtime/schedule.py `_prefetch`):
    the plain backward never holds the first unit and its staged prefetches unsharded together, so
    the kept tail stays within the larger of the two (`sizes`). Keeping both was one unit above the
    plain peak (1.0B GPT fp32, parameters on NVMe: peak RSS 13.10 against 12.90 B/param)."""
    first = next((s for s in backward.steps if s.unit not in resident), None)
    if first is None:
        return frozenset()
    window = {first.unit, *first.prefetch}
    budget: int | None = None
    unit_sizes: Mapping[int, int] = {}  # `sizes`, where a budget is set
    together = {first.unit} | (set(first.prefetch) - set(staged))  # unsharded at once in the plain backward
    if len(together) < len(window):
        assert sizes is not None, "staged units need their sizes"
        unit_sizes = sizes
        budget = max(sum(sizes[u] for u in together), sum(sizes[u] for u in window - {first.unit}))
    kept: set[int] = set()
    for step in reversed(forward.steps):
        if step.unit in resident:
            continue
        if step.unit not in window:
            break
        # kept, the backward's first step holds the tail beside the units it gathers at once
        if budget is not None and sum(unit_sizes[u] for u in kept | together | {step.unit}) > budget:
            break
        kept.add(step.unit)
    return frozenset(kept)
