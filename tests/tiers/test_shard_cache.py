"""The NVMe parameter cache (tiers/shard_cache.py): Belady's policy along the traced order, and an engine
whose cached run equals the uncached one bitwise while reading fewer (or no) shards from NVMe."""

from __future__ import annotations

import pathlib

import pytest
import torch

import zeroinf
from zeroinf.config import ConfigError
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.tiers.shard_cache import simulate_reads

UNITS = [f"blocks.{i}" for i in range(6)]
STEP = UNITS + UNITS[::-1]  # forward, then backward


@pytest.mark.parametrize("slots", range(0, 8))
def test_each_slot_saves_two_reads_a_step_once_the_order_is_known(slots: int) -> None:
    reads = simulate_reads(STEP, slots, steps=4)
    held = min(slots, len(UNITS))
    # Optimal for this pattern: a slot keeps one shard from forward to backward and one from backward
    # to the next forward. The first step, before the trace, keeps the most recent ones (LRU).
    assert reads[1:] == [len(STEP) - 2 * held] * 3
    assert reads[0] == len(STEP) - held


def test_half_the_units_in_cache_read_each_shard_once_a_step() -> None:
    assert simulate_reads(STEP, len(UNITS) // 2, steps=3)[1:] == [len(UNITS)] * 2


def _train(tmp_path: pathlib.Path, cache_bytes: int | str, optimizer: str, steps: int = 3) -> dict:
    folder = tmp_path / f"swap-{cache_bytes}-{optimizer}"
    offload = zeroinf.OffloadConfig(
        params="nvme", optimizer=optimizer, nvme_dir=str(folder), param_cache_bytes=cache_bytes,
    )
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload, split_root=False)  # blocks of one size
    torch.manual_seed(0)
    model = zeroinf.shard(GPT(GPTConfig(n_layer=4, d_model=64, n_head=2, seq_len=16)), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    losses, reads = [], []
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = torch.randint(0, 256, (2, 17), generator=g)
        before = engine.io_report()["by_kind"]["params"]["read"]
        loss = model(data[:, :-1], data[:, 1:])
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        reads.append(engine.io_report()["by_kind"]["params"]["read"] - before)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    out = {
        "losses": losses, "reads": reads, "state": state, "cache": engine.io_report()["param_cache"],
        "shard_bytes": engine.unit_plan.nvme_param_units[0].shard_bytes,
        "cache_ledger": engine.ledger.live_bytes("host", "param_cache"),
        "slot_bytes": engine.unit_plan.param_cache_slot_bytes,
    }
    engine.close()
    opt.states.close()
    return out


@pytest.mark.parametrize("optimizer", ["host", "nvme"])
def test_a_cached_run_equals_the_uncached_one_and_reads_less(tmp_path: pathlib.Path, optimizer: str) -> None:
    plain = _train(tmp_path, 0, optimizer)
    whole = _train(tmp_path, "1GiB", optimizer)  # holds every shard
    half = _train(tmp_path, 2 * plain["shard_bytes"] + 8192, optimizer)  # two slots of four units
    for run in (whole, half):
        assert run["losses"] == plain["losses"]
        for key, value in plain["state"].items():
            assert torch.equal(run["state"][key], value), key
    shard = plain["shard_bytes"]
    assert plain["cache"] is None
    # With the states on NVMe the parameter file also holds the masters (optim/nvme_states.py [Note: masters in
    # the parameter file]); the step takes them from the shard a unit keeps after its backward gather, and
    # that kept shard also spares the read of the last unit of forward, the first of backward. Once both
    # passes are traced the forward keeps three of the four units gathered for the backward (they fit the
    # prefetch budget, and on NVMe the first backward unit and its prefetches are never gathered together:
    # runtime/prefetch.py `kept_for_backward`), so the backward reads one; with the states on NVMe the step
    # then reads the masters of two kept ones itself (the same bytes; the last unit's shard is kept for it).
    kept = 1 if optimizer == "nvme" else 0
    steady = 5 + (2 if optimizer == "nvme" else 0)
    assert plain["reads"] == [(8 - kept) * shard] + [steady * shard] * 2  # the first step reads on demand
    assert whole["reads"] == [4 * shard, 0, 0]  # each shard once, on its first use; never after, masters included
    # hits: backward of step 1, forward of steps 2-3 and the one unit their backwards gather, state_dict()
    assert whole["cache"]["slots"] == 4 and whole["cache"]["hits"] == 4 + 4 + 1 + 4 + 1 + 4
    assert whole["cache"]["misses"] == 4
    assert whole["cache_ledger"] == 4 * whole["slot_bytes"]
    assert half["cache"]["slots"] == 2
    assert half["reads"][1:] == [(2 + kept) * shard] * 2  # half the shards read once a step (and the masters)


def test_a_cache_needs_parameters_on_nvme_and_room_for_one_shard(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="param_cache_bytes"):
        zeroinf.OffloadConfig(params="host", param_cache_bytes="1GiB")
    with pytest.raises(ConfigError, match="param_cache_bytes"):
        zeroinf.OffloadConfig(params="nvme", nvme_dir=str(tmp_path), param_cache_bytes=-1)
    cfg = zeroinf.OffloadConfig(params="nvme", nvme_dir=str(tmp_path), param_cache_bytes="2KiB")
    assert cfg.param_cache_bytes == 2048
    with pytest.raises(ValueError, match="holds no parameter shard"):
        _train(tmp_path, 2048, "host", steps=1)
