"""The test harness's threads per spawned rank: the cores over every rank of every xdist worker,
capped by the caller's OMP_NUM_THREADS (stop 51's GPU-machine suite gave each rank half of 16 cores
beside 14 workers, with OMP_NUM_THREADS=1 set)."""

from __future__ import annotations

import pytest

from tests import _harness


@pytest.mark.parametrize(
    ("cores", "workers", "omp", "world", "expected"),
    [
        (16, None, None, 2, 8),  # one pytest process: the ranks share the machine
        (16, "12", None, 2, 1),  # 12 workers x 2 ranks on 16 cores
        (16, "2", None, 2, 4),
        (16, None, "1", 2, 1),  # the caller asked for one thread
        (16, "2", "2", 4, 2),
        (2, "2", None, 4, 1),  # never zero
        (16, None, "junk", 2, 8),  # not a count: ignored
    ],
)
def test_rank_threads_share_the_cores(monkeypatch: pytest.MonkeyPatch, cores: int, workers: str | None,
                                      omp: str | None, world: int, expected: int) -> None:
    monkeypatch.setattr(_harness.os, "cpu_count", lambda: cores)
    for name, value in (("PYTEST_XDIST_WORKER_COUNT", workers), ("OMP_NUM_THREADS", omp)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert _harness.rank_threads(world) == expected
