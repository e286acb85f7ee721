"""The traced order of units in a pass, recorded once and checked on every later pass.

The first training forward (and backward) records the order in which units run; later passes
compare each event with the record. At the first mismatch the pass is marked as departed: the
scheduler stops prefetching and fetches on demand for the rest of it. Every rank runs the same
modules, so every rank departs at the same event and the collectives stay in the same order.
"""

from __future__ import annotations

from enum import Enum


class TraceState(Enum):
    RECORDING = "recording"
    FOLLOWING = "following"
    DEPARTED = "departed"


class PassTrace:
    def __init__(self) -> None:
        self.order: list[int] = []
        self.recorded = False
        self.state = TraceState.RECORDING
        self.position = 0
        self.departures = 0  # passes that left the trace, for telemetry and tests

    def begin_pass(self, record: bool) -> None:
        if not self.recorded and record:
            self.order, self.state = [], TraceState.RECORDING
        elif self.recorded and record:
            self.state = TraceState.FOLLOWING
        else:  # eval / no-grad / generation passes never follow or change the trace
            self.state = TraceState.DEPARTED
        self.position = 0

    def observe(self, unit: int) -> int | None:
        """Record or check the next event; the trace position if following it, else None."""
        if self.state is TraceState.RECORDING:
            self.order.append(unit)
            return None
        if self.state is TraceState.FOLLOWING:
            pos = self.position
            if pos < len(self.order) and self.order[pos] == unit:
                self.position += 1
                return pos
            self.state = TraceState.DEPARTED
            self.departures += 1
        return None

    def end_pass(self) -> None:
        if self.state is TraceState.RECORDING and self.order:
            self.recorded = True
        elif self.state is TraceState.FOLLOWING and self.position != len(self.order):
            self.departures += 1  # ended early: still fine, the scheduler reshards everything
