"""Ctrl-C lands between the engine's operations, never inside one.

[Note: Ctrl-C inside the engine]
Python raises KeyboardInterrupt in the main thread between any two bytecodes. Inside the engine's
bookkeeping that can fall between two halves of one operation: a staging buffer taken from its pool
and not yet recorded as the shard's, a unit's parameters half pointed at its gathered buffer. After
such a Ctrl-C (a notebook's interrupt button) the loop's `zeroinf.load` or next step waited
`io_timeout_s` for a buffer nobody would give back (BufferPoolTimeout) or failed an assertion:
4 of 43 interrupt points sampled across an NVMe step (`sys.settrace` raising at the n-th line of
zeroinf's code), where a process restart was the only way on.

So the engine's entry points (every hook, and `step`, `zero_grad`, `state_dict`, `zeroinf.save` and
`zeroinf.load`) run `held()`: a SIGINT arriving inside is noted, and the KeyboardInterrupt raised
when the outermost one returns, a point where the engine's state is whole and a failed pass ends as
any other (runtime/failed_backward.py), a half-done step as any other (optim/states.py `fail`). Waits
inside (a disk read, a collective) go on until their operation ends: seconds at most, bounded by
`io_timeout_s` and `collective_timeout_s`; a second Ctrl-C meanwhile is raised at once (a stuck
disk must not hold the interrupt for `io_timeout_s`; the state may then be cut, as before). The
handler is installed once, from the main thread, only where SIGINT has Python's default handler (a
program's own handling is left alone); outside the engine it does what the default does.
"""

from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")
_MAIN = threading.main_thread()


class _State:
    depth = 0  # entry points of the engine the main thread is inside
    pending = False  # a SIGINT arrived inside one
    installed = False


_state = _State()


def install() -> None:
    """Defer SIGINT inside the engine from now on (idempotent; a no-op off the main thread, or where the
    program handles SIGINT itself)."""
    if _state.installed or threading.current_thread() is not _MAIN:
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    signal.signal(signal.SIGINT, _on_sigint)
    _state.installed = True


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    if _state.depth > 0 and not _state.pending:
        _state.pending = True
        return
    _state.pending = False  # a second Ctrl-C while the first waits: raised at once
    signal.default_int_handler(signum, frame)


class held:  # noqa: N801 - used like a function: `with interrupts.held():`
    """An engine entry point: a Ctrl-C inside it is raised when the outermost one returns."""

    __slots__ = ("main",)

    def __enter__(self) -> None:
        self.main = threading.current_thread() is _MAIN
        if self.main:
            _state.depth += 1

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if not self.main:
            return
        _state.depth -= 1
        if _state.depth == 0 and _state.pending:
            _state.pending = False
            if kind is None:  # an error already on its way stops the loop as the interrupt would
                raise KeyboardInterrupt


def entry_point(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` runs `held()`: see [Note: Ctrl-C inside the engine]."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with held():
            return fn(*args, **kwargs)

    return run
