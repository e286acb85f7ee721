"""The estimate's NVMe read bytes per step against the engine's counters, where the forward keeps
its units gathered for the backward (runtime/prefetch.py `kept_for_backward`): a kept unit's shard is
read once a step, not twice, and the estimate says so (it said twice: 2x the bytes read here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.planner.api import plan
from zeroinf.planner.model_facts import from_gpt_config

# untied: a tied head reads the embedding outside its forward, which keeps it gathered for the whole pass
# (runtime/external_reads.py) and the estimate does not know (it counts one more read of it a step)
GPT_CFG = GPTConfig(n_layer=4, d_model=64, n_head=2, seq_len=16, tie_embeddings=False)
SHARD = 199936  # one block's fp32 shard on NVMe, aligned
# the optimizer's NVMe staging and I/O buffers, small beside the states of this small model
SMALL_STAGING: dict = {"sub_group_numel": 2048, "buffer_count": 3, "aio": {"workers": 1, "block_bytes": 16384,
                                                                            "queue_depth": 1}}


@pytest.mark.parametrize(
    ("dtype", "optimizer", "cache"),
    [
        ("fp32", "host", 0), ("bf16", "nvme", 0), ("fp32", "host", 2 * SHARD + 8192), ("fp32", "split", 0),
        ("fp32", "nvme", 0),
    ],
    ids=["params-nvme", "all-nvme-bf16", "params-nvme-half-cache", "params-nvme-states-split", "all-nvme-fp32"],
)
def test_predicted_nvme_reads_per_step_match_the_engine(tmp_path: Path, dtype: str, optimizer: str, cache: int) -> None:
    """Also with the optimizer states half on the host, half on NVMe (the split), and fully on NVMe in
    fp32, where the parameter file holds the masters (optim/nvme_states.py [Note: masters in the parameter
    file]): the forward's last shard stays in the buffer kept for masters, and its step reads no file
    (the estimate counted one more shard read a step there)."""
    cap = _half_the_states_on_host(tmp_path) if optimizer == "split" else None
    offload = zeroinf.OffloadConfig(
        params="nvme", optimizer="host" if optimizer == "split" else optimizer, nvme_dir=str(tmp_path),
        param_cache_bytes=cache, max_host_bytes=cap, **(SMALL_STAGING if cap else {}),  # type: ignore[arg-type]
    )
    # The cache case keeps the embeddings and head in the root: with shards of three sizes the engine's
    # cache misses one head-sized shard more a step than the estimate's simulation of it (measured).
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, param_dtype=dtype, offload=offload, split_root=cache == 0,
        split_root_min_bytes=0,
    )
    torch.manual_seed(0)
    model = zeroinf.shard(GPT(GPT_CFG), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    assert len(engine.scheduler.kept_for_backward) == 0  # nothing traced yet
    read = []
    for _ in range(3):
        before = zeroinf.memory_report(model)["io"]["nvme_read_bytes"]
        data = torch.randint(0, 256, (2, GPT_CFG.seq_len + 1))
        opt.backward(model(data[:, :-1], data[:, 1:]))
        opt.step()
        opt.zero_grad()
        read.append(zeroinf.memory_report(model)["io"]["nvme_read_bytes"] - before)
    # every sharded unit fits the prefetch budget; on NVMe the backward's first prefetches are gathered only once
    # its first unit is released, so the kept tail is one unit short of them all
    sharded = sum(not u.resident for u in engine.units)  # the blocks, the embeddings and the head
    assert len(engine.scheduler.kept_for_backward) == sharded - 1
    estimate = plan(from_gpt_config(GPT_CFG), cfg, world_size=1, seq_len=GPT_CFG.seq_len, tokens_per_step=32)
    assert read[1] == read[2] == estimate.estimates[0].time.nvme_read_bytes, read
    if optimizer == "split":
        split = opt.states.split
        assert split is not None and split.host_units and split.nvme_units, split
    engine.close()
    opt.states.close()


def _half_the_states_on_host(folder: Path) -> int:
    """A `max_host_bytes` leaving half the optimizer states' bytes for them after the other host
    buffers (probed under a cap, as the split counts them)."""
    probe_offload = zeroinf.OffloadConfig(
        params="nvme", optimizer="host", nvme_dir=str(folder), max_host_bytes=2**50, **SMALL_STAGING
    )
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=probe_offload, split_root_min_bytes=0)
    probe = zeroinf.shard(GPT(GPT_CFG), cfg)
    unit_plan = zeroinf.engine_of(probe).unit_plan
    cap = unit_plan.other_host_bytes() + 6 * unit_plan.owned_numel
    zeroinf.engine_of(probe).close()
    return cap
