"""The optimizer step inside backward (optim/backward_step.py [Note: the step inside backward]) equals the
step after backward bitwise in fp32: stage 3 (and 2), states on the device, on host and on NVMe, world 1 and 2,
with clipping off, with clipping that triggers, and with an fp16 overflow. One spawned group per
world size runs every pair of cases; each pair differs only in `offload.step_in_backward`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import Case, run_cases
from zeroinf import OffloadConfig
from zeroinf.memory import Tier
from zeroinf.planner.unit_plan import step_in_backward_mode
from zeroinf.topology import Topology

SUB_GROUP_NUMEL = 5000  # most units split into several sub-groups (the stream's prefetch and eviction)
VARIANTS = {
    "noclip": {},  # "final": exact as it goes
    "clip": {"clip": 0.05},  # triggers on the first step: undone and redone; later steps hold back
    "clip-idle": {"clip": 1e6},  # never triggers: speculation confirmed every step
    "fp16-overflow": {"dtype": "fp16", "overflow_step": 2, "clip": 1e6},  # undone and skipped
}
SETUPS = {  # stage, offload
    "s3-onvme-gnvme": (3, {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"}),
    "s3-ohost-ghost": (3, {"params": "host", "optimizer": "host", "gradients": "host"}),
    # fp32 shards written straight from the host masters (partition/shard_home.py), undone and redone
    "s3-pnvme-ohost": (3, {"params": "nvme", "optimizer": "host", "gradients": "host"}),
    "s3-onvme-gdevice": (3, {"optimizer": "nvme"}),
    "s2-ohost-gnvme": (2, {"optimizer": "host", "gradients": "nvme"}),
    # everything on the device: each unit's gradient shard freed once stepped, below FSDP2's peak
    "s3-odevice-gdev": (3, {}),
    "s2-odevice-gdev": (2, {}),
    # the CPU kernels on a worker thread (optim/background.py) while backward goes on
    "s3-ohost-ghost-thread": (3, {"params": "host", "optimizer": "host", "gradients": "host", "step_thread": True}),
    "s3-ohost-gdev-thread": (3, {"optimizer": "host", "step_thread": True}),
}


def _cases(folder: Path, world: int) -> list[Case]:
    cases = []
    for setup, (stage, tiers) in SETUPS.items():
        for variant, fields in VARIANTS.items():
            if world == 2 and (
                setup.startswith("s2") or variant == "clip-idle" or setup.endswith(("gdevice", "gdev-thread"))
            ):
                continue  # world 2: stage 3, states on NVMe and on host, the three decisions (suite time)
            for on in (False, True):
                name = f"{setup}-{variant}-{'in' if on else 'after'}"
                offload = OffloadConfig(
                    **tiers, nvme_dir=str(folder / name), sub_group_numel=SUB_GROUP_NUMEL,  # type: ignore[arg-type]
                    step_in_backward=on,
                )
                overrides = (("offload", offload), ("persist_threshold_bytes", 0))
                cases.append(Case(name, stage, steps=5, overrides=overrides, **fields))  # type: ignore[arg-type]
    return cases


def _compare(results: dict[str, dict]) -> None:
    for name, got in results.items():
        if not name.endswith("-in"):
            continue
        ref = results[name.removesuffix("-in") + "-after"]
        assert [math.isnan(x) for x in got["losses"]] == [math.isnan(x) for x in ref["losses"]], name
        assert [x for x in got["losses"] if not math.isnan(x)] == [x for x in ref["losses"] if not math.isnan(x)], (
            name, got["losses"], ref["losses"])
        assert got["skipped"] == ref["skipped"], name
        for key, value in ref["weights"].items():
            assert torch.equal(got["weights"][key], value), (name, key)
        # It did step inside backward (not after it under another name), and undid what it had to.
        assert max(got["stepped_in_backward"]) > 0, name
        assert max(ref["stepped_in_backward"]) == 0 and ref["rollbacks"] == 0, name
        # The worker thread ran the kernels exactly where asked (offload.step_thread).
        assert (got["background_kernels"] > 0) == ("-thread-" in name), name
        stem = name.removesuffix("-in")
        variant = next(v for v in sorted(VARIANTS, key=len, reverse=True) if stem.endswith("-" + v))
        if variant in ("clip", "fp16-overflow"):
            assert got["rollbacks"] >= 1, name
        else:
            assert got["rollbacks"] == 0, name
        if variant == "clip":  # after a clipped step it holds back: no second undo in a row
            assert got["rollbacks"] == 1 and got["stepped_in_backward"][1] == 0, name


def test_in_backward_equals_after_backward_world_1(tmp_path: Path) -> None:
    cases = _cases(tmp_path, 1)
    _compare(run_cases(0, 1, cases))


def test_in_backward_equals_after_backward_world_2(tmp_path: Path) -> None:
    cases = _cases(tmp_path, 2)
    results = run_ranks(run_cases, 2, cases, timeout_s=600)
    _compare(results[0])


# -- behaviour around the step ---------------------------------------------------------------------------
class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _build(tmp_path: Path, **offload: object) -> tuple[torch.nn.Module, zeroinf.AdamW]:
    offload.setdefault("nvme_dir", str(tmp_path))
    cfg = zeroinf.Config(stage=3, offload=OffloadConfig(**offload))  # type: ignore[arg-type]
    model = zeroinf.shard(Stack(), cfg, Topology.single(torch.device("cpu")))
    return model, zeroinf.AdamW(model, lr=1e-2)


def test_changing_the_lr_between_backward_and_step_is_an_error_not_a_silent_mix(tmp_path: Path) -> None:
    model, opt = _build(tmp_path, optimizer="host")
    assert opt.step_mode == "final"
    opt.backward(model(torch.randn(4, 32)))
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match="changed between backward and optimizer.step"):
        opt.step()
    opt.zero_grad()  # the step finished (with the backward-time lr): training can go on
    opt.backward(model(torch.randn(4, 32)))
    opt.step()
    opt.close()


def test_zero_grad_before_step_refuses_once_units_were_stepped(tmp_path: Path) -> None:
    model, opt = _build(tmp_path, optimizer="nvme")
    opt.backward(model(torch.randn(4, 32)))
    with pytest.raises(RuntimeError, match="call optimizer.step\\(\\) first"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    opt.close()


def test_modes_and_what_speculation_keeps(tmp_path: Path) -> None:
    base = zeroinf.Config(stage=3, grad_clip_norm=1.0)
    mode = step_in_backward_mode
    nvme = {"nvme_dir": str(tmp_path)}
    assert mode(dataclasses.replace(base, offload=OffloadConfig(optimizer="device"))) is None
    assert mode(zeroinf.Config(stage=3, offload=OffloadConfig(optimizer="device"))) == "final"  # no norm needed
    assert mode(dataclasses.replace(base, offload=OffloadConfig(optimizer="nvme", **nvme))) == "speculative"
    assert mode(dataclasses.replace(base, offload=OffloadConfig(optimizer="host"))) is None  # auto: no RAM copy
    assert mode(dataclasses.replace(base, offload=OffloadConfig(optimizer="host", step_in_backward=True))) == (
        "speculative"
    )
    assert mode(zeroinf.Config(stage=3, offload=OffloadConfig(optimizer="host"))) == "final"
    with pytest.raises(zeroinf.ConfigError, match="offload.step_in_backward"):
        OffloadConfig(step_in_backward="yes")
    # Host speculation keeps the stepped states until step(); they are gone after it.
    cfg = zeroinf.Config(stage=3, grad_clip_norm=1e6, offload=OffloadConfig(optimizer="host", step_in_backward=True))
    model = zeroinf.shard(Stack(), cfg, Topology.single(torch.device("cpu")))
    opt = zeroinf.AdamW(model, lr=1e-2)
    ledger = zeroinf.engine_of(model).ledger
    opt.backward(model(torch.randn(4, 32)))
    assert ledger.live_bytes(Tier.HOST, "optimizer_backup") > 0
    opt.step()
    assert ledger.live_bytes(Tier.HOST, "optimizer_backup") == 0 and opt.rollbacks == 0
    opt.close()


def _most_gradient_bytes(
    tmp_path: Path, gradients: str, optimizer: str = "host", params: str = "nvme"
) -> tuple[dict[str, int], int, dict, zeroinf.AdamW]:
    offload = OffloadConfig(params=params, optimizer=optimizer, gradients=gradients, nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)
    model = zeroinf.shard(Stack(), cfg, Topology.single(torch.device("cpu")))
    opt = zeroinf.AdamW(model, lr=1e-2)
    engine = zeroinf.engine_of(model)
    most: dict[str, int] = {}
    reserve = engine.ledger.reserve

    def watch(tier: object, nbytes: int, tag: str) -> None:
        reserve(tier, nbytes, tag)  # type: ignore[arg-type]
        for where in (Tier.DEVICE, Tier.HOST):  # gradient bytes alive at once, per tier
            alive = sum(engine.ledger.live_bytes(where, t) for t in ("grad_shard", "grad_unsharded"))
            most[where.value] = max(most.get(where.value, 0), alive)

    engine.ledger.reserve = watch  # type: ignore[method-assign]
    for _ in range(2):
        opt.backward(model(torch.randn(4, 32)))
        opt.step()
        opt.zero_grad()
    one_unit = max(4 * u.layout.shard_numel for u in engine.units)
    return most, one_unit, zeroinf.memory_report(model), opt


@pytest.mark.parametrize("gradients", ["device", "host"])
def test_gradients_stepped_inside_backward_are_freed_one_unit_at_a_time(tmp_path: Path, gradients: str) -> None:
    """With the optimizer on the host stepping inside backward, no gradient buffer of the model's size
    exists: one CPU process holds one unit's reduced gradient at a time (and with gradients on the
    host no persistent host shard is ever made); memory_report gives host bytes per parameter."""
    most, one_unit, report, opt = _most_gradient_bytes(tmp_path, gradients)
    engine = opt.engine
    assert opt.units_stepped_in_backward > 0
    assert most["host"] == 0, most
    assert most["device"] <= one_unit, most
    params = sum(u.layout.numel for u in engine.all_units)
    assert report["host"]["peak_bytes_per_param"] == report["host"]["peak_bytes"] / params
    assert report["host"]["by_tag"]["optimizer_state"] == 12 * sum(u.owned_numel for u in engine.units)
    opt.close()
    engine.close()


def test_on_the_device_each_gradient_is_freed_once_stepped(tmp_path: Path) -> None:
    """Everything on the device: the step inside backward frees each unit's gradient shard, so the
    device never holds the model's gradients (FSDP2 holds all of them until its step), and the
    device's live bytes are the fp32 masters held as the shards plus the moments: 12 per parameter."""
    most, one_unit, report, opt = _most_gradient_bytes(tmp_path, "device", optimizer="device", params="device")
    engine = opt.engine
    assert opt.step_mode == "final" and opt.units_stepped_in_backward == len(engine.units)
    assert most["device"] <= one_unit, most
    owned = sum(u.owned_numel for u in engine.units)
    assert report["device"]["by_tag"]["optimizer_state"] == 8 * owned
    assert report["device"]["live_bytes"] == 12 * owned
    opt.close()
    engine.close()
