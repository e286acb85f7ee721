"""How `transformers.TrainingArguments` and `zeroinf.Config` agree, for `zeroinf.integrations.Trainer`.

The Trainer's arguments are the source of truth for what the Trainer schedules: its
`gradient_accumulation_steps` and `max_grad_norm` become `Config.grad_accum_steps` and
`Config.grad_clip_norm` (the engine clips, exactly across shards; the Trainer itself does not clip).
A Config that sets either to another value is refused by name, never silently overridden.
`activation_checkpointing=True` (or its older alias `gradient_checkpointing`) becomes
`Config.activation_checkpointing=True` and its `every_n_layers` `Config.checkpoint_every`: the engine
recomputes each unit (a decoder layer: the granularity of transformers' own checkpointing), and the
Trainer does not also turn on the model's, which would recompute every layer twice.
`bf16=True` / `fp16=True` (TRL's configs default to `bf16=True`) become `Config.param_dtype`, as
DeepSpeed's "auto" takes them: the parameters compute in that dtype over fp32 masters, and
accelerate's autocast and GradScaler stay off (the engine scales fp16 losses itself).

Trainer features that would wrap, cast, compile or rebuild the sharded model, or replace its
optimizer, are refused with the zeroinf setting that does the job. Pure functions of plain values:
`args` is read by attribute only, so tests pass any object with the fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from zeroinf.config import Config
from zeroinf.planner.unit_plan import step_in_backward_mode

# [Note: auto_find_batch_size]
# `auto_find_batch_size=True` catches an out-of-memory error in a step, halves the batch and runs the
# training loop again with the same model and optimizer. zeroinf ends a backward that raised at the
# next entry (runtime/failed_backward.py), so the retry trains from the weights before the failed step,
# as the plain Trainer's does, wherever the step runs after backward or speculatively inside it (with
# clipping: `max_grad_norm` > 0, the Trainer's default, or fp16). A final step inside backward
# (no clipping, the default `step_in_backward`) cannot be undone once it has stepped a unit, so that
# combination is refused before training instead of failing at the first out-of-memory error.
# At world > 1 every rank must run out of memory alike, as under DDP.
AUTO_BATCH_NEEDS_UNDO = (
    "auto_find_batch_size=True retries a step whose backward ran out of memory, and without clipping the "
    "step inside backward (offload.step_in_backward) cannot be undone once it stepped a unit: keep "
    "max_grad_norm > 0 (the default 1.0), or set offload.step_in_backward = false in the Config"
)

LION_OPTIMS = ("lion_32bit", "paged_lion_32bit")
"""`TrainingArguments.optim` values of bitsandbytes' 32-bit Lion, which zeroinf.Lion computes over the
shards (paging is for the GPU's states; zeroinf places them by its Config)."""

ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
"""`TrainingArguments.optim` values zeroinf.AdamW stands in for (the same update rule); the Trainer
shards any other through zeroinf.ShardedOptimizer (integrations/trainer.py `create_optimizer`)."""


class TrainerArgumentsError(ValueError):
    """TrainingArguments that zeroinf cannot honour; the message names each argument and its fix."""


def _name(value: Any) -> str:
    return str(getattr(value, "value", value))  # OptimizerNames is a str enum


def refused_arguments(args: Any) -> list[str]:
    """One line per TrainingArguments setting zeroinf refuses (empty: all are fine)."""
    problems = []
    mixed = _name(getattr(args, "mixed_precision", "no"))
    if asked_dtype(args) is None and mixed not in ("no", "None"):
        problems.append(
            f"mixed precision {mixed!r} is set (ACCELERATE_MIXED_PRECISION?): zeroinf computes in fp32, bf16 or "
            "fp16 (Config(param_dtype=...), or bf16=True / fp16=True); unset it"
        )
    if getattr(args, "fp16_full_eval", False) or getattr(args, "bf16_full_eval", False):
        problems.append("fp16_full_eval/bf16_full_eval cast the sharded model: leave them False")
    optim = _name(getattr(args, "optim", ADAMW_OPTIMS[0]))
    if optim in ADAMW_OPTIMS and getattr(args, "optim_args", None):
        problems.append(f"optim_args={args.optim_args!r}: zeroinf.AdamW takes no extra arguments; leave it unset")
    if getattr(args, "deepspeed", None):
        problems.append(
            "deepspeed is set: zeroinf replaces DeepSpeed here; leave it unset and pass its file as "
            f"zeroinf_config=zeroinf.Config.from_deepspeed({args.deepspeed!r}) (the optimizer and LR schedule "
            "come from TrainingArguments, as DeepSpeed's \"auto\" values do)"
        )
    if getattr(args, "fsdp", None):
        problems.append(f"fsdp={args.fsdp!r}: zeroinf shards the model itself; leave fsdp unset")
    if getattr(args, "load_best_model_at_end", False) and getattr(args, "save_only_model", False):
        problems.append(
            "load_best_model_at_end=True with save_only_model=True: zeroinf loads the best checkpoint from its "
            "sharded zeroinf/ folder, which save_only_model leaves out; drop save_only_model"
        )
    return problems


def asked_dtype(args: Any) -> str | None:
    """The compute dtype `args` ask for: `bf16=True` / `fp16=True`, or accelerate's mixed precision
    (`accelerate launch --mixed_precision bf16`, ACCELERATE_MIXED_PRECISION); None: fp32."""
    if getattr(args, "fp16", False):
        return "fp16"
    if getattr(args, "bf16", False):
        return "bf16"
    mixed = _name(getattr(args, "mixed_precision", "no"))
    return mixed if mixed in ("fp16", "bf16") else None


def config_for_trainer(cfg: Config, args: Any) -> Config:
    """`cfg` with the Trainer's accumulation, clipping, compute dtype and activation checkpointing;
    raises TrainerArgumentsError on any conflict."""
    problems = refused_arguments(args)
    param_dtype = cfg.param_dtype
    dtype = asked_dtype(args)
    if dtype is not None:
        # As DeepSpeed's "auto": the Trainer's flag sets the engine's dtype. The parameters themselves
        # take it (masters stay fp32), where the plain Trainer autocasts fp32 parameters.
        if param_dtype not in ("fp32", dtype):
            problems.append(
                f"Config.param_dtype={param_dtype!r} but TrainingArguments ask for {dtype} (bf16/fp16=True, or "
                "accelerate's mixed precision): make them agree, or leave param_dtype unset in the Config"
            )
        param_dtype = dtype
    accum = int(args.gradient_accumulation_steps)
    if cfg.grad_accum_steps not in (1, accum):
        problems.append(
            f"Config.grad_accum_steps={cfg.grad_accum_steps} but gradient_accumulation_steps={accum}: the Trainer "
            f"decides when to step; set gradient_accumulation_steps={cfg.grad_accum_steps} in TrainingArguments "
            "and leave grad_accum_steps unset in the Config"
        )
    max_norm = getattr(args, "max_grad_norm", None)
    clip = float(max_norm) if max_norm is not None and max_norm > 0 else None
    if cfg.grad_clip_norm is not None and cfg.grad_clip_norm != clip:
        problems.append(
            f"Config.grad_clip_norm={cfg.grad_clip_norm} but max_grad_norm={max_norm}: the Trainer's value is used; "
            f"set max_grad_norm={cfg.grad_clip_norm} in TrainingArguments (0 disables clipping) and leave "
            "grad_clip_norm unset in the Config"
        )
    checkpointing, every = cfg.activation_checkpointing, cfg.checkpoint_every
    if asks_checkpointing(args):
        checkpointing = True
        kwargs = getattr(args, "activation_checkpointing_kwargs", None)
        options = dict(kwargs or getattr(args, "gradient_checkpointing_kwargs", None) or {})
        options.pop("use_reentrant", None)  # how torch's checkpoint recomputes; the engine recomputes its own way
        asked = int(options.pop("every_n_layers", every))
        if every not in (1, asked):
            problems.append(
                f"Config.checkpoint_every={every} but every_n_layers={asked} in the checkpointing kwargs: set one "
                "of them"
            )
        every = asked
        if options:
            problems.append(
                f"activation_checkpointing_kwargs {sorted(options)}: zeroinf's checkpointing takes every_n_layers "
                "(Config.checkpoint_every) only"
            )
    agreed = dataclasses.replace(
        cfg, grad_accum_steps=accum, grad_clip_norm=clip, activation_checkpointing=checkpointing,
        checkpoint_every=every, param_dtype=param_dtype,
    )
    if getattr(args, "auto_find_batch_size", False) and step_in_backward_mode(agreed) == "final":
        problems.append(AUTO_BATCH_NEEDS_UNDO)
    if problems:
        raise TrainerArgumentsError(
            "zeroinf.integrations.Trainer cannot use these TrainingArguments:\n- " + "\n- ".join(problems)
        )
    return agreed


def asks_checkpointing(args: Any) -> bool:
    """Activation checkpointing asked of the Trainer (`activation_checkpointing`, or its older alias)."""
    return bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
