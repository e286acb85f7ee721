"""Optional dependencies: one clear error naming the extra that provides them.

The engine needs only torch; the Hugging Face paths (`from_pretrained`, `zeroinf finetune`, the
Trainer integration, LoRA through peft) need packages the user of those paths already has, or gets
with `pip install "zeroinf[hf]"`.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, feature: str, extra: str = "hf") -> ModuleType:
    """`import module`, or an ImportError that says which feature needs it and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        raise ImportError(
            f"{feature} needs the '{top}' package, which is not installed: "
            f'pip install "zeroinf[{extra}]" (or pip install {top})'
        ) from err
