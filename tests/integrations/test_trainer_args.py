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
        ({"bf16": True}, r"Config\(param_dtype="),
        ({"fp16": True}, r"Config\(param_dtype="),
        ({"bf16_full_eval": True}, "bf16_full_eval"),
        ({"optim": "adafactor"}, "optim='adafactor'.*use optim='adamw_torch'"),
        ({"optim_args": "amsgrad=True"}, "optim_args"),
        ({"gradient_checkpointing": True}, r"Config\(activation_checkpointing=True\)"),
        pytest.param(  # the field's newer name (transformers 5.23 has it, 5.17 does not)
            {"activation_checkpointing": True}, r"Config\(activation_checkpointing=True\)",
            marks=pytest.mark.skipif(
                "activation_checkpointing" not in {f.name for f in dataclasses.fields(TrainingArguments)},
                reason="this transformers' TrainingArguments has no activation_checkpointing field",
            ),
        ),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"fsdp": "full_shard"}, "fsdp"),
        ({"load_best_model_at_end": True, "eval_strategy": "steps"}, "load_best_model_at_end"),
    ],
)
def test_refused_arguments_name_the_fix(tmp_path, kwargs, message) -> None:
    with pytest.raises(TrainerArgumentsError, match=message):
        config_for_trainer(zeroinf.Config(), _args(tmp_path, **kwargs))


def test_all_problems_are_listed_at_once(tmp_path) -> None:
    args = _args(tmp_path, bf16=True, optim="sgd", gradient_accumulation_steps=2)
    with pytest.raises(TrainerArgumentsError) as info:
        config_for_trainer(zeroinf.Config(grad_accum_steps=3), args)
    assert str(info.value).count("\n- ") == 3


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_adamw_optims_are_accepted(tmp_path, optim: str) -> None:
    assert config_for_trainer(zeroinf.Config(), _args(tmp_path, optim=optim)).grad_clip_norm == 1.0
