"""A shard home lets go of its device copy once the gather has read it (partition/shard_home.py
`MemoryHome.end_load`).

It kept the copy until the unit's next load or optimizer step. On a GPU with parameters on the host,
that held every unit's last device copy of its shard from its forward gather until its backward
one: at the end of forward the whole model's compute-dtype shard was on the GPU, unseen by the
ledger (not measured on a GPU; the invariant is checked here). On the CPU, where the copy is the
host shard itself, it kept the bf16 shards an fp32 master had replaced (stage 3 with parameters in
memory builds the master as the shard, optim/states.py [Note: masters in the memory shard]): a 1.1B
Llama built under `zeroinf.init` peaked 1.27 GiB higher when its optimizer was built (14.93 against
13.66 GiB, measured at stop 52: build, shard, AdamW, two steps of 64 tokens, RSS from /proc).
"""

from __future__ import annotations

import gc
import weakref

import torch

import zeroinf
from tests._parity import build_model, global_batch
from zeroinf import OffloadConfig
from zeroinf.partition.shard_home import MemoryHome


def _cfg(params: str) -> zeroinf.Config:
    offload = OffloadConfig(params=params, optimizer="host")
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype="bf16", offload=offload)


def _holds_a_copy(home: object) -> bool:
    copy = getattr(home, "_copy", None)
    return copy is not None and "tensor" in vars(copy)


def test_no_home_holds_a_device_copy_after_a_forward() -> None:
    model = zeroinf.shard(build_model(), _cfg("host"))
    try:
        homes = [u.home for u in zeroinf.engine_of(model).units if isinstance(u.home, MemoryHome)]
        assert homes
        with torch.no_grad():
            model(*global_batch(0))
        holding = [h for h in homes if _holds_a_copy(h)]
        assert not holding, f"{len(holding)} of {len(homes)} homes still hold their last device copy"
    finally:
        zeroinf.engine_of(model).close()


def test_compute_shards_replaced_by_masters_are_freed() -> None:
    cfg = _cfg("device")  # a CPU device: the shard in memory becomes the fp32 master
    with zeroinf.init(cfg):
        built = build_model()
    model = zeroinf.shard(built, cfg)
    try:
        engine = zeroinf.engine_of(model)
        shared = [u for u, s in zip(engine.units, engine.unit_plan.masters_in_memory_shard, strict=True) if s]
        assert shared
        old = [weakref.ref(u.home.shard) for u in shared]  # type: ignore[union-attr]
        opt = zeroinf.AdamW(model, lr=1e-3)
        gc.collect()
        alive = [i for i, ref in enumerate(old) if ref() is not None]
        assert not alive, f"the bf16 shards of {len(alive)} of {len(old)} units outlived their replacement"
        assert all(u.home.shard.dtype == torch.float32 for u in shared)  # type: ignore[union-attr]
        opt.close()
    finally:
        zeroinf.engine_of(model).close()
