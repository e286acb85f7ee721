"""TRL's trainers on a zeroinf-sharded model: `zeroinf.integrations.SFTTrainer` and `DPOTrainer`.

    from trl import SFTConfig
    from zeroinf.integrations import SFTTrainer

    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir="out", ...), train_dataset=ds,
                         processing_class=tokenizer, peft_config=LoraConfig(...),   # optional
                         zeroinf_config=zeroinf.Config(stage=3))
    trainer.train()

`trl.SFTTrainer` with everything `zeroinf.integrations.Trainer` changes (trainer.py): TRL prepares the
dataset, adds the adapters of `peft_config` and its fused LM head, then the model is sharded ([Note:
sharding after the Trainer's constructor]); SFTConfig's default `bf16=True` becomes
`Config.param_dtype="bf16"` (trainer_args.py; `bf16=False` trains in fp32).

`DPOTrainer` likewise; its reference model is the peft model with its adapters disabled, or the
`ref_model` given, which may be sharded (a frozen model: `zeroinf.shard(ref.requires_grad_(False),
cfg)`; accelerate leaves it as it is), so it too needs no whole copy on the device. Any other
Trainer subclass combines the same way: `class MyTrainer(zeroinf.integrations.Trainer, Other)`.
"""

from __future__ import annotations

import trl

from zeroinf.integrations.trainer import Trainer


class SFTTrainer(Trainer, trl.SFTTrainer):
    """`trl.SFTTrainer` on a sharded model; takes `trl.SFTConfig` and `zeroinf_config` (trainer.py)."""


class DPOTrainer(Trainer, trl.DPOTrainer):
    """`trl.DPOTrainer` on a sharded model; takes `trl.DPOConfig` and `zeroinf_config` (trainer.py)."""
