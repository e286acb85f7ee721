"""User configuration: frozen, validated dataclasses, loaded from TOML or JSON.

Each field has a docstring (the string literal under it); `docs/config.md` is generated from them
by `python -m zeroinf.config --markdown` and a test checks the two agree. Errors raised here name
the field, the bad value and the fix. Most users set two fields: `stage` and `param_dtype`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import math
import sys
import textwrap
import threading
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
TIERS = ("device", "host", "nvme")
MOMENT_DTYPES = ("fp32", "bf16")  # Adam's moments: fp32, or bf16 with stochastic rounding
AUTO = "auto"
"""A field set to "auto" is chosen for the machine: `param_dtype` at once (bf16 where the device computes
it natively, else fp32), the placement fields (`stage`, the `offload` tiers, `activation_checkpointing`)
by `zeroinf.plan` when the model is known (`zeroinf.shard`, `zeroinf train`): the fastest predicted
placement that fits."""


class ConfigError(ValueError):
    """An invalid configuration value; the message names the field, the value and the fix."""

    def __init__(self, field_name: str, value: object, fix: str) -> None:
        super().__init__(f"config field `{field_name}` = {value!r} is invalid: {fix}")
        self.field_name = field_name
        self.value = value
        self.fix = fix


def _normalize_dtype(field_name: str, value: object, allow_auto: bool = False) -> str:
    name = _DTYPE_ALIASES.get(str(value), str(value))
    if allow_auto and name == AUTO:
        from zeroinf.planner.profile import auto_param_dtype  # reads the CPU flags / CUDA once

        return auto_param_dtype()
    if name not in DTYPES:
        choices = sorted(DTYPES) + ([AUTO] if allow_auto else [])
        raise ConfigError(field_name, value, f"use one of {choices}")
    return name


def _number(field_name: str, value: object, fix: str = "use a number") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(field_name, value, fix)


def _positive_int(field_name: str, value: object, fix: str = "use a positive integer") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field_name, value, fix)


def _bool(field_name: str, value: object) -> None:
    # A string such as "false" would be truthy: flags take true or false only.
    if not isinstance(value, bool):
        raise ConfigError(field_name, value, "use true or false")


def _finite_seconds(field_name: str, value: object) -> None:
    # An infinite (or astronomically long) timeout fails later inside torch.distributed or a thread
    # wait: refuse it here.
    _number(field_name, value, "use a positive number of seconds")
    if not 0 < value <= threading.TIMEOUT_MAX:  # type: ignore[operator]
        raise ConfigError(field_name, value, f"use a positive number of seconds up to {threading.TIMEOUT_MAX:.3g}")


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, used only when `param_dtype` is fp16."""

    initial_scale: float = 2.0**16
    """Loss scale at the first step; a power of two keeps scaling exact."""
    growth_interval: int = 2000
    """Steps without overflow after which the scale is multiplied by `growth_factor`."""
    growth_factor: float = 2.0
    """Factor applied to the scale after `growth_interval` clean steps (> 1)."""
    backoff_factor: float = 0.5
    """Factor applied to the scale when a step overflows; that step is skipped (0 < f < 1)."""
    min_scale: float = 1.0
    """The scale never falls below this; repeated overflows at the floor raise an error."""

    def __post_init__(self) -> None:
        for name in ("initial_scale", "growth_factor", "backoff_factor", "min_scale"):
            _number(f"loss_scale.{name}", getattr(self, name))
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"loss_scale.{name}", getattr(self, name), "use a finite number")
        if not self.initial_scale > 0:
            raise ConfigError("loss_scale.initial_scale", self.initial_scale, "use a positive number, e.g. 65536")
        _positive_int("loss_scale.growth_interval", self.growth_interval)
        if not self.growth_factor > 1:
            raise ConfigError("loss_scale.growth_factor", self.growth_factor, "use a number > 1, e.g. 2.0")
        if not 0 < self.backoff_factor < 1:
            raise ConfigError("loss_scale.backoff_factor", self.backoff_factor, "use a number in (0, 1), e.g. 0.5")
        if not 0 < self.min_scale <= self.initial_scale:
            raise ConfigError("loss_scale.min_scale", self.min_scale, "use a number in (0, initial_scale]")


