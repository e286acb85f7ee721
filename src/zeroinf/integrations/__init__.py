"""Integrations with other libraries; each needs its library only when it is used.

    from zeroinf.integrations import Trainer     # transformers.Trainer on a zeroinf-sharded model (docs/trainer.md)

`import zeroinf.integrations` imports nothing else: transformers and accelerate are loaded on first
use of `Trainer` (`pip install transformers accelerate`, or `pip install zeroinf[hf]`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer", "TrainerArgumentsError", "config_for_trainer"]


def __getattr__(name: str) -> Any:
    if name == "Trainer":
        try:
            from zeroinf.integrations.trainer import Trainer
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(
                f"zeroinf.integrations.Trainer needs transformers and accelerate ({e}): "
                "pip install 'zeroinf[hf]' (or: pip install transformers accelerate)"
            ) from e
        return Trainer
    if name in ("TrainerArgumentsError", "config_for_trainer"):
        from zeroinf.integrations import trainer_args

        return getattr(trainer_args, name)
    raise AttributeError(f"module 'zeroinf.integrations' has no attribute {name!r}")
