"""Opening the NVMe tier for stage-3 parameter shards: one swap file per rank, a staging pool.

Sizes come from the unit plan (planner/unit_plan.py), before any unit is built: the file is
preallocated once, with room for every non-resident unit's shard at an aligned offset, so building
under `zeroinf.init` can write each shard out as soon as its unit is materialized.

The staging pool holds the shards in flight: one per unit the prefetcher may read ahead (bounded
by `prefetch_bytes` and the smallest unit), the unit running now, and writes after the optimizer
step. Host memory for parameters is therefore that pool, whatever the model size.
"""

from __future__ import annotations

from zeroinf.aio import AioEngine, BufferPool
from zeroinf.config import Config
from zeroinf.memory import Ledger
from zeroinf.partition.shard_home import NvmeGradFiles, NvmeParamFiles
from zeroinf.planner.unit_plan import SWAP_ALIGN_BYTES as ALIGN_BYTES
from zeroinf.planner.unit_plan import ModelPlan
from zeroinf.telemetry import get_logger
from zeroinf.tiers.host import check_host_cap
from zeroinf.tiers.nvme import NvmeSwap, plan_swap_layout
from zeroinf.topology import Topology


def open_param_files(plan: ModelPlan, cfg: Config, topo: Topology, ledger: Ledger) -> NvmeParamFiles | None:
    """The parameter swap file and staging pool, sized by the unit plan (planner/unit_plan.py); None
    (with a notice) when every unit is resident."""
    if not plan.nvme_param_units:  # small models: keep them resident and run, as DeepSpeed does
        get_logger().info(
            "offload.params = 'nvme', but all %d units are resident (the root, or below persist_threshold_bytes "
            "= %d): every parameter stays on the device; lower persist_threshold_bytes to offload them",
            len(plan.units), cfg.persist_threshold_bytes,
        )
        return None
    shard_bytes = plan.param_swap_bytes()
    staging = plan.param_staging()
    folder = cfg.offload.nvme_dir
    assert folder is not None  # OffloadConfig requires it for nvme
    swap_layout = plan_swap_layout(shard_bytes, folder, topo.rank, alignment_bytes=ALIGN_BYTES)
    check_host_cap(
        staging.total_bytes, cfg.offload.max_host_bytes, f"parameter staging ({staging.count} buffers)",
        "raise offload.max_host_bytes or lower prefetch_bytes",
    )
    engine = AioEngine(cfg.offload.aio, ledger=ledger)
    try:
        swap = NvmeSwap(swap_layout, engine, ledger=ledger)
    except BaseException:
        engine.close()
        raise
    pool = BufferPool(
        staging.count, staging.buffer_bytes, alignment_bytes=ALIGN_BYTES, ledger=ledger, tag="param_staging"
    )
    return NvmeParamFiles(swap, engine, pool, cfg.offload.io_timeout_s)


def open_grad_files(plan: ModelPlan, cfg: Config, topo: Topology, ledger: Ledger) -> NvmeGradFiles:
    """The gradient swap file: room for every trainable unit's fp32 gradient shard (sizes from the unit plan)."""
    shard_bytes = plan.grad_swap_bytes()
    folder = cfg.offload.nvme_dir
    assert folder is not None
    engine = AioEngine(cfg.offload.aio, ledger=ledger)
    try:
        layout = plan_swap_layout(shard_bytes, folder, topo.rank, alignment_bytes=ALIGN_BYTES)
        swap = NvmeSwap(layout, engine, ledger=ledger)
    except BaseException:
        engine.close()
        raise
    return NvmeGradFiles(swap, cfg.offload.io_timeout_s)
