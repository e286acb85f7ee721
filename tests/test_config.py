"""Config validation: bad values raise a ConfigError naming the field and the fix; loading round-trips."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from zeroinf.config import AioConfig, Config, ConfigError, LossScaleConfig, OffloadConfig

# (test id, data for Config.from_dict, field the error must name, fragment of the fix it must give)
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    ("stage-5", {"stage": 5}, "stage", 'use 0, 1, 2, 3 or "auto"'),
    ("stage-str", {"stage": "2"}, "stage", 'use 0, 1, 2, 3 or "auto"'),
    ("stage-bool", {"stage": True}, "stage", 'use 0, 1, 2, 3 or "auto"'),
    ("stage-negative", {"stage": -1}, "stage", 'use 0, 1, 2, 3 or "auto"'),
    ("param-dtype-int8", {"param_dtype": "int8"}, "param_dtype", "use one of ['bf16', 'fp16', 'fp32', 'auto']"),
    ("reduce-dtype-fp16", {"reduce_dtype": "fp16"}, "reduce_dtype", "use fp32 or bf16"),
    ("reduce-dtype-half-alias", {"reduce_dtype": "half"}, "reduce_dtype", "use fp32 or bf16"),
    ("grad-accum-0", {"grad_accum_steps": 0}, "grad_accum_steps", "use a positive integer"),
    ("grad-accum-neg", {"grad_accum_steps": -1}, "grad_accum_steps", "use a positive integer"),
    ("grad-accum-float", {"grad_accum_steps": 1.5}, "grad_accum_steps", "use a positive integer"),
    ("grad-accum-bool", {"grad_accum_steps": True}, "grad_accum_steps", "use a positive integer"),
    ("clip-0", {"grad_clip_norm": 0}, "grad_clip_norm", "use a positive number or leave it unset"),
    ("clip-neg", {"grad_clip_norm": -1.0}, "grad_clip_norm", "use a positive number or leave it unset"),
    ("clip-nan", {"grad_clip_norm": float("nan")}, "grad_clip_norm", "use a positive number"),
    ("clip-str", {"grad_clip_norm": "1.0"}, "grad_clip_norm", "use a positive number"),
    ("bucket-0", {"bucket_bytes": 0}, "bucket_bytes", "use a positive integer"),
    ("bucket-str", {"bucket_bytes": "25MiB"}, "bucket_bytes", "use a positive integer"),
    (
        "unit-classes-bare-str",
        {"unit_classes": "Block"},
        "unit_classes",
        'use a list of class names (or classes), e.g. ["Block"]',
    ),
    ("unit-classes-non-str", {"unit_classes": ["Block", 3]}, "unit_classes", "use a list of class names"),
    (
        "backoff-1.5",
        {"loss_scale": {"backoff_factor": 1.5}},
        "loss_scale.backoff_factor",
        "use a number in (0, 1)",
    ),
    (
        "backoff-0",
        {"loss_scale": {"backoff_factor": 0.0}},
        "loss_scale.backoff_factor",
        "use a number in (0, 1)",
    ),
    ("growth-0.9", {"loss_scale": {"growth_factor": 0.9}}, "loss_scale.growth_factor", "use a number > 1"),
    (
        "growth-interval-0",
        {"loss_scale": {"growth_interval": 0}},
        "loss_scale.growth_interval",
        "positive integer",
    ),
    ("initial-0", {"loss_scale": {"initial_scale": 0}}, "loss_scale.initial_scale", "use a positive number"),
    (
        "min-above-initial",
        {"loss_scale": {"initial_scale": 1024.0, "min_scale": 2048.0}},
        "loss_scale.min_scale",
        "use a number in (0, initial_scale]",
    ),
    (
        "min-0",
        {"loss_scale": {"min_scale": 0.0}},
        "loss_scale.min_scale",
        "use a number in (0, initial_scale]",
    ),
    (
        "offload-params-gpu",
        {"offload": {"params": "gpu"}},
        "offload.params",
        "use one of ['device', 'host', 'nvme', 'auto']",
    ),
    ("offload-optimizer-nvme-no-dir", {"offload": {"optimizer": "nvme"}}, "offload.nvme_dir", "set nvme_dir"),
    (
        "offload-gradients-nvme-no-dir",
        {"stage": 3, "offload": {"gradients": "nvme", "optimizer": "host"}},
        "offload.nvme_dir",
        "set nvme_dir",
    ),
    ("offload-params-stage2", {"offload": {"params": "host"}}, "offload.params", "use stage 3"),
    (
        "offload-gradients-host-device-optimizer",
        {"offload": {"gradients": "host"}},
        "offload.gradients",
        "set offload.optimizer to 'host' or 'nvme'",
    ),
    ("unknown-top-level", {"stages": 2}, "stages", "unknown field; known fields are"),
    (
        "unknown-nested",
        {"offload": {"nvme_path": "/tmp"}},
        "offload.nvme_path",
        "unknown field; known fields are",
    ),
    ("nested-not-a-table", {"loss_scale": 3}, "loss_scale", "pass a LossScaleConfig or a table"),
    ("timeout-0", {"collective_timeout_s": 0}, "collective_timeout_s", "use a positive number of seconds"),
    ("timeout-inf", {"collective_timeout_s": float("inf")}, "collective_timeout_s", "positive number of seconds up to"),
    ("io-timeout-inf", {"offload": {"io_timeout_s": float("inf")}}, "offload.io_timeout_s", "seconds up to"),
    ("initial-scale-inf", {"loss_scale": {"initial_scale": float("inf")}}, "loss_scale.initial_scale", "finite"),
    ("unit-classes-dict", {"unit_classes": {"Block": 1}}, "unit_classes", "use a list of class names"),
    ("unit-classes-int", {"unit_classes": 3}, "unit_classes", "use a list of class names"),
    ("aio-workers-float", {"offload": {"aio": {"workers": 1.5}}}, "offload.aio.workers", "integer >= 1"),
    ("aio-depth-str", {"offload": {"aio": {"queue_depth": "8"}}}, "offload.aio.queue_depth", "integer >= 1"),
    ("aio-align-str", {"offload": {"aio": {"alignment_bytes": "4096"}}}, "offload.aio.alignment_bytes", "power of two"),
    ("aio-block-str", {"offload": {"aio": {"block_bytes": "1MiB"}}}, "offload.aio.block_bytes", "positive multiple"),
    ("aio-o-direct-str", {"offload": {"aio": {"o_direct": "false"}}}, "offload.aio.o_direct", "use true or false"),
    ("aio-integrity-int", {"offload": {"aio": {"integrity": 1}}}, "offload.aio.integrity", "use true or false"),
    ("step-thread-int", {"offload": {"step_thread": 1}}, "offload.step_thread", "use true, false or 'auto'"),
    (
        "timeout-neg",
        {"collective_timeout_s": -5.0},
        "collective_timeout_s",
        "use a positive number of seconds",
    ),
]


@pytest.mark.parametrize(("data", "field_name", "fix"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_config_names_field_and_fix(data: dict[str, Any], field_name: str, fix: str) -> None:
    with pytest.raises(zeroinf.ConfigError) as info:
        Config.from_dict(data)
    message = str(info.value)
    assert info.value.field_name == field_name
    assert f"`{field_name}`" in message, message
    assert fix in message, message


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="`stage`"):
        Config(stage=7)


def test_direct_construction_validates_like_from_dict() -> None:
    with pytest.raises(zeroinf.ConfigError, match=r"`loss_scale\.backoff_factor`"):
        LossScaleConfig(backoff_factor=1.5)
    with pytest.raises(zeroinf.ConfigError, match=r"`offload\.params`"):
        OffloadConfig(params="gpu")
    # A nested table may come as a dict, as in from_dict and as OffloadConfig's `aio` takes it (it used to
    # be refused with "pass a LossScaleConfig or a table of its fields", a table being what it got).
    assert Config(offload={"optimizer": "host"}).offload == OffloadConfig(optimizer="host")  # type: ignore[arg-type]
    assert Config(loss_scale={"backoff_factor": 0.25}).loss_scale == LossScaleConfig(backoff_factor=0.25)  # type: ignore[arg-type]
    assert Config(offload={"aio": {"workers": 2}}).offload.aio.workers == 2  # type: ignore[arg-type]
    with pytest.raises(zeroinf.ConfigError, match=r"`loss_scale\.backoff_factor`"):
        Config(loss_scale={"backoff_factor": 1.5})  # type: ignore[arg-type]
    with pytest.raises(zeroinf.ConfigError, match=r"`offload\.optimiser`.*unknown field"):
        Config(offload={"optimiser": "host"})  # type: ignore[arg-type]
    with pytest.raises(zeroinf.ConfigError, match="`offload`"):
        Config(offload="host")  # type: ignore[arg-type]


# Every field of every config class, given each value of a pool of wrong types and edge values, either
# accepts it or raises a ConfigError naming that field: never a TypeError from deep inside validation
# (alignment_bytes, workers, unit_classes did; o_direct took the string "false" as true).
WRONG_VALUES: list[Any] = [
    None, "x", "auto", "fp32", "nvme", "1", b"x", -1, 0, 1, 3, 1.5, -0.5, float("nan"), float("inf"), True, False,
    [1], ["Block"], {}, {"a": 1}, (1, 2), 2**70,
]


@pytest.mark.parametrize("cls", [Config, OffloadConfig, AioConfig, LossScaleConfig], ids=lambda c: c.__name__)
def test_every_field_refuses_wrong_values_by_name(cls: type, tmp_path: Path) -> None:
    import dataclasses

    for f in dataclasses.fields(cls):
        for value in WRONG_VALUES:
            extra = {"nvme_dir": str(tmp_path)} if cls is OffloadConfig and f.name != "nvme_dir" else {}
            try:
                made = cls(**{f.name: value, **extra})
            except ConfigError as e:
                # the field itself, a field of its table, or the field it conflicts with naming it
                assert f.name in e.field_name.split(".") or f.name in e.fix, (f.name, value, str(e))
                continue
            if isinstance(made, Config):
                assert Config.from_dict(made.to_dict()) == made  # what is accepted round-trips


def test_stage_float_rejected() -> None:
    with pytest.raises(zeroinf.ConfigError, match="`stage`"):
        Config(stage=2.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("data", "field_name"),
    [
        ({"collective_timeout_s": "600"}, "collective_timeout_s"),
        ({"loss_scale": {"initial_scale": "65536"}}, "loss_scale.initial_scale"),
        ({"loss_scale": {"growth_factor": None}}, "loss_scale.growth_factor"),
    ],
)
def test_non_numeric_values_raise_config_error(data: dict[str, Any], field_name: str) -> None:
    with pytest.raises(zeroinf.ConfigError, match=f"`{field_name}`"):
        Config.from_dict(data)


@pytest.mark.parametrize(
    ("data", "field_name"),
    [
        ({"grad_clip_norm": True}, "grad_clip_norm"),
        ({"collective_timeout_s": True}, "collective_timeout_s"),
        ({"sync_every_micro_step": "yes"}, "sync_every_micro_step"),
        ({"reuse_step_memory": "yes"}, "reuse_step_memory"),
    ],
)
def test_bool_mixups_raise_config_error(data: dict[str, Any], field_name: str) -> None:
    with pytest.raises(zeroinf.ConfigError, match=f"`{field_name}`"):
        Config.from_dict(data)


# -- valid configurations ---------------------------------------------------------------------------------
def test_defaults_are_valid() -> None:
    cfg = Config()
    assert cfg.stage == 2 and cfg.param_dtype == "fp32" and cfg.grad_clip_norm is None
    assert cfg.loss_scale == LossScaleConfig() and cfg.offload == OffloadConfig()
    assert Config.from_dict({}) == cfg


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("bfloat16", "bf16"),
        ("float32", "fp32"),
        ("float", "fp32"),
        ("float16", "fp16"),
        ("half", "fp16"),
        ("bf16", "bf16"),
    ],
)
def test_dtype_aliases_normalize(alias: str, name: str) -> None:
    assert Config(param_dtype=alias).param_dtype == name
    if name != "fp16":
        assert Config(reduce_dtype=alias).reduce_dtype == name


def test_torch_dtypes() -> None:
    import torch

    cfg = Config(param_dtype="bfloat16", reduce_dtype="fp32")
    assert cfg.param_torch_dtype is torch.bfloat16 and cfg.reduce_torch_dtype is torch.float32


def test_resolved_stage_is_the_number_and_refuses_auto() -> None:
    assert [Config(stage=s).resolved_stage for s in (0, 1, 2, 3)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="stage.*'auto'.*zeroinf.plan"):
        _ = Config(stage="auto").resolved_stage


def test_unit_classes_list_becomes_tuple() -> None:
    assert Config(unit_classes=["Block"]).unit_classes == ("Block",)  # type: ignore[arg-type]


def test_unit_classes_take_classes_as_fsdp_wrap_policies_do() -> None:
    class Block(torch.nn.Module):
        pass

    class Head(torch.nn.Module):
        pass

    assert Config(unit_classes=[Block, "Mlp"]).unit_classes == ("Block", "Mlp")  # type: ignore[list-item]
    assert Config(unit_classes={Head, Block}).unit_classes == ("Block", "Head")  # type: ignore[arg-type]


def _expected() -> Config:
    return Config(
        stage=1,
        param_dtype="bf16",
        grad_accum_steps=4,
        grad_clip_norm=1.0,
        unit_classes=("Block",),
        loss_scale=LossScaleConfig(initial_scale=1024.0, growth_interval=100, backoff_factor=0.25),
        offload=OffloadConfig(nvme_dir="/tmp/swap"),
        collective_timeout_s=120.0,
    )


TOML = """\
stage = 1
param_dtype = "bfloat16"
grad_accum_steps = 4
grad_clip_norm = 1.0
unit_classes = ["Block"]
collective_timeout_s = 120.0

