"""DeepSpeed configs: every mapped key reaches its zeroinf field (compared with hand-written Configs),
unknown and "auto" keys are listed in one warning, contradictions are refused by their DeepSpeed key."""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import zeroinf
from zeroinf import cli
from zeroinf.aio.config import AioConfig
from zeroinf.config import Config, ConfigError, LossScaleConfig, OffloadConfig
from zeroinf.deepspeed_config import AIO_NOT_APPLIED, translate

NVME = "/tmp/zeroinf-ds-test-swap"  # translation only: nothing is written there


def full_config() -> dict[str, Any]:
    """Every key the module maps, each at a value other than zeroinf's default, plus two unknown keys."""
    return {
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 0.5,
        "communication_data_type": "bf16",
        "bf16": {"enabled": True},
        "fp16": {"enabled": False, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                 "min_loss_scale": 0.25},
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": NVME},
            "offload_optimizer": {"device": "nvme", "nvme_path": NVME, "buffer_count": 12},
            "sub_group_size": 123_456,
            "stage3_prefetch_bucket_size": 3e6,  # JSON writes these as floats
            "stage3_max_live_parameters": 7_000_000,
            "stage3_param_persistence_threshold": 5_000,
            "reduce_bucket_size": 1e6,
            "mics_shard_size": 8,
            "made_up_key": 1,
        },
        "aio": {"block_size": 2 * 2**20, "queue_depth": 16, "thread_count": 4, "single_submit": False},
        "my_unknown_section": {"x": 1},
    }


# bf16 compute and bf16 reduction: every element count becomes 2 bytes per element.
EXPECTED_AIO = AioConfig(block_bytes=2 * 2**20, queue_depth=16, workers=4)
EXPECTED = Config(
    stage=3,
    param_dtype="bf16",
    reduce_dtype="bf16",
    grad_accum_steps=4,
    grad_clip_norm=0.5,
    bucket_bytes=1_000_000 * 2,
    prefetch_bytes=3_000_000 * 2,
    max_live_bytes=7_000_000 * 2,
    persist_threshold_bytes=5_000 * 2,
    shard_group_size=8,
    loss_scale=LossScaleConfig(initial_scale=2.0**12, growth_interval=500, min_scale=0.25),
    offload=OffloadConfig(
        params="nvme", optimizer="nvme", gradients="host", nvme_dir=NVME, sub_group_numel=123_456, buffer_count=4,
        aio=EXPECTED_AIO,
    ),
)

MAPPED_KEYS = [
    "gradient_accumulation_steps",
    "gradient_clipping",
    "communication_data_type",
    "bf16.enabled",
    "fp16.initial_scale_power",
    "fp16.loss_scale_window",
    "fp16.min_loss_scale",
    "zero_optimization.stage",
    "zero_optimization.offload_param.device",
    "zero_optimization.offload_optimizer.device",
    "zero_optimization.offload_optimizer.buffer_count",
    "zero_optimization.sub_group_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.mics_shard_size",
    "aio.block_size",
    "aio.queue_depth",
    "aio.thread_count",
]


