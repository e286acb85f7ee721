"""The prefetch planner, without processes: a plan is replayed by an independent simulator here.

The simulator knows only what the runtime does with a plan: at step i the unit about to run is
gathered (on demand unless it is already unsharded), releases lagged by `release_lag` take effect
once that unit has been gathered, the step's prefetches start, and the unit is released after it
ran when `release_after` says so (`release_lag` 1: only once the next unit has been gathered, as in
backward). Everything the memory bound promises is checked against that replay.

Memory bound (what no plan can avoid is "forced"): the unit about to run is always gathered, and
with `release_lag` 1 the unit whose release is still pending is live too. Every other live unit
(prefetched ahead, or kept for a reuse) is the planner's choice, so whenever the live bytes exceed
`max_live_bytes`, nothing but forced units may be live. Hence, when every unit fits the budget
(`release_lag` 0), or every two units do (`release_lag` 1), the peak never exceeds the budget.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from zeroinf.runtime.prefetch import PrefetchPlan, kept_for_backward, plan_prefetch

UNLIMITED = 2**62


@dataclass
class Replay:
    peak: int = 0
    gathers: list[tuple[int, int, str]] = field(default_factory=list)  # (step, unit, "demand" | "prefetch")
    violations: list[str] = field(default_factory=list)  # over budget with an optional unit live
    max_ahead: int = 0  # most units prefetched and not yet run, at any time


def replay(
    plan: PrefetchPlan, order: list[int], sizes: dict[int, int], resident: set[int], max_live_bytes: int,
    release_lag: int, live_at_start: frozenset[int] = frozenset(),
) -> Replay:
    """Replay `plan` the way the runtime executes it; measure live bytes, gathers and budget violations.
    `live_at_start`: units the previous pass left gathered (a prefetch of one of them is a no-op)."""
    assert list(plan.order) == list(order), "the plan must have one step per traced event, in order"
    out = Replay()
    live: set[int] = set(live_at_start)
    ahead: set[int] = set()  # prefetched, not yet run
    pending: list[tuple[int, int]] = []  # (unit, step at which its release takes effect)

    def check(i: int, where: str, current: int) -> None:
        total = sum(sizes[u] for u in live)
        out.peak = max(out.peak, total)
        forced = {current} | {u for u, _ in pending}
        optional = live - forced
        if total > max_live_bytes and optional:
            out.violations.append(
                f"step {i} ({where}): {total} live bytes > budget {max_live_bytes} with optional units "
                f"{sorted(optional)} live (forced: {sorted(forced & live)})"
            )

    for i, (step, unit) in enumerate(zip(plan.steps, order, strict=True)):
        if unit in resident:
            continue
        if unit not in live:
            out.gathers.append((i, unit, "demand"))
            live.add(unit)
        ahead.discard(unit)
        check(i, "gather", unit)
        due = [u for u, at in pending if at <= i]
        pending = [(u, at) for u, at in pending if at > i]
        for u in due:
            if u != unit:  # released and immediately needed again: it simply stays
                live.discard(u)
        for u in step.prefetch:
            if u in live_at_start and u in live:
                continue
            assert u not in live, f"step {i}: prefetches unit {u}, which is already unsharded"
            assert u not in resident, f"step {i}: prefetches resident unit {u}"
            out.gathers.append((i, u, "prefetch"))
            live.add(u)
            ahead.add(u)
        out.max_ahead = max(out.max_ahead, len(ahead))
        check(i, "prefetch", unit)
        if step.release_after:
            if release_lag == 0:
                live.discard(unit)
            else:
                pending.append((unit, i + release_lag))
    return out


def plan_and_replay(order, sizes, resident, prefetch_bytes, max_live_bytes, reuse_window=2, release_lag=0):
    plan = plan_prefetch(order, sizes, resident, prefetch_bytes, max_live_bytes, reuse_window, release_lag)
    return plan, replay(plan, order, sizes, resident, max_live_bytes, release_lag)


def random_case(rng: random.Random) -> dict:
    n = rng.randint(1, 8)
    sizes = {u: rng.choice([rng.randint(1, 10), rng.randint(1, 40)]) for u in range(n)}
    resident = {u for u in range(n) if rng.random() < 0.15}
    if rng.random() < 0.5:  # a pass over distinct units, like a forward over blocks
        order = rng.sample(range(n), n)
    else:  # repeats (a unit called twice, weight sharing): exercises the reuse window
        order = [rng.randrange(n) for _ in range(rng.randint(1, 16))]
    return dict(
        order=order, sizes=sizes, resident=resident,
        prefetch_bytes=rng.choice([0, rng.randint(1, 60), UNLIMITED]),
        max_live_bytes=rng.choice([rng.randint(1, 30), rng.randint(10, 120), UNLIMITED]),
        reuse_window=rng.choice([1, 2, 3]),
    )


CASES = [random_case(random.Random(seed)) for seed in range(300)]


# -- (a) unlimited budgets -----------------------------------------------------------------------------
@pytest.mark.parametrize("release_lag", [0, 1])
def test_unlimited_budgets_prefetch_everything_after_the_first(release_lag: int) -> None:
    rng = random.Random(7)
    for _ in range(200):
        case = random_case(rng)
        case.update(prefetch_bytes=UNLIMITED, max_live_bytes=UNLIMITED)
        plan, run = plan_and_replay(**case, release_lag=release_lag)
        for i, step in enumerate(plan.steps):
            assert step.unit not in step.prefetch, f"{case}: step {i} prefetches its own unit"
        demand = [(i, u) for i, u, how in run.gathers if how == "demand"]
        first = next((i for i, u in enumerate(case["order"]) if u not in case["resident"]), None)
        # only the first non-resident event waits for an on-demand gather; all later ones find
        # their unit already unsharded (prefetched at an earlier step, or kept from a reuse)
        assert demand == ([] if first is None else [(first, case["order"][first])]), case


def test_unlimited_budgets_distinct_units_each_prefetched_once_before_its_step() -> None:
    order = [3, 0, 5, 1, 4, 2]
    for release_lag in (0, 1):
        plan, run = plan_and_replay(order, {u: 10 + u for u in range(6)}, set(), UNLIMITED, UNLIMITED,
                                    release_lag=release_lag)
        where = {u: i for i, step in enumerate(plan.steps) for u in step.prefetch}
        assert sum(len(s.prefetch) for s in plan.steps) == len(order) - 1  # each once...
        assert sorted(where) == sorted(order[1:])  # ...and all but the first
        for u, i in where.items():
            assert i < order.index(u)
        assert not run.violations


# -- (b) the memory bound ----------------------------------------------------------------------------------
@pytest.mark.parametrize("release_lag", [0, 1])
def test_live_bytes_stay_within_budget(release_lag: int) -> None:
    failures = []
    for n, case in enumerate(CASES):
        plan, run = plan_and_replay(**case, release_lag=release_lag)
        if plan.peak_live_bytes != run.peak:
            failures.append(f"case {n}: plan.peak_live_bytes {plan.peak_live_bytes} != {run.peak}: {case}")
        if run.violations:
            failures.append(f"case {n}: {run.violations[0]}: {case}")
        planned = set(case["order"]) - case["resident"]
        sizes = sorted((case["sizes"][u] for u in planned), reverse=True)
        forced_max = sum(sizes[: 1 + release_lag])
        if forced_max <= case["max_live_bytes"] and run.peak > case["max_live_bytes"]:
            failures.append(f"case {n}: peak {run.peak} > budget {case['max_live_bytes']}: {case}")
    assert not failures, f"{len(failures)} of {len(CASES)} cases fail, e.g.:\n" + "\n".join(failures[:5])


def test_a_unit_larger_than_the_budget_still_runs_alone() -> None:
    plan, run = plan_and_replay([0, 1, 2], {0: 5, 1: 50, 2: 5}, set(), UNLIMITED, 20)
    assert run.peak == 50 == plan.peak_live_bytes
    assert not run.violations
    assert 1 not in plan.steps[0].prefetch  # never gathered ahead: it would not fit
    assert plan.steps[1].prefetch == ()  # nothing joins it while it runs over the budget


# -- (c) no prefetch ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("release_lag", [0, 1])
def test_zero_prefetch_bytes_prefetch_nothing(release_lag: int) -> None:
    for case in CASES:
        case = dict(case, prefetch_bytes=0)
        plan, run = plan_and_replay(**case, release_lag=release_lag)
        assert all(step.prefetch == () for step in plan.steps), case
        assert all(how == "demand" for _, _, how in run.gathers)


# -- (d) reuse window --------------------------------------------------------------------------------------
def test_unit_reused_soon_is_kept_when_the_budget_allows() -> None:
    # A runs, B, then A again: keeping A needs A and B unsharded together (2 bytes)
    for prefetch_bytes in (0, UNLIMITED):
        plan, run = plan_and_replay([0, 1, 0], {0: 1, 1: 1}, set(), prefetch_bytes, 2)
        assert plan.steps[0].release_after is False
        assert [u for _, u, _ in run.gathers] == [0, 1]  # A is not gathered twice
        assert plan.steps[2].release_after is True  # not reused again: released at the end
        assert run.peak <= 2


def test_unit_reused_soon_is_released_when_the_budget_does_not_allow() -> None:
    # A alone is larger than the budget: it cannot stay
    plan, _ = plan_and_replay([0, 1, 0], {0: 5, 1: 1}, set(), UNLIMITED, 3)
    assert plan.steps[0].release_after is True
    # A fits, and so does B, but not both: keeping A would make B's gather exceed the budget
    for prefetch_bytes in (0, UNLIMITED):
        plan, run = plan_and_replay([0, 1, 0], {0: 1, 1: 1}, set(), prefetch_bytes, 1)
        assert plan.steps[0].release_after is True, (
            f"prefetch_bytes={prefetch_bytes}: A kept although B must be gathered next: {run.violations}"
        )
        assert run.peak == 1 and not run.violations


def test_unit_reused_beyond_the_window_is_released() -> None:
    plan, _ = plan_and_replay([0, 1, 2, 0], {0: 1, 1: 1, 2: 1}, set(), UNLIMITED, UNLIMITED, reuse_window=2)
    assert plan.steps[0].release_after is True
    plan, _ = plan_and_replay([0, 1, 2, 0], {0: 1, 1: 1, 2: 1}, set(), UNLIMITED, UNLIMITED, reuse_window=3)
    assert plan.steps[0].release_after is False


# -- (e) resident units ------------------------------------------------------------------------------------
@pytest.mark.parametrize("release_lag", [0, 1])
def test_resident_units_are_never_planned(release_lag: int) -> None:
    seen = 0
    for case in CASES:
        plan, run = plan_and_replay(**case, release_lag=release_lag)
        for step in plan.steps:
            assert not set(step.prefetch) & case["resident"], case
            if step.unit in case["resident"]:
                seen += 1
                assert step.prefetch == () and step.release_after is False, case
        assert not {u for _, u, _ in run.gathers} & case["resident"]
    assert seen > 50  # the random cases do exercise resident units
    # resident bytes are not part of the live bytes
    plan, _ = plan_and_replay([9, 0, 9, 1], {9: 1000, 0: 1, 1: 1}, {9}, UNLIMITED, 2, release_lag=release_lag)
    assert plan.peak_live_bytes == 2


# -- (f) a forward over 24 blocks ----------------------------------------------------------------------------
@pytest.mark.parametrize("release_lag", [0, 1])
def test_forward_over_24_blocks_with_three_blocks_budget(release_lag: int) -> None:
    block = 4096
    order = list(range(24)) if release_lag == 0 else list(reversed(range(24)))
    sizes = {u: block for u in range(24)} | {24: 999}
    plan, run = plan_and_replay(order + [24], sizes, {24}, UNLIMITED, 3 * block, release_lag=release_lag)
    assert all(len(step.prefetch) <= 2 for step in plan.steps)
    assert run.max_ahead == 2  # with release_lag 1, the pending release is part of the 3 blocks at the gather
    assert run.peak == plan.peak_live_bytes == 3 * block
    assert not run.violations
    # only the first block is gathered on demand; the pipeline keeps running ahead until the end
    assert [u for _, u, how in run.gathers if how == "demand"] == [order[0]]
    assert sorted(u for _, u, _ in run.gathers) == list(range(24))


# -- (f) units kept gathered from the end of forward into backward ---------------------------------------
def _kept_replays(case: dict) -> tuple[frozenset[int], list[Replay]]:
    """A training step's two passes over distinct units (backward: the reverse), replayed plainly and
    with the forward keeping `kept_for_backward` gathered into the backward."""
    order, sizes, resident = case["order"], case["sizes"], case["resident"]
    budgets = (case["prefetch_bytes"], case["max_live_bytes"], case["reuse_window"])
    forward = plan_prefetch(order, sizes, resident, *budgets, release_lag=0)
    backward = plan_prefetch(order[::-1], sizes, resident, *budgets, release_lag=1)
    kept = kept_for_backward(forward, backward, resident)
    last = {u: i for i, u in enumerate(order)}
    keeping = dataclasses.replace(forward, steps=tuple(
        dataclasses.replace(step, release_after=step.release_after and not (step.unit in kept and last[step.unit] == i))
        for i, step in enumerate(forward.steps)
    ))
    live = case["max_live_bytes"]
    return kept, [
        replay(forward, order, sizes, resident, live, 0), replay(backward, order[::-1], sizes, resident, live, 1),
        replay(keeping, order, sizes, resident, live, 0),
        replay(backward, order[::-1], sizes, resident, live, 1, live_at_start=kept),
    ]


DISTINCT = [c for c in CASES if len(set(c["order"])) == len(c["order"])]


@pytest.mark.parametrize("case", DISTINCT, ids=[f"distinct{i}" for i in range(len(DISTINCT))])
def test_units_kept_for_backward_add_no_peak_and_save_their_gathers(case: dict) -> None:
    kept, (forward, backward, keeping, kept_backward) = _kept_replays(case)
    assert not kept & case["resident"]
    # while the forward's tail runs only tail units are live, all of them within what the backward's
    # first step gathers anyway: no peak beyond the two plain passes'
    assert keeping.peak <= max(forward.peak, backward.peak)
    assert kept_backward.peak == backward.peak and not kept_backward.violations
    assert len(kept_backward.gathers) == len(backward.gathers) - len(kept)
    assert len(keeping.gathers) == len(forward.gathers)


def test_the_forwards_tail_within_the_backwards_first_prefetch_is_kept() -> None:
    order, sizes = [0, 1, 2, 3, 4], {u: 10 for u in range(5)}
    def kept(prefetch_bytes: int, max_live_bytes: int = UNLIMITED, resident: frozenset[int] = frozenset()) -> set:
        args = (sizes, set(resident), prefetch_bytes, max_live_bytes)
        forward, backward = plan_prefetch(order, *args), plan_prefetch(order[::-1], *args, release_lag=1)
        return set(kept_for_backward(forward, backward, set(resident)))
    assert kept(UNLIMITED) == {0, 1, 2, 3, 4}
    assert kept(0) == {4}  # the unit that ends the forward starts the backward: always kept
    assert kept(20) == {2, 3, 4}  # the first backward unit and the 20 bytes it prefetches
    assert kept(UNLIMITED, max_live_bytes=30) == {2, 3, 4}
    assert kept(20, resident=frozenset({4})) == {1, 2, 3}  # a resident unit is never planned


def test_a_staged_tail_stays_within_what_the_plain_backward_holds_at_once() -> None:
    """Shards on NVMe prefetched by the backward's first step are read there and gathered at the next
    event, once its first unit is released: the kept tail holds at most the larger of the two."""
    order = [0, 1, 2, 3, 4]
    def kept(prefetch_bytes: int, sizes: dict[int, int], staged: frozenset[int]) -> set:
        args = (sizes, set(), prefetch_bytes, UNLIMITED)
        forward, backward = plan_prefetch(order, *args), plan_prefetch(order[::-1], *args, release_lag=1)
        return set(kept_for_backward(forward, backward, set(), staged, sizes))
    even, everything = {u: 10 for u in range(5)}, frozenset(range(5))
    assert kept(10, even, everything) == {4}  # one prefetch: the first unit alone, as the plain backward
    assert kept(10, even, frozenset()) == {3, 4}  # in memory the prefetch is gathered at once
    assert kept(40, even, everything) == {1, 2, 3, 4}  # the four prefetched units follow the first
    assert kept(UNLIMITED, even, everything) == {1, 2, 3, 4}
    assert kept(0, even, everything) == {4}  # no prefetch: nothing staged to wait for
    assert kept(20, {0: 10, 1: 10, 2: 10, 3: 10, 4: 30}, everything) == {4}  # the large first unit fills it
    # a host/NVMe split: an unstaged prefetch is gathered at once beside the first unit, kept or not
    assert kept(20, even, frozenset({0, 1, 2})) == {3, 4}
    assert kept(20, even, frozenset({3})) == {4}  # keeping 3 would hold 4, 3 and the gathered 2 at once
