"""A rank that dies or hangs mid-step: the others fail within `collective_timeout_s` with an error that
names the collective and the world, exit non-zero and leave nothing running; the swap folder serves
the next run. Ranks are real processes (tests/_launch.py) running tests/_rank_script.py with every
state on NVMe; rank 1 stops itself in the middle of a step's forward.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests._launch import finish, run_ranks_as_processes, start_ranks

SCRIPT = str(Path(__file__).with_name("_rank_script.py"))
TIMEOUT_S = 10.0  # collective_timeout_s of these runs


def launch(swap: Path, *extra: str) -> list:
    return start_ranks([SCRIPT, "all-nvme", str(swap), "--steps", "3", "--timeout", str(TIMEOUT_S), *extra], 2)


def wait_for(condition, what: str, limit_s: float = 120.0) -> float:  # type: ignore[no-untyped-def]
    """Poll until `condition()`; returns the monotonic time it first held."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {limit_s} s"
        time.sleep(0.02)
    return time.monotonic()


def process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def check_survivor_failed(rank0, swap: Path, ended_after_s: float) -> None:  # type: ignore[no-untyped-def]
    assert rank0.returncode not in (0, None), rank0.stderr[-3000:]
    message = rank0.stderr.strip().splitlines()[-1]
    assert "CollectiveError" in message and "failed on rank 0 of a world of 2" in message, rank0.stderr[-3000:]
    assert any(kind in message for kind in ("all-gather", "reduce-scatter", "all-reduce")), message
    print(f"rank 0 ended {ended_after_s:.1f} s after rank 1 stopped (collective_timeout_s {TIMEOUT_S})")
    assert ended_after_s < 2 * TIMEOUT_S, f"rank 0 ended {ended_after_s:.1f} s after rank 1 stopped"
    assert "terminate called" not in rank0.stderr
    assert not processes_mentioning(str(swap)), "a process of the run is still there"
    assert not [p for p in swap.iterdir() if p.name.startswith("zeroinf-rank0-")]  # rank 0 cleaned up


def test_a_killed_rank_makes_the_others_fail_in_time_and_the_folder_serves_the_next_run(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    procs = launch(swap, "--stop-rank", "1", "--stop-step", "1", "--signal", "KILL")
    died = wait_for(lambda: procs[1].poll() is not None, "rank 1's death")
    ended = wait_for(lambda: procs[0].poll() is not None, "rank 0's end", limit_s=4 * TIMEOUT_S)
    rank0, rank1 = finish(procs, timeout_s=30)
    assert rank1.returncode == -signal.SIGKILL, rank1.stderr[-2000:]
    check_survivor_failed(rank0, swap, ended - died)
    assert [p for p in swap.iterdir() if p.name.startswith("zeroinf-rank1-")]  # the dead rank's leftovers

    again = run_ranks_as_processes([SCRIPT, "all-nvme", str(swap), "--steps", "1"], world=2, timeout_s=240)
    assert [r.returncode for r in again] == [0, 0], again[1].stderr[-3000:]
    assert not list(swap.iterdir())


@pytest.mark.slow
def test_a_hung_rank_makes_the_others_fail_after_the_collective_timeout(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    procs = launch(swap, "--stop-rank", "1", "--stop-step", "1", "--signal", "STOP")
    try:
        stopped = wait_for(lambda: process_state(procs[1].pid) == "T", "rank 1's stop")
        ended = wait_for(lambda: procs[0].poll() is not None, "rank 0's end", limit_s=4 * TIMEOUT_S)
        assert ended - stopped > TIMEOUT_S * 0.9, "rank 0 did not wait for the timeout"
    finally:
        procs[1].kill()
    rank0, _ = finish(procs, timeout_s=30)
    assert "Timed out" in rank0.stderr, rank0.stderr[-3000:]
    check_survivor_failed(rank0, swap, ended - stopped)
