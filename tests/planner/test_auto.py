"""`auto`: the compute dtype from the hardware (detection mocked), the placement the planner picks,
and where "auto" is resolved (zeroinf.shard, zeroinf train) or refused (zeroinf.init)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.config import AUTO
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.planner import profile as profiles
from zeroinf.planner.api import ALL_AUTO, plan
from zeroinf.planner.estimate import Capacity
from zeroinf.planner.model_facts import from_gpt_config

GPT_CFG = GPTConfig(seq_len=64, n_layer=3, n_head=2, d_model=128)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No cached machine profile of the developer's machine: the defaults."""
    monkeypatch.setenv("ZEROINF_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize(
    ("flags", "native"),
    [
        ({"avx2", "fma"}, False),  # AMD EPYC of this machine: AVX2 only
        ({"avx2", "avx512f", "avx512bw"}, False),  # AVX512 without BF16
        ({"avx2", "avx512f", "avx512_bf16"}, True),  # Cooper Lake, Zen 4
        ({"avx2", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
        ({"fp", "asimd", "bf16"}, True),  # aarch64 with BFMMLA (Graviton 3)
    ],
)
def test_cpu_bf16_detection_from_the_instruction_sets(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], native: bool
) -> None:
    monkeypatch.setattr(profiles, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert profiles.native_bf16.__wrapped__("cpu") is native


def test_cuda_bf16_detection_without_emulation(monkeypatch: pytest.MonkeyPatch) -> None:
    asked = {}

    def supported(including_emulation: bool = True) -> bool:
        asked["emulation"] = including_emulation
        return True

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    assert profiles.native_bf16.__wrapped__("cuda") is True
    assert asked == {"emulation": False}


@pytest.mark.parametrize(("native", "dtype"), [(False, "fp32"), (True, "bf16")])
def test_param_dtype_auto_follows_the_hardware(monkeypatch: pytest.MonkeyPatch, native: bool, dtype: str) -> None:
    monkeypatch.setattr(profiles, "native_bf16", lambda device_type=None: native)
    assert zeroinf.Config(param_dtype="auto").param_dtype == dtype
    assert zeroinf.Config(param_dtype=AUTO, stage=3).param_torch_dtype == zeroinf.config.DTYPES[dtype]
    with pytest.raises(zeroinf.ConfigError, match="auto"):
        zeroinf.Config(reduce_dtype="auto")  # only the compute dtype is chosen for the machine


def test_this_machine_resolves_auto_to_its_native_dtype() -> None:
    expected = "bf16" if profiles.native_bf16() else "fp32"
    assert zeroinf.Config(param_dtype="auto").param_dtype == expected


def test_auto_picks_in_memory_when_everything_fits() -> None:
    result = plan(from_gpt_config(GPT_CFG), ALL_AUTO, seq_len=64, tokens_per_step=128)
    best = result.config
    assert (best.offload.params, best.offload.optimizer, best.offload.gradients) == ("device",) * 3
    assert result.best is result.estimates[0] and result.best.fits
    assert not best.is_auto


def test_auto_offloads_when_memory_is_short(tmp_path: Path) -> None:
    facts = from_gpt_config(GPT_CFG)
    roomy = plan(facts, ALL_AUTO, seq_len=64, tokens_per_step=128, nvme_dir=str(tmp_path))
    in_memory = roomy.best
    assert in_memory is not None
    # RAM for less than the in-memory placement needs (but enough for the leanest), and room on disk.
    leanest = min(e.ram_bytes for e in roomy.estimates)
    assert leanest < in_memory.ram_bytes
    ram = int((leanest + in_memory.ram_bytes) / 2 / 0.9)
    short = plan(
        facts, ALL_AUTO, seq_len=64, tokens_per_step=128, nvme_dir=str(tmp_path),
        capacity=Capacity(ram_bytes=ram, device_bytes=None, nvme_free_bytes=2**40),
    )
    chosen = short.config  # on a CPU the device tier is RAM too: NVMe tiers or checkpointing make room
    assert chosen != in_memory.config
    assert short.best is not None and short.best.ram_bytes <= 0.9 * ram < in_memory.ram_bytes
    nothing = plan(
        facts, ALL_AUTO, seq_len=64, tokens_per_step=128, nvme_dir=str(tmp_path),
        capacity=Capacity(ram_bytes=2**20, device_bytes=None, nvme_free_bytes=2**20),
    )
    assert nothing.best is None
    with pytest.raises(ValueError, match="no placement of GPT fits this machine"):
        _ = nothing.config


def test_fixed_fields_that_rule_out_every_placement_are_named(tmp_path) -> None:
    """Stage 1 with parameters on the host and the rest auto: no placement exists. It said "no
    placement fits this machine ... free memory or disk", which sent users to the wrong fix."""
    offload = dataclasses.replace(ALL_AUTO.offload, params="host", nvme_dir=str(tmp_path))
    base = dataclasses.replace(ALL_AUTO, stage=1, offload=offload)
    result = plan(from_gpt_config(GPT_CFG), base, seq_len=64, tokens_per_step=128)
    assert not result.estimates
    named = r"is possible with the fields you set \(config field `offload.params`.*use stage 3"
    with pytest.raises(ValueError, match=named):
        _ = result.config


def test_a_parameter_cache_keeps_only_nvme_parameter_placements(tmp_path) -> None:
    """A parameter cache with parameters auto: only placements with parameters on NVMe can use it.
    The first refused combination used to abort the whole plan with the cache's ConfigError."""
    offload = dataclasses.replace(ALL_AUTO.offload, param_cache_bytes=2**20, nvme_dir=str(tmp_path))
    result = plan(from_gpt_config(GPT_CFG), dataclasses.replace(ALL_AUTO, offload=offload), seq_len=64,
                  tokens_per_step=128)
    assert result.estimates and {e.config.offload.params for e in result.estimates} == {"nvme"}
    assert any("param_cache_bytes" in reason for reason in result.refused)


def test_fields_that_are_not_auto_stay() -> None:
    base = dataclasses.replace(ALL_AUTO, stage=3)
    result = plan(from_gpt_config(GPT_CFG), base, seq_len=64, tokens_per_step=128)
    assert {e.config.stage for e in result.estimates} == {3}
    assert result.config.stage == 3


def test_shard_resolves_auto_and_leaves_nvme_out_without_a_folder() -> None:
    cfg = dataclasses.replace(ALL_AUTO, offload=zeroinf.OffloadConfig(params=AUTO, optimizer=AUTO, gradients=AUTO))
    torch.manual_seed(0)
    model = zeroinf.shard(GPT(GPT_CFG), cfg)
    engine = zeroinf.engine_of(model)
    assert not engine.cfg.is_auto
    assert "nvme" not in (engine.cfg.offload.params, engine.cfg.offload.optimizer, engine.cfg.offload.gradients)
    opt = zeroinf.AdamW(model, lr=1e-3)
    idx = torch.randint(0, 256, (2, 64))
    opt.backward(model(idx, idx))
    opt.step()
    opt.close()
    engine.close()


def test_init_refuses_auto_placement_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"zeroinf.plan\(.*\).config"):
        with zeroinf.init(zeroinf.Config(stage="auto")):
            pass


def test_train_offload_auto_prints_the_choice(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from zeroinf import cli
    from zeroinf.train import TrainArgs, train

    ns = cli.build_parser().parse_args(["train", "--offload", "auto", "--nvme-dir", str(tmp_path)])
    cfg = cli.engine_config(ns)
    assert cfg.is_auto and cfg.stage == AUTO and cfg.offload.nvme_dir == str(tmp_path)
    result = train(TrainArgs(
        model="tiny", seq_len=32, global_batch=4, steps=2, eval_batches=0, max_corpus_bytes=2**18, config=cfg,
    ))
    assert len(result.losses) == 2
    out = capsys.readouterr().out
    assert "auto placement (zeroinf plan): stage" in out and "s/step" in out


def test_hybrid_sharding_plans_the_states_sharded_over_a_group(tmp_path) -> None:
    """`shard_group_size` shards the states over a group, not the world: eight ranks in groups of two
    need per rank what two ranks sharding everything need, and more than eight ranks sharding it."""
    base = dataclasses.replace(ALL_AUTO, stage=3, offload=zeroinf.OffloadConfig(nvme_dir=str(tmp_path)))
    facts = from_gpt_config(GPT_CFG)

    def ledger(world: int, group: int | None) -> int:
        cfg = dataclasses.replace(base, shard_group_size=group)
        estimate = plan(facts, cfg, world_size=world, seq_len=64, tokens_per_step=64 * world).best
        assert estimate is not None
        return estimate.ledger.device + estimate.ledger.host

    assert ledger(8, 2) == ledger(2, None) > ledger(8, None)