@pytest.fixture
def warnings_of_zeroinf() -> Iterator[list[logging.LogRecord]]:
    """Records of the `zeroinf` logger, whatever its handlers and propagation."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger, handler = logging.getLogger("zeroinf"), Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def _without(data: dict[str, Any], dotted: str) -> dict[str, Any]:
    data = copy.deepcopy(data)
    *path, leaf = dotted.split(".")
    table = data
    for name in path:
        table = table[name]
    del table[leaf]
    return data


def test_every_mapped_key_reaches_its_field_and_unknown_keys_are_listed() -> None:
    t = translate(full_config())
    assert t.config == EXPECTED
    assert t.aio == EXPECTED_AIO
    assert t.auto == ()
    assert dict(t.ignored) == {
        "zero_optimization.made_up_key": "",
        "my_unknown_section": "",
        "aio.single_submit": AIO_NOT_APPLIED,
    }
    assert t.config.offload.aio == EXPECTED_AIO  # applied: the NVMe tiers' engines use it


@pytest.mark.parametrize("key", MAPPED_KEYS)
def test_each_mapped_key_matters(key: str) -> None:
    """Leaving any one mapped key out changes the translation (or makes it refused: without `stage`,
    offloading parameters contradicts DeepSpeed's stage 0): none of them is silently dropped."""
    before = translate(full_config())
    try:
        after = translate(_without(full_config(), key))
    except ConfigError:
        assert key == "zero_optimization.stage"
        return
    assert (after.config, after.aio) != (before.config, before.aio), key


@pytest.mark.parametrize(
    ("precision", "reduce", "compute_bytes", "reduce_bytes"),
    [({}, None, 4, 4), ({"bf16": {"enabled": True}}, None, 2, 4), ({"fp16": {"enabled": True}}, "fp32", 2, 4),
     ({"bfloat16": {"enabled": True}}, "bf16", 2, 2)],
)
def test_element_counts_become_bytes_of_the_dtype_they_hold(
    precision: dict[str, Any], reduce: str | None, compute_bytes: int, reduce_bytes: int
) -> None:
    ds: dict[str, Any] = {
        **precision,
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 1000, "stage3_max_live_parameters": 3000,
                              "stage3_param_persistence_threshold": 10, "reduce_bucket_size": 500},
    }
    if reduce:
        ds["communication_data_type"] = reduce
    cfg = translate(ds).config
    assert (cfg.prefetch_bytes, cfg.max_live_bytes, cfg.persist_threshold_bytes) == (
        1000 * compute_bytes, 3000 * compute_bytes, 10 * compute_bytes
    )
    assert cfg.bucket_bytes == 500 * reduce_bytes


def test_fp16_loss_scale_fields_and_fixed_behaviours() -> None:
    ds = {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 10, "loss_scale_window": 100,
                 "min_loss_scale": 2, "hysteresis": 2, "consecutive_hysteresis": False},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": False},
    }
    t = translate(ds)
    assert t.config == Config(
        stage=2, param_dtype="fp16",
        loss_scale=LossScaleConfig(initial_scale=1024.0, growth_interval=100, min_scale=2),
        offload=OffloadConfig(optimizer="host", gradients="host"),
    )
    # the values that describe zeroinf's one behaviour pass silently; the others are listed with it
    assert dict(t.ignored) == {
        "fp16.hysteresis": "zeroinf always behaves as hysteresis=1",
        "zero_optimization.contiguous_gradients": "zeroinf always behaves as contiguous_gradients=true",
    }


@pytest.mark.parametrize(("deepspeed_count", "zeroinf_count"), [(0, 2), (4, 2), (8, 2), (9, 3), (12, 4), (30, 10)])
def test_buffer_count_converts_tensor_buffers_to_sub_group_buffers(deepspeed_count: int, zeroinf_count: int) -> None:
    """DeepSpeed buffers hold one of a sub-group's 3 fp32 tensors, zeroinf's all 3 (at least 2 buffers)."""
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": deepspeed_count}}}
    assert translate(ds).config.offload.buffer_count == zeroinf_count


def test_stage_1_offloads_the_optimizer_but_keeps_gradients_on_the_device() -> None:
    ds = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}
    assert translate(ds).config == Config(stage=1, offload=OffloadConfig(optimizer="host"))


def test_auto_keeps_zeroinf_defaults_and_is_listed() -> None:
    """A config as Hugging Face Trainer's docs write it: every tunable left to "auto"."""
    ds = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
        "fp16": {"enabled": "auto"},
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            "sub_group_size": "auto",
            "stage3_max_live_parameters": "auto",
        },
    }
    t = translate(ds)
    assert t.config == Config(stage=3)
    assert set(t.auto) == {
        "gradient_accumulation_steps", "gradient_clipping", "fp16.enabled", "bf16.enabled",
        "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.sub_group_size",
        "zero_optimization.stage3_max_live_parameters",
    }
    assert set(t.ignored) == {"train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler"}
    assert "zeroinf.optimizer_from_deepspeed" in t.ignored["optimizer"]


