"""The stage-3 unshard scheduler: what to gather and release at each hook event of a pass.

The hooks (runtime/hooks.py) call in here; this class decides, from the traced order and the
prefetch plan, when each unit is all-gathered and resharded. It owns the two traces (forward,
backward) and the plans built from them once both are recorded.

Forward: the root pre-forward begins a pass; each unit's pre-forward waits for the unit (gathering
it on demand if the plan did not prefetch it), then starts the plan's prefetches; its post-forward
releases it unless the plan keeps it for a reuse soon, or, in a training pass, for the backward that
starts with it (the forward's last units that the backward's first prefetch would gather again
anyway; runtime/prefetch.py `kept_for_backward`). Backward: each unit's pre-backward (a hook
on its forward outputs) waits for it and prefetches ahead; the unit is released once all its
gradients have arrived (the engine calls `release`). A pass that departs from its trace fetches
on demand and releases right after use. Passes without grad (eval, each decoding step of
generation) follow a trace of their own, recorded by the first of them, so decoding prefetches
the next units as training does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from zeroinf.partition.unit import ParamState, ShardedUnit
from zeroinf.partition.wrap import module_path
from zeroinf.runtime.prefetch import PrefetchPlan, kept_for_backward, plan_prefetch
from zeroinf.runtime.trace import PassTrace, TraceState


@dataclass(frozen=True)
class PrefetchBudget:
    prefetch_bytes: int
    max_live_bytes: int
    reuse_window: int = 2


class UnshardScheduler:
    def __init__(self, units: list[ShardedUnit], budget: PrefetchBudget) -> None:
        self.units = units
        self.budget = budget
        self.resident = {i for i, u in enumerate(units) if u.resident}
        self.forward_trace, self.backward_trace = PassTrace(), PassTrace()
        self.forward_plan: PrefetchPlan | None = None
        self.backward_plan: PrefetchPlan | None = None
        # No-grad passes (eval, each decoding step of `generate`) have a trace and plan of their own:
        # the first is recorded (on demand), the next ones prefetch along it. The training trace never
        # sees them, so a generation between steps leaves training's plan alone.
        self.inference_trace = PassTrace()
        self.inference_plan: PrefetchPlan | None = None
        self._forward_step_of: dict[int, int | None] = {}
        self._training_pass = False
        self.kept_for_backward: frozenset[int] = frozenset()
        self._last_forward_position: dict[int, int] = {}
        self._to_gather: list[int] = []  # read from NVMe at the previous event, gathered at the next
        # Units whose weights model code reads outside their forward: kept gathered to each pass's end
        # (runtime/external_reads.py); `in_pass`: from a forward's start to its pass's `release_all`.
        self.read_outside_units: set[int] = set()
        self.in_pass = False
        # Told the traced order of a training step (forward, then backward) once both passes are traced:
        # the NVMe parameter cache evicts along it (tiers/shard_cache.py).
        self.on_traced: Callable[[list[int]], None] | None = None

    # -- plans ----------------------------------------------------------------------------------------
    def _plan_args(self) -> dict[str, object]:
        sizes = {i: u.unsharded_bytes for i, u in enumerate(self.units)}
        # a unit stays gathered while the units nested in it run (its hooks fire around theirs)
        nested = {
            i: frozenset(j for j, v in enumerate(self.units) if v.name.startswith(f"{module_path(u.name)}."))
            for i, u in enumerate(self.units)
        }
        return dict(
            sizes=sizes, resident=self.resident, prefetch_bytes=self.budget.prefetch_bytes,
            max_live_bytes=self.budget.max_live_bytes, reuse_window=self.budget.reuse_window,
            nested={i: js for i, js in nested.items() if js},
        )

    def _build_plans(self) -> None:
        args = self._plan_args()
        self.forward_plan = plan_prefetch(self.forward_trace.order, release_lag=0, **args)  # type: ignore[arg-type]
        self.backward_plan = plan_prefetch(self.backward_trace.order, release_lag=1, **args)  # type: ignore[arg-type]
        staged = {i for i, u in enumerate(self.units) if u.loads_from_storage}  # prefetches gathered an event later
        self.kept_for_backward = kept_for_backward(
            self.forward_plan, self.backward_plan, self.resident, staged, args["sizes"]  # type: ignore[arg-type]
        )
        self._last_forward_position = {unit: i for i, unit in enumerate(self.forward_trace.order)}
        if self.on_traced is not None:  # the reads a step makes: the backward's kept units are not read
            backward = list(self.backward_trace.order)
            for unit in self.kept_for_backward:
                backward.remove(unit)
            self.on_traced(list(self.forward_trace.order) + backward)

    def _prefetch(self, plan: PrefetchPlan | None, position: int | None) -> None:
        """Start the plan's prefetches. A shard on NVMe is read now and gathered at the next event:
        the collective's moment then depends on the event count, never on when the read finished,
        so every rank issues its collectives in the same order."""
        if plan is None or position is None:
            return
        for unit in plan.steps[position].prefetch:
            if self.units[unit].loads_from_storage:
                self.units[unit].start_fetch()
                self._to_gather.append(unit)
            else:
                self.units[unit].start_unshard()

    def _gather_fetched(self) -> None:
        for unit in self._to_gather:
            self.units[unit].start_unshard()
        self._to_gather.clear()

    def release_all(self) -> None:
        """Reshard every non-resident unit (end of a pass, before an optimizer step)."""
        self._to_gather.clear()
        self.in_pass = False
        for i, unit in enumerate(self.units):
            if i not in self.resident:
                unit.reshard()

    def read_outside(self, index: int) -> None:
        """Model code reads unit `index`'s weights outside its forward: during a pass, gather it now
        and keep it gathered to the pass's end, in this pass and every later one; outside a pass,
        nothing (its placeholders answer metadata reads)."""
        if not self.in_pass:
            return
        self.read_outside_units.add(index)
        self._gather_fetched()
        self.units[index].wait_unshard()

    # -- forward --------------------------------------------------------------------------------------
    def _pass(self) -> tuple[PassTrace, PrefetchPlan | None]:
        """The trace and plan of the pass under way: training's, or the no-grad passes'."""
        if self._training_pass:
            return self.forward_trace, self.forward_plan
        return self.inference_trace, self.inference_plan

    def begin_forward(self, training: bool) -> None:
        self.release_all()
        self.in_pass = True
        self._training_pass = training
        trace, plan = self._pass()
        trace.begin_pass(record=True)
        if plan is None and trace.state is TraceState.FOLLOWING:  # no plan yet: on demand, not departed
            trace.state = TraceState.DEPARTED
        for i in self.resident:
            self.units[i].wait_unshard()

    @property
    def training_pass(self) -> bool:
        """Whether the forward pass under way began with gradients enabled."""
        return self._training_pass

    def pre_forward(self, index: int) -> None:
        trace, plan = self._pass()
        position = trace.observe(index)
        self._forward_step_of[index] = position
        self._gather_fetched()
        self.units[index].wait_unshard()
        self._prefetch(plan, position)

    def post_forward(self, index: int) -> None:
        if index in self.resident:
            return
        position = self._forward_step_of.pop(index, None)
        _, plan = self._pass()
        keep = position is not None and plan is not None and not plan.steps[position].release_after
        keep = keep or index in self.read_outside_units or (
            self._training_pass and position is not None and index in self.kept_for_backward
            and self._last_forward_position.get(index) == position
        )
        if not keep:
            self.units[index].reshard()

    def end_forward(self) -> None:
        trace, _ = self._pass()
        trace.end_pass()
        if not self._training_pass:
            self.release_all()
            if self.inference_plan is None and trace.recorded:
                self.inference_plan = plan_prefetch(trace.order, release_lag=0, **self._plan_args())  # type: ignore[arg-type]

    # -- backward -------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        record = self.forward_trace.recorded
        self.backward_trace.begin_pass(record=record)
        if self.backward_plan is None and self.backward_trace.state is TraceState.FOLLOWING:
            self.backward_trace.state = TraceState.DEPARTED

    def pre_backward(self, index: int) -> None:
        position = self.backward_trace.observe(index)
        self._gather_fetched()
        self.units[index].wait_unshard()
        self._prefetch(self.backward_plan, position)

    def release(self, index: int) -> None:
        """A unit's gradients are all in: it is not needed again in this backward (one read outside
        its forward is released with the rest at the end of the backward)."""
        if index not in self.resident and index not in self.read_outside_units:
            self.units[index].reshard()

    def end_backward(self) -> None:
        self.backward_trace.end_pass()
        self.release_all()
        if self.forward_plan is None and self.forward_trace.recorded and self.backward_trace.recorded:
            self._build_plans()

    # -- inspection -----------------------------------------------------------------------------------
    def unsharded_units(self) -> list[int]:
        return [i for i, u in enumerate(self.units) if u.state is not ParamState.SHARDED]
