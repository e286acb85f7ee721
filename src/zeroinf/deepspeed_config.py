"""DeepSpeed JSON configs read as zeroinf Configs: `zeroinf.Config.from_deepspeed(path_or_dict)`.

DeepSpeed and zeroinf build the same ZeRO stages and offload tiers, so most of a DeepSpeed config
has a direct counterpart. This module is the one place that knows the mapping; `translate` is a
pure function of the parsed JSON, and `config_from_deepspeed` adds reading the file and logging.

[Note: DeepSpeed keys and their zeroinf fields]

    DeepSpeed key                                  zeroinf field                  how
    zero_optimization.stage                        stage                          same numbers; absent: 0, as DeepSpeed
    zero_optimization.offload_param.device         offload.params                 none/cpu/nvme -> device/host/nvme;
                                                                                  stage 3 only
    zero_optimization.offload_optimizer.device     offload.optimizer              same words; at stages 2-3 also
                                                   (+ offload.gradients)          gradient shards to the host, as
                                                                                  DeepSpeed keeps them there
    offload_param.nvme_path,                       offload.nvme_dir               one folder for all swap files: two
      offload_optimizer.nvme_path                                                 different paths are refused
    offload_optimizer.buffer_count                 offload.buffer_count           count // 3, at least 2 (see below)
    zero_optimization.sub_group_size               offload.sub_group_numel        elements in both
    stage3_prefetch_bucket_size                    prefetch_bytes                 elements x compute item size
    stage3_max_live_parameters                     max_live_bytes                 elements x compute item size
    stage3_param_persistence_threshold             persist_threshold_bytes        elements x compute item size;
                                                                                  DeepSpeed compares each parameter,
                                                                                  zeroinf each unit
    zero_optimization.reduce_bucket_size           bucket_bytes                   elements x reduce item size
    zero_optimization.mics_shard_size              shard_group_size               -1 (off) leaves it unset
    communication_data_type                        reduce_dtype                   fp16 refused (reductions overflow)
    bf16.enabled (or bfloat16), fp16.enabled       param_dtype                    both true is refused
    fp16.loss_scale                                -                              0 (dynamic) only: no static scale
    fp16.initial_scale_power                       loss_scale.initial_scale       2 ** power
    fp16.loss_scale_window                         loss_scale.growth_interval     steps in both
    fp16.min_loss_scale                            loss_scale.min_scale
    gradient_clipping                              grad_clip_norm                 0 means no clipping in both
    gradient_accumulation_steps                    grad_accum_steps
    aio.block_size, aio.queue_depth,               offload.aio.block_bytes,       other aio keys (single_submit,
      aio.thread_count/intra_op_parallelism          queue_depth, workers         overlap_events...) are listed

[Note: element counts become byte counts] DeepSpeed sizes buckets and thresholds in elements, zeroinf
in bytes. A count of n elements holds n values of the dtype it carries, so it is multiplied by that
dtype's item size: the compute dtype (`param_dtype`, chosen by `bf16`/`fp16`) for the prefetch, live
and persistence sizes, which count parameters; the reduce dtype (`reduce_dtype`, fp32 unless
`communication_data_type` says otherwise) for the gradient bucket, which zeroinf fills in that dtype.
A bf16 run's `stage3_prefetch_bucket_size: 5e7` is thus `prefetch_bytes = 1e8`. Staging buffers
differ in the same way: a DeepSpeed buffer holds one fp32 tensor of a sub-group, so an Adam sub-group
takes three (master, exp_avg, exp_avg_sq); a zeroinf buffer holds all three. `buffer_count` is
therefore divided by 3, the same host memory, but never below 2, the fewest that overlap a read with
a write (DeepSpeed's usual 4 becomes 2).

Keys a config leaves out keep zeroinf's defaults (tuned for this engine), except `stage` (see above).
"auto", as Hugging Face Trainer writes it, also keeps zeroinf's default, and is listed. A switch set
to what zeroinf always does (`overlap_comm: true`, `pin_memory: true`, ...) is accepted silently; any
other key, known to DeepSpeed or not, is listed in one warning. Contradictions are refused with a
`ConfigError` naming the DeepSpeed key, and so are values zeroinf's own validation refuses.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zeroinf.aio.config import AioConfig
from zeroinf.config import DTYPES, Config, ConfigError, LossScaleConfig, OffloadConfig, _normalize_dtype
from zeroinf.telemetry import get_logger

AUTO = "auto"
DEVICE_TIERS = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""DeepSpeed's offload `device` word -> zeroinf's tier."""