def test_absent_keys_keep_zeroinf_defaults_but_absent_stage_is_deepspeeds_0() -> None:
    assert translate({}).config == Config(stage=0)
    assert translate({"gradient_clipping": 0}).config == Config(stage=0, grad_clip_norm=None)
    assert translate({"zero_optimization": {"stage": 2}}).config == Config(stage=2)


# (test id, DeepSpeed config, the key the error must name, a fragment of its fix)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("bf16-and-fp16", {"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "fp16.enabled",
     "bf16.enabled is true as well"),
    ("offload-param-stage-2", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     "zero_optimization.offload_param.device", "set zero_optimization.stage to 3"),
    ("nvme-without-path", {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}},
     "zero_optimization.offload_optimizer.nvme_path", "local folder"),
    ("two-nvme-paths", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
                                              "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}},
     "zero_optimization.offload_optimizer.nvme_path", "one folder"),
    ("static-loss-scale", {"fp16": {"enabled": True, "loss_scale": 128}}, "fp16.loss_scale", "dynamically"),
    ("stage-7", {"zero_optimization": {"stage": 7}}, "zero_optimization.stage", "use 0, 1, 2 or 3"),
    ("stage-auto", {"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage", "use 0, 1, 2 or 3"),
    ("stage-bool", {"zero_optimization": {"stage": True}}, "zero_optimization.stage", "use 0, 1, 2 or 3"),
    ("device-gpu", {"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}},
     "zero_optimization.offload_param.device", "use one of ['none', 'cpu', 'nvme']"),
    ("fractional-count", {"zero_optimization": {"sub_group_size": 1.5}}, "zero_optimization.sub_group_size",
     "whole number"),
    ("negative-count", {"zero_optimization": {"reduce_bucket_size": -1}}, "zero_optimization.reduce_bucket_size",
     "whole number >= 0"),
    ("sub-group-0", {"zero_optimization": {"sub_group_size": 0}}, "zero_optimization.sub_group_size",
     "positive integer (it sets zeroinf's offload.sub_group_numel)"),
    ("buffer-count-negative", {"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": -4}}},
     "zero_optimization.offload_optimizer.buffer_count", "whole number >= 0"),
    ("fp16-reduction", {"communication_data_type": "fp16"}, "communication_data_type", "fp16 reductions overflow"),
    ("reduce-int8", {"communication_data_type": "int8"}, "communication_data_type", "use one of"),
    ("negative-clip", {"gradient_clipping": -1.0}, "gradient_clipping", "positive number"),
    ("clip-string", {"gradient_clipping": "1.0"}, "gradient_clipping", "use a number"),
    ("accum-0", {"gradient_accumulation_steps": 0}, "gradient_accumulation_steps", "positive integer"),
    ("enabled-yes", {"bf16": {"enabled": "yes"}}, "bf16.enabled", "true or false"),
    ("scale-power-200", {"fp16": {"enabled": True, "initial_scale_power": 200}}, "fp16.initial_scale_power",
     "exponent in 0..126"),
    ("min-scale-above-initial", {"fp16": {"initial_scale_power": 4, "min_loss_scale": 64}}, "fp16.min_loss_scale",
     "initial_scale"),
    ("aio-block-unaligned", {"aio": {"block_size": 1000}}, "aio.block_size", "multiple of alignment_bytes"),
    ("zero-not-a-table", {"zero_optimization": True}, "zero_optimization", "JSON object"),
    ("root-not-a-table", [1, 2], "<root>", "JSON object"),  # type: ignore[list-item]
]


