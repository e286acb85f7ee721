"""A parameter's whole optimizer state between steps (optim/full_state.py [Note: a parameter's
optimizer state]): `zeroinf.optimizer_state` reads it, `zeroinf.set_optimizer_state` writes moments
and step counts, `opt.state[p]` names both.

Against plain PyTorch (torch's fused AdamW, the kernel zeroinf runs) on the same batches: 3 steps,
then every trained parameter's `step`, `exp_avg`, `exp_avg_sq` and master equal torch's
`opt.state[p]` and `p` bitwise; then the moments and step of two parameters are reset (the token
embedding and a block's weight, as after re-initializing them) in both runs, and 2 more steps give
the same losses and weights bitwise. At stages 0-3 with the states on the device, the host and NVMe
(stage 3: the parameters there too), split between host and NVMe; at world 2 in one spawned group
(stage 1 in memory, stage 3 on NVMe) to the parity suite's fp32 tolerances. bf16 moments read back
as the checkpoint holds them. Misuse stops with the way out named.
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
from tests.optim.test_split_states import SMALL_IO, _budget
from tests.test_parity import TOLERANCES

BEFORE, AFTER = 3, 2
RESET = ("tok.weight", "blocks.1.fc.weight")  # two parameters whose state is reset after BEFORE steps
SHAPES = {n: p.shape for n, p in build_model().named_parameters()}  # at stage 3 parameters are placeholders


def _plain() -> tuple[list[float], dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Plain PyTorch: losses, the states after BEFORE steps by name, the weights at the end."""
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    named = dict(model.named_parameters())
    losses, states = [], {}
    for step in range(BEFORE + AFTER):
        if step == BEFORE:
            states = {n: {**{k: v.clone() for k, v in opt.state[p].items()}, "master": p.detach().clone()}
                      for n, p in named.items()}
            for name in RESET:
                st = opt.state[named[name]]
                st["exp_avg"].zero_()
                st["exp_avg_sq"].zero_()
                st["step"].zero_()
        loss = model(*global_batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, states, model.state_dict()


def _sharded(stage: int, offload: dict[str, Any], world: int = 1, rank: int = 0) -> dict[str, Any]:
    """The same loop on a sharded model: losses (averaged over ranks), the states read after BEFORE
    steps by name, the weights at the end."""
    cfg = zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    named = dict(model.named_parameters())
    losses = train_rank_slices(model, opt, rank, world, 0, BEFORE)
    read = zeroinf.optimizer_state(opt)
    states = {n: read[p] for n, p in named.items()}
    zero = {"exp_avg": torch.zeros, "exp_avg_sq": torch.zeros}
    reset = {named[n]: {"step": 0, **{k: make(SHAPES[n]) for k, make in zero.items()}} for n in RESET}
    zeroinf.set_optimizer_state(opt, reset)
    again = zeroinf.optimizer_state(opt, [named[RESET[0]]])[named[RESET[0]]]
    assert float(again["step"]) == 0 and not again["exp_avg"].any() and not again["exp_avg_sq"].any()
    losses += train_rank_slices(model, opt, rank, world, BEFORE, BEFORE + AFTER)
    return {"losses": losses, "states": states, "weights": model.state_dict()}


def _assert_plain(got: dict[str, Any], what: str, exact: bool = True) -> None:
    losses, states, weights = _plain()
    loss_rtol, atol = (0.0, 0.0) if exact else TOLERANCES["fp32"]
    for a, b in zip(got["losses"], losses, strict=True):
        assert math.isclose(a, b, rel_tol=loss_rtol, abs_tol=0.0), (what, got["losses"], losses)
    assert got["states"].keys() == states.keys()
    for name, state in states.items():
        ours = got["states"][name]
        assert float(ours["step"]) == float(state["step"]), (what, name)
        for kind in ("exp_avg", "exp_avg_sq", "master"):
            assert ours[kind].dtype == torch.float32 and ours[kind].device.type == "cpu"
            assert ours[kind].shape == state[kind].shape, (what, name, kind)
            assert torch.allclose(ours[kind], state[kind], rtol=0.0, atol=atol), (what, name, kind)
    for k, v in weights.items():
        assert torch.allclose(got["weights"][k], v, rtol=0.0, atol=atol), (what, k)


TIERS = {"device": {}, "host": {"optimizer": "host"}, "nvme": {"optimizer": "nvme"}}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tier", TIERS)
def test_the_state_read_and_reset_equal_torch_adamw(stage: int, tier: str, tmp_path: Path) -> None:
    offload = {**TIERS[tier], "nvme_dir": str(tmp_path)}
    if stage == 3 and tier != "device":
        offload["params"] = tier
    _assert_plain(_sharded(stage, offload), f"stage {stage}, {tier}")


def test_split_states(tmp_path: Path) -> None:
    budget = _budget(tmp_path, 1, 0.5, params="nvme")
    split = {"params": "nvme", "optimizer": "host", "max_host_bytes": budget, "nvme_dir": str(tmp_path), **SMALL_IO}
    _assert_plain(_sharded(3, split), "split host/NVMe")


def _world2(rank: int, world: int, stage: int, offload: dict[str, Any]) -> dict[str, Any]:
    if "nvme_dir" in offload:
        offload = {**offload, "nvme_dir": f"{offload['nvme_dir']}/r{rank}"}
    return _sharded(stage, offload, world, rank)


def test_world_2(tmp_path: Path) -> None:
    """Each rank owns half of each unit's states: the read sums the two halves into place."""
    for stage, offload in ((1, {}), (3, {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)})):
        got = run_ranks(_world2, 2, stage, offload)
        assert got[0]["losses"] == got[1]["losses"]
        for name, state in got[0]["states"].items():  # every rank reads the same whole state
            assert all(torch.equal(state[k], got[1]["states"][name][k]) for k in state), name
        _assert_plain(got[0], f"world 2, stage {stage}", exact=False)


