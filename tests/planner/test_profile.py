"""The machine profile: defaults with a notice, the cache per machine, per-rank figures, the probes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf import cli
from zeroinf.planner import profile as profiles
from zeroinf.planner.api import plan


@pytest.fixture(autouse=True)
def _cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("ZEROINF_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_defaults_without_a_measurement_and_the_plan_says_so() -> None:
    p = profiles.load_profile()
    assert not p.measured and p.source == "defaults"
    assert p.bf16_native == profiles.native_bf16()
    result = plan("tiny")
    assert any("zeroinf plan --measure" in n for n in result.notes)


def test_cache_round_trip_per_machine(_cache: Path) -> None:
    measured = dataclasses.replace(
        profiles.default_profile(), measured=True, source="test", collective_bps={2: 1e9},
        concurrent_matmul_flops={2: 5e9}, compute_efficiency=1.3, dtype_efficiency={"bf16": 1.5},
    )
    path = profiles.save_profile(measured)
    assert path.parent == _cache and profiles.machine_key() in path.name
    assert profiles.load_profile() == measured
    path.write_text('{"version": 1}')  # another version: measured again, defaults meanwhile
    assert not profiles.load_profile().measured


def test_rank_figures_scale_with_threads_and_busy_neighbours() -> None:
    base = dataclasses.replace(
        profiles.default_profile(), device="cpu", cores=4, threads=4, adam_params_per_s=400e6,
        matmul_flops={"fp32": ((64, 40e9), (1024, 80e9))}, memory_bps=40e9, device_memory_bytes=None,
        single_thread={"adam_params_per_s": 100e6, "memory_bps": 10e9,
                       "matmul_flops": {"fp32": ((64, 10e9), (1024, 20e9))}},
        concurrent_matmul_flops={2: 10e9},
    )
    one = base.for_threads(1)
    assert one.adam_params_per_s == pytest.approx(100e6) and one.matmul_rate("fp32", 1024) == pytest.approx(20e9)
    assert base.for_threads(4) is base
    two = base.for_threads(2)
    assert 100e6 < two.adam_params_per_s < 400e6
    busy = base.for_rank(2, ranks=2)  # each of 2 ranks measured 10 GFLOP/s at 512 while both computed
    assert busy.matmul_rate("fp32", 512) == pytest.approx(10e9, rel=1e-6)
    assert busy.adam_params_per_s < two.adam_params_per_s


def test_probes_are_short_and_sane(tmp_path: Path) -> None:
    matmul = profiles.probe_matmul(torch.device("cpu"), budget_s=0.03, sizes=(64, 256))
    assert set(matmul) == {"fp32", "bf16", "fp16"} and all(r > 0 for _, r in matmul["fp32"])
    assert profiles.probe_adam(torch.device("cpu"), budget_s=0.1) > 1e6
    read, write = profiles.probe_disk(str(tmp_path), size_bytes=8 * 2**20)
    assert read > 0 and write > 0 and not list(tmp_path.iterdir())


def test_measure_caches_and_the_plan_uses_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, _cache: Path
) -> None:
    calls = []

    def fake_measure(nvme_dir: str | None, world_sizes: tuple[int, ...] = (), log: object = None) -> object:
        calls.append((nvme_dir, world_sizes))
        return dataclasses.replace(profiles.default_profile(), measured=True, source="measured (test)")

    monkeypatch.setattr(profiles, "measure_profile", fake_measure)
    assert cli.main(["plan", "--model", "tiny", "--measure", "--nvme-dir", str(tmp_path), "--world", "2"]) == 0
    out = capsys.readouterr()
    assert calls == [(str(tmp_path), (2,))]
    assert "cached in" in out.err and "conservative defaults" not in out.out
    assert profiles.load_profile().source == "measured (test)"


def test_calibration_is_per_dtype_and_the_estimate_uses_the_plans_dtype() -> None:
    """A reference step twice as slow as predicted in fp32 and three times in bf16 gives factors 2 and 3;
    a dtype without its own factor takes fp32's; the plan's compute time follows its param_dtype's."""
    from zeroinf.models.gpt import GPTConfig
    from zeroinf.planner.estimate import pass_seconds
    from zeroinf.planner.model_facts import from_gpt_config

    base = dataclasses.replace(profiles.default_profile(), device="cpu", device_memory_bytes=None)
    one = dataclasses.replace(base.for_threads(1), compute_efficiency=1.0)
    facts = {
        dtype: from_gpt_config(GPTConfig(**profiles.REFERENCE_GPT)).pass_facts(
            profiles.REFERENCE_BATCH, profiles.REFERENCE_GPT["seq_len"], dtype, torch.device("cpu")
        )
        for dtype in ("fp32", "bf16")
    }
    predicted = {dtype: 3 * pass_seconds(f, dtype, one) for dtype, f in facts.items()}
    refs = {
        dtype: {"forward_backward_s": factor * predicted[dtype], "peak_rss_bytes": 2**31, "ledger_bytes": 0}
        for dtype, factor in (("fp32", 2.0), ("bf16", 3.0))
    }
    calibrated = profiles.calibrate(base, refs)
    assert calibrated.efficiency("fp32") == pytest.approx(2.0) == calibrated.compute_efficiency
    assert set(calibrated.dtype_efficiency) == {"bf16"}  # fp32's is compute_efficiency, kept once
    assert calibrated.efficiency("bf16") == pytest.approx(3.0)
    assert calibrated.efficiency("fp16") == pytest.approx(2.0)  # no factor of its own: fp32's
    assert calibrated.baseline_rss_bytes > base.baseline_rss_bytes  # 2 GiB minus activations
    assert profiles.MachineProfile.from_json(json.loads(json.dumps(calibrated.to_json()))) == calibrated

    def compute_s(profile: profiles.MachineProfile, dtype: str) -> float:
        result = plan("tiny", zeroinf.Config(stage=3, param_dtype=dtype), profile=profile)
        assert result.best is not None
        return result.best.time.compute_s

    for dtype, factor in (("fp32", 2.0), ("bf16", 3.0)):
        assert compute_s(calibrated, dtype) == pytest.approx(factor * compute_s(base, dtype), rel=1e-9)
