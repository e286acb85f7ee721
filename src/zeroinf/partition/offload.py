"""Opening the NVMe tier for stage-3 parameter shards: one swap file per rank, a staging pool.

Sizes come from the unit specs before any unit is built (the file is preallocated once, with
room for every non-resident unit's shard at an aligned offset), so building under `zeroinf.init`
can write each shard out as soon as its unit is materialized.

The staging pool holds the shards in flight: one per unit the prefetcher may read ahead (bounded
by `prefetch_bytes` and the smallest unit), the unit running now, and writes after the optimizer
step. Host memory for parameters is therefore that pool, whatever the model size.
"""

from __future__ import annotations

import math

from zeroinf.aio import AioConfig, AioEngine, BufferPool
from zeroinf.aio.buffers import round_up
from zeroinf.config import Config
from zeroinf.memory import Ledger
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.partition.shard_home import GRAD_KIND, PARAM_KIND, NvmeGradFiles, NvmeParamFiles
from zeroinf.partition.wrap import UnitSpec
from zeroinf.telemetry import get_logger
from zeroinf.tiers.host import check_host_cap
from zeroinf.tiers.nvme import NvmeSwap, plan_swap_layout
from zeroinf.topology import Topology

ALIGN_BYTES = 4096
EXTRA_BUFFERS = 3  # the unit running now, one being gathered, one write in flight


def open_param_files(
    specs: list[UnitSpec], resident: set[str], cfg: Config, topo: Topology, ledger: Ledger
) -> NvmeParamFiles | None:
    """The parameter swap file and staging pool; None (with a notice) when every unit is resident."""
    itemsize = cfg.param_torch_dtype.itemsize
    shard_bytes: dict[tuple[str, str], int] = {}
    unsharded: list[int] = []
    for spec in specs:
        if spec.key in resident:
            continue
        layout = FlatLayout.build([(n, p.shape) for n, p in spec.params], topo.world_size)
        shard_bytes[(spec.key or "<root>", PARAM_KIND)] = layout.shard_numel * itemsize
        unsharded.append(layout.padded_numel * itemsize)
    if not shard_bytes:  # small models: keep them resident and run, as DeepSpeed does
        get_logger().info(
            "offload.params = 'nvme', but all %d units are resident (the root, or below persist_threshold_bytes "
            "= %d): every parameter stays on the device; lower persist_threshold_bytes to offload them",
            len(specs), cfg.persist_threshold_bytes,
        )
        return None
    folder = cfg.offload.nvme_dir
    assert folder is not None  # OffloadConfig requires it for nvme
    swap_layout = plan_swap_layout(shard_bytes, folder, topo.rank, alignment_bytes=ALIGN_BYTES)
    ahead = min(len(unsharded), math.ceil(cfg.prefetch_bytes / min(unsharded)) if cfg.prefetch_bytes else 0)
    count = ahead + EXTRA_BUFFERS
    buffer_bytes = round_up(max(shard_bytes.values()), ALIGN_BYTES)
    check_host_cap(
        count * buffer_bytes, cfg.offload.max_host_bytes, f"parameter staging ({count} buffers)",
        "raise offload.max_host_bytes or lower prefetch_bytes",
    )
    engine = AioEngine(AioConfig(), ledger=ledger)
    try:
        swap = NvmeSwap(swap_layout, engine, ledger=ledger)
    except BaseException:
        engine.close()
        raise
    pool = BufferPool(count, buffer_bytes, alignment_bytes=ALIGN_BYTES, ledger=ledger, tag="param_staging")
    return NvmeParamFiles(swap, engine, pool, cfg.offload.io_timeout_s)


def open_grad_files(specs: list[UnitSpec], cfg: Config, topo: Topology, ledger: Ledger) -> NvmeGradFiles:
    """The gradient swap file: room for every unit's fp32 gradient shard."""
    fp32_bytes = 4
    shard_bytes = {
        (spec.key or "<root>", GRAD_KIND): fp32_bytes
        * FlatLayout.build([(n, p.shape) for n, p in spec.params], topo.world_size).shard_numel
        for spec in specs
    }
    folder = cfg.offload.nvme_dir
    assert folder is not None
    engine = AioEngine(AioConfig(), ledger=ledger)
    try:
        layout = plan_swap_layout(shard_bytes, folder, topo.rank, alignment_bytes=ALIGN_BYTES)
        swap = NvmeSwap(layout, engine, ledger=ledger)
    except BaseException:
        engine.close()
        raise
    return NvmeGradFiles(swap, cfg.offload.io_timeout_s)
