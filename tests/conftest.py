"""The default run is CPU-only, also on a machine with GPUs: every world-1 test, every spawned gloo
rank and every subprocess runs on the CPU (`ZEROINF_DEVICE=cpu`, inherited by child processes).
Tests marked `gpu` (`pytest -m gpu`) choose their CUDA device explicitly and skip without one."""

from __future__ import annotations

import os

import pytest

from zeroinf.topology import DEVICE_ENV

os.environ[DEVICE_ENV] = "cpu"

# A lent GPU machine's run can be cut by its time limit before pytest prints any traceback (stop 51:
# 38 errors and failures seen as bare names). With ZEROINF_TEST_FAILURES=<file>, each failing
# report's traceback is appended to that file as it happens (by the xdist controller, or the only
# process without xdist).
FAILURES_ENV = "ZEROINF_TEST_FAILURES"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(FAILURES_ENV)
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
