"""A sharded model's NVMe traffic, cumulative and over the last optimizer step (`engine.io_report()`,
part of `zeroinf.memory_report`): what the SSD wears, and how much of the I/O time was hidden."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from zeroinf.aio.engine import DISK_ACTIVITY

if TYPE_CHECKING:
    from zeroinf.engine import Engine

IO_KINDS = ("params", "grads", "optimizer")  # the NVMe traffic the report tells apart


class IoTraffic:
    """The engine's NVMe counters read as a report; `end_step()` closes each step's window."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.last_step: dict[str, Any] | None = None  # see `report`
        self._mark = (time.perf_counter(), self.totals())

    def totals(self) -> dict[str, float]:
        """Cumulative NVMe traffic of this rank per kind ("<kind>_read_bytes", "<kind>_written_bytes"
        for params, grads and optimizer), seconds blocked on it and in flight, and the process's
        disk-busy seconds (aio/engine.py DiskActivity)."""
        engine = self.engine
        out = {f"{kind}_{d}_bytes": 0.0 for kind in IO_KINDS for d in ("read", "written")}
        wait = busy = 0.0
        for kind, files, aio in (
            ("params", engine.param_files, engine.param_files.engine if engine.param_files else None),
            ("grads", engine.grad_files, engine.grad_files.swap.engine if engine.grad_files else None),
        ):
            if files is None or aio is None:
                continue
            stats = aio.stats()
            out[f"{kind}_read_bytes"], out[f"{kind}_written_bytes"] = stats.bytes_read, stats.bytes_written
            wait, busy = wait + files.io_wait_s, busy + files.io_busy_s
        if engine.optimizer_io is not None:
            states, pipeline = engine.optimizer_io
            out["optimizer_read_bytes"] = states.traffic.total.get("nvme_read_bytes", 0)
            out["optimizer_written_bytes"] = states.traffic.total.get("nvme_written_bytes", 0)
            wait, busy = wait + pipeline.io_wait_s, busy + pipeline.io_busy_s
        out.update(io_wait_s=wait, io_busy_s=busy, disk_busy_s=DISK_ACTIVITY.busy_s())
        return out

    def end_step(self) -> None:
        """Close the I/O window of the step that just ended (`last_step`) and open the next one."""
        now, totals = time.perf_counter(), self.totals()
        start, before = self._mark
        self._mark = (now, totals)
        wall = now - start
        delta = {k: totals[k] - before[k] for k in totals}
        traffic = _traffic(delta)
        moved = traffic["read_bytes"] + traffic["written_bytes"]
        params_per_rank = sum(u.layout.numel for u in self.engine.all_units) / self.engine.topo.world_size
        self.last_step = {
            "step_s": wall,
            **traffic,
            "bytes_per_param": moved / params_per_rank if params_per_rank else 0.0,
            "disk_busy_s": delta["disk_busy_s"],
            "disk_busy_share": delta["disk_busy_s"] / wall if wall > 0 else 0.0,
            "io_wait_s": delta["io_wait_s"],
        }

    def report(self) -> dict[str, Any]:
        """NVMe traffic of this rank: cumulative bytes read and written (what the SSD wears), per
        kind, seconds blocked on I/O and seconds I/O was in flight (overlap: the share of I/O time
        hidden behind other work); `last_step`: the same over the last optimizer step's window
        (end of one step to the end of the next), with bytes per parameter this rank holds and the
        disk-busy share (seconds any request of the process was in flight / the step's seconds);
        `param_cache`: the NVMe parameter cache's slots, hits and misses (None without one)."""
        totals = self.totals()
        traffic = _traffic(totals)
        wait, busy = totals["io_wait_s"], totals["io_busy_s"]
        return {
            "nvme_read_bytes": traffic["read_bytes"], "nvme_written_bytes": traffic["written_bytes"],
            "io_wait_s": wait, "io_busy_s": busy,
            "overlap_pct": 100.0 * (1 - wait / busy) if busy > 0 else 0.0,
            "by_kind": traffic["by_kind"],
            "disk_busy_s": totals["disk_busy_s"],
            "last_step": self.last_step,
            "param_cache": self._param_cache(),
        }

    def _param_cache(self) -> dict[str, int] | None:
        """Slots and cumulative hits / misses (loads served from host / read from NVMe) of the parameter cache."""
        files = self.engine.param_files
        cache = files.cache if files is not None else None
        if cache is None:
            return None
        return {"slots": cache.slots, "held": cache.held, "hits": cache.hits, "misses": cache.misses}


def _traffic(counts: dict[str, float]) -> dict[str, Any]:
    """Bytes read and written, in all and per kind, from `IoTraffic.totals`-style counters (or their
    difference over a step)."""
    by_kind = {kind: {d: counts[f"{kind}_{d}_bytes"] for d in ("read", "written")} for kind in IO_KINDS}
    return {
        "read_bytes": sum(k["read"] for k in by_kind.values()),
        "written_bytes": sum(k["written"] for k in by_kind.values()),
        "by_kind": by_kind,
    }
