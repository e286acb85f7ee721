"""The `zeroinf` logger, and counters of what the engine did in a step.

[Note: logging like a library]
Importing zeroinf configures nothing: the package logger gets only a `NullHandler` (so a program
that configures no logging sees no "no handlers" noise), keeps its level and propagation, and
every record flows to whatever handlers the program set up. Only an application configures
logging; ours is the `zeroinf` command, which calls `configure_cli_logging`: one stream handler
on the package logger whose lines carry the rank, and INFO and below from rank 0 only (every rank
logs the same notices), unless `ZEROINF_LOG_ALL_RANKS=1`. Warnings and errors come from every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import torch
from torch.profiler import record_function

F = TypeVar("F", bound=Callable[..., Any])

LOGGER_NAME = "zeroinf"
ALL_RANKS_ENV = "ZEROINF_LOG_ALL_RANKS"

logging.getLogger(LOGGER_NAME).addHandler(logging.NullHandler())
_cli_handler: logging.Handler | None = None


def get_logger(name: str = "") -> logging.Logger:
    """The `zeroinf` logger, or its child `zeroinf.<name>`; configured by the application, not here."""
    return logging.getLogger(f"{LOGGER_NAME}.{name}" if name else LOGGER_NAME)


class RankFilter(logging.Filter):
    """Sets `record.rank`; on ranks other than 0 passes only records at WARNING or above, unless
    `all_ranks`. Attached to the CLI's handler, never to the package logger."""

    def __init__(self, rank: int, all_ranks: bool) -> None:
        super().__init__()
        self.rank, self.all_ranks = rank, all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return self.all_ranks or self.rank == 0 or record.levelno >= logging.WARNING


def configure_cli_logging(level: int = logging.INFO, stream: TextIO | None = None) -> logging.Handler:
    """Set up the `zeroinf` command's logging (see [Note: logging like a library]); returns the handler.

    The rank comes from torchrun's `RANK`; the line prefix names it only when running distributed.
    """
    global _cli_handler
    rank = int(os.environ.get("RANK", "0"))
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(RankFilter(rank, os.environ.get(ALL_RANKS_ENV, "") not in ("", "0")))
    prefix = "[zeroinf rank %(rank)s] " if distributed else "[zeroinf] "
    handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))
    logger = get_logger()
    if _cli_handler is not None:  # called again in one process (tests run `main` in-process)
        logger.removeHandler(_cli_handler)
    logger.addHandler(handler)
    _cli_handler = handler
    if logger.level == logging.NOTSET or logger.level > level:
        logger.setLevel(level)
    return handler


class CollectiveCounter:
    """Counts collectives by kind ("all_gather", "reduce_scatter", "all_reduce", ...) per step."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.this_step: Counter[str] = Counter()
        self.last_step: Counter[str] = Counter()

    def add(self, kind: str, n: int = 1) -> None:
        self.total[kind] += n
        self.this_step[kind] += n

    def end_step(self) -> None:
        self.last_step, self.this_step = self.this_step, Counter()


# -- phases in profiler traces and timelines -------------------------------------------------------------
# [Note: phase labels] The engine's phases carry `torch.profiler.record_function` labels, so a user's
# own profiler trace shows them: zeroinf::unshard, ::reshard, ::reduce, ::swap_in, ::swap_out,
# ::optimizer (and ::wait_io.<kind> where the training thread blocks on NVMe, ::forward / ::backward
# around the passes). A label costs ~10 us even with no profiler running, so it is only entered
# while one records (a ~0.1 us check), keeping hot paths as they were. The same labels feed
# `record_phases()`, which keeps (name, thread, start, end) of every phase for one step's timeline
# (`zeroinf train --report`, planner/timeline.py).
_PROFILING = torch._C._autograd._profiler_enabled


@dataclass(frozen=True)
class PhaseEvent:
    name: str
    thread: str
    start_s: float
    end_s: float
    depth: int
    """How many phases of the same thread were open around it."""


class PhaseRecorder:
    """Collects the phases that ran while it was active (`record_phases`)."""

    def __init__(self) -> None:
        self.events: list[PhaseEvent] = []
        self.start_s = time.perf_counter()
        self.end_s: float | None = None
        self._depth = threading.local()
        self._lock = threading.Lock()

    def enter(self) -> tuple[float, int]:
        depth = getattr(self._depth, "value", 0)
        self._depth.value = depth + 1
        return time.perf_counter(), depth

    def leave(self, name: str, start_s: float, depth: int) -> None:
        end = time.perf_counter()
        self._depth.value = depth
        event = PhaseEvent(name, threading.current_thread().name, start_s, end, depth)
        with self._lock:
            self.events.append(event)


_recorder: PhaseRecorder | None = None


@contextlib.contextmanager
def record_phases() -> Iterator[PhaseRecorder]:
    """Record every zeroinf phase (all threads) while the block runs; one recorder at a time."""
    global _recorder
    if _recorder is not None:
        raise RuntimeError("record_phases is already active")
    recorder = PhaseRecorder()
    _recorder = recorder
    try:
        yield recorder
    finally:
        recorder.end_s = time.perf_counter()
        _recorder = None


class _Phase:
    __slots__ = ("name", "recorder", "label", "start", "depth")

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        self.recorder = _recorder
        self.label = record_function(self.name) if _PROFILING() else None
        if self.label is not None:
            self.label.__enter__()
        if self.recorder is not None:
            self.start, self.depth = self.recorder.enter()

    def __exit__(self, *exc: object) -> None:
        if self.recorder is not None:
            self.recorder.leave(self.name, self.start, self.depth)
        if self.label is not None:
            self.label.__exit__(*exc)


def phase_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """`record_function(name)` while a profiler records, the phase in `record_phases`; else nothing."""
    if _recorder is None and not _PROFILING():
        return contextlib.nullcontext()
    return _Phase(name)


def phase(name: str) -> Callable[[F], F]:
    """Decorate a method so its calls appear as `name` in profiler traces (see [Note: phase labels])."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _recorder is None and not _PROFILING():
                return fn(*args, **kwargs)
            with _Phase(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
