"""One rank-aware logger, and counters of what the engine did in a step."""

from __future__ import annotations

import logging
import os
from collections import Counter


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
