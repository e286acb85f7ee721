"""PassTrace: record once, follow on later passes, depart at the first mismatch for the rest of a pass."""

from __future__ import annotations

from zeroinf.runtime.trace import PassTrace, TraceState


def run_pass(trace: PassTrace, events: list[int], record: bool = True) -> list[int | None]:
    trace.begin_pass(record=record)
    positions = [trace.observe(e) for e in events]
    trace.end_pass()
    return positions


def recorded(order: list[int]) -> PassTrace:
    trace = PassTrace()
    assert run_pass(trace, order) == [None] * len(order)  # recording: no positions yet
    assert trace.recorded and trace.order == order and trace.departures == 0
    return trace


def test_record_then_follow_gives_positions() -> None:
    order = [0, 1, 2, 1, 3]  # a unit may run twice in a pass
    trace = recorded(order)
    for _ in range(3):
        trace.begin_pass(record=True)
        assert trace.state is TraceState.FOLLOWING
        assert [trace.observe(e) for e in order] == list(range(len(order)))
        trace.end_pass()
    assert trace.order == order and trace.departures == 0


def test_a_mismatch_departs_for_the_rest_of_the_pass_then_the_next_pass_follows() -> None:
    order = [0, 1, 2, 3, 4]
    trace = recorded(order)
    trace.begin_pass(record=True)
    assert trace.observe(0) == 0 and trace.observe(1) == 1
    assert trace.observe(3) is None  # 2 was expected
    assert trace.state is TraceState.DEPARTED and trace.departures == 1
    # the rest of the pass is on demand, even events that match the trace again
    assert [trace.observe(e) for e in (2, 3, 4)] == [None, None, None]
    trace.end_pass()
    assert trace.departures == 1  # one departure per pass, not per mismatched event
    assert trace.order == order  # a departure never rewrites the record
    assert run_pass(trace, order) == [0, 1, 2, 3, 4]
    assert trace.departures == 1


def test_extra_and_missing_events_depart() -> None:
    trace = recorded([0, 1, 2])
    assert run_pass(trace, [0, 1, 2, 5]) == [0, 1, 2, None]  # an event past the end of the trace
    assert trace.departures == 1
    assert run_pass(trace, [0, 1]) == [0, 1]  # a pass that ends early
    assert trace.departures == 2
    assert run_pass(trace, [0, 1, 2]) == [0, 1, 2]
    assert trace.departures == 2 and trace.order == [0, 1, 2]


def test_no_grad_passes_never_follow_nor_change_the_record() -> None:
    trace = PassTrace()
    # before anything is recorded: an eval pass records nothing
    assert run_pass(trace, [0, 2], record=False) == [None, None]
    assert not trace.recorded and trace.order == []
    order = [0, 1, 2]
    assert run_pass(trace, order) == [None, None, None]
    assert trace.recorded and trace.order == order
    for events in ([0, 1, 2], [0, 2], [2, 1, 0, 1]):  # matching or not
        trace.begin_pass(record=False)
        assert trace.state is TraceState.DEPARTED
        assert [trace.observe(e) for e in events] == [None] * len(events)
        trace.end_pass()
        assert trace.order == order and trace.recorded
    assert trace.departures == 0  # an eval pass is not a departure from the training trace
    assert run_pass(trace, order) == [0, 1, 2]  # training follows again


def test_an_empty_recording_pass_records_nothing() -> None:
    trace = PassTrace()
    run_pass(trace, [])
    assert not trace.recorded
    assert run_pass(trace, [4, 5]) == [None, None]  # still recording
    assert trace.recorded and trace.order == [4, 5]
