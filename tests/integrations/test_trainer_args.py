"""TrainingArguments -> zeroinf.Config (src/zeroinf/integrations/trainer_args.py): pure, no training."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import dataclasses  # noqa: E402

from transformers import TrainingArguments  # noqa: E402

import zeroinf  # noqa: E402
from zeroinf.integrations import TrainerArgumentsError, config_for_trainer  # noqa: E402


def _args(tmp_path, **kwargs) -> TrainingArguments:
    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **kwargs)


def test_accumulation_and_clipping_come_from_the_trainer(tmp_path) -> None:
    cfg = config_for_trainer(zeroinf.Config(stage=3), _args(tmp_path, gradient_accumulation_steps=4, max_grad_norm=0.5))
    assert (cfg.stage, cfg.grad_accum_steps, cfg.grad_clip_norm) == (3, 4, 0.5)
    # max_grad_norm 0 (or None) disables clipping, as in the plain Trainer
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path, max_grad_norm=0)).grad_clip_norm is None
    # a Config that already agrees is kept as it is
    same = zeroinf.Config(grad_accum_steps=4, grad_clip_norm=1.0)
    assert config_for_trainer(same, _args(tmp_path, gradient_accumulation_steps=4)) == same


NEW_CHECKPOINTING_NAME = pytest.mark.skipif(  # transformers 5.23 has it, 5.17 does not
    "activation_checkpointing" not in {f.name for f in dataclasses.fields(TrainingArguments)},
    reason="this transformers' TrainingArguments has no activation_checkpointing field",
)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gradient_checkpointing": True},
        {"gradient_checkpointing": True,
         "gradient_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}},
        pytest.param({"activation_checkpointing": True, "activation_checkpointing_kwargs": {"every_n_layers": 2}},
                     marks=NEW_CHECKPOINTING_NAME),
    ],
)
def test_activation_checkpointing_comes_from_the_trainer(tmp_path, kwargs) -> None:
    """The engine checkpoints its units (the Trainer then leaves the model's own off: test_trainer.py)."""
    cfg = config_for_trainer(zeroinf.Config(), _args(tmp_path, **kwargs))
    every = (kwargs.get("gradient_checkpointing_kwargs") or kwargs.get("activation_checkpointing_kwargs") or {})
    assert (cfg.activation_checkpointing, cfg.checkpoint_every) == (True, every.get("every_n_layers", 1))
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path)).activation_checkpointing is False
    with pytest.raises(TrainerArgumentsError, match="checkpoint_every=3 but every_n_layers=2"):
        config_for_trainer(
            zeroinf.Config(checkpoint_every=3, activation_checkpointing=True),
            _args(tmp_path, gradient_checkpointing=True, gradient_checkpointing_kwargs={"every_n_layers": 2}),
        )


@pytest.mark.parametrize(
    ("cfg", "kwargs", "message"),
    [
        (zeroinf.Config(grad_accum_steps=4), {"gradient_accumulation_steps": 2},
         "grad_accum_steps=4 but gradient_accumulation_steps=2.*set gradient_accumulation_steps=4"),
        (zeroinf.Config(grad_clip_norm=0.5), {}, r"grad_clip_norm=0.5 but max_grad_norm=1.0.*set max_grad_norm=0.5"),
        (zeroinf.Config(grad_clip_norm=0.5), {"max_grad_norm": 0}, "grad_clip_norm=0.5 but max_grad_norm=0"),
    ],
)
def test_conflicts_are_refused_by_name(tmp_path, cfg, kwargs, message) -> None:
    with pytest.raises(TrainerArgumentsError, match=message):
        config_for_trainer(cfg, _args(tmp_path, **kwargs))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bf16_full_eval": True}, "bf16_full_eval"),
        ({"optim_args": "amsgrad=True"}, "optim_args"),
        ({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"preserve_rng_state": False}},
         r"kwargs \['preserve_rng_state'\]: zeroinf's checkpointing takes every_n_layers"),
        ({"auto_find_batch_size": True, "max_grad_norm": 0},
         r"auto_find_batch_size=True retries .* cannot be undone .* keep max_grad_norm > 0"),
        ({"fsdp": "full_shard"}, "fsdp"),
        ({"load_best_model_at_end": True, "eval_strategy": "steps", "save_only_model": True},
         "load_best_model_at_end=True with save_only_model=True.*drop save_only_model"),
    ],
)
def test_refused_arguments_name_the_fix(tmp_path, kwargs, message) -> None:
    with pytest.raises(TrainerArgumentsError, match=message):
        config_for_trainer(zeroinf.Config(), _args(tmp_path, **kwargs))


def test_auto_find_batch_size_is_taken_where_a_failed_backward_can_be_undone(tmp_path) -> None:
    """integrations/trainer_args.py [Note: auto_find_batch_size]."""
    clipped = config_for_trainer(zeroinf.Config(), _args(tmp_path, auto_find_batch_size=True))  # max_grad_norm 1.0
    assert clipped.grad_clip_norm == 1.0
    after = zeroinf.Config(offload={"step_in_backward": False})
    assert config_for_trainer(after, _args(tmp_path, auto_find_batch_size=True, max_grad_norm=0)).grad_clip_norm is None


def test_all_problems_are_listed_at_once(tmp_path) -> None:
    args = _args(tmp_path, bf16=True, bf16_full_eval=True, gradient_accumulation_steps=2)
    with pytest.raises(TrainerArgumentsError) as info:
        config_for_trainer(zeroinf.Config(grad_accum_steps=3, param_dtype="fp16"), args)
    assert str(info.value).count("\n- ") == 3


@pytest.mark.parametrize("flag", ["bf16", "fp16"])
def test_bf16_and_fp16_set_the_compute_dtype(tmp_path, flag: str) -> None:
    """As DeepSpeed's "auto" takes them (TRL's configs default to bf16=True): the flag becomes
    Config.param_dtype; a Config asking for the other half-precision dtype is refused by name."""
    assert config_for_trainer(zeroinf.Config(stage=3), _args(tmp_path, **{flag: True})).param_dtype == flag
    assert config_for_trainer(zeroinf.Config(param_dtype=flag), _args(tmp_path, **{flag: True})).param_dtype == flag
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path)).param_dtype == "fp32"
    other = "fp16" if flag == "bf16" else "bf16"
    with pytest.raises(TrainerArgumentsError, match=f"param_dtype='{other}' but TrainingArguments ask for {flag}"):
        config_for_trainer(zeroinf.Config(param_dtype=other), _args(tmp_path, **{flag: True}))


def test_accelerates_mixed_precision_sets_the_dtype_and_fp8_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path)).param_dtype == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(TrainerArgumentsError, match="mixed precision 'fp8'"):
        config_for_trainer(zeroinf.Config(), _args(tmp_path))


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_adamw_optims_are_accepted(tmp_path, optim: str) -> None:
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path, optim=optim)).grad_clip_norm == 1.0


def test_a_deepspeed_file_is_refused_naming_the_config_that_reads_it() -> None:
    """TrainingArguments(deepspeed=...) needs DeepSpeed installed to be built at all, so a plain object
    with the field stands in (the checks read arguments by attribute only)."""
    from types import SimpleNamespace

    from zeroinf.integrations.trainer_args import refused_arguments

    problems = refused_arguments(SimpleNamespace(deepspeed="ds_config.json"))
    assert len(problems) == 1 and "zeroinf.Config.from_deepspeed('ds_config.json')" in problems[0], problems