[loss_scale]
initial_scale = 1024.0
growth_interval = 100
backoff_factor = 0.25

[offload]
nvme_dir = "/tmp/swap"
"""


def test_load_toml(tmp_path: Path) -> None:
    path = tmp_path / "train.toml"
    path.write_text(TOML)
    assert Config.load(path) == _expected()
    assert Config.load(str(path)) == _expected()


def test_load_json(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps(_expected().to_dict()))
    assert Config.load(path) == _expected()


def test_to_dict_round_trips() -> None:
    cfg = _expected()
    assert Config.from_dict(cfg.to_dict()) == cfg
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_load_errors_come_from_validation(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[offload]\nparams = 'gpu'\n")
    with pytest.raises(zeroinf.ConfigError, match=r"`offload\.params`"):
        Config.load(path)


def test_load_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        Config.load(path)


def test_load_yaml_rejected(tmp_path: Path) -> None:
    path = tmp_path / "train.yaml"
    path.write_text("stage: 1\n")
    with pytest.raises(ValueError, match=r"\.toml or \.json") as info:
        Config.load(path)
    assert "train.yaml" in str(info.value)
    assert not isinstance(info.value, zeroinf.ConfigError)


def test_offload_aio_table_loads_and_names_its_fields(tmp_path: Path) -> None:
    toml = '[offload]\nparams = "device"\n\n[offload.aio]\nblock_bytes = 2097152\nworkers = 4\n'
    (tmp_path / "train.toml").write_text(toml)
    aio = Config.load(tmp_path / "train.toml").offload.aio
    assert (aio.block_bytes, aio.workers, aio.queue_depth) == (2 * 2**20, 4, AioConfig().queue_depth)
    with pytest.raises(ConfigError, match=r"offload\.aio\.block_bytes"):
        Config.from_dict({"offload": {"aio": {"block_bytes": 1000}}})
    with pytest.raises(ConfigError, match=r"offload\.aio\.made_up"):
        Config.from_dict({"offload": {"aio": {"made_up": 1}}})


def test_entry_points_take_a_dict_of_fields_and_refuse_a_deepspeed_dict() -> None:
    """shard, init, from_pretrained, plan and the Trainer take a Config, None or a dict of its fields
    (Config.of); a DeepSpeed dict is refused with its translation, other types by name."""
    fields = {"stage": 2, "grad_clip_norm": 1.0, "offload": {"optimizer": "host"}}
    assert Config.of(fields) == Config(stage=2, grad_clip_norm=1.0, offload=OffloadConfig(optimizer="host"))
    assert Config.of(None) == Config()
    cfg = Config(stage=1)
    assert Config.of(cfg) is cfg
    with pytest.raises(ConfigError, match=r"shard got a DeepSpeed config .*Config\.from_deepspeed\(ds_config\)"):
        Config.of({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match="`stag`"):
        Config.of({"stag": 3})
    with pytest.raises(TypeError, match="zeroinf.init: the config is a str"):
        Config.of("train.toml", "zeroinf.init")  # type: ignore[arg-type]
    model = zeroinf.shard(torch.nn.Sequential(torch.nn.Linear(4, 4)), {"stage": 3, "persist_threshold_bytes": 0})
    try:
        assert zeroinf.engine_of(model).cfg.stage == 3
    finally:
        zeroinf.engine_of(model).close()
    with zeroinf.init({"stage": 3}):
        built = torch.nn.Linear(4, 4)
    assert built.weight.is_meta
    zeroinf.engine_of(zeroinf.shard(built, {"stage": 3})).close()