@pytest.mark.parametrize(("ds", "key", "fix"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_contradictions_and_bad_values_are_refused_by_their_deepspeed_key(ds: Any, key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as caught:
        translate(ds)
    assert caught.value.field_name == key
    assert fix in str(caught.value)


def test_from_a_file_equals_from_the_dict_and_logs_one_warning(
    tmp_path: Path, warnings_of_zeroinf: list[logging.LogRecord]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(full_config()))
    assert Config.from_deepspeed(path) == EXPECTED
    assert Config.from_deepspeed(str(path)) == EXPECTED
    assert len(warnings_of_zeroinf) == 2  # one per call
    message = warnings_of_zeroinf[0].getMessage()
    assert str(path) in message and "\n" not in message
    for key in ("zero_optimization.made_up_key", "my_unknown_section", "aio.single_submit"):
        assert key in message
    warnings_of_zeroinf.clear()
    assert Config.from_deepspeed({"zero_optimization": {"stage": 1}}) == Config(stage=1)
    assert warnings_of_zeroinf == []  # nothing to say: no warning


def test_auto_keys_are_in_the_warning(warnings_of_zeroinf: list[logging.LogRecord]) -> None:
    Config.from_deepspeed({"gradient_clipping": "auto"})
    (record,) = warnings_of_zeroinf
    assert record.levelno == logging.WARNING
    assert "\"auto\" kept zeroinf's default for: gradient_clipping" in record.getMessage()


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.json"):
        Config.from_deepspeed(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"zero_optimization": ')
    with pytest.raises(ValueError, match="broken.json is not valid JSON"):
        Config.from_deepspeed(broken)
    twice = tmp_path / "twice.json"
    twice.write_text('{"zero_optimization": {"stage": 3, "stage": 2}}')
    with pytest.raises(ConfigError, match="appears twice"):
        Config.from_deepspeed(twice)


def test_cli_deepspeed_with_overrides(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(full_config()))
    ns = cli.build_parser().parse_args(
        ["train", "--deepspeed", str(path), "--nvme-dir", str(tmp_path), "--grad-accum", "2"]
    )
    cfg = cli.engine_config(ns)
    assert cfg.offload.nvme_dir == str(tmp_path) and cfg.grad_accum_steps == 2
    assert cfg.prefetch_bytes == EXPECTED.prefetch_bytes and cfg.stage == 3


def test_cli_trains_the_demo_from_a_deepspeed_config(tmp_path: Path) -> None:
    """The acceptance run, small: stage 3 with parameters and optimizer states on NVMe, from DeepSpeed JSON."""
    swap = tmp_path / "swap"
    swap.mkdir()
    ds = {
        "train_batch_size": 8,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "nvme", "nvme_path": str(swap), "pin_memory": True},
            "offload_optimizer": {"device": "nvme", "nvme_path": str(swap), "pin_memory": True},
            "stage3_param_persistence_threshold": 1e3,
        },
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    report = tmp_path / "report.json"
    argv = ["train", "--model", "tiny", "--steps", "3", "--batch", "8", "--seq-len", "32", "--eval-batches", "0",
            "--no-progress", "--deepspeed", str(tmp_path / "ds.json"), "--report", str(report)]
    src = str(Path(zeroinf.__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-m", "zeroinf", *argv], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": src})
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "train_batch_size" in warnings[0]
    saved = json.loads(report.read_text())
    expected = translate(ds).config
    assert saved["engine_config"] == json.loads(json.dumps(expected.to_dict()))
    assert expected.offload == OffloadConfig(params="nvme", optimizer="nvme", gradients="host", nvme_dir=str(swap))
    assert len(saved["losses"]) == 3
    io = saved["memory"]["io"]
    assert io["nvme_read_bytes"] > 0 and io["nvme_written_bytes"] > 0


def test_the_migration_guide_example_translates_to_its_toml(tmp_path: Path) -> None:
    """docs/migrating-from-deepspeed.md: its DeepSpeed JSON and its zeroinf TOML are the same Config."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "migrating-from-deepspeed.md").read_text()
    ds_json = text.split("```json\n", 1)[1].split("```", 1)[0]
    toml = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "train.toml").write_text(toml)
    t = translate(json.loads(ds_json))
    assert t.config == Config.load(tmp_path / "train.toml")
    assert set(t.ignored) == {"train_micro_batch_size_per_gpu", "optimizer"} and t.auto == ()


def test_the_warning_comes_from_rank_0_only(
    monkeypatch: pytest.MonkeyPatch, warnings_of_zeroinf: list[logging.LogRecord]
) -> None:
    monkeypatch.setenv("RANK", "1")
    assert Config.from_deepspeed({"made_up": 1}) == Config(stage=0)
    assert warnings_of_zeroinf == []
    monkeypatch.setenv("RANK", "0")
    Config.from_deepspeed({"made_up": 1})
    assert len(warnings_of_zeroinf) == 1
