"""Precision: which buffers take the compute dtype, and dynamic loss scaling for fp16 compute.

`buffer_in_compute_dtype`: the engine casts a model's floating buffers (rotary frequency tables
aside) to the compute dtype, as `module.to(param_dtype)` would, and the planner's meta pass does the
same so it meets the dtypes training meets.

The loss scale multiplies the loss before backward; the optimizer divides it out of the gradients
(bf16 and fp32 need none). A step whose gradients overflow (inf/nan anywhere, on any rank) is
skipped and the scale backs off; after `growth_interval` clean steps it grows again.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import nn

from zeroinf.config import AUTO, Config, LossScaleConfig
from zeroinf.telemetry import get_logger


# [Note: which buffers take the compute dtype]
# Floating buffers take the compute dtype, as `module.to(param_dtype)` (and DeepSpeed's
# `module.bfloat16()`) would make them: a table left in fp32 upcasts the activations it touches, and
# the next matmul or layer norm against bf16 weights refuses the mixed dtypes. Rotary frequency
# tables are the exception: Hugging Face builds every `inv_freq` (also `original_inv_freq`,
# `{layer_type}_inv_freq`) in fp32 on purpose, non-persistent, and its rotary modules read it in
# fp32 (a bf16 `inv_freq` would shift the positions of long sequences); a bf16 `from_pretrained`
# keeps them fp32 too, so they keep the precision they were built in. This rule used to keep every
# non-persistent buffer as built, which broke two of the 150 causal-LM types benchmarks/hf_sweep.py
# trains in bf16: openai-gpt's causal mask (`bias`) and xglm's sinusoidal positions (`weights`),
# built in fp32 by an fp32 model and in bf16 by a bf16 load, where they work.
def buffer_in_compute_dtype(module: nn.Module, name: str, buffer: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Buffer `name` of `module` as the engine holds it: floating buffers in the compute `dtype` (so
    mixed-dtype arithmetic does not upcast activations), rotary frequency tables (non-persistent,
    named `*inv_freq`) as they were built ([Note: which buffers take the compute dtype])."""
    if not buffer.is_floating_point() or buffer.dtype == dtype or keeps_its_precision(module, name):
        return buffer
    return buffer.to(dtype)


def keeps_its_precision(module: nn.Module, name: str) -> bool:
    """A rotary frequency table (Hugging Face's non-persistent `inv_freq` buffers)."""
    return name in module._non_persistent_buffers_set and name.endswith("inv_freq")


# [Note: parameters the model keeps in fp32]
# Some models keep parts of themselves in fp32 whatever the compute dtype, and transformers'
# `from_pretrained(dtype=...)` honours them: MoE routers score tokens with fp32 gate weights and
# biases (`_keep_in_fp32_modules_strict`, under bf16 and fp16: DeepSeek-V3's `gate.weight` and
# `e_score_correction_bias`, GLM-4-MoE, Ernie-4.5-MoE, Mistral-Large-3, ...), T5 keeps its `wo`
# projections fp32 under fp16 (`_keep_in_fp32_modules`, against overflow). `module.to(bf16)`
# rounds them, as DeepSpeed's `module.bfloat16()` and FSDP2's `param_dtype` do: the router then
# scores from bf16-rounded weights (its forward upcasts them, the rounding stays). zeroinf keeps
# them (Config.keep_fp32, "auto" reading those declarations): a unit's parameters that match form a
# unit of their own in fp32 beside it (partition/wrap.py, key `<unit>#fp32`), gathered, reduced and
# stepped with it, their master the fp32 value itself; matching buffers stay fp32. The model's own
# forward handles the mixed dtypes, as it must under `from_pretrained`. What it costs: one more
# collective per block for a few kilobytes, and the kept parameters at 4 bytes each.
def fp32_names(model: nn.Module, cfg: Config) -> Callable[[str], bool] | None:
    """Whether a parameter or buffer of `model`, by its full name, stays fp32 under `cfg`'s compute
    dtype ([Note: parameters the model keeps in fp32]); None when nothing does."""
    if cfg.param_dtype == "fp32":
        return None
    patterns = declared_fp32(model, cfg.param_dtype) if cfg.keep_fp32 == AUTO else tuple(cfg.keep_fp32)
    if not patterns:
        return None
    # transformers' syntax (core_model_loading.build_glob_alternation): `*` is any characters, the
    # rest a regular expression searched anywhere in the name
    found = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns))
    return lambda name: found.search(name) is not None


