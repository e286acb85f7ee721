"""fp32 masters kept in the parameter file (optim/nvme_states.py [Note: masters in the parameter file]):
when it applies, that no master file is laid out for those units, the bytes a step moves (with a
cache holding every shard, and without one, where the step takes each master from the shard kept
after the unit's backward gather), bitwise parity with the host optimizer, state_dict, and the
planner's prediction of the files and the traffic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, train_step
from zeroinf import OffloadConfig
from zeroinf.memory import Tier
from zeroinf.partition.wrap import discover_units
from zeroinf.planner.unit_plan import UnitShape, plan_units

STEPS = 3


def _cfg(folder: Path, optimizer: str = "nvme", cache: int | str = 0, **fields: object) -> zeroinf.Config:
    offload = OffloadConfig(
        params="nvme", optimizer=optimizer, nvme_dir=str(folder), param_cache_bytes=cache, sub_group_numel=2048,
    )
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload, **fields)  # type: ignore[arg-type]


def _flags(cfg: zeroinf.Config) -> tuple[bool, ...]:
    shapes = [UnitShape.of(spec) for spec in discover_units(build_model(), ())]
    return plan_units(shapes, cfg, 1).masters_in_param_file


def test_it_applies_to_fp32_nvme_units_with_states_on_nvme_and_no_speculative_step(tmp_path: Path) -> None:
    flags = _flags(_cfg(tmp_path))
    assert flags[:-1] == (True,) * (len(flags) - 1)  # the blocks
    assert flags[-1] is False  # the root unit is resident: its masters keep their own file
    assert not any(_flags(_cfg(tmp_path, param_dtype="bf16")))  # a bf16 shard is not the master
    assert not any(_flags(_cfg(tmp_path, optimizer="host")))  # masters in RAM already
    assert not any(_flags(_cfg(tmp_path, grad_clip_norm=1.0)))  # speculative: the masters before are kept
    step_after = zeroinf.Config(  # stepped after backward: the masters are read from the file at step()
        stage=3, persist_threshold_bytes=0,
        offload=OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path), step_in_backward=False),
    )
    assert all(_flags(step_after)[:-1])


def _train(cfg: zeroinf.Config) -> dict:
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    engine = zeroinf.engine_of(model)
    losses, traffic = [], []
    for step in range(STEPS):
        before = engine.io_report()["by_kind"]
        losses.append(train_step(model, opt, step))
        for unit in engine.units:  # writes behind still in flight would be counted in the next step
            if hasattr(unit.home, "read_range"):
                unit.home._finish_own_write()
        after = engine.io_report()["by_kind"]
        kinds = [(k, d) for k in ("params", "optimizer") for d in ("read", "written")]
        traffic.append({(k, d): after[k][d] - before[k][d] for k, d in kinds})
    plan = engine.unit_plan
    held = [u for u, h in zip(plan.trainable_units, plan.masters_in_param_file, strict=True) if h]
    state = opt.state_dict()
    out = {
        "losses": losses, "traffic": traffic, "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "held_numel": sum(u.owned_numel for u in held), "held_shard_bytes": sum(u.shard_bytes for u in held),
        "last_shard_bytes": held[-1].shard_bytes if held else 0,
        "other_numel": sum(u.owned_numel for u in plan.trainable_units) - sum(u.owned_numel for u in held),
        "master_file": engine.ledger.live_bytes(Tier.NVME, "optimizer_master"),
        "moment_file": engine.ledger.live_bytes(Tier.NVME, "optimizer_exp_avg"),
        "masters": state["master"], "ledger_nvme": dict(engine.ledger.snapshot()["nvme"]["by_tag"]),
    }
    # The masters state_dict reports are the parameters' owned shards (fp32: the same numbers).
    for unit, master in zip(engine.units, state["master"], strict=True):
        assert torch.equal(master, _owned(unit)), unit.name
    opt.close()
    engine.close()
    return out


def _owned(unit: object) -> torch.Tensor:
    home = unit.home  # type: ignore[attr-defined]
    out = torch.empty(unit.owned_numel, dtype=torch.float32)  # type: ignore[attr-defined]
    if not hasattr(home, "read_range"):  # the resident root, in memory
        return unit.param_flat[unit.owned_start : unit.owned_end].float()  # type: ignore[attr-defined]
    handle = home.read_range(0, unit.owned_numel, out)  # type: ignore[attr-defined]
    if handle is not None:
        handle.wait()
    return out


@pytest.mark.parametrize("cache", [0, "1GiB"])
def test_one_copy_on_disk_fewer_bytes_a_step_and_the_host_optimizer_bitwise(tmp_path: Path, cache: int | str) -> None:
    ref = _train(_cfg(tmp_path / "host", optimizer="host", cache=cache))
    got = _train(_cfg(tmp_path / "nvme", cache=cache))
    assert got["losses"] == ref["losses"]
    for key, value in ref["weights"].items():
        assert torch.equal(got["weights"][key], value), key
    for a, b in zip(got["masters"], ref["masters"], strict=True):
        assert torch.equal(a, b)
    held, other, shard = got["held_numel"], got["other_numel"], got["held_shard_bytes"]
    assert held > 0 and shard == 4 * held  # world 1: the owned range is the shard
    # The master file holds only the resident root's masters; the moments' files hold every unit.
    assert got["moment_file"] >= 4 * (held + other)
    assert got["master_file"] < got["moment_file"] and got["master_file"] >= 4 * other
    for step, traffic in enumerate(got["traffic"]):
        # Moments of every unit in and out; the root's master too (its own file).
        assert traffic[("optimizer", "read")] == traffic[("optimizer", "written")] == 8 * (held + other) + 4 * other
        assert traffic[("params", "written")] == shard  # the new shards, which are the new masters
        if cache:  # shards read once, on first use; the step takes the masters from the cache
            assert traffic[("params", "read")] == (shard if step == 0 else 0), step
        else:  # forward and backward, but the last unit of forward is kept for the first of backward; the
            # masters come from the buffer each unit kept after its backward gather
            assert traffic[("params", "read")] == 2 * shard - got["last_shard_bytes"], step


def test_the_plan_predicts_the_files_and_the_bytes(tmp_path: Path) -> None:
    for cache in (0, "1GiB"):
        cfg = _cfg(tmp_path / f"plan-{cache}", cache=cache)
        got = _train(cfg)
        plan = zeroinf.plan(build_model(), cfg, tokens_per_step=8 * 16)
        assert len(plan.estimates) == 1  # every field set: the one placement
        estimate = plan.estimates[0]
        for tag in ("optimizer_master", "optimizer_exp_avg", "param_shard"):
            assert estimate.ledger.by_tag["nvme"][tag] == got["ledger_nvme"][tag], tag
        last = got["traffic"][-1]
        read = last[("params", "read")] + last[("optimizer", "read")]
        # without a cache, the shard kept from the end of forward serves its unit's step (counted since
        # stop 40; the estimate said one shard more)
        assert estimate.time.nvme_read_bytes == read, (cache, estimate.time.nvme_read_bytes, read)
        if cache:
            assert read == last[("optimizer", "read")]
        assert estimate.time.nvme_written_bytes == last[("params", "written")] + last[("optimizer", "written")]


def test_kept_shards_cover_the_reductions_backward_leaves_running(tmp_path: Path) -> None:
    """A unit is stepped once its reduction finishes; with several ranks backward leaves two running,
    so the shards of the units gathered meanwhile are kept too (oldest given back first)."""
    from zeroinf.partition.shard_home import NvmeParamFiles

    cfg = _cfg(tmp_path)
    shapes = [UnitShape.of(spec) for spec in discover_units(build_model(), ())]
    assert plan_units(shapes, cfg, 1).param_buffers_kept_for_masters == 1  # one CPU process: none in flight
    world2 = plan_units(shapes, cfg, 2)
    assert world2.param_buffers_kept_for_masters == 1 + world2.reductions_in_flight == 3

    class Pool:
        released: list[str] = []

        def release(self, buf: str) -> None:
            self.released.append(buf)

    files = NvmeParamFiles.__new__(NvmeParamFiles)
    files.pools, files.keep, files._kept = Pool(), 3, {}  # type: ignore[assignment]
    for name in ("b3", "b2", "b1"):  # backward's gathers
        files.keep_loaded(name, f"buf-{name}")  # type: ignore[arg-type]
    assert files.kept("b3") == "buf-b3" and files.pools.released == []  # type: ignore[attr-defined]
    files.keep_loaded("b0", "buf-b0")  # type: ignore[arg-type]
    assert files.kept("b3") is None and files.pools.released == ["buf-b3"]  # type: ignore[attr-defined]
    assert files.take_kept("b2") == "buf-b2" and files.kept("b2") is None
    files.drop_kept()
    assert sorted(files.pools.released) == ["buf-b0", "buf-b1", "buf-b3"]  # type: ignore[attr-defined]
