"""Optimizer states split between host and NVMe by `offload.max_host_bytes` (`SplitStateStore`):
which units stay on the host, bitwise parity with the single-tier placements at world 1 and 2
(stepped inside backward, after it, and speculatively with clipping), checkpoints saved under one
split and loaded under another, and the plan's report of the split."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import GLOBAL_BATCH, LR, Case, build_model, global_batch, run_cases, train_rank_slices
from zeroinf import OffloadConfig
from zeroinf.memory import Tier
from zeroinf.partition.wrap import discover_units
from zeroinf.planner.unit_plan import UnitShape, choose_host_units, plan_units
from zeroinf.tiers.host import HostCapError


# -- which units stay on the host (pure) ---------------------------------------------------------------------
def test_host_units_are_spread_along_the_order_and_fill_the_budget() -> None:
    on_host = choose_host_units([100] * 10, budget_bytes=12 * 500, bytes_per_element=12)
    assert sum(on_host) == 5
    assert on_host == (False, True) * 5  # alternating: NVMe swaps run while host units step
    # Uneven units: never over budget; what the even pass leaves is filled with units that fit.
    sizes = [400, 50, 50, 300, 50, 50, 200, 50]
    on_host = choose_host_units(sizes, budget_bytes=12 * 600, bytes_per_element=12)
    used = sum(n for n, h in zip(sizes, on_host, strict=True) if h)
    assert used <= 600
    assert all(used + n > 600 for n, h in zip(sizes, on_host, strict=True) if not h)
    assert choose_host_units([10, 10], 0, 12) == (False, False)
    assert choose_host_units([10, 10], 10**9, 12) == (True, True)


# Small staging, so that a tiny model's states (~0.5 MB) outweigh the NVMe part's buffers.
SMALL_IO = {"sub_group_numel": 2048, "buffer_count": 3, "aio": {"workers": 1, "block_bytes": 16384, "queue_depth": 1}}


def _plan(offload: OffloadConfig, world: int, stage: int = 3, **cfg: object):
    config = zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload, **cfg)  # type: ignore[arg-type]
    shapes = [UnitShape.of(spec) for spec in discover_units(build_model(), ())]
    return plan_units(shapes, config, world)


def _budget(folder: Path, world: int, share: float, **offload: object) -> int:
    """A `max_host_bytes` leaving `share` of the states' bytes for them after the other host buffers."""
    probe = OffloadConfig(optimizer="host", nvme_dir=str(folder), **SMALL_IO, **offload)  # type: ignore[arg-type]
    plan = _plan(probe, world)
    return plan.other_host_bytes() + int(12 * plan.owned_numel * share)


def test_the_plan_splits_only_what_exceeds_the_budget(tmp_path: Path) -> None:
    budget = _budget(tmp_path, 1, 0.5, params="nvme")
    offload = OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path), max_host_bytes=budget, **SMALL_IO)
    split = _plan(offload, 1).optimizer_split()
    assert split is not None and split.host_units and split.nvme_units
    assert 12 * split.host_numel <= split.budget_bytes
    roomy = OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path), max_host_bytes=2**40)
    assert _plan(roomy, 1).optimizer_split() is None
    no_folder = OffloadConfig(optimizer="host", max_host_bytes=budget)  # nowhere to spill: no split
    assert _plan(no_folder, 1).optimizer_split() is None


# -- parity: the split trains exactly as the single-tier placements -------------------------------------------
VARIANTS = {  # name: (Case fields, offload fields)
    "in": ({}, {}),  # stepped inside backward ("final")
    "after": ({}, {"step_in_backward": False}),
    "clip-spec": ({"clip": 0.05}, {"step_in_backward": True}),  # speculative: undone and redone
}


def _cases(folder: Path, world: int) -> list[Case]:
    cases = []
    for variant, (fields, extra) in VARIANTS.items():
        if world == 2 and variant != "in":
            continue  # suite time: world 2 runs the default mode
        budget = _budget(folder, world, 0.5, params="nvme", **extra)
        tiers = {
            "host": {"optimizer": "host"},
            "split": {"optimizer": "host", "max_host_bytes": budget},
            "nvme": {"optimizer": "nvme"},
        }
        for tier, offload in tiers.items():
            name = f"{variant}-{tier}"
            cfg = OffloadConfig(
                params="nvme", nvme_dir=str(folder / name), **offload, **extra, **SMALL_IO  # type: ignore[arg-type]
            )
            overrides = (("offload", cfg), ("persist_threshold_bytes", 0))
            cases.append(Case(name, 3, steps=3, overrides=overrides, **fields))  # type: ignore[arg-type]
    return cases