MIB = 1024 * 1024


@dataclass(frozen=True)
class AioConfig:
    """How the engine splits and issues transfers.

    The defaults match the best sequential O_DIRECT setting measured on the project's NVMe disk
    (1 MiB requests, 8 in flight, see docs/aio.md); `zeroinf bench-io --sweep` finds yours and
    prints the `[offload.aio]` lines that apply it.
    """

    block_bytes: int = 1 * MIB
    """Size of one request to the kernel. A transfer larger than this is split into blocks issued
    concurrently. Must be a positive multiple of `alignment_bytes`."""

    queue_depth: int = 8
    """Most blocks in flight at once across the whole engine (the device's queue depth). With the
    thread backend each worker has at most one block in flight, so the effective depth is
    min(queue_depth, workers)."""

    workers: int = 8
    """Threads issuing the pread/pwrite system calls (they release the GIL). Each owns one bounce
    buffer of `block_bytes` from the engine's pool."""

    o_direct: bool = True
    """Open files with O_DIRECT (bypass the page cache). Falls back to buffered I/O, with one warning,
    on filesystems that refuse it (tmpfs, some network filesystems)."""

    alignment_bytes: int = 4096
    """Alignment O_DIRECT requires of file offsets, sizes and buffer addresses: the filesystem's
    logical block (4 KiB covers 512-byte and 4 KiB devices). A power of two."""

    integrity: bool = False
    """Store an xxh3-64 checksum of every write and verify it when the same (file, offset, bytes)
    is read back; a mismatch raises IntegrityError. Costs one extra pass over the data."""

    def __post_init__(self) -> None:
        a = self.alignment_bytes
        fix = "use a power of two: 4096 (or 512 for old disks)"
        _positive_int("offload.aio.alignment_bytes", a, fix)
        if a & (a - 1):
            raise ConfigError("offload.aio.alignment_bytes", a, fix)
        fix = f"use a positive multiple of alignment_bytes={a}, e.g. {MIB} (1 MiB)"
        _positive_int("offload.aio.block_bytes", self.block_bytes, fix)
        if self.block_bytes % a:
            raise ConfigError("offload.aio.block_bytes", self.block_bytes, fix)
        _positive_int("offload.aio.queue_depth", self.queue_depth, "use an integer >= 1, e.g. 8")
        _positive_int("offload.aio.workers", self.workers, "use an integer >= 1, e.g. 8")
        _bool("offload.aio.o_direct", self.o_direct)
        _bool("offload.aio.integrity", self.integrity)


