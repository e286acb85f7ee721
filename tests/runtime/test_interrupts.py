"""runtime/interrupts.py: Ctrl-C (SIGINT) inside the engine's entry points comes out when the outermost
one returns; a second one at once; outside them, and where the program handles SIGINT itself,
nothing changes. In a process of its own (the handler is process-wide and wants the main thread);
the end-to-end check (a Ctrl-C anywhere in an NVMe step, then `zeroinf.load`) is
tests/optim/test_interrupted_step.py."""

from __future__ import annotations

import signal
from typing import Any

from tests._harness import run_ranks
from zeroinf.runtime import interrupts


def _ctrl_c() -> None:
    signal.raise_signal(signal.SIGINT)


def _cases(rank: int, world: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts._state.installed = False
    interrupts.install()
    seen["installed"] = signal.getsignal(signal.SIGINT) is interrupts._on_sigint
    # Inside nested entry points: nothing until the outermost one returns.
    reached = []
    try:
        with interrupts.held():
            with interrupts.held():
                _ctrl_c()
                reached.append("inner")
            reached.append("outer")
    except KeyboardInterrupt:
        reached.append("raised at the end")
    seen["deferred"] = reached
    # A second Ctrl-C while the first waits: at once.
    reached = []
    try:
        with interrupts.held():
            _ctrl_c()
            reached.append("after the first")
            _ctrl_c()
            reached.append("after the second")
    except KeyboardInterrupt:
        reached.append("raised")
    seen["second"] = reached
    # An error already on its way is not replaced, and the interrupt is not kept for later.
    try:
        with interrupts.held():
            _ctrl_c()
            raise ValueError("on its way")
    except ValueError as exc:
        seen["error_kept"] = str(exc)
    seen["nothing_pending"] = not interrupts._state.pending and interrupts._state.depth == 0
    # Outside: as Python's default handler.
    try:
        _ctrl_c()
        seen["outside"] = "not raised"
    except KeyboardInterrupt:
        seen["outside"] = "raised"
    # A program's own handler is left alone.
    own: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: own.append(signum))
    interrupts._state.installed = False
    interrupts.install()
    _ctrl_c()
    seen["own_handler_kept"] = own == [signal.SIGINT] and not interrupts._state.installed
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return seen


def test_ctrl_c_inside_the_engine_comes_out_at_the_end_of_its_entry_point() -> None:
    (seen,) = run_ranks(_cases, 1)
    assert seen["installed"]
    assert seen["deferred"] == ["inner", "outer", "raised at the end"]
    assert seen["second"] == ["after the first", "raised"]
    assert seen["error_kept"] == "on its way" and seen["nothing_pending"]
    assert seen["outside"] == "raised"
    assert seen["own_handler_kept"]
