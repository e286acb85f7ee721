"""The NVMe tier of one process: the only place that builds I/O engines and opens swap files.

An engine builds one `NvmeTier` from its `OffloadConfig` (`nvme_dir`, `aio`, `io_timeout_s`). The
unit homes (parameters, gradients: `open_param_files`, `open_grad_files`), the optimizer's state
store (optim/nvme_states.py) and checkpoint streaming ask it for swap files and engines; the
construction-time park (tiers/park_file.py) and the pretrained-weights reader (weights/) take an
engine from `tiers.nvme.open_engine`. tests/tiers/test_tier_ownership.py checks that no module outside `aio/`
and `tiers/` constructs an `AioEngine` or an `NvmeSwap` or lays out a swap file, so every NVMe byte
of a run goes through engines built from the one `[offload.aio]` setting (the one
`zeroinf bench-io --sweep` prints).

One engine per traffic lane (parameters, gradients, optimizer states, checkpoints), not one for
all. An engine's queue is first in, first out: in one queue, the read of the unit the forward needs
next would wait behind a sub-group of optimizer write-behind. Separate lanes keep those reads from
queuing behind writes, and each lane's counters are the per-kind bytes of `memory_report()["io"]`.
The lanes share the config and the process's disk-busy clock (aio/engine.py `DISK_ACTIVITY`).
Sizes come from the unit plan (planner/unit_plan.py), computed once before anything is built.
Each tier's files carry a model index (tiers/nvme.py [Note: several sharded models in one process]).
"""

from __future__ import annotations

import os
import shutil

from zeroinf.aio import AioEngine
from zeroinf.aio.buffers import SizedPools
from zeroinf.config import OffloadConfig
from zeroinf.memory import Ledger, format_bytes
from zeroinf.partition.shard_home import NvmeGradFiles, NvmeParamFiles
from zeroinf.planner.unit_plan import SWAP_ALIGN_BYTES, ModelPlan
from zeroinf.telemetry import get_logger
from zeroinf.tiers.host import check_host_cap
from zeroinf.tiers.nvme import ModelIndex, NvmeSwap, SwapFolderError, ensure_swap_folder, plan_swap_layout
from zeroinf.tiers.shard_cache import ShardCache

LANES = ("params", "grads", "optimizer", "checkpoint")


