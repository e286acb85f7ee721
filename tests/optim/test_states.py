"""Optimizer-state stores: sub-group planning, config and pre-flight checks, ledger and traffic
accounting per tier, state_dict round trips, and identical updates on every tier."""

from __future__ import annotations

import copy
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroinf
from zeroinf.config import ConfigError, OffloadConfig
from zeroinf.memory import Tier
from zeroinf.optim.pipeline import plan_sub_groups
from zeroinf.tiers.host import HostCapError
from zeroinf.tiers.nvme import SwapFolderError
from zeroinf.topology import Topology

CPU = Topology.single(torch.device("cpu"))
_OPEN: list[zeroinf.AdamW] = []


@pytest.fixture(autouse=True)
def _close_optimizers() -> Any:
    """Close every optimizer a test built, also when it fails (their I/O threads must not outlive it)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


# -- planning ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_numel", [None, 1, 100, 1000, 4096, 5000, 10**9])
def test_sub_groups_cover_each_unit_in_bounded_contiguous_pieces(max_numel: int | None) -> None:
    numels = [12_608, 0, 2_624, 4_096, 1]
    groups = plan_sub_groups(numels, max_numel)
    assert [g.index for g in groups] == list(range(len(groups)))
    for ui, numel in enumerate(numels):
        mine = [g for g in groups if g.unit_index == ui]
        assert [(g.start, g.end) for g in mine][:1] == ([(0, mine[0].end)] if numel else [])
        assert all(a.end == b.start for a, b in zip(mine, mine[1:], strict=False))
        assert sum(g.numel for g in mine) == numel and all(g.unit_numel == numel for g in mine)
        assert all(g.numel <= (max_numel or numel) for g in mine)
        assert all(g.whole_unit == (len(mine) == 1) for g in mine)
        if max_numel and max_numel >= 1024:
            assert all(g.start % 1024 == 0 for g in mine)  # split points on 4 KiB of fp32
        elif max_numel and max_numel >= 64:  # else on the parameters' alignment (flat_buffer.py)
            assert all(g.start % 64 == 0 for g in mine)
    assert len({g.key for g in groups}) == len(groups)


def test_split_pieces_are_near_equal() -> None:
    groups = plan_sub_groups([10 * 2**20 + 5], 4 * 2**20)
    assert len(groups) == 3 and max(g.numel for g in groups) - min(g.numel for g in groups) < 2048


# -- config --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field", "fix"),
    [
        ({"optimizer": "nvme"}, "offload.nvme_dir", "set nvme_dir"),
        ({"sub_group_numel": 0}, "offload.sub_group_numel", "positive integer"),
        ({"buffer_count": 1}, "offload.buffer_count", ">= 2"),
        ({"max_host_bytes": "lots"}, "offload.max_host_bytes", "16GiB"),
        ({"max_host_bytes": -1}, "offload.max_host_bytes", "positive integer"),
        ({"io_timeout_s": 0}, "offload.io_timeout_s", "positive number of seconds"),
        ({"nvme_dir": ""}, "offload.nvme_dir", "path of a local folder"),
    ],
)
def test_offload_config_errors_name_the_field(kwargs: dict[str, Any], field: str, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadConfig(**kwargs)
    assert info.value.field_name == field and fix in str(info.value)


def test_offload_config_accepts_host_and_nvme_and_size_strings(tmp_path: Path) -> None:
    assert OffloadConfig(optimizer="host").optimizer == "host"
    cfg = OffloadConfig(optimizer="nvme", nvme_dir=tmp_path, max_host_bytes="1GiB")  # type: ignore[arg-type]
    assert cfg.nvme_dir == str(tmp_path) and cfg.max_host_bytes == 2**30
    loaded = zeroinf.Config.from_dict({"offload": {"optimizer": "nvme", "nvme_dir": "/x", "buffer_count": 4}})
    assert loaded.offload.buffer_count == 4


# -- a small model on each tier ------------------------------------------------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(48, 48) for _ in range(3)])
        self.norm = nn.LayerNorm(48)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.norm(x).square().mean()


def _build(folder: Path | None, tier: str, stage: int = 1, **offload: Any) -> tuple[nn.Module, zeroinf.AdamW]:
    if folder is not None:
        folder.mkdir(exist_ok=True)
    cfg = zeroinf.Config(
        stage=stage,
        offload=OffloadConfig(optimizer=tier, nvme_dir=str(folder) if folder else None, **offload),
    )
    model = zeroinf.shard(Net(), cfg, CPU)
    groups = [  # two param groups: no weight decay for biases and the norm
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]},
        {
            "params": [
                p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)
            ],
            "weight_decay": 0.0,
        },
    ]
    opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.1, param_groups=groups)
    _OPEN.append(opt)
    return model, opt


def _train(model: nn.Module, opt: zeroinf.AdamW, steps: range) -> None:
    for step in steps:
        model(torch.randn(16, 48, generator=torch.Generator().manual_seed(step))).backward()
        opt.step()
        opt.zero_grad()


# Every split point (a multiple of 1024, or of 64 for sub-groups under 1024 elements) is a multiple of
# 64 from its parameter's start (partition/flat_buffer.py [Note: why every parameter starts on 64
# elements]), so the fused kernel's vector loop and scalar tail cover the same elements as for an
# unsplit unit and every tier is bitwise identical (a split off that grid differed by 1 ulp).
TIERS = [
    ("device", {}), ("host", {}), ("nvme", {"sub_group_numel": 1024}), ("nvme", {"sub_group_numel": 100}),
    ("nvme", {"buffer_count": 2}),
]


@pytest.mark.parametrize(
    ("tier", "offload"), TIERS, ids=["device", "host", "nvme-split", "nvme-split-small", "nvme-2buf"]
)
def test_every_tier_computes_the_same_update(tmp_path: Path, tier: str, offload: dict) -> None:
    ref_model, ref_opt = _build(None, "device")
    model, opt = _build(tmp_path / "swap", tier, **offload)
    _train(ref_model, ref_opt, range(3))
    _train(model, opt, range(3))
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(a, b), name  # the same kernel on the same numbers, only cut differently
    ours, ref = opt.state_dict(), ref_opt.state_dict()
    for key in ("master", "exp_avg", "exp_avg_sq"):
        for a, b in zip(ours[key], ref[key], strict=True):
            assert torch.equal(a, b)
    assert ours["param_steps"] == ref["param_steps"]
    assert ours["param_steps"] == [[3] * len(u.params) for u in zeroinf.engine_of(model).units]
    opt.close()


def test_ledger_and_traffic_per_tier(tmp_path: Path) -> None:
    for tier in ("device", "host", "nvme"):
        model, opt = _build(tmp_path / tier, tier, sub_group_numel=1000)
        engine = zeroinf.engine_of(model)
        # fp32 at stage 1: in memory the master is the owned range of the parameters ([Note: masters in
        # the memory shard]), so the store holds the moments only
        per_element = 8 if tier != "nvme" else 12
        assert all(engine.unit_plan.masters_in_memory_shard) == (tier != "nvme")
        state_bytes = per_element * sum(u.owned_numel for u in engine.units)
        step_bytes = 12 * sum(u.owned_numel for u in engine.units)  # the kernel reads and writes all three
        _train(model, opt, range(2))
        report = zeroinf.memory_report(model)
        on = {t: report[t]["by_tag"] for t in ("device", "host", "nvme")}
        if tier == "nvme":
            assert (
                sum(on["nvme"].get(f"optimizer_{k}", 0) for k in ("master", "exp_avg", "exp_avg_sq"))
                >= state_bytes
            )
            assert "optimizer_state" not in on["device"] and "optimizer_state" not in on["host"]
            # buffer_count "auto": two units' sub-groups and two more, each buffer 3 states x 1000 fp32
            # (each state 4 KiB aligned)
            per_unit = max(Counter(sg.unit_index for sg in opt.states.sub_groups).values())
            assert opt.states.staging_slots == max(3, 2 * per_unit + 2)
            assert on["host"]["optimizer_staging"] == opt.states.staging_slots * 3 * 4096
        else:
            assert on[tier]["optimizer_state"] == state_bytes
        assert dict(opt.states.traffic.last_step) == {
            f"{tier}_read_bytes": step_bytes,
            f"{tier}_written_bytes": step_bytes,
        }
        assert opt.states.traffic.total[f"{tier}_read_bytes"] == 2 * step_bytes
        opt.close()
        assert engine.ledger.live_bytes(Tier.HOST) == engine.ledger.live_bytes(Tier.NVME) == 0


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_state_dict_round_trip_resumes_exactly(tmp_path: Path, tier: str) -> None:
    model, opt = _build(tmp_path / "a", tier, sub_group_numel=1000)
    _train(model, opt, range(2))
    saved_model, saved_opt = copy.deepcopy(dict(model.state_dict())), opt.state_dict()
    _train(model, opt, range(2, 4))

    resumed, resumed_opt = _build(tmp_path / "b", tier, sub_group_numel=1000)
    resumed.load_state_dict(saved_model)
    resumed_opt.load_state_dict(saved_opt)
    _train(resumed, resumed_opt, range(2, 4))
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), name
    opt.close()
    resumed_opt.close()


def test_fp16_overflow_skips_the_step_without_touching_the_swap_files(tmp_path: Path) -> None:
    """Stepping after backward: the norm is known before any state moves. (Inside backward the step
    is speculative and an overflow undoes it: tests/optim/test_step_in_backward.py.)"""
    (tmp_path / "swap").mkdir()
    offload = OffloadConfig(optimizer="nvme", nvme_dir=str(tmp_path / "swap"), step_in_backward=False)
    cfg = zeroinf.Config(stage=2, param_dtype="fp16", offload=offload)
    model = zeroinf.shard(Net(), cfg, CPU)
    opt = zeroinf.AdamW(model, lr=1e-2)
    _OPEN.append(opt)
    before = opt.state_dict()
    opt.backward(model(torch.randn(4, 48, dtype=torch.float16)) * float("inf"))
    opt.step()
    assert opt.last_step_skipped and not opt.states.traffic.last_step
    assert opt.states.engine.bytes_read == sum(4 * t.numel() for t in before["master"]) * 3  # state_dict only
    opt.close()


# -- pre-flight checks ---------------------------------------------------------------------------------
def test_missing_swap_folder_is_created(tmp_path: Path) -> None:
    cfg = zeroinf.Config(offload=OffloadConfig(optimizer="nvme", nvme_dir=str(tmp_path / "absent")))
    model = zeroinf.shard(Net(), cfg, CPU)
    opt = zeroinf.AdamW(model)
    assert sorted(p.name for p in (tmp_path / "absent").iterdir()) == [
        f"zeroinf-rank0-optimizer_{kind}.swap" for kind in ("exp_avg", "exp_avg_sq", "master")
    ]
    opt.close()


def test_swap_folder_whose_parent_is_missing_is_reported_before_training(tmp_path: Path) -> None:
    cfg = zeroinf.Config(offload=OffloadConfig(optimizer="nvme", nvme_dir=str(tmp_path / "no" / "absent")))
    model = zeroinf.shard(Net(), cfg, CPU)
    with pytest.raises(SwapFolderError, match=r"absent' does not exist.*parent .* either.*rank 0 need \d+ bytes"):
        zeroinf.AdamW(model)


def test_too_little_free_space_names_bytes_needed_and_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=12345))
    cfg = zeroinf.Config(offload=OffloadConfig(optimizer="nvme", nvme_dir=str(tmp_path)))
    model = zeroinf.shard(Net(), cfg, CPU)
    with pytest.raises(
        SwapFolderError, match=r"has 12345 bytes .* free but the optimizer swap files .* need \d+"
    ):
        zeroinf.AdamW(model)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_host_cap_too_small_is_reported(tmp_path: Path, tier: str) -> None:
    cfg = zeroinf.Config(offload=OffloadConfig(optimizer=tier, nvme_dir=str(tmp_path), max_host_bytes=4096))
    model = zeroinf.shard(Net(), cfg, CPU)
    with pytest.raises(HostCapError, match=r"needs \d+ bytes .* offload.max_host_bytes = 4096"):
        zeroinf.AdamW(model)
    assert zeroinf.engine_of(model).ledger.live_bytes(Tier.HOST) == 0


def test_two_models_in_one_process_share_a_swap_folder(tmp_path: Path) -> None:
    """Each model's files carry its own index (tiers/nvme.py [Note: several sharded models in one
    process]); another process using the folder is still refused (tests/tiers/test_nvme.py)."""
    _, first = _build(tmp_path, "nvme")
    _, second = _build(tmp_path, "nvme")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "zeroinf-rank0-optimizer_master.swap" in names and "zeroinf-rank0-model1-optimizer_master.swap" in names
    first.close()
    second.close()
    assert not list(tmp_path.iterdir())


class Branchy(nn.Module):
    """Units whose parameters do not all get gradients: one never, one every other step."""

    class Sub(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused, self.sometimes = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([Branchy.Sub() for _ in range(2)])

    def forward(self, x: torch.Tensor, odd: bool) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer.used(x))
            if odd:
                x = layer.sometimes(x)
        return x.square().mean()


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_parameters_without_a_gradient_are_not_stepped(tmp_path: Path, tier: str) -> None:
    """As in torch.optim: no weight decay, no moment decay and no step count without a gradient."""
    reference = Branchy()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    cfg = zeroinf.Config(
        stage=1, offload=OffloadConfig(optimizer=tier, nvme_dir=str(tmp_path), sub_group_numel=1024)
    )
    model = zeroinf.shard(Branchy(), cfg, CPU)
    opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.1)
    _OPEN.append(opt)
    for step in range(5):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(step))
        for m, o in ((reference, ref_opt), (model, opt)):
            m(x, odd=step % 2 == 1).backward()
            o.step()
            o.zero_grad()
    for (name, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert torch.equal(model.layers[0].unused.weight, Branchy().layers[0].unused.weight)
    steps = opt.state_dict()["param_steps"][0]  # unit 0: used.{weight,bias}, unused.*, sometimes.*
    assert steps == [5, 5, 0, 0, 2, 2]


def _load_rank0_state(rank: int, world: int, stage: int) -> str | None:
    """Every rank loads rank 0's `opt.state_dict()` (DDP's habit of saving rank 0's alone)."""
    from tests._parity import TinyGPT, train_rank_slices

    torch.manual_seed(0)
    model = zeroinf.shard(TinyGPT(), zeroinf.Config(stage=stage))
    opt = zeroinf.AdamW(model, lr=1e-2)
    train_rank_slices(model, opt, rank, world, 0, 1)
    shared = [opt.state_dict()]
    torch.distributed.broadcast_object_list(shared, src=0)
    try:
        opt.load_state_dict(shared[0])
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("stage", [0, 2])
def test_another_ranks_optimizer_shard_is_refused(stage: int) -> None:
    from tests._harness import run_ranks

    errors = run_ranks(_load_rank0_state, 2, stage)
    if stage == 0:  # every rank holds the whole state: rank 0's is rank 1's too
        assert errors == [None, None]
        return
    for error in errors:  # every rank raises, none is left waiting in a collective
        assert error is not None and "optimizer states of ranks [0, 0] loaded on ranks 0-1" in error
        assert "on every rank, one file each, or use zeroinf.save" in error
