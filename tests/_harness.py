"""Start N gloo ranks on the CPU, run a function on each, and return what each returned.

Ranks are forked from a fork server that imported torch, zeroinf and transformers once (each rank
gets the test's environment, as a spawned one would); ZEROINF_TEST_START=spawn starts a fresh
interpreter per rank instead.

Any rank's exception is re-raised in the test with that rank's traceback; a group that does not
finish within the timeout is killed and reported with the ranks that were still running, so a
collective mismatch shows up as a clear failure instead of a hung test run.
"""

from __future__ import annotations

import atexit
import datetime
import io
import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


class RankFailure(AssertionError):
    pass


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, timeout_s: float, args: tuple,
            results: Any, environ: dict[str, str]) -> None:
    # A fork server's child has the server's environment: take the test's, as a spawned rank would.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(  # gloo ranks on the CPU, whatever accelerators the machine has
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        ZEROINF_DEVICE="cpu",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(rank_threads(world_size))
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        # Tensors through a Queue would travel as shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save(out, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    # A forked rank ends in os._exit, which skips the interpreter's exit: run its atexit handlers
    # (weakref finalizers among them, which remove swap files left open) as a spawned rank's exit would.
    atexit._run_exitfuncs()


def rank_threads(world_size: int) -> int:
    """Intra-op threads of one rank: the cores shared by every rank of every pytest-xdist worker, and
    never more than `OMP_NUM_THREADS` where the caller set it. Dividing by the ranks alone gave each rank
    half of a 16-core machine while 12 workers ran beside it: ~190 spinning threads on 16 cores, and
    what the caller's OMP_NUM_THREADS=1 asked for was overridden."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    threads = max(1, (os.cpu_count() or 1) // (world_size * max(1, workers)))
    asked = os.environ.get("OMP_NUM_THREADS", "")
    return min(threads, int(asked)) if asked.isdigit() and int(asked) > 0 else threads


# Imported once, in the fork server, instead of in every rank (missing ones are skipped).
PRELOAD = ["torch", "torch.distributed", "zeroinf", "transformers.modeling_utils"]
START_ENV = "ZEROINF_TEST_START"  # "spawn": a fresh interpreter per rank, as before


def _context() -> Any:
    """Ranks start from a fork server that imported torch, zeroinf and transformers once per test
    process (about 2-5 s of imports saved per rank; the suite spawns hundreds of ranks)."""
    if os.environ.get(START_ENV) == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes; return results by rank.

    `fn` must be importable by module path (a top-level function of a test module).
    """
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="zeroinf-store-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_worker, args=(fn, r, world_size, store_path, timeout_s, args, results, dict(os.environ)),
                name=f"zeroinf-rank{r}", daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(outputs) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pending = sorted(set(range(world_size)) - set(outputs))
                    raise RankFailure(
                        f"{fn.__name__}: ranks {pending} of {world_size} did not finish within {timeout_s:.0f} s "
                        "(a hang: mismatched collectives or a deadlock)"
                    )
                try:
                    rank, status, payload = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in outputs and not p.is_alive() and p.exitcode]
                    if dead:
                        raise RankFailure(
                            f"{fn.__name__}: rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                        ) from None
                    continue
                if status == "error":
                    raise RankFailure(f"{fn.__name__}: rank {rank} of {world_size} raised:\n{payload}")
                import torch

                outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=5 if len(outputs) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [outputs[r] for r in range(world_size)]
