"""A DeepSpeed config's `optimizer` and `scheduler` sections, built over a sharded model.

    opt, sched = zeroinf.optimizer_from_deepspeed(model, "ds_config.json")   # sched: None without one

[Note: DeepSpeed's optimizer and scheduler sections]
`Config.from_deepspeed` reads the engine's part of a DeepSpeed config; `deepspeed.initialize` also
builds the optimizer and the LR schedule from the same file, and a run migrated from DeepSpeed kept
its numbers only if those were retyped into code. Here they are read as DeepSpeed reads them
(runtime/engine.py `_configure_basic_optimizer`, runtime/lr_schedules.py, 0.19):

- `"Adam"` and `"AdamW"`: `zeroinf.AdamW`, or `zeroinf.Adam` (weight decay as an L2 term) for
  `"Adam"` with `"adam_w_mode": false`; DeepSpeed's "Adam" is AdamW unless told so. DeepSpeed's
  Adam kernels default to `weight_decay` 0 (torch's AdamW to 0.01), so 0 where the section has none.
  `torch_adam` and `fp32_optimizer_states` choose DeepSpeed kernels and are ignored (zeroinf runs
  torch's fused kernel on fp32 states); `bias_correction: false` and `amsgrad` are refused (torch's
  fused Adam has neither).
- Any other name DeepSpeed takes from `torch.optim` ("SGD", "Adagrad", "RMSprop", ...):
  `zeroinf.ShardedOptimizer` over that class, which refuses an update that is not elementwise.
  "Lion": `zeroinf.Lion` (optim/lion.py) over the shards with DeepSpeed's defaults (lr 1e-3, betas
  0.9, 0.999, no weight decay). DeepSpeed's own "Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
  "Muon" and the MuP variants are refused, naming why (not elementwise, or compressed communication
  zeroinf lacks).
- `"WarmupLR"`, `"WarmupDecayLR"`, `"WarmupCosineLR"`: `DeepSpeedSchedule`, a torch LR scheduler
  with DeepSpeed's formulas (log or linear warmup, linear decay, cosine to `cos_min_ratio`). It
  steps as DeepSpeed's engine steps them, once per optimizer step after it, and reproduces its
  learning rates step for step, including DeepSpeed's first step at the warmup's minimum (its
  schedule starts at iteration -1) and at least two warmup steps. Other `torch.optim.lr_scheduler`
  names are built as DeepSpeed builds them; "OneCycle" and "LRRangeTest" are refused, naming
  torch's `OneCycleLR`.
- `"auto"` values (the Hugging Face Trainer fills them from its arguments) are refused: give numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zeroinf.config import ConfigError
from zeroinf.deepspeed_config import read_deepspeed

ADAM_NAMES = ("adam", "adamw")
REFUSED_OPTIMIZERS = {
    "lamb": "LAMB scales each parameter's update by its whole norm (not elementwise over a shard)",
    "onebitadam": "1-bit Adam compresses the gradient communication, which zeroinf does not",
    "zerooneadam": "0/1 Adam compresses the gradient communication, which zeroinf does not",
    "onebitlamb": "1-bit LAMB compresses the gradient communication and is not elementwise",
    "muon": "Muon orthogonalizes each whole matrix (not elementwise over a shard)",
    "muadam": "the MuP optimizers need per-parameter width multipliers zeroinf does not track",
    "muadamw": "the MuP optimizers need per-parameter width multipliers zeroinf does not track",
    "musgd": "the MuP optimizers need per-parameter width multipliers zeroinf does not track",
}
SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
REFUSED_SCHEDULES = {
    "OneCycle": "use torch.optim.lr_scheduler.OneCycleLR on the zeroinf optimizer",
    "LRRangeTest": "use torch.optim.lr_scheduler.LambdaLR with the range test's factor",
}
LOG, LINEAR = "log", "linear"


def _no_auto(section: str, params: Mapping[str, Any]) -> None:
    for key, value in params.items():
        if value == "auto":
            raise ConfigError(
                f"{section}.params.{key}", value,
                "'auto' is filled in by the Hugging Face Trainer from its arguments; give the number here",
            )


class DeepSpeedSchedule(torch.optim.lr_scheduler.LRScheduler):
    """DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR as a torch LR scheduler ([Note:
    DeepSpeed's optimizer and scheduler sections]). `last_epoch` counts `step()` calls; DeepSpeed's
    `last_batch_iteration` is one less."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        kind: str,
        *,
        total_num_steps: int | None = None,
        warmup_min_lr: float | list[float] = 0.0,
        warmup_max_lr: float | list[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = LOG,
        warmup_min_ratio: float = 0.0,
        cos_min_ratio: float = 0.0001,
    ) -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"DeepSpeedSchedule: kind {kind!r} is not one of {', '.join(SCHEDULES)}")
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ConfigError("scheduler.params.warmup_num_steps", warmup_num_steps, "use a positive whole number")
        if warmup_type not in (LOG, LINEAR):
            raise ConfigError("scheduler.params.warmup_type", warmup_type, f"use {LOG!r} or {LINEAR!r}")
        if kind != "WarmupLR" and (isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int)):
            raise ConfigError("scheduler.params.total_num_steps", total_num_steps, f"{kind} needs the run's step count")
        groups = len(optimizer.param_groups)
        self.kind, self.warmup_type = kind, warmup_type
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = max(2, warmup_num_steps)  # as DeepSpeed: log(1) would divide by zero
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        top = [g["lr"] for g in optimizer.param_groups] if warmup_max_lr is None else warmup_max_lr
        if kind == "WarmupDecayLR" and warmup_max_lr is None:
            top = 0.001  # DeepSpeed's default there, not the group's lr
        self.max_lrs = _per_group(top, groups, "warmup_max_lr")
        super().__init__(optimizer)

    def _warmup(self, iteration: int) -> float:
        if self.warmup_type == LOG:  # as DeepSpeed computes it, to the last bit: times the inverse
            return (1.0 / math.log(self.warmup_num_steps)) * math.log(iteration + 1)
        return iteration / self.warmup_num_steps

    def _lr(self, iteration: int, group: int) -> float:
        """DeepSpeed's learning rate of group `group` at its `last_batch_iteration`."""
        base = float(self.base_lrs[group])
        if self.kind == "WarmupCosineLR":
            if iteration < 0:
                return 0.0
            if iteration < self.warmup_num_steps:
                ratio = self.warmup_min_ratio + self._warmup(iteration) * (1.0 - self.warmup_min_ratio)
            else:
                assert self.total_num_steps is not None
                decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
                progress = (iteration - self.warmup_num_steps + 1) / decay_steps
                cosine = (1 + math.cos(math.pi * min(1.0, progress))) / 2
                ratio = max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
            return base * ratio
        low, high = self.min_lrs[group], self.max_lrs[group]
        if iteration < 0:
            return low
        if iteration < self.warmup_num_steps:
            gamma = self._warmup(iteration)
        elif self.kind == "WarmupDecayLR":
            assert self.total_num_steps is not None
            left = float(self.total_num_steps - iteration)
            gamma = max(0.0, left / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    def get_lr(self) -> list[float]:  # type: ignore[override]
        return [self._lr(self.last_epoch - 1, group) for group in range(len(self.optimizer.param_groups))]


def _per_group(value: float | list[float], groups: int, name: str) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * groups
    if len(values) != groups:
        raise ConfigError(f"scheduler.params.{name}", value, f"give one value or one per param group ({groups})")
    return [float(v) for v in values]


def _optimizer(model: Any, section: Mapping[str, Any]) -> torch.optim.Optimizer:
    import zeroinf

    name = str(section.get("type", ""))
    params = dict(section.get("params") or {})
    _no_auto("optimizer", params)
    if "betas" in params:  # a JSON list; torch's optimizers keep a tuple
        params["betas"] = tuple(params["betas"])
    if "max_grad_norm" in params:
        raise ConfigError("optimizer.params.max_grad_norm", params["max_grad_norm"],
                          "clip with the config's gradient_clipping (Config.grad_clip_norm), as DeepSpeed requires")
    lowered = name.lower()
    if lowered in REFUSED_OPTIMIZERS:
        raise ConfigError("optimizer.type", name, REFUSED_OPTIMIZERS[lowered])
    if lowered in ADAM_NAMES:
        adam_w_mode = params.pop("adam_w_mode", True)
        params.pop("torch_adam", None)
        params.pop("fp32_optimizer_states", None)
        if params.pop("bias_correction", True) is not True:
            raise ConfigError("optimizer.params.bias_correction", False, "torch's fused Adam always corrects the bias")
        if params.get("amsgrad"):
            raise ConfigError("optimizer.params.amsgrad", True, "zeroinf's Adam keeps two moments: amsgrad=false")
        params.setdefault("weight_decay", 0.0)  # DeepSpeed's Adam kernels' default
        cls = zeroinf.AdamW if lowered == "adamw" or adam_w_mode else zeroinf.Adam
        try:
            return cls(model, **params)
        except TypeError as error:  # a parameter DeepSpeed's Adam takes and zeroinf's does not
            raise ConfigError("optimizer.params", sorted(params), f"{cls.__name__}: {error}") from None
    if lowered == "lion":  # DeepSpeed's Lion: zeroinf.Lion over the shards, with DeepSpeed's defaults
        torch_class: Any = zeroinf.Lion
        params = {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, **params}
        params.pop("fp32_optimizer_states", None)
    else:
        torch_class = getattr(torch.optim, name, None)
        if not (isinstance(torch_class, type) and issubclass(torch_class, torch.optim.Optimizer)):
            raise ConfigError("optimizer.type", name, "use Adam, AdamW, or the name of a torch.optim optimizer")
    parameters = model.parameters() if isinstance(model, nn.Module) else model
    return zeroinf.ShardedOptimizer(torch_class, parameters, **params)  # refuses what it cannot run, naming it


def _scheduler(optimizer: torch.optim.Optimizer, section: Mapping[str, Any]) -> Any:
    name = str(section.get("type", ""))
    params = dict(section.get("params") or {})
    _no_auto("scheduler", params)
    if name in REFUSED_SCHEDULES:
        raise ConfigError("scheduler.type", name, REFUSED_SCHEDULES[name])
    if name in SCHEDULES:
        params.pop("last_batch_iteration", None)
        try:
            return DeepSpeedSchedule(optimizer, name, **params)
        except TypeError as error:  # a parameter DeepSpeed's schedule does not take either
            raise ConfigError("scheduler.params", sorted(params), str(error)) from None
    torch_class = getattr(torch.optim.lr_scheduler, name, None)
    if not isinstance(torch_class, type):
        raise ConfigError("scheduler.type", name, f"use {', '.join(SCHEDULES)} or a torch.optim.lr_scheduler name")
    try:
        return torch_class(optimizer, **params)
    except TypeError as error:
        raise ConfigError("scheduler.params", sorted(params), f"{name}: {error}") from None


def optimizer_from_deepspeed(
    model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    source: str | os.PathLike[str] | Mapping[str, Any],
) -> tuple[torch.optim.Optimizer, Any]:
    """The optimizer and LR scheduler a DeepSpeed config's `optimizer` and `scheduler` sections make,
    over a sharded model (or its param groups); the scheduler is None where the config has none
    ([Note: DeepSpeed's optimizer and scheduler sections]). Step the scheduler after each
    `optimizer.step()`, as DeepSpeed's engine does."""
    data, label = read_deepspeed(source)
    section = data.get("optimizer")
    if not isinstance(section, Mapping) or "type" not in section:
        raise ConfigError("optimizer", section, f"{label} has no optimizer section with a type: build the optimizer "
                          "in code (zeroinf.AdamW)")
    optimizer = _optimizer(model, section)
    scheduler_section = data.get("scheduler")
    if scheduler_section is None:
        return optimizer, None
    if not isinstance(scheduler_section, Mapping) or "type" not in scheduler_section:
        raise ConfigError("scheduler", scheduler_section, "give a type and its params, as DeepSpeed reads them")
    return optimizer, _scheduler(optimizer, scheduler_section)
