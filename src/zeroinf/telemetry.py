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
from collections import Counter
from collections.abc import Callable
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


# -- phases in profiler traces ---------------------------------------------------------------------------
# [Note: phase labels] The engine's phases carry `torch.profiler.record_function` labels, so a user's
# own profiler trace shows them: zeroinf::unshard, ::reshard, ::reduce, ::swap_in, ::swap_out,
# ::optimizer (and ::wait_io.<kind> where the training thread blocks on NVMe, ::forward / ::backward
# around `zeroinf train`'s passes). A label costs ~10 us even with no profiler running, so it is only
# entered while one records (a ~0.1 us check), keeping hot paths as they were.
_PROFILING = torch._C._autograd._profiler_enabled


def phase_scope(name: str) -> contextlib.AbstractContextManager[Any]:
    """`record_function(name)` while a profiler records, else nothing."""
    return record_function(name) if _PROFILING() else contextlib.nullcontext()


def phase(name: str) -> Callable[[F], F]:
    """Decorate a method so its calls appear as `name` in profiler traces (see [Note: phase labels])."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _PROFILING():
                return fn(*args, **kwargs)
            with record_function(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
