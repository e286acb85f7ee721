"""TRL's trainers on a zeroinf-sharded model: `zeroinf.integrations.SFTTrainer` and `DPOTrainer`.

    from trl import SFTConfig
    from zeroinf.integrations import SFTTrainer

    trainer = SFTTrainer(model="path/to/hf-folder", args=SFTConfig(output_dir="out", ...), train_dataset=ds,
                         peft_config=LoraConfig(...),                 # optional
                         zeroinf_config=zeroinf.Config(stage=3))
    trainer.train()

`trl.SFTTrainer` with everything `zeroinf.integrations.Trainer` changes (trainer.py): TRL prepares the
dataset, adds the adapters of `peft_config` and its fused LM head, then the model is sharded ([Note:
sharding after the Trainer's constructor]); SFTConfig's default `bf16=True` becomes
`Config.param_dtype="bf16"` (trainer_args.py; `bf16=False` trains in fp32).

A model given as a local folder is loaded by `zeroinf.from_pretrained` (TRL would load it whole with
transformers, then zeroinf would shard it: the full model in memory first, which is what zeroinf
avoids); `peft_config` then adds its adapters in `prepare=`, after TRL's `set_seed(args.seed)` as
TRL adds them, and `args.model_init_kwargs` go to `from_config` (loader-only ones are refused by name).

`DPOTrainer` likewise; its reference model is the peft model with its adapters disabled, or the
`ref_model` given, which may be sharded (a frozen model: `zeroinf.shard(ref.requires_grad_(False),
cfg)`; accelerate leaves it as it is). Without either, where TRL would load the reference whole from
the model's folder, it is loaded from there by `zeroinf.from_pretrained`, frozen and sharded. Any other
Trainer subclass combines the same way: `class MyTrainer(zeroinf.integrations.Trainer, Other)`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import transformers
import trl
from torch import nn

import zeroinf
from zeroinf.config import Config
from zeroinf.engine import sharded_engine
from zeroinf.integrations.trainer import Trainer
from zeroinf.integrations.trainer_args import config_for_trainer

ZeroinfConfig = Config | Mapping[str, Any] | None


def _is_path(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike))


def _load(
    path: str | os.PathLike[str], cfg: Config, args: Any, peft_config: Any = None, frozen: bool = False
) -> nn.Module:
    """The sharded model of the Hugging Face folder `path`: with `peft_config`'s adapters (drawn after
    `set_seed(args.seed)`, as TRL draws them), or frozen (a reference model)."""

    def prepare(model: nn.Module) -> nn.Module:
        if frozen:
            return model.requires_grad_(False)
        from peft import get_peft_model

        transformers.set_seed(args.seed)
        return get_peft_model(model, peft_config)

    kwargs = dict(args.model_init_kwargs or {})
    needs_prepare = frozen or peft_config is not None
    return zeroinf.from_pretrained(path, cfg, prepare=prepare if needs_prepare else None, **kwargs)


def _config(zeroinf_config: ZeroinfConfig, args: Any, who: str) -> Config:
    return config_for_trainer(Config.of(zeroinf_config, f"zeroinf.integrations.{who}"), args)


class SFTTrainer(Trainer, trl.SFTTrainer):
    """`trl.SFTTrainer` on a sharded model; takes `trl.SFTConfig`, `zeroinf_config` (trainer.py), and a
    model object or a local Hugging Face folder."""

    def __init__(
        self, model: Any, args: Any = None, *trainer_args: Any, zeroinf_config: ZeroinfConfig = None,
        peft_config: Any = None, **trainer_kwargs: Any,
    ) -> None:
        if _is_path(model):
            args = args if args is not None else trl.SFTConfig(f"{os.path.basename(os.fspath(model))}-SFT")
            model = _load(model, _config(zeroinf_config, args, "SFTTrainer"), args, peft_config)
            zeroinf_config = peft_config = None  # the model carries both now
        super().__init__(
            model, args, *trainer_args, zeroinf_config=zeroinf_config, peft_config=peft_config, **trainer_kwargs
        )


class DPOTrainer(Trainer, trl.DPOTrainer):
    """`trl.DPOTrainer` on a sharded model; takes `trl.DPOConfig`, `zeroinf_config` (trainer.py), and a
    model object or a local Hugging Face folder; the reference model as above."""

    def __init__(
        self, model: Any, ref_model: Any = None, args: Any = None, *, zeroinf_config: ZeroinfConfig = None,
        peft_config: Any = None, **trainer_kwargs: Any,
    ) -> None:
        if args is None and _is_path(model):
            args = trl.DPOConfig(f"{os.path.basename(os.fspath(model))}-DPO")
        folder = os.fspath(model) if _is_path(model) else getattr(getattr(model, "config", None), "_name_or_path", "")
        load_ref = ref_model is None and peft_config is None and os.path.isfile(os.path.join(folder, "config.json"))
        if args is not None and (load_ref or _is_path(model)):
            engine = None if _is_path(model) else sharded_engine(model)
            cfg = engine.cfg if engine is not None else _config(zeroinf_config, args, "DPOTrainer")
            if load_ref:  # where TRL would load it whole
                ref_model = _load(folder, cfg, args, frozen=True)
            if _is_path(model):
                model = _load(model, cfg, args, peft_config)
                zeroinf_config = peft_config = None
        super().__init__(
            model, args=args, ref_model=ref_model, zeroinf_config=zeroinf_config, peft_config=peft_config,
            **trainer_kwargs,
        )