def _compare(results: dict[str, dict]) -> None:
    for name, got in results.items():
        if not name.endswith("-split"):
            continue
        split = got["optimizer_split"]
        assert split is not None and split["host_units"] > 0 and split["nvme_units"] > 0, (name, split)
        assert 0 < got["host_optimizer_state_bytes"] == 12 * split["host_numel"] <= split["budget_bytes"], name
        for other in ("host", "nvme"):
            ref = results[name.removesuffix("split") + other]
            assert ref["optimizer_split"] is None
            assert got["losses"] == ref["losses"], (name, other, got["losses"], ref["losses"])
            for key, value in ref["weights"].items():
                assert torch.equal(got["weights"][key], value), (name, other, key)
            assert got["rollbacks"] == ref["rollbacks"], name
        assert (max(got["stepped_in_backward"]) > 0) == (not name.startswith("after")), name


def test_split_equals_host_and_nvme_world_1(tmp_path: Path) -> None:
    _compare(run_cases(0, 1, _cases(tmp_path, 1)))




# -- checkpoints across splits --------------------------------------------------------------------------------
SAVE_AT, STEPS = 2, 4


def _make(kind: str, folder: str, budget: int):
    offload = {
        "host": {"optimizer": "host"},
        "split": {"optimizer": "host", "max_host_bytes": budget},
        "nvme": {"optimizer": "nvme"},
    }[kind]
    os.makedirs(folder, exist_ok=True)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0,
                         offload=OffloadConfig(params="nvme", nvme_dir=folder, **offload, **SMALL_IO))  # type: ignore[arg-type]
    model = zeroinf.shard(build_model(), cfg)
    return model, zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _checkpoints_across_splits(rank: int, world: int, root: str, budget: int) -> dict:
    import zeroinf.checkpoint as ck

    out: dict[str, object] = {}
    model, opt = _make("split", f"{root}/swap-straight", budget)
    assert getattr(opt.states, "split", None) is not None
    out["straight"] = train_rank_slices(model, opt, rank, world, 0, STEPS)
    opt.close()
    for saved in ("split", "host", "nvme"):
        model, opt = _make(saved, f"{root}/swap-save-{saved}", budget)
        train_rank_slices(model, opt, rank, world, 0, SAVE_AT)
        ck.save(f"{root}/ckpt-{saved}", model, opt, step=SAVE_AT)
        opt.close()
    for saved, loaded in (("split", "host"), ("split", "nvme"), ("host", "split"), ("nvme", "split")):
        model, opt = _make(loaded, f"{root}/swap-{saved}-{loaded}", budget)
        info = ck.load(f"{root}/ckpt-{saved}", model, opt)
        out[f"{saved}->{loaded}"] = train_rank_slices(model, opt, rank, world, info["step"], STEPS)
        opt.close()
    return out


def _check_checkpoints(got: dict) -> None:
    straight = got["straight"]
    for key, losses in got.items():
        if key != "straight":
            assert losses == straight[SAVE_AT:], (key, losses, straight)


# -- the ledger, the plan and the error without a folder ------------------------------------------------------
def test_ledger_counts_each_part_where_it_is_and_the_plan_reports_the_split(tmp_path: Path) -> None:
    budget = _budget(tmp_path, 1, 0.4, params="nvme")
    offload = OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path), max_host_bytes=budget, **SMALL_IO)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    split = opt.states.split
    x, y = global_batch(0)
    opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()
    ledger = zeroinf.engine_of(model).ledger
    assert ledger.live_bytes(Tier.HOST, "optimizer_state") == 12 * split.host_numel
    assert ledger.live_bytes(Tier.NVME, "optimizer_master") >= 4 * split.nvme_numel
    traffic = opt.states.traffic.last_step
    assert traffic["host_read_bytes"] == 12 * split.host_numel
    assert traffic["nvme_read_bytes"] == traffic["nvme_written_bytes"] == 12 * split.nvme_numel
    assert zeroinf.memory_report(model)["io"]["last_step"]["by_kind"]["optimizer"]["read"] == 12 * split.nvme_numel
    # zeroinf.plan predicts the same split and the same host bytes for it.
    plan = zeroinf.plan(build_model(), cfg, tokens_per_step=GLOBAL_BATCH * 16, nvme_dir=str(tmp_path))
    estimate = next(e for e in plan.estimates if e.optimizer_split is not None)
    assert estimate.optimizer_split == split
    assert estimate.ledger.by_tag["host"]["optimizer_state"] == 12 * split.host_numel
    assert "optimizer states split" in estimate.placement
    opt.close()