@dataclass(frozen=True)
class OffloadConfig:
    """Where each kind of model state lives (`device`, `host` or `nvme`), and how `nvme` states move."""

    params: str = "device"
    """Tier of the compute-dtype parameter shards; "auto": chosen by `zeroinf.plan` (fastest that fits)."""
    optimizer: str = "device"
    """Tier of the fp32 master weights and Adam moments; with `host` or `nvme` the update runs on the CPU."""
    moment_dtype: str = "fp32"
    """Dtype of Adam's two moments, wherever they live: "fp32" (12 bytes per parameter with the fp32
    master), or "bf16" (8 bytes: a third less memory, disk and NVMe traffic for the states; each moment
    is updated in fp32 and rounded to bf16 stochastically, so it stays unbiased; optim/moments.py).
    Not bitwise torch.optim's AdamW: within its rounding (docs/design.md, "Optimizer step"). The states
    of a torch optimizer through `zeroinf.ShardedOptimizer` (Lion's momentum, SGD's, RMSprop's square
    average) likewise: Lion then keeps 6 bytes per parameter."""
    gradients: str = "device"
    """Tier of the fp32 gradient shards."""
    nvme_dir: str | None = None
    """Folder for the swap files, required when any tier is `nvme`; created if missing, checked for room."""
    sub_group_numel: int = 2**22
    """Most elements per optimizer sub-group on `nvme`; staging takes 12 B/element (48 MiB per buffer;
    8 B/element with bf16 moments)."""
    buffer_count: int | str = AUTO
    """Host staging buffers for `nvme` sub-groups (>= 2); 3 overlap reading k+1 and writing k-1 with k.
    "auto": room to read a unit's states while its backward runs as the previous unit's are written
    (2 units' sub-groups + 2, within 1 GiB of staging), or 3 under `max_host_bytes`."""
    max_host_bytes: int | None = None
    """Cap on host bytes for offload (staging, or the states on `host`), e.g. "16GiB"; None: no cap. With
    an `nvme_dir`, what exceeds it goes to NVMe, split by unit and spread along the step order:
    parameter shards on `host` first, then optimizer states on `host` in what the shards and buffers
    leave; without a folder, optimizer states over the cap are an error."""
    param_cache_bytes: int = 0
    """Host bytes that keep parameter shards on `nvme` between uses, e.g. "4GiB" (0: none). A shard
    read for forward stays for backward and the next step while it fits; when full, the shard whose
    next use along the traced order is farthest away makes room. Updated shards are written to the
    cache and the file together. Whole shards only: it holds `param_cache_bytes // shard` of them."""
    io_timeout_s: float = 600.0
    """Seconds one swap may take before the step fails with an error naming the file."""
    aio: AioConfig = field(default_factory=AioConfig)
    """The asynchronous I/O engine's settings for every `nvme` tier (table `[offload.aio]`)."""
    step_in_backward: bool | str = AUTO
    """Step each unit's optimizer states during backward, as soon as its reduced gradient is complete,
    instead of after it (optim/backward_step.py [Note: the step inside backward]); its gradient is then freed,
    so no gradient buffer of the model's size exists on any tier. Exact; with clipping or fp16 it is
    speculative and undone when the norm says so, which on `host` or `device` keeps a copy of the
    stepped states until `step()`. "auto": on for `nvme` states, and for `host` and `device` states
    when neither clipping nor fp16 needs the norm; true: also host and device with clipping/fp16."""
    step_thread: bool | str = AUTO
    """With the step inside backward and the optimizer states on `host`: run each unit's CPU AdamW
    kernel on a worker thread, so the rest of backward keeps being queued on the accelerator
    meanwhile (optim/background.py). "auto": on when the compute device is an accelerator (on a CPU
    device backward and the step share the cores); results are the same either way."""

    def __post_init__(self) -> None:
        if isinstance(self.aio, Mapping):
            object.__setattr__(self, "aio", _from_dict(AioConfig, dict(self.aio), prefix="offload.aio."))
        if not isinstance(self.aio, AioConfig):
            raise ConfigError("offload.aio", self.aio, "use an AioConfig or a table of its fields")
        for name in ("params", "optimizer", "gradients"):
            value = getattr(self, name)
            if value not in (*TIERS, AUTO):
                raise ConfigError(f"offload.{name}", value, f"use one of {[*TIERS, AUTO]}")
        if self.nvme_dir is not None:
            if not isinstance(self.nvme_dir, (str, Path)) or not str(self.nvme_dir):
                raise ConfigError("offload.nvme_dir", self.nvme_dir, "use the path of a local folder")
            object.__setattr__(self, "nvme_dir", str(self.nvme_dir))
        nvme_tiers = [n for n in ("params", "optimizer", "gradients") if getattr(self, n) == "nvme"]
        if nvme_tiers and self.nvme_dir is None:
            raise ConfigError(
                "offload.nvme_dir", None,
                f"offload.{nvme_tiers[0]} is 'nvme': set nvme_dir to a local folder for the swap files",
            )
        for name in ("step_in_backward", "step_thread"):
            if not isinstance(getattr(self, name), bool) and getattr(self, name) != AUTO:
                raise ConfigError(f"offload.{name}", getattr(self, name), f"use true, false or {AUTO!r}")
        object.__setattr__(self, "moment_dtype", _normalize_dtype("offload.moment_dtype", self.moment_dtype))
        if self.moment_dtype not in MOMENT_DTYPES:
            raise ConfigError("offload.moment_dtype", self.moment_dtype, f"use one of {list(MOMENT_DTYPES)}")
        _positive_int("offload.sub_group_numel", self.sub_group_numel)
        count = self.buffer_count
        if count != AUTO and (isinstance(count, bool) or not isinstance(count, int) or count < 2):
            raise ConfigError(
                "offload.buffer_count", count, f"use an integer >= 2 (3 overlaps reads, writes) or {AUTO!r}"
            )
        for name in ("max_host_bytes", "param_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, str):
                from zeroinf.memory import parse_bytes

                try:
                    object.__setattr__(self, name, parse_bytes(value))
                except ValueError:
                    raise ConfigError(f"offload.{name}", value, 'use a byte count or a size like "16GiB"') from None
        if self.max_host_bytes is not None:
            _positive_int("offload.max_host_bytes", self.max_host_bytes)
        cache = self.param_cache_bytes
        if isinstance(cache, bool) or not isinstance(cache, int) or cache < 0:
            raise ConfigError("offload.param_cache_bytes", cache, 'use a byte count >= 0 or a size like "4GiB"')
        if cache and self.params not in ("nvme", AUTO):
            raise ConfigError(
                "offload.param_cache_bytes", cache,
                f"it caches parameter shards on nvme, but offload.params is {self.params!r}: set params = 'nvme' or 0",
            )
        _finite_seconds("offload.io_timeout_s", self.io_timeout_s)


@dataclass(frozen=True)
class Config:
    """How zeroinf shards and trains a model."""

    stage: int | str = 2
    """ZeRO stage: 0 plain data parallel, 1 shards optimizer states, 2 also gradients, 3 also parameters;
    "auto": chosen with the offload tiers by `zeroinf.plan`."""
    param_dtype: str = "fp32"
    """Compute dtype of the parameters (fp32, bf16, fp16); master weights are always fp32. "auto": bf16
    where the device computes it natively (CUDA with bf16, a CPU with AMX or AVX512-BF16), else fp32.
    It holds whatever dtype the model was loaded in: a bf16 model under the default fp32 is upcast
    (exactly, at twice its memory) and `shard` warns."""
    reduce_dtype: str = "fp32"
    """Dtype in which gradients are accumulated and reduced across ranks."""
    cast_forward_inputs: bool = True
    """With `param_dtype` bf16 or fp16: the floating-point tensors among the sharded model's forward
    inputs (arguments and keyword arguments, nested in tuples, lists and dicts) are cast to it, as
    FSDP2's `MixedPrecisionPolicy` does by default (an fp32 input met bf16 weights with a dtype error
    before); integer tensors (token ids, labels) are untouched. false passes inputs as given (fp32
    targets of a loss the model computes itself)."""
    keep_fp32: tuple[str, ...] | str = AUTO
    """With `param_dtype` bf16 or fp16: parameters and floating buffers that stay fp32 (computed from
    their fp32 values, trained as fp32), named by patterns in Hugging Face's syntax (each searched in
    the full name, `*` any characters: "gate.weight", "router"). "auto": what the model declares, as
    transformers' `from_pretrained(dtype=...)` keeps them: `_keep_in_fp32_modules_strict` (MoE routers
    and biases of DeepSeek-V3, GLM-4-MoE, Ernie-4.5-MoE, ...) under bf16 and fp16,
    `_keep_in_fp32_modules` (T5's `wo`, ...) under fp16 only; none for other models. () keeps none
    (what `module.to(param_dtype)` does). precision.py [Note: parameters the model keeps in fp32]."""
    grad_accum_steps: int = 1
    """Backward passes (micro-steps) per optimizer step."""
    sync_every_micro_step: bool = False
    """Reduce gradients after every micro-step instead of only the last one (trades bandwidth for memory)."""
    grad_clip_norm: float | None = None
    """Clip the global gradient L2 norm (exact across shards) to this value; None disables clipping."""
    grad_clip_value: float | None = None
    """Clamp every gradient element to [-value, value] before the step, as
    `torch.nn.utils.clip_grad_value_` does (after averaging over ranks and micro-steps, loss scale
    removed); None disables it. Not together with `grad_clip_norm`."""
    bucket_bytes: int = 25 * 2**20
    """Largest single gradient all-reduce (stages 0-1); bigger units are reduced in pieces of this size."""
    unit_classes: tuple[str, ...] = ()
    """Module class names whose instances each form a unit (classes are accepted and kept by name);
    empty means automatic discovery."""
    shard_group_size: int | None = None
    """Hybrid sharding (FSDP's HYBRID_SHARD, DeepSpeed's MiCS): shard over groups of this many
    consecutive ranks (a machine's GPUs: the all-gathers stay on its fast links) and replicate across
    the groups; each reduced gradient shard is then averaged over the replicas (one all-reduce per
    unit across machines), so training is data parallel over every rank. Must divide the world size
    and be at least 2; None shards over the whole world. Checkpoints are written by the first group
    and read by every group (comm.py [Note: hybrid sharding])."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling for fp16."""
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    """Placement of model states across tiers."""
    prefetch_bytes: int = 256 * 2**20
    """Stage 3: unsharded bytes all-gathered ahead of use (beyond the unit running now); the forward's
    last units within it stay gathered for the backward that starts with them."""
    max_live_bytes: int | None = None
    """Stage 3: cap on unsharded bytes of non-resident units alive at once; None means no cap."""
    persist_threshold_bytes: int = 2**18
    """Stage 3: units whose unsharded size is below this stay unsharded (like the root unit)."""
    split_root: bool = True
    """Stage 3: each `nn.Embedding` / `nn.Linear` outside the repeated blocks whose parameters (not
    shared with another module) are at least as large as the smallest block (and
    `persist_threshold_bytes`) is a unit of its own, gathered only while it runs, instead of staying
    in the root unit, which is never sharded (a language model's token embedding and LM head). false
    keeps them in the root."""
    split_root_min_bytes: int | None = None
    """With `split_root`: split layers of at least this many bytes (in `param_dtype`) instead of those
    at least as large as the smallest block (None)."""
    activation_checkpointing: bool | str = False
    """Recompute each checkpointed unit's forward in backward, keeping only its inputs; "auto": chosen
    with the placement by `zeroinf.plan`."""
    checkpoint_every: int = 1
    """With activation checkpointing: checkpoint every k-th unit (1 = all units but the root)."""
    offload_activations: bool = False
    """Move the inputs kept by activation checkpointing to host memory until backward needs them."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait before the run fails with a timeout naming the rank. A process group
    the loop made itself (`dist.init_process_group`) keeps its own timeout for its collectives; the
    engine's own hold this one on the CPU (gloo), while on CUDA that group's (NCCL's watchdog) holds:
    pass `timeout=` to `init_process_group`, or let `zeroinf.init_distributed` make the group
    (comm.py [Note: the collective timeout over a process group made elsewhere])."""
    check_collectives: bool = False
    """Before each of the engine's collectives (unit all-gathers, gradient reduce-scatters, its
    all-reduces), one small all-reduce checks that every rank is calling the same one: kind, size
    and unit. On a mismatch every rank stops with a CollectiveError naming what each rank called,
    where gloo aborts the process, NCCL hangs, or buffers of equal size are silently mixed. For
    finding where ranks diverge (a layer skipped on some ranks at stage 3, an evaluation on one
    rank); it adds a round trip to every collective and takes the overlap away, so leave it off to
    train (comm.py [Note: checking that the ranks call the same collectives]). The environment
    variable ZEROINF_CHECK_COLLECTIVES=1 turns it on for every model without editing the script."""
    reuse_step_memory: bool | str = AUTO
    """From the second step on, keep the memory a step frees for the next step instead of giving
    buffers above 32 MiB back to the OS, which the next step faults in again page by page (glibc;
    tiers/host.py [Note: glibc's thresholds while building and while training]): what an
    accelerator's caching allocator does for device memory, for a CPU device. Faster where the CPU
    computes (1.31B GPT fully on NVMe, bf16: 18.1 against 20.3 s/step) for a peak RSS that can be
    higher (the heap keeps fragments: from 0 to +45% in docs/design.md's runs). "auto": on when the
    device is the CPU and, after the first step, the machine has as much memory available as the
    process holds; given back for good if that stops holding. false: the leanest peak."""

    def __post_init__(self) -> None:
        if self.stage != AUTO and (
            isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in (0, 1, 2, 3)
        ):
            raise ConfigError("stage", self.stage, 'use 0, 1, 2, 3 or "auto"')
        object.__setattr__(self, "param_dtype", _normalize_dtype("param_dtype", self.param_dtype, allow_auto=True))
        object.__setattr__(self, "reduce_dtype", _normalize_dtype("reduce_dtype", self.reduce_dtype))
        if self.reduce_dtype == "fp16":
            raise ConfigError("reduce_dtype", self.reduce_dtype, "fp16 reductions overflow; use fp32 or bf16")
        keep: Any = self.keep_fp32
        if keep != AUTO:
            if isinstance(keep, str) or not isinstance(keep, (list, tuple)) or not all(
                isinstance(k, str) and k for k in keep
            ):
                raise ConfigError(
                    "keep_fp32", keep,
                    'use "auto" (what the model declares) or a list of name patterns, e.g. ["gate.weight"]',
                )
            object.__setattr__(self, "keep_fp32", tuple(keep))
        if self.shard_group_size is not None:
            _positive_int("shard_group_size", self.shard_group_size, "use None (shard over every rank) or an int >= 2")
            if self.shard_group_size < 2:
                raise ConfigError(
                    "shard_group_size", self.shard_group_size,
                    "use None or an int >= 2 (groups of one rank would hold every state whole: stage 0's data "
                    "parallelism, which needs no groups)",
                )
        _positive_int("grad_accum_steps", self.grad_accum_steps)
        _bool("cast_forward_inputs", self.cast_forward_inputs)
        _bool("sync_every_micro_step", self.sync_every_micro_step)
        if self.grad_clip_norm is not None and not (
            isinstance(self.grad_clip_norm, (int, float))
            and not isinstance(self.grad_clip_norm, bool)
            and self.grad_clip_norm > 0
        ):
            raise ConfigError("grad_clip_norm", self.grad_clip_norm, "use a positive number or leave it unset")
        if self.grad_clip_value is not None:
            value = self.grad_clip_value
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and value > 0):
                raise ConfigError("grad_clip_value", value, "use a positive finite number or leave it unset")
            if self.grad_clip_norm is not None:
                raise ConfigError(
                    "grad_clip_value", value,
                    "set grad_clip_norm or grad_clip_value, not both: torch's clip_grad_norm_ after clip_grad_value_ "
                    "takes the norm of the clamped gradients, which the engine does not compute",
                )
        _positive_int("bucket_bytes", self.bucket_bytes)
        classes: Any = self.unit_classes
        listed = isinstance(classes, (list, tuple, set, frozenset))
        if not listed or not all(isinstance(c, (str, type)) for c in classes):
            raise ConfigError("unit_classes", classes, 'use a list of class names (or classes), e.g. ["Block"]')
        # Classes, as FSDP's auto-wrap policies take them, are kept by name (the config stays plain data);
        # a set is sorted so that every rank holds the same tuple.
        names = [c.__name__ if isinstance(c, type) else c for c in classes]
        if isinstance(classes, (set, frozenset)):
            names.sort()
        object.__setattr__(self, "unit_classes", tuple(names))
        if isinstance(self.prefetch_bytes, bool) or not isinstance(self.prefetch_bytes, int) or self.prefetch_bytes < 0:
            raise ConfigError("prefetch_bytes", self.prefetch_bytes, "use a byte count >= 0 (0 disables prefetch)")
        if self.max_live_bytes is not None:
            _positive_int("max_live_bytes", self.max_live_bytes)
        if (
            isinstance(self.persist_threshold_bytes, bool)
            or not isinstance(self.persist_threshold_bytes, int)
            or self.persist_threshold_bytes < 0
        ):
            raise ConfigError("persist_threshold_bytes", self.persist_threshold_bytes, "use a byte count >= 0")
        _bool("split_root", self.split_root)
        if self.split_root_min_bytes is not None and (
            isinstance(self.split_root_min_bytes, bool)
            or not isinstance(self.split_root_min_bytes, int)
            or self.split_root_min_bytes < 0
        ):
            raise ConfigError(
                "split_root_min_bytes", self.split_root_min_bytes, "use a byte count >= 0, or leave it unset"
            )
        if not isinstance(self.activation_checkpointing, bool) and self.activation_checkpointing != AUTO:
            raise ConfigError("activation_checkpointing", self.activation_checkpointing, 'use true, false or "auto"')
        _bool("offload_activations", self.offload_activations)
        _bool("check_collectives", self.check_collectives)
        if not isinstance(self.reuse_step_memory, bool) and self.reuse_step_memory != AUTO:
            raise ConfigError("reuse_step_memory", self.reuse_step_memory, 'use true, false or "auto"')
        _positive_int("checkpoint_every", self.checkpoint_every)
        if self.offload_activations and not self.activation_checkpointing:
            raise ConfigError(
                "offload_activations",
                True,
                "it offloads the inputs kept by checkpointing: also set activation_checkpointing",
            )
        _finite_seconds("collective_timeout_s", self.collective_timeout_s)
        for name, cls in (("loss_scale", LossScaleConfig), ("offload", OffloadConfig)):
            if isinstance(getattr(self, name), Mapping):  # Config(offload={"optimizer": "host"}), as from_dict
                object.__setattr__(self, name, _from_dict(cls, dict(getattr(self, name)), prefix=f"{name}."))
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(name, getattr(self, name), f"pass a {cls.__name__} or a table of its fields")
        if self.is_auto:
            return  # the placement is checked once zeroinf.plan has chosen it
        if self.offload.params != "device" and self.stage != 3:
            raise ConfigError(
                "offload.params", self.offload.params, "parameters move to host/nvme only when sharded: use stage 3"
            )
        if self.offload.gradients != "device" and self.resolved_stage < 2:
            raise ConfigError(
                "offload.gradients", self.offload.gradients, "gradient shards exist from stage 2 on: use stage 2 or 3"
            )
        if self.offload.gradients != "device" and self.offload.optimizer == "device":
            raise ConfigError(
                "offload.gradients", self.offload.gradients,
                "offloaded gradients feed a CPU optimizer step: set offload.optimizer to 'host' or 'nvme' too",
            )

    @property
    def is_auto(self) -> bool:
        """Whether a placement field (stage, an offload tier, activation checkpointing) is still "auto"."""
        o = self.offload
        return AUTO in (self.stage, o.params, o.optimizer, o.gradients) or self.activation_checkpointing == AUTO

    @property
    def resolved_stage(self) -> int:
        """`stage` as a number, once it is chosen; a ValueError while it is still "auto" (`zeroinf.plan`,
        `zeroinf.shard` and `zeroinf train` resolve it first)."""
        if isinstance(self.stage, int):
            return self.stage
        raise ValueError(f'config field `stage` is {self.stage!r}: choose a placement with zeroinf.plan first')

    @property
    def split_min_numel(self) -> int | None:
        """The fewest parameters of a layer that `split_root` makes a unit of its own; None: no split
        (stages 0-2 keep every unit unsharded, so a split would change nothing but the units' count)."""
        if not self.split_root or self.resolved_stage != 3:
            return None
        floor = max(self.persist_threshold_bytes, self.split_root_min_bytes or 0)
        return max(1, -(-floor // DTYPES[self.param_dtype].itemsize))

    @property
    def split_any_size(self) -> bool:
        """With `split_root`: split layers smaller than the smallest block too (a byte floor is set)."""
        return self.split_root_min_bytes is not None

    @property
    def param_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.param_dtype]

    @property
    def reduce_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce_dtype]

    # -- loading ------------------------------------------------------------------------------------
    @classmethod
    def of(cls, value: Config | Mapping[str, Any] | None, where: str = "zeroinf.shard") -> Config:
        """What every entry point takes as its config: a Config, None (the defaults), or a mapping of
        Config's fields (a parsed TOML or JSON table, as `from_dict`). A DeepSpeed config dict is
        refused with its translation (`from_deepspeed`), not read as fields it lacks."""
        if value is None:
            return cls()
        if isinstance(value, Config):
            return value
        if isinstance(value, Mapping):
            deepspeed_keys = sorted(k for k in value if k in _DEEPSPEED_KEYS)
            if deepspeed_keys:
                raise ConfigError(
                    deepspeed_keys[0], value[deepspeed_keys[0]],
                    f"{where} got a DeepSpeed config (keys {deepspeed_keys}): translate it with "
                    "zeroinf.Config.from_deepspeed(ds_config)",
                )
            return cls.from_dict(dict(value))
        raise TypeError(
            f"{where}: the config is a {type(value).__name__}; pass a zeroinf.Config, a dict of its fields, "
            "or None for the defaults"
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Config:
        """Build from plain data (nested tables for `loss_scale` and `offload`); unknown keys raise."""
        return _from_dict(cls, data, prefix="")

    @classmethod
    def load(cls, path: str | Path) -> Config:
        """Load a `.toml` or `.json` file."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file {path} does not exist")
        try:
            if path.suffix == ".toml":
                data = tomllib.loads(path.read_text())
            elif path.suffix == ".json":
                data = json.loads(path.read_text())
            else:
                raise ValueError(f"config file {path}: use a .toml or .json file")
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"config file {path} is not valid {path.suffix[1:].upper()}: {error}") from None
        return cls.from_dict(data)

    @classmethod
    def from_deepspeed(cls, source: str | Path | Mapping[str, Any]) -> Config:
        """Translate a DeepSpeed JSON config (its path, or the parsed dict); see `zeroinf.deepspeed_config`.

        Keys with no meaning here are listed in one logged warning; contradictory ones raise a
        ConfigError naming the DeepSpeed key."""
        from zeroinf.deepspeed_config import config_from_deepspeed

        return config_from_deepspeed(source)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Top-level keys of a DeepSpeed config that no zeroinf Config has (Config.of tells them apart).
_DEEPSPEED_KEYS = frozenset({
    "zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "gradient_clipping", "bf16", "fp16", "optimizer", "scheduler",
    "steps_per_print", "wall_clock_breakdown", "aio", "zero_allow_untested_optimizer",
})

_NESTED: dict[tuple[type, str], type] = {
    (Config, "loss_scale"): LossScaleConfig, (Config, "offload"): OffloadConfig, (OffloadConfig, "aio"): AioConfig,
}


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "<root>", data, "use a table of fields")
    known = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{prefix}{key}", value, f"unknown field; known fields are {sorted(known)}")
        nested = _NESTED.get((cls, key))
        if nested is not None and isinstance(value, dict):
            value = _from_dict(nested, value, prefix=f"{prefix}{key}.")
        if key in ("unit_classes", "keep_fp32") and isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                docs[node.target.id] = str(nxt.value.value).strip()
    return docs


def config_markdown() -> str:
    """The configuration reference, as written to docs/config.md."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `src/zeroinf/config.py` by `python -m zeroinf.config --markdown`; a test keeps it in sync.",
        "Load with `zeroinf.Config.load(\"train.toml\")` (or `.json`); "
        "nested tables are `[loss_scale]`, `[offload]` and `[offload.aio]`. "
        "Every entry point also takes the same fields as a dict (`zeroinf.shard(model, {\"stage\": 3})`).",
        "",
    ]
    for cls, title in ((Config, "Config"), (LossScaleConfig, "[loss_scale]"), (OffloadConfig, "[offload]"),
                       (AioConfig, "[offload.aio]")):
        summary = inspect.cleandoc(cls.__doc__ or "")
        lines += [f"## {title}", "", summary, "", "| field | default | meaning |", "|---|---|---|"]
        docs = field_docs(cls)
        for f in fields(cls):
            if f.default is not dataclasses.MISSING:
                default = repr(f.default)
            else:
                default = f"{f.type} defaults"
            lines.append(f"| `{f.name}` | `{default}` | {' '.join(docs.get(f.name, '').split())} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        print(config_markdown())
    else:
        print("usage: python -m zeroinf.config --markdown", file=sys.stderr)
        sys.exit(2)