def test_bf16_moments_read_back_as_the_checkpoint_holds_them(tmp_path: Path) -> None:
    offload = {"optimizer": "host", "moment_dtype": "bf16"}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    for step in range(2):
        opt.backward(model(*global_batch(step)))
        opt.step()
        opt.zero_grad()
    read = zeroinf.optimizer_state(opt)
    saved = opt.state_dict()
    engine = zeroinf.engine_of(model)
    for ui, unit in enumerate(engine.units):
        for p, slot in zip(unit.params, unit.layout.slots, strict=True):
            for kind in ("exp_avg", "exp_avg_sq", "master"):
                flat = saved[kind][ui].float()[slot.offset : slot.offset + slot.numel]
                assert torch.equal(read[p][kind].reshape(-1), flat), (slot.name, kind)
                if kind != "master":  # bf16 values: rounding them again changes nothing
                    assert torch.equal(read[p][kind], read[p][kind].bfloat16().float())


def test_misuse_is_named(tmp_path: Path) -> None:
    offload = {"optimizer": "host", "nvme_dir": str(tmp_path)}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    model.tok.weight.requires_grad_(False)  # after shard: still trained, as the engine decided at shard
    opt = zeroinf.AdamW(model, lr=LR)
    p = model.blocks[0].fc.weight
    with pytest.raises(KeyError, match=r"zeroinf.optimizer_state\(optimizer, \[param\]\)"):
        opt.state[p]["exp_avg"]
    with pytest.raises(KeyError, match="zeroinf.set_optimizer_state"):
        opt.state[p] = {"exp_avg": torch.zeros(SHAPES["blocks.0.fc.weight"])}
    assert len(opt.state) == 0 and opt.state.get(p) is None
    with pytest.raises(ValueError, match="master weights change with the parameter"):
        zeroinf.set_optimizer_state(opt, {p: {"master": torch.zeros(SHAPES["blocks.0.fc.weight"])}})
    with pytest.raises(ValueError, match=r"exp_avg of blocks.0.fc.weight has shape \(3,\), the parameter \(128, 32\)"):
        zeroinf.set_optimizer_state(opt, {p: {"exp_avg": torch.zeros(3)}})
    with pytest.raises(ValueError, match="not a count of steps"):
        zeroinf.set_optimizer_state(opt, {p: {"step": 1.5}})
    with pytest.raises(ValueError, match="no optimizer state: it is frozen"):
        zeroinf.optimizer_state(opt, [torch.nn.Parameter(torch.zeros(2))])
    # a step inside backward leaves the states partly updated until step() decides
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload={**offload, "step_in_backward": True})
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR)
    opt.backward(model(*global_batch(0)))
    with pytest.raises(RuntimeError, match=r"ran \(partly\) inside it and is decided in optimizer.step\(\)"):
        zeroinf.optimizer_state(opt, [model.blocks[0].fc.weight])
    opt.step()
    assert float(zeroinf.optimizer_state(opt, [model.blocks[0].fc.weight])[model.blocks[0].fc.weight]["step"]) == 1