def declared_fp32(model: nn.Module, param_dtype: str) -> tuple[str, ...]:
    """The patterns `model` (a transformers model, or one wrapping it: peft) keeps in fp32 under
    `param_dtype`, as `PreTrainedModel._get_dtype_plan` reads them: strict ones under bf16 and fp16,
    the others under fp16 only."""
    names = ["_keep_in_fp32_modules_strict"] + (["_keep_in_fp32_modules"] if param_dtype == "fp16" else [])
    found: set[str] = set()
    for module in model.modules():
        for name in names:
            found.update(getattr(module, name, None) or ())
    return tuple(sorted(found))


# [Note: a bf16 model under the default fp32 compute dtype]
# A model loaded in bf16 (`from_pretrained(..., torch_dtype=torch.bfloat16)`) and sharded with the
# default `param_dtype="fp32"` computes in fp32: its values are upcast exactly, masters are fp32 as
# always, but its parameters take twice the memory they had (a LoRA fine-tune's frozen bf16 base
# too), which a user who loaded in bf16 to save memory did not ask for and was not told. FSDP2
# keeps the dtype it is given; DeepSpeed follows its config. zeroinf keeps the config's word (the
# dtype is a training choice, not a property of the checkpoint) and says what it did once.
def warn_if_upcast(module: nn.Module, dtype: torch.dtype, rank: int) -> None:
    """Warn (rank 0) when floating parameters of `module` are narrower than the compute `dtype`."""
    if rank != 0:
        return
    narrower = [p for p in module.parameters() if p.is_floating_point() and p.element_size() < dtype.itemsize]
    if not narrower:
        return
    total = sum(p.numel() for p in module.parameters())
    share = sum(p.numel() for p in narrower) / max(total, 1)
    found = sorted({str(p.dtype).removeprefix("torch.") for p in narrower})
    compute = str(dtype).removeprefix("torch.")
    warnings.warn(
        f"{share:.0%} of the model's parameters are {'/'.join(found)}, but Config.param_dtype is "
        f"{compute}: zeroinf computes in {compute} (the values "
        "are upcast exactly; masters are fp32 either way), so they take twice the memory they had. For "
        "bf16 compute set Config(param_dtype='bf16') (or 'auto'; the Trainer: bf16=True)",
        UserWarning, stacklevel=_first_frame_outside_zeroinf(),
    )


def _first_frame_outside_zeroinf() -> int:
    """The `stacklevel` that names the caller's line outside this package (the user's `shard` call)."""
    package = os.path.dirname(os.path.abspath(__file__))
    level = 1  # the frame that calls warnings.warn
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


MAX_OVERFLOWS_AT_MIN_SCALE = 10


class DynamicLossScaler:
    def __init__(self, cfg: LossScaleConfig) -> None:
        self.cfg = cfg
        self.scale = float(cfg.initial_scale)
        self.clean_steps = 0
        self.overflows_at_min = 0
        self.skipped_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        """Record the outcome of a step: back off and log on overflow, grow after a clean interval."""
        if overflow:
            self.skipped_steps += 1
            self.clean_steps = 0
            if self.scale <= self.cfg.min_scale:
                self.overflows_at_min += 1
                if self.overflows_at_min >= MAX_OVERFLOWS_AT_MIN_SCALE:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed {self.overflows_at_min} steps in a row at the minimum loss "
                        f"scale {self.cfg.min_scale}: the model diverged or fp16 cannot represent it; "
                        "lower the learning rate or use param_dtype='bf16'"
                    )
            new_scale = max(self.scale * self.cfg.backoff_factor, self.cfg.min_scale)
            get_logger().warning(
                "step %d: gradient overflow, step skipped; loss scale %g -> %g", step, self.scale, new_scale
            )
            self.scale = new_scale
            return
        self.overflows_at_min = 0
        self.clean_steps += 1
        if self.clean_steps >= self.cfg.growth_interval:
            self.scale *= self.cfg.growth_factor
            self.clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
            "overflows_at_min": self.overflows_at_min,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
        self.skipped_steps = int(state["skipped_steps"])
        self.overflows_at_min = int(state.get("overflows_at_min", 0))