def test_a_cap_too_small_without_a_folder_names_the_fix() -> None:
    cfg = zeroinf.Config(offload=OffloadConfig(optimizer="host", max_host_bytes=4096))
    model = zeroinf.shard(build_model(), cfg)
    with pytest.raises(HostCapError, match="set offload.nvme_dir"):
        zeroinf.AdamW(model)


def test_split_time_model_counts_only_the_nvme_part(tmp_path: Path) -> None:
    from zeroinf.planner.estimate import Workload, step_time
    from zeroinf.planner.profile import default_profile

    budget = _budget(tmp_path, 1, 0.5, params="nvme")
    base = {"params": "nvme", "nvme_dir": str(tmp_path), **SMALL_IO}
    plans = {
        "host": _plan(OffloadConfig(optimizer="host", **base), 1),
        "split": _plan(OffloadConfig(optimizer="host", max_host_bytes=budget, **base), 1),
        "nvme": _plan(OffloadConfig(optimizer="nvme", **base), 1),
    }
    profile, work = default_profile(), Workload(tokens_per_step=32, seq_len=16, world_size=1)
    moved = {k: step_time(p, None, work, profile, 40_000).nvme_read_bytes for k, p in plans.items()}
    split = plans["split"].optimizer_split()
    assert split is not None and math.isclose(moved["split"] - moved["host"], 12 * split.nvme_numel)
    assert moved["host"] < moved["split"] < moved["nvme"]