STATES_PER_BUFFER = 3
"""fp32 tensors of one sub-group in a zeroinf staging buffer (master, exp_avg, exp_avg_sq); a
DeepSpeed buffer holds one."""
MIN_STAGING_BUFFERS = 2
"""The fewest staging buffers `OffloadConfig.buffer_count` accepts."""

AIO_NOT_APPLIED = "no zeroinf equivalent: the engine's knobs are offload.aio.block_bytes, queue_depth and workers"

_REASONS = {
    "train_batch_size": "the batch is the data loader's; zeroinf train: --batch",
    "train_micro_batch_size_per_gpu": "the batch is the data loader's; zeroinf train: --batch",
    "optimizer": "not an engine setting: zeroinf.optimizer_from_deepspeed(model, config) builds it, as zeroinf "
    "train and finetune --deepspeed do",
    "scheduler": "not an engine setting: zeroinf.optimizer_from_deepspeed(model, config) builds it, as zeroinf "
    "train and finetune --deepspeed do",
    "zero_optimization.offload_param.buffer_count": "parameter staging is sized from prefetch_bytes",
    "zero_optimization.offload_param.buffer_size": "parameter staging is sized from prefetch_bytes",
    "zero_optimization.offload_param.max_in_cpu": "parameter staging is sized from prefetch_bytes",
    "zero_optimization.stage3_max_reuse_distance": "the prefetch plan keeps a unit for a reuse two units ahead",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "zeroinf consolidate writes full weights",
    "checkpoint": "a save argument: zeroinf.save(..., node_local=True), zeroinf train --save-node-local",
}
"""Why a DeepSpeed key has no counterpart, where a sentence helps; other ignored keys are just listed."""

_FIXED: dict[str, dict[str, bool | int]] = {
    "": {"wall_clock_breakdown": False},
    "zero_optimization": {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "allgather_partitions": True,
        "reduce_scatter": True,
    },
    "zero_optimization.offload_param": {"pin_memory": True},
    "zero_optimization.offload_optimizer": {"pin_memory": True, "pipeline_read": True, "pipeline_write": True},
    "fp16": {"hysteresis": 1, "consecutive_hysteresis": False},
}
"""DeepSpeed switches for which zeroinf has one fixed behaviour: the value that describes it is
accepted silently, another value is listed (host memory is pinned whenever CUDA is present, NVMe
sub-groups are always pipelined, the loss scale backs off at every overflow)."""


@dataclass(frozen=True)
class Translation:
    """A DeepSpeed config in zeroinf's terms."""

    config: Config
    """The engine config."""
    aio: AioConfig | None
    """The `aio` section translated and validated (also `config.offload.aio`), None without one."""
    ignored: Mapping[str, str]
    """Dotted DeepSpeed keys zeroinf does not use -> why (empty when there is nothing more to say)."""
    auto: tuple[str, ...]
    """Dotted keys set to "auto": zeroinf's default was kept."""

    def notice(self, source: str = "DeepSpeed config") -> str | None:
        """One line listing the ignored and "auto" keys, grouped by reason; None when there are none."""
        parts = []
        if self.ignored:
            by_reason: dict[str, list[str]] = {}
            for key, reason in self.ignored.items():
                by_reason.setdefault(reason, []).append(key)
            groups = [", ".join(keys) + (f" ({reason})" if reason else "") for reason, keys in by_reason.items()]
            parts.append(f"ignored {len(self.ignored)} key(s) with no meaning in zeroinf: {'; '.join(groups)}")
        if self.auto:
            parts.append(f"\"auto\" kept zeroinf's default for: {', '.join(self.auto)}")
        return f"{source}: {'. '.join(parts)}" if parts else None


@dataclass
class _Notes:
    ignored: dict[str, str] = field(default_factory=dict)
    auto: list[str] = field(default_factory=list)