def preflight_swap_folder(folder: str, needed_bytes: int, what: str) -> None:
    """Check before training that `folder` exists (or create it), is writable and has room for `needed_bytes`."""
    what = f"{what} need {needed_bytes} bytes ({format_bytes(needed_bytes)})"
    try:
        ensure_swap_folder(folder)
    except SwapFolderError as exc:
        raise SwapFolderError(f"{exc}; {what}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SwapFolderError(f"offload.nvme_dir {folder!r} is not writable: choose a writable folder; {what}")
    free = shutil.disk_usage(folder).free
    if free < needed_bytes:
        raise SwapFolderError(
            f"offload.nvme_dir {folder!r} has {free} bytes ({format_bytes(free)}) free but {what}: "
            "free space, choose a bigger disk, or shard over more ranks"
        )


class NvmeTier:
    """This rank's engines (one per lane, built on first use) and the swap files opened through them."""

    def __init__(self, offload: OffloadConfig, rank: int, ledger: Ledger | None = None) -> None:
        self.offload, self.rank = offload, rank
        self.ledger = ledger if ledger is not None else Ledger()
        self.aio = offload.aio
        self.timeout_s = offload.io_timeout_s
        self._engines: dict[str, AioEngine] = {}
        self._swaps: list[NvmeSwap] = []
        self._model: ModelIndex | None = None  # claimed when the first swap opens

    @property
    def folder(self) -> str:
        folder = self.offload.nvme_dir
        if folder is None:
            raise ValueError("this placement puts state on NVMe but offload.nvme_dir is not set: set it to a folder")
        return folder

    def engine(self, lane: str) -> AioEngine:
        """The engine of `lane` (one of LANES), built on first use and shared after."""
        if lane not in LANES:
            raise ValueError(f"unknown I/O lane {lane!r}; lanes: {LANES}")
        engine = self._engines.get(lane)
        if engine is None or engine.closed:  # closed with its user (a closed optimizer's store): a new one
            engine = self._engines[lane] = AioEngine(self.aio, ledger=self.ledger)
        return engine

    def open_swap(
        self, lane: str, slot_bytes: dict[tuple[str, str], int], alignment_bytes: int = SWAP_ALIGN_BYTES,
        preflight: str | None = None,
    ) -> NvmeSwap:
        """Preallocated swap files with the given slots (per (key, kind) bytes), on `lane`'s engine.
        `preflight` names what the files hold, for the message when the folder lacks room."""
        if self._model is None:
            self._model = ModelIndex(self.folder, self.rank, "tier")
        layout = plan_swap_layout(
            slot_bytes, self.folder, self.rank, alignment_bytes=alignment_bytes, model=self._model.index
        )
        if preflight is not None:
            preflight_swap_folder(layout.folder, sum(layout.file_bytes.values()), f"{preflight} of rank {self.rank}")
        swap = NvmeSwap(layout, self.engine(lane), ledger=self.ledger)
        self._swaps.append(swap)
        return swap

    def close(self) -> None:
        """Remove the swap files and stop every lane's threads, waiting for requests in flight (idempotent)."""
        for swap in self._swaps:
            swap.close()
        self._swaps.clear()
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()
        if self._model is not None:
            self._model.release()
            self._model = None


# -- unit shards on NVMe ---------------------------------------------------------------------------------------
def open_param_files(plan: ModelPlan, tier: NvmeTier) -> NvmeParamFiles | None:
    """The parameter swap file, staging pool and cache, sized by the unit plan; None (with a notice)
    when every unit is resident. The pool holds the shards in flight: one per unit the prefetcher may
    read ahead (bounded by `prefetch_bytes`), one gathered on demand, and one write behind unless
    updates are written straight from the masters. Host memory for parameters on NVMe is therefore
    that pool and `param_cache_bytes`' slots, whatever the model size."""
    cfg = plan.cfg
    if not plan.nvme_param_units:  # small models: keep them resident and run, as DeepSpeed does
        get_logger().info(
            "offload.params = 'nvme', but all %d units are resident (the root, or below persist_threshold_bytes "
            "= %d): every parameter stays on the device; lower persist_threshold_bytes to offload them",
            len(plan.units), cfg.persist_threshold_bytes,
        )
        return None
    staging = plan.param_staging()
    check_host_cap(
        staging.total_bytes, tier.offload.max_host_bytes, f"parameter staging ({staging.count} buffers)",
        "raise offload.max_host_bytes or lower prefetch_bytes",
    )
    slots = plan.param_cache_slots()
    if slots:
        check_host_cap(
            staging.total_bytes + slots * plan.param_cache_slot_bytes, tier.offload.max_host_bytes,
            f"parameter staging and cache ({staging.count} + {slots} buffers)",
            "raise offload.max_host_bytes or lower offload.param_cache_bytes",
        )
    swap = tier.open_swap("params", plan.param_swap_bytes())
    pools = SizedPools(staging.classes, alignment_bytes=SWAP_ALIGN_BYTES, ledger=tier.ledger, tag="param_staging")
    cache = ShardCache(slots, plan.param_cache_slot_bytes, SWAP_ALIGN_BYTES, tier.ledger) if slots else None
    return NvmeParamFiles(swap, swap.engine, pools, tier.timeout_s, cache, keep=plan.param_buffers_kept_for_masters)


def open_grad_files(plan: ModelPlan, tier: NvmeTier) -> NvmeGradFiles:
    """The gradient swap file: room for every trainable unit's fp32 gradient shard (sizes from the unit plan)."""
    return NvmeGradFiles(tier.open_swap("grads", plan.grad_swap_bytes()), tier.timeout_s)
