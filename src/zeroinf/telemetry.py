"""One rank-aware logger, and counters of what the engine did in a step."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.profiler import record_function

F = TypeVar("F", bound=Callable[..., Any])


def get_logger() -> logging.Logger:
    """The `zeroinf` logger; messages are prefixed with the rank when running distributed."""
    logger = logging.getLogger("zeroinf")
    if not logger.handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get("RANK")
        prefix = f"[zeroinf rank {rank}] " if rank is not None else "[zeroinf] "
        handler.setFormatter(logging.Formatter(prefix + "%(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


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