# -- parameter shards split between host and NVMe ---------------------------------------------------------------
class Stack(torch.nn.Module):
    """Ten units: enough that a few units' staging is smaller than the shards they stand for."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(128, 128) for _ in range(10)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _stack_config(kind: str, folder: str, world: int, optimizer: str = "device") -> zeroinf.Config:
    """Parameters on the host, on NVMe (`cached`: with a host cache holding every shard), or split with
    room for about half the host shards."""
    base = dict(stage=3, persist_threshold_bytes=0, prefetch_bytes=0)
    common = dict(nvme_dir=folder, optimizer=optimizer, **SMALL_IO)
    if kind in ("nvme", "cached"):
        cache = "1GiB" if kind == "cached" else 0
        return zeroinf.Config(**base, offload=OffloadConfig(params="nvme", param_cache_bytes=cache, **common))  # type: ignore[arg-type]
    budget = None
    if kind == "split":
        shapes = [UnitShape.of(spec) for spec in discover_units(Stack(), ())]
        probe = plan_units(shapes, zeroinf.Config(**base, offload=OffloadConfig(params="nvme", **common)), world)
        budget = probe.other_host_bytes() + sum(u.shard_bytes for u in probe.sharded_units) // 2
    return zeroinf.Config(**base, offload=OffloadConfig(params="host", max_host_bytes=budget, **common))  # type: ignore[arg-type]


def _train_stack(rank: int, world: int, root: str, optimizer: str) -> dict:
    import zeroinf.checkpoint as ck

    out: dict[str, object] = {}
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(1))[rank::world]
    for kind in ("host", "split", "nvme", "cached"):
        cfg = _stack_config(kind, f"{root}/{kind}", world, optimizer)
        with zeroinf.init(cfg):
            model = Stack()
        zeroinf.shard(model, cfg)
        opt = zeroinf.AdamW(model, lr=1e-2)
        engine = zeroinf.engine_of(model)
        tiers = [engine.unit_plan.unit(u.name).param_tier.value for u in engine.all_units if not u.resident]
        losses = []
        for step in range(4):
            loss = model(x * (step + 1))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 1:
                ck.save(f"{root}/ckpt-{kind}", model, opt, step=2)
        out[kind] = {"losses": losses, "weights": {k: v.clone() for k, v in model.state_dict().items()},
                     "tiers": tiers, "host_shard_bytes": engine.ledger.live_bytes(Tier.HOST, "param_shard"),
                     "optimizer_split": (split := getattr(opt.states, "split", None)) is not None,
                     "optimizer_host_units": len(split.host_units) if split is not None else None}
        opt.close()
        engine.close()
    for saved, loaded in (("split", "host"), ("split", "nvme"), ("nvme", "split"), ("split", "cached")):
        cfg = _stack_config(loaded, f"{root}/{saved}-{loaded}", world, optimizer)
        model = zeroinf.shard(Stack(), cfg)
        opt = zeroinf.AdamW(model, lr=1e-2)
        ck.load(f"{root}/ckpt-{saved}", model, opt)
        losses = []
        for step in range(2, 4):
            loss = model(x * (step + 1))
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[f"{saved}->{loaded}"] = losses
        opt.close()
        zeroinf.engine_of(model).close()
    return out


def _check_param_split(got: dict, optimizer: str) -> None:
    tiers = got["split"]["tiers"]
    assert "host" in tiers and "nvme" in tiers, tiers
    assert tiers[::2] != tiers[1::2]  # spread along the order, not packed at one end
    assert set(got["host"]["tiers"]) == {"host"}
    assert set(got["nvme"]["tiers"]) == set(got["cached"]["tiers"]) == {"nvme"}
    assert 0 < got["split"]["host_shard_bytes"] < got["host"]["host_shard_bytes"]
    for other in ("host", "nvme", "cached"):
        assert got["split"]["losses"] == got[other]["losses"], other
        for key, value in got[other]["weights"].items():
            assert torch.equal(got["split"]["weights"][key], value), (other, key)
    for key in ("split->host", "split->nvme", "nvme->split", "split->cached"):
        assert got[key] == got["host"]["losses"][2:], key
    # Parameter shards come first in the host budget: the optimizer states (on "host") get what they
    # leave, here nothing, so they all went to NVMe rather than over the cap.
    assert got["split"]["optimizer_split"] == (optimizer == "host")
    if optimizer == "host":
        assert got["split"]["optimizer_host_units"] == 0


def test_parameter_shards_split_world_1(tmp_path: Path) -> None:
    _check_param_split(_train_stack(0, 1, str(tmp_path), "device"), "device")


def _world_2(rank: int, world: int, root: str) -> dict:
    """Every world-2 check in one spawned group: optimizer-split parity, checkpoints across splits,
    parameter and optimizer splits together."""
    budget = _budget(Path(root), world, 0.5, params="nvme")
    os.makedirs(f"{root}/cases", exist_ok=True)
    return {
        "cases": run_cases(rank, world, _cases(Path(root) / "cases", world)),
        "checkpoints": _checkpoints_across_splits(rank, world, f"{root}/ckpt", budget),
        "stack": _train_stack(rank, world, f"{root}/stack", "host"),
    }


def test_splits_world_2(tmp_path: Path) -> None:
    got = run_ranks(_world_2, 2, str(tmp_path), timeout_s=600)[0]
    _compare(got["cases"])
    _check_checkpoints(got["checkpoints"])
    _check_param_split(got["stack"], "host")


def test_plan_reports_the_parameter_split(tmp_path: Path) -> None:
    cfg = _stack_config("split", str(tmp_path), 1)
    plan = zeroinf.plan(Stack(), cfg, tokens_per_step=8, seq_len=1, nvme_dir=str(tmp_path),
                        example_inputs=lambda batch, seq: ((torch.randn(batch, 128),), {}))
    estimate = plan.estimates[0]
    assert estimate.param_split is not None and all(estimate.param_split)
    assert "parameter shards split" in estimate.placement
    host = estimate.ledger.by_tag["host"]
    assert 0 < host["param_shard"] and host["param_staging"] > 0


# -- the split sized for the optimizer's own states -----------------------------------------------------------
def test_the_split_is_sized_for_the_optimizers_states(tmp_path: Path) -> None:
    """Under a cap that holds 30% of Adam's states, Lion's (8 bytes an element: one moment) put more
    units on the host, as the plan predicts for it; plain SGD's (4) fit whole. A successor keeping more
    states than the host part has room for (AdamW after Lion) is refused before Lion gives anything
    up, naming the fix; Lion goes on training."""
    budget = _budget(tmp_path, 1, 0.3, params="nvme")
    offload = OffloadConfig(params="nvme", optimizer="host", nvme_dir=str(tmp_path), max_host_bytes=budget, **SMALL_IO)
    adam_split = _plan(offload, 1).optimizer_split()
    lion_split = _plan(offload, 1).with_moments(1).optimizer_split()
    assert adam_split is not None and lion_split is not None
    assert lion_split.host_numel > adam_split.host_numel and 8 * lion_split.host_numel <= lion_split.budget_bytes
    assert _plan(offload, 1).with_moments(0).optimizer_split() is None  # plain SGD: 4 bytes, all on the host
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)
    predicted = zeroinf.plan(
        build_model(), cfg, tokens_per_step=GLOBAL_BATCH * 16, nvme_dir=str(tmp_path), optimizer="lion"
    ).estimates[0]
    assert predicted.optimizer_split == lion_split
    assert predicted.ledger.by_tag["host"]["optimizer_state"] == 8 * lion_split.host_numel

    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.ShardedOptimizer(zeroinf.Lion, model.parameters(), lr=1e-3)
    assert zeroinf.engine_of(model).unit_plan.moments == 1
    assert opt.states.split == lion_split
    assert zeroinf.engine_of(model).ledger.live_bytes(Tier.HOST, "optimizer_state") == 8 * lion_split.host_numel
    x, y = global_batch(0)
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    with pytest.raises(HostCapError, match="keeping 2 state tensors"):
        zeroinf.AdamW(model, lr=LR)
    loss = model(x, y)
    loss.backward()
    opt.step()  # Lion was left as it was
    opt.zero_grad()
    assert math.isfinite(loss.item())
    opt.close()


def test_the_planner_counts_the_optimizers_states(tmp_path: Path) -> None:
    """`zeroinf.plan(..., optimizer=)`: states per element and NVMe swap files for what it keeps; bad
    names and counts are refused naming the choices."""
    from zeroinf.planner.unit_plan import optimizer_moments

    nvme = OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=nvme)
    tags = {}
    for name in ("adamw", "lion", "sgd"):
        e = zeroinf.plan(build_model(), cfg, tokens_per_step=GLOBAL_BATCH * 16, optimizer=name).estimates[0]
        tags[name] = e.ledger.by_tag["nvme"]
    assert tags["adamw"]["optimizer_exp_avg_sq"] > 0 and tags["adamw"]["optimizer_exp_avg"] > 0
    assert "optimizer_exp_avg_sq" not in tags["lion"] and tags["lion"]["optimizer_exp_avg"] > 0
    assert "optimizer_exp_avg" not in tags["sgd"]
    assert tags["sgd"]["optimizer_master"] == tags["adamw"]["optimizer_master"]
    host = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=OffloadConfig(optimizer="host"))
    state = {
        name: zeroinf.plan(build_model(), host, optimizer=name).estimates[0].ledger.by_tag["host"]
        for name in ("adamw", "lion", "sgd", 1)
    }
    moment = 4 * _plan(OffloadConfig(optimizer="host"), 1).owned_numel  # one fp32 moment
    # (a master that is its unit's fp32 shard is counted with the shard, not here)
    state = {name: tags.get("optimizer_state", 0) for name, tags in state.items()}
    assert state["adamw"] - state["lion"] == state["lion"] - state["sgd"] == moment and state[1] == state["lion"]
    assert optimizer_moments("SGD-Momentum") == 1 and optimizer_moments("RMSprop") == 1
    with pytest.raises(ValueError, match="not one the planner knows: use one of adamw"):
        optimizer_moments("muon")
    with pytest.raises(ValueError, match="0, 1 or 2 state tensors"):
        optimizer_moments(3)


@pytest.mark.parametrize(("optimizer", "dtype", "params", "share"), [
    ("lion", "bf16", "device", 0.58), ("sgd", "fp32", "nvme", 0.48), ("adamw", "bf16", "nvme", 0.42),
])
def test_the_host_states_are_what_the_plan_predicts_for_the_optimizer(
    optimizer: str, dtype: str, params: str, share: float, tmp_path: Path
) -> None:
    """Under a cap that splits Adam's states but not Lion's or SGD's, those need no split, so the
    parameter shards in memory can be their masters ([Note: masters in the memory shard]): the plan
    for the optimizer (`zeroinf.plan(..., optimizer=)`) and the engine that builds it agree on the
    split and on the host bytes."""
    builds = {
        "adamw": lambda m: zeroinf.AdamW(m, lr=LR),
        "lion": lambda m: zeroinf.ShardedOptimizer(zeroinf.Lion, m.parameters(), lr=1e-4),
        "sgd": lambda m: zeroinf.ShardedOptimizer(torch.optim.SGD, m.parameters(), lr=1e-2),
    }
    budget = _budget(tmp_path, 1, share, params=params)
    offload = OffloadConfig(params=params, optimizer="host", nvme_dir=str(tmp_path), max_host_bytes=budget, **SMALL_IO)
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype=dtype, offload=offload)
    predicted = zeroinf.plan(
        build_model(), cfg, tokens_per_step=GLOBAL_BATCH * 16, nvme_dir=str(tmp_path), optimizer=optimizer
    ).estimates[0]
    model = zeroinf.shard(build_model(), cfg)
    opt = builds[optimizer](model)
    assert getattr(opt.states, "split", None) == predicted.optimizer_split
    live = zeroinf.engine_of(model).ledger.live_bytes(Tier.HOST, "optimizer_state")
    assert live == predicted.ledger.by_tag["host"].get("optimizer_state", 0)
    x, y = global_batch(0)
    model(x, y).backward()
    opt.step()
    opt.close()
