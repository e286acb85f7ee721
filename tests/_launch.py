"""Launch ranks as real processes (not the spawn harness): for tests of how a process ends.

`start_ranks` starts `world` Python processes of one script with the environment torchrun would
give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT on loopback), so each rank exits through the real
interpreter shutdown, and its exit code and stderr are its own (an abort shows as -6 on that rank).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
ROOT = str(Path(__file__).resolve().parents[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This checkout's sources first on the path, one CPU thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, ROOT, os.environ.get("PYTHONPATH")) if p)
    env.pop("ZEROINF_LOG_ALL_RANKS", None)
    return {**env, **(extra or {})}


@dataclass
class Finished:
    rank: int
    returncode: int
    stdout: str
    stderr: str


def start_ranks(
    args: list[str], world: int, extra_env: dict[str, str] | None = None
) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = rank_env(
            {
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                **(extra_env or {}),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def finish(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[Finished]:
    """Wait for every rank (killing them all past `timeout_s`) and collect exit codes and output."""
    deadline = time.monotonic() + timeout_s
    out = []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            stdout, stderr = p.communicate()
            stderr += f"\n[test] rank {rank} did not finish within {timeout_s} s and was killed"
        out.append(Finished(rank, p.returncode, stdout, stderr))
    return out


def run_ranks_as_processes(
    args: list[str], world: int, timeout_s: float, extra_env: dict[str, str] | None = None
) -> list[Finished]:
    return finish(start_ranks(args, world, extra_env), timeout_s)