class _Table:
    """One JSON object of the config; remembers the keys read, so `finish` can list the others."""

    def __init__(self, data: object, path: str, notes: _Notes) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path or "<root>", data, "use a JSON object of settings")
        self.data, self.path, self.notes = data, path, notes
        self.read: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def raw(self, name: str) -> Any:
        self.read.add(name)
        return self.data.get(name)

    def table(self, name: str) -> _Table | None:
        value = self.raw(name)
        return None if value is None else _Table(value, self.key(name), self.notes)

    def setting(self, name: str) -> Any:
        """The value of `name`; None when absent or "auto" (which is noted)."""
        value = self.raw(name)
        if value == AUTO:
            self.notes.auto.append(self.key(name))
            return None
        return value

    def finish(self) -> None:
        """Note every key not read, unless it states the one behaviour zeroinf has."""
        fixed = _FIXED.get(self.path, {})
        for name, value in self.data.items():
            if name in self.read:
                continue
            if name in fixed and type(value) is type(fixed[name]) and value == fixed[name]:
                continue
            if name in fixed:
                reason = f"zeroinf always behaves as {name}={json.dumps(fixed[name])}"
            else:
                reason = _REASONS.get(self.key(name), "")
            self.notes.ignored[self.key(name)] = reason


def _count(table: _Table, name: str) -> int | None:
    """A whole number (JSON writes 5e8 as a float), or None when absent or "auto"."""
    value = table.setting(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() or value < 0:
        raise ConfigError(table.key(name), value, 'use a whole number >= 0 (or "auto")')
    return int(value)


def _number(table: _Table, name: str) -> float | None:
    value = table.setting(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(table.key(name), value, 'use a number (or "auto")')
    return value


def _flag(table: _Table, name: str) -> bool | None:
    value = table.setting(name)
    if value is not None and not isinstance(value, bool):
        raise ConfigError(table.key(name), value, 'use true or false (or "auto")')
    return value


@dataclass
class _Fields:
    """Config fields being gathered, each with the DeepSpeed key and value it came from."""

    values: dict[str, dict[str, Any]] = field(
        default_factory=lambda: {"": {}, "offload": {}, "loss_scale": {}, "offload.aio": {}}
    )
    origin: dict[str, tuple[str, Any]] = field(default_factory=dict)
    has_aio: bool = False
    """Whether the config has an `aio` table (then `build` makes an AioConfig, even of defaults)."""

    def set(self, name: str, value: Any, ds_key: str, ds_value: Any) -> None:
        """Set zeroinf field `name` (dotted for nested tables) unless `value` is None."""
        if value is None:
            return
        table, _, leaf = name.rpartition(".")
        self.values[table][leaf] = value
        self.origin[name] = (ds_key, ds_value)

    def build(self) -> tuple[Config, AioConfig | None]:
        """Construct and validate; a field zeroinf refuses is reported under its DeepSpeed key."""
        v = self.values
        try:
            aio = AioConfig(**v["offload.aio"])
            loss_scale, offload = LossScaleConfig(**v["loss_scale"]), OffloadConfig(**v["offload"], aio=aio)
            config = Config(**v[""], loss_scale=loss_scale, offload=offload)
            return config, aio if self.has_aio else None
        except ConfigError as error:
            if error.field_name not in self.origin:
                raise
            ds_key, ds_value = self.origin[error.field_name]
            raise ConfigError(ds_key, ds_value, f"{error.fix} (it sets zeroinf's {error.field_name})") from None


def _precision(root: _Table, fields_: _Fields) -> str:
    """`param_dtype` from `bf16`/`fp16` and the fp16 loss scaler; returns the compute dtype."""
    bf16 = root.table("bf16")
    if bf16 is None:
        bf16 = root.table("bfloat16")  # DeepSpeed's other spelling
    fp16 = root.table("fp16")
    bf16_on = bf16 is not None and bool(_flag(bf16, "enabled"))
    fp16_on = fp16 is not None and bool(_flag(fp16, "enabled"))
    if bf16 is not None and fp16 is not None and bf16_on and fp16_on:
        raise ConfigError(fp16.key("enabled"), True, f"{bf16.key('enabled')} is true as well: enable only one")
    if fp16 is not None:
        _loss_scale(fp16, fields_)
        fp16.finish()
    if bf16 is not None:
        bf16.finish()
    if bf16_on or fp16_on:
        table = bf16 if bf16_on else fp16
        assert table is not None
        dtype = "bf16" if bf16_on else "fp16"
        fields_.set("param_dtype", dtype, table.key("enabled"), True)
        return dtype
    return Config().param_dtype


def _loss_scale(fp16: _Table, fields_: _Fields) -> None:
    static = fp16.setting("loss_scale")
    if static is not None and (isinstance(static, bool) or static != 0):
        raise ConfigError(
            fp16.key("loss_scale"), static, "zeroinf scales the loss dynamically only: use 0 and initial_scale_power"
        )
    power = _count(fp16, "initial_scale_power")
    if power is not None and power > 126:
        raise ConfigError(fp16.key("initial_scale_power"), power, "use an exponent in 0..126, e.g. 16 (scale 65536)")
    key = fp16.key("initial_scale_power")
    fields_.set("loss_scale.initial_scale", None if power is None else 2.0**power, key, power)
    window = _count(fp16, "loss_scale_window")
    fields_.set("loss_scale.growth_interval", window, fp16.key("loss_scale_window"), window)
    floor = _number(fp16, "min_loss_scale")
    fields_.set("loss_scale.min_scale", floor, fp16.key("min_loss_scale"), floor)


def _offload(zero: _Table, name: str, stage: int) -> tuple[str, str | None, _Table | None]:
    """(tier, nvme_path, table) of `offload_param` or `offload_optimizer`."""
    table = zero.table(name)
    if table is None:
        return "device", None, None
    device = table.raw("device")
    device = "none" if device is None else device
    if not isinstance(device, str) or device not in DEVICE_TIERS:
        raise ConfigError(table.key("device"), device, f"use one of {list(DEVICE_TIERS)}")
    tier = DEVICE_TIERS[device]
    if name == "offload_param" and tier != "device" and stage != 3:
        raise ConfigError(
            table.key("device"), device,
            f"parameters are offloaded only when sharded: set zero_optimization.stage to 3 (it is {stage}) "
            'or the device to "none"',
        )
    path = table.raw("nvme_path")
    if tier == "nvme" and (not isinstance(path, str) or not path):
        raise ConfigError(table.key("nvme_path"), path, 'device is "nvme": set it to a local folder for the swap files')
    if tier != "nvme" and path is not None:
        table.notes.ignored[table.key("nvme_path")] = 'used only with device "nvme"'
        path = None
    return tier, path, table


def _zero(root: _Table, fields_: _Fields, compute_dtype: str, reduce_dtype: str) -> None:
    """The `zero_optimization` table: stage, placement, swap folder, buckets and thresholds."""
    zero = root.table("zero_optimization")
    stage = 0 if zero is None else zero.raw("stage")
    stage = 0 if stage is None else stage
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ConfigError("zero_optimization.stage", stage, "use 0, 1, 2 or 3")
    fields_.set("stage", stage, "zero_optimization.stage", stage)
    if zero is None:
        return
    params, param_path, param_table = _offload(zero, "offload_param", stage)
    optimizer, optimizer_path, optimizer_table = _offload(zero, "offload_optimizer", stage)
    if param_table is not None:
        fields_.set("offload.params", params, param_table.key("device"), param_table.raw("device"))
    if optimizer_table is not None:
        key, device = optimizer_table.key("device"), optimizer_table.raw("device")
        fields_.set("offload.optimizer", optimizer, key, device)
        if optimizer != "device" and stage >= 2:
            fields_.set("offload.gradients", "host", key, device)
        count = _count(optimizer_table, "buffer_count")
        buffers = None if count is None else max(MIN_STAGING_BUFFERS, count // STATES_PER_BUFFER)
        fields_.set("offload.buffer_count", buffers, optimizer_table.key("buffer_count"), count)
    if param_path and optimizer_path and os.path.normpath(param_path) != os.path.normpath(optimizer_path):
        raise ConfigError(
            "zero_optimization.offload_optimizer.nvme_path", optimizer_path,
            f"zeroinf keeps all swap files in one folder: use the offload_param.nvme_path {param_path!r} here too",
        )
    for path, table in ((param_path, param_table), (optimizer_path, optimizer_table)):
        if path is not None and table is not None:
            fields_.set("offload.nvme_dir", path, table.key("nvme_path"), path)
    sub_group = _count(zero, "sub_group_size")
    fields_.set("offload.sub_group_numel", sub_group, zero.key("sub_group_size"), sub_group)
    mics = zero.setting("mics_shard_size")  # MiCS: shard within groups of this many ranks; -1 is off
    if mics is not None and mics != -1:
        fields_.set("shard_group_size", mics, zero.key("mics_shard_size"), mics)
    compute_bytes, reduce_bytes = DTYPES[compute_dtype].itemsize, DTYPES[reduce_dtype].itemsize
    for ds_name, name, itemsize in (
        ("stage3_prefetch_bucket_size", "prefetch_bytes", compute_bytes),
        ("stage3_max_live_parameters", "max_live_bytes", compute_bytes),
        ("stage3_param_persistence_threshold", "persist_threshold_bytes", compute_bytes),
        ("reduce_bucket_size", "bucket_bytes", reduce_bytes),
    ):
        numel = _count(zero, ds_name)
        fields_.set(name, None if numel is None else numel * itemsize, zero.key(ds_name), numel)
    for table in (param_table, optimizer_table, zero):
        if table is not None:
            table.finish()


def _aio(root: _Table, fields_: _Fields) -> None:
    """The `aio` table into `offload.aio`; its keys without an equivalent are listed as ignored."""
    table = root.table("aio")
    if table is None:
        return
    applied = {"block_size": "block_bytes", "queue_depth": "queue_depth", "thread_count": "workers",
               "intra_op_parallelism": "workers"}
    for ds_name, name in applied.items():
        value = _count(table, ds_name)
        fields_.set(f"offload.aio.{name}", value, table.key(ds_name), value)
    fields_.has_aio = True
    for name in table.data:
        if name not in applied:
            table.notes.ignored[table.key(name)] = AIO_NOT_APPLIED


def translate(ds: Mapping[str, Any]) -> Translation:
    """Translate a parsed DeepSpeed config (module docstring); raises ConfigError naming a DeepSpeed key."""
    notes = _Notes()
    root = _Table(ds, "", notes)
    fields_ = _Fields()
    compute_dtype = _precision(root, fields_)
    reduce_value = root.setting("communication_data_type")
    reduce_dtype = Config().reduce_dtype
    if reduce_value is not None:
        reduce_dtype = _normalize_dtype("communication_data_type", reduce_value)
        fields_.set("reduce_dtype", reduce_dtype, "communication_data_type", reduce_value)
    _zero(root, fields_, compute_dtype, reduce_dtype)
    clip = _number(root, "gradient_clipping")
    fields_.set("grad_clip_norm", clip if clip != 0 else None, "gradient_clipping", clip)
    accum = _count(root, "gradient_accumulation_steps")
    fields_.set("grad_accum_steps", accum, "gradient_accumulation_steps", accum)
    _aio(root, fields_)
    root.finish()
    config, aio = fields_.build()
    return Translation(config, aio, dict(notes.ignored), tuple(notes.auto))


def read_deepspeed(source: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """(the parsed config, a label naming it for messages) from a JSON file's path or a dict."""
    if isinstance(source, Mapping):
        return source, "DeepSpeed config"
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist")
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_refuse_duplicate_keys)
    except json.JSONDecodeError as error:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {error}") from None
    return data, f"DeepSpeed config {path}"


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ConfigError(key, value, "the key appears twice in one JSON object: keep one")
        data[key] = value
    return data


def config_from_deepspeed(source: str | os.PathLike[str] | Mapping[str, Any]) -> Config:
    """`Config.from_deepspeed`: read, translate, and log the ignored and "auto" keys as one warning.

    Every rank reads the same file, so the warning comes from rank 0 only (torchrun's RANK)."""
    data, label = read_deepspeed(source)
    translation = translate(data)
    notice = translation.notice(label)
    if notice and os.environ.get("RANK", "0") == "0":
        get_logger().warning(notice)
    return translation.config
