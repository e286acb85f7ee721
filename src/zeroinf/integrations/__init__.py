"""Integrations with other libraries; each needs its library only when it is used.

    from zeroinf.integrations import Trainer     # transformers.Trainer on a zeroinf-sharded model (docs/trainer.md)
    from zeroinf.integrations import Seq2SeqTrainer   # the same for transformers.Seq2SeqTrainer
    from zeroinf.integrations import SFTTrainer       # the same for TRL's SFTTrainer (pip install trl)
    from zeroinf.integrations import DPOTrainer       # and TRL's DPOTrainer
    from zeroinf.integrations import sharded_save_state   # accelerate's save_state/load_state, sharded

`import zeroinf.integrations` imports nothing else: transformers and accelerate are loaded on first
use of `Trainer` (`pip install transformers accelerate`, or `pip install zeroinf[hf]`), TRL on first use
of `SFTTrainer` or `DPOTrainer`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DPOTrainer", "SFTTrainer", "Seq2SeqTrainer", "Trainer", "TrainerArgumentsError", "config_for_trainer",
    "sharded_save_state",
]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "Seq2SeqTrainer"):
        try:
            from zeroinf.integrations import trainer
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"zeroinf.integrations.{name} needs transformers and accelerate ({e}): "
                "pip install 'zeroinf[hf]' (or: pip install transformers accelerate)"
            ) from e
        return getattr(trainer, name)
    if name in ("SFTTrainer", "DPOTrainer"):
        try:
            from zeroinf.integrations import trl_trainers
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"zeroinf.integrations.{name} needs TRL ({e}): pip install 'zeroinf[hf]' trl"
            ) from e
        return getattr(trl_trainers, name)
    if name == "sharded_save_state":  # accelerate itself is imported by the caller
        from zeroinf.integrations import accelerate_loop

        return accelerate_loop.sharded_save_state
    if name in ("TrainerArgumentsError", "config_for_trainer"):
        from zeroinf.integrations import trainer_args

        return getattr(trainer_args, name)
    raise AttributeError(f"module 'zeroinf.integrations' has no attribute {name!r}")
