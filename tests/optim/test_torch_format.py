"""The optimizer state in torch.optim's format, out and in (optim/torch_format.py [Note: the optimizer
state in torch.optim's format]).

Both ways against plain PyTorch on the same batches: a plain run's `opt.state_dict()` after 3 steps,
loaded with its weights into a sharded model and optimizer, continues 2 more steps with plain
PyTorch's losses and weights; and a sharded run's `zeroinf.full_optimizer_state_dict` after 3
steps, loaded with its weights into a plain model and `torch.optim` optimizer, continues the same.
Bitwise at world 1 for zeroinf.AdamW against torch's fused AdamW (decay and no-decay groups, the
second at its own lr) at stages 0-3 on the device, the host and NVMe, and for torch's SGD with
momentum and torch's fused AdamW through zeroinf.ShardedOptimizer (no `step` in SGD's state; AdamW's
loaded parameters never take a first step there, so their `step` is made as torch makes it); at
world 2 (stage 3 on NVMe), both ranks export the same dict and the continuation matches within the
fp32 tolerances; the dict held by rank 0 alone (`holder=0`, with the fp32 masters: accelerate's
save_state) resumes bitwise as that one, the other ranks' dicts and a holder without the host memory
for it are refused on every rank.
Mismatched groups, states the optimizer does not keep and a missing `step` are refused by name.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, train_rank_slices
from tests.test_parity import TOLERANCES

BEFORE, AFTER = 3, 2
SGD = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Decay and no-decay groups by dimension (nanoGPT's, the Trainer's), the second at half the lr."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": LR / 2},
    ]


def _torch_opt(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind in ("adamw", "torch-adamw"):
        return torch.optim.AdamW(_groups(model), lr=LR, fused=True)
    return torch.optim.SGD(_groups(model), **SGD)


def _zeroinf_opt(kind: str, model: torch.nn.Module) -> Any:
    if kind == "adamw":
        return zeroinf.AdamW(_groups(model), lr=LR)
    if kind == "torch-adamw":  # its `step` made by ShardedOptimizer for parameters that never stepped there
        return zeroinf.ShardedOptimizer(torch.optim.AdamW, _groups(model), lr=LR, fused=True)
    return zeroinf.ShardedOptimizer(torch.optim.SGD, _groups(model), **SGD)


def _plain_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        loss = model(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(kind: str, stage: int, offload: dict[str, Any]) -> tuple[torch.nn.Module, Any]:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
    return model, _zeroinf_opt(kind, model)


def _assert_same(a: list[float], b: list[float], wa: dict, wb: dict, what: str, exact: bool = True) -> None:
    rtol, atol = (0.0, 0.0) if exact else TOLERANCES["fp32"]
    assert all(math.isclose(x, y, rel_tol=rtol, abs_tol=0.0) for x, y in zip(a, b, strict=True)), (what, a, b)
    for k, v in wb.items():
        assert torch.allclose(wa[k], v, rtol=0.0, atol=atol), (what, k)


TIERS = {
    "stage0-device": (0, {}),
    "stage1-host": (1, {"optimizer": "host"}),
    "stage2-nvme": (2, {"optimizer": "nvme"}),
    "stage3-device": (3, {}),
    "stage3-nvme": (3, {"params": "nvme", "optimizer": "nvme"}),
}


@pytest.mark.parametrize("kind", ["adamw", "sgd", "torch-adamw"])
@pytest.mark.parametrize("placement", TIERS)
def test_both_ways_continue_as_plain_pytorch(kind: str, placement: str, tmp_path: Path) -> None:
    stage, tiers = TIERS[placement]
    offload = {**tiers, "nvme_dir": str(tmp_path)}
    # plain -> zeroinf
    plain = build_model()
    plain_opt = _torch_opt(kind, plain)
    _plain_steps(plain, plain_opt, 0, BEFORE)
    model, opt = _sharded(kind, stage, offload)
    model.load_state_dict(plain.state_dict())
    zeroinf.load_full_optimizer_state_dict(opt, plain_opt.state_dict())
    want = _plain_steps(plain, plain_opt, BEFORE, BEFORE + AFTER)
    got = train_rank_slices(model, opt, 0, 1, BEFORE, BEFORE + AFTER)
    _assert_same(got, want, model.state_dict(), plain.state_dict(), f"plain -> {placement}")
    opt.close()
    # zeroinf -> plain
    model, opt = _sharded(kind, stage, offload)
    train_rank_slices(model, opt, 0, 1, 0, BEFORE)
    exported = zeroinf.full_optimizer_state_dict(opt)
    plain = build_model()
    plain.load_state_dict(model.state_dict())
    plain_opt = _torch_opt(kind, plain)
    plain_opt.load_state_dict(exported)
    want = train_rank_slices(model, opt, 0, 1, BEFORE, BEFORE + AFTER)
    got = _plain_steps(plain, plain_opt, BEFORE, BEFORE + AFTER)
    _assert_same(got, want, plain.state_dict(), model.state_dict(), f"{placement} -> plain")
    assert ("step" in exported["state"][0]) == (kind != "sgd")
    opt.close()


def _with_unused(model: torch.nn.Module) -> torch.nn.Module:
    model.unused = torch.nn.Parameter(torch.ones(5))  # never in forward: no gradient, never stepped
    return model


def test_the_format_is_torchs(tmp_path: Path) -> None:
    """Same keys, indices, shapes and group hyperparameters as torch's own state dict after the same
    steps; a parameter that never had a gradient has no state in either."""
    plain = _with_unused(build_model())
    plain_opt = _torch_opt("adamw", plain)
    _plain_steps(plain, plain_opt, 0, BEFORE)
    theirs = plain_opt.state_dict()
    config = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload={"optimizer": "host"})
    model = zeroinf.shard(_with_unused(build_model()), config)
    opt = _zeroinf_opt("adamw", model)
    train_rank_slices(model, opt, 0, 1, 0, BEFORE)
    ours = zeroinf.full_optimizer_state_dict(opt)
    unused = next(i for i, p in enumerate(q for g in plain_opt.param_groups for q in g["params"]) if p is plain.unused)
    assert unused not in theirs["state"]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert ours["state"][index].keys() == state.keys()
        for key, value in state.items():
            assert ours["state"][index][key].shape == value.shape and ours["state"][index][key].dtype == value.dtype
            assert torch.equal(ours["state"][index][key], value), (index, key)
    for group, their_group in zip(ours["param_groups"], theirs["param_groups"], strict=True):
        assert group == their_group  # every setting, `fused=True` included: torch then runs zeroinf's kernel
    opt.close()


def _world2(rank: int, world: int, folder: str) -> dict[str, Any]:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": f"{folder}/r{rank}"}
    model, opt = _sharded("adamw", 3, offload)
    before = train_rank_slices(model, opt, rank, world, 0, BEFORE)
    exported = zeroinf.full_optimizer_state_dict(opt)
    weights = model.state_dict()
    fresh, fresh_opt = _sharded("adamw", 3, {**offload, "nvme_dir": f"{folder}/fresh{rank}"})
    fresh.load_state_dict(weights)
    zeroinf.load_full_optimizer_state_dict(fresh_opt, exported)
    after = train_rank_slices(fresh, fresh_opt, rank, world, BEFORE, BEFORE + AFTER)
    out: dict[str, Any] = {"exported": exported, "losses": before + after, "weights": fresh.state_dict()}
    # Held by rank 0 alone (accelerate's save_state): rank 1 gets a dict naming it, which loads nowhere;
    # rank 0's, given to both, resumes as the dict every rank held.
    held = zeroinf.full_optimizer_state_dict(opt, holder=0, masters=True)
    out["held_keys"] = (sorted(held), len(held["state"]), sorted(held["zeroinf"]))
    try:
        zeroinf.load_full_optimizer_state_dict(fresh_opt, held)
    except ValueError as exc:
        out["stub_refused"] = str(exc)
    shared = [held]
    torch.distributed.broadcast_object_list(shared, src=0)
    again, again_opt = _sharded("adamw", 3, {**offload, "nvme_dir": f"{folder}/again{rank}"})
    again.load_state_dict(weights)
    again_opt.load_state_dict(shared[0])  # torch.optim's format: the same loader
    out["held_losses"] = train_rank_slices(again, again_opt, rank, world, BEFORE, BEFORE + AFTER)
    if rank == 0:  # the holder's host has no room: every rank refuses, none is killed midway
        import zeroinf.optim.torch_format as torch_format

        torch_format.available_ram_bytes = lambda: 1
    try:
        zeroinf.full_optimizer_state_dict(opt, holder=0)
    except MemoryError as exc:
        out["no_room"] = str(exc)
    for o in (opt, fresh_opt, again_opt):
        o.close()
    return out


def test_world_2_exports_the_same_dict_on_every_rank_and_loads_it(tmp_path: Path) -> None:
    got = run_ranks(_world2, 2, str(tmp_path))
    ours, theirs = got[0]["exported"], got[1]["exported"]
    assert ours["state"].keys() == theirs["state"].keys()
    assert all(torch.equal(v, theirs["state"][i][k]) for i, s in ours["state"].items() for k, v in s.items())
    plain = build_model()
    plain_opt = _torch_opt("adamw", plain)
    want = _plain_steps(plain, plain_opt, 0, BEFORE + AFTER)
    _assert_same(got[0]["losses"], want, got[0]["weights"], plain.state_dict(), "world 2", exact=False)
    assert got[0]["held_keys"][0] == ["param_groups", "state", "zeroinf"] and got[0]["held_keys"][1] > 0
    assert got[0]["held_keys"][2] == ["master", "optimizer", "scaler", "step_count"]
    assert got[1]["held_keys"] == (["param_groups", "state", "zeroinf"], 0, ["held_by_rank"])
    for r in got:
        assert "1 rank(s) were given an optimizer state dict without the state" in r["stub_refused"], r
        assert r["held_losses"] == r["losses"][BEFORE:], r  # bitwise: the same state, masters included
        assert "does not fit in the host memory" in r["no_room"] and "zeroinf.save" in r["no_room"], r


def test_mismatches_are_refused_by_name() -> None:
    model, opt = _sharded("adamw", 1, {})
    plain = build_model()
    one_group = torch.optim.AdamW(plain.parameters(), lr=LR)
    with pytest.raises(ValueError, match=r"param groups of \[\d+\] parameters, zeroinf.AdamW of \[\d+, \d+\]"):
        zeroinf.load_full_optimizer_state_dict(opt, one_group.state_dict())
    amsgrad = torch.optim.AdamW(_groups(plain), lr=LR, amsgrad=True)
    _plain_steps(plain, amsgrad, 0, 1)
    with pytest.raises(ValueError, match=r"has state \['max_exp_avg_sq'\].*amsgrad=True"):
        zeroinf.load_full_optimizer_state_dict(opt, amsgrad.state_dict())
    sgd_plain = build_model()
    sgd = _torch_opt("sgd", sgd_plain)
    _plain_steps(sgd_plain, sgd, 0, 1)
    with pytest.raises(ValueError, match="has state \\['momentum_buffer'\\]"):
        zeroinf.load_full_optimizer_state_dict(opt, sgd.state_dict())
    exported = zeroinf.full_optimizer_state_dict(opt)  # no step taken yet: no state
    no_step = {"state": {0: {"exp_avg": torch.zeros(1), "exp_avg_sq": torch.zeros(1)}},
               "param_groups": exported["param_groups"]}
    with pytest.raises(ValueError, match="parameter 0 has no `step`"):
        zeroinf.load_full_optimizer_state_dict(opt, no_step)
    opt.close()
