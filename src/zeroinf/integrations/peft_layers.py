"""PEFT's tuner layers on a sharded model: merges run on gathered parameters; AdaLoRA is refused.

[Note: merge_and_unload at stage 3]
PEFT merges an adapter by writing its base layer's weight in place (`base_layer.weight.data +=
delta`, LoRA; IA3, LoHa, LoKr, OFT, ... alike), reading the adapter's parameters. At stage 3 both
are empty placeholders between uses: the delta came out as an empty product and the write changed
nothing, so `model.merge_and_unload()` returned the base without the adapters, silently (a trained
LoRA's logits 0.15 off the unmerged model's; under DeepSpeed's ZeRO-3 peft does the same). So at
`shard` every tuner layer of a peft model gets a `merge` and an `unmerge` of its own (instance
attributes over the class's methods) that run the layer's code inside `zeroinf.gathered(layer
params, modify=True)`: its unit is gathered, the write lands in every rank's shard and tier, and
the unit is sharded again, one layer at a time. Inside a block that already gathers them for
writing, those are left to it (it commits them). `merge_adapter`, `unmerge_adapter`,
`merge_and_unload` and the `with model.disable_adapter()` paths all go through these two methods.
A collective, as `gathered` is: every rank merges, as every rank runs the same code.

[Note: AdaLoRA]
AdaLoRA's rank allocation (`update_and_allocate`, called every step between the backward and
`zero_grad`) reads each adapter parameter's `p.grad` and masks the singular values in place. The
engine keeps gradients in its own buffers, reduced and sharded, never in `p.grad` (DeepSpeed's
ZeRO does too; peft reads them there through `deepspeed.utils.safe_get_full_grad`), so the
allocation failed in peft's code (`Parameter * NoneType`) at stages 0-2 and, at stage 3, the
orthogonality penalty it adds to the loss reads the adapters outside their units' forward. Refused
at `shard` with the alternatives named; every other peft method trains at parity (docs/finetune.md).
Prefix tuning with activation checkpointing is refused there too, as peft refuses it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from torch import nn

from zeroinf.engine import owning_engine


def is_peft_model(model: nn.Module) -> bool:
    """A peft model (`PeftModel`): saved as its adapters, as peft and the Trainer save it."""
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def adapter_configs(model: nn.Module) -> dict[str, Any]:
    """A peft model's adapter configs by adapter name; empty for any other model."""
    configs = getattr(model, "peft_config", None) if is_peft_model(model) else None
    return dict(configs) if isinstance(configs, dict) else {}


def adapter_type(config: Any) -> str:
    """An adapter config's peft type: "LORA", "ADALORA", ..."""
    return str(getattr(config, "peft_type", "")).rsplit(".", 1)[-1]


def tuner_layers(model: nn.Module) -> list[Any]:
    """The modules of `model` that are peft tuner layers (`BaseTunerLayer`s; none where peft was
    never imported)."""
    if "peft" not in sys.modules:  # a model with adapters imported peft to get them
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class MergeHandle:
    """Removes a layer's gathered `merge`/`unmerge` (the engine's handles are removed on close)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    def remove(self) -> None:
        for name in ("merge", "unmerge"):
            self.layer.__dict__.pop(name, None)


def refuse_unsupported_adapters(model: nn.Module, checkpointing: bool) -> None:
    """Raise if `model` is a peft model training an adapter the engine cannot train: AdaLoRA ([Note:
    AdaLoRA]); prefix tuning with activation checkpointing, which peft refuses with transformers'
    checkpointing too (the recompute appends the prefix's key/value cache a second time: "The size of
    tensor a (28) must match the size of tensor b (16)")."""
    for name, config in adapter_configs(model).items():
        kind = adapter_type(config)
        if getattr(config, "inference_mode", False):
            continue
        if kind == "ADALORA":
            raise NotImplementedError(
                f"zeroinf.shard: adapter {name!r} is AdaLoRA, whose rank allocation (update_and_allocate) reads "
                "every adapter parameter's p.grad after backward and masks it in place; zeroinf keeps gradients "
                "sharded in its own buffers, never in p.grad. Use LoRA (use_rslora=True or use_dora=True for "
                "its variants) or another peft method (all others train as in plain PyTorch)"
            )
        if kind == "PREFIX_TUNING" and checkpointing:
            raise NotImplementedError(
                f"zeroinf.shard: adapter {name!r} is prefix tuning, which does not work with activation checkpointing "
                "(the recompute appends the prefix's key/value cache a second time; peft refuses it with "
                "transformers' checkpointing too): set Config(activation_checkpointing=False), or use prompt "
                "tuning or LoRA"
            )


def install_gathered_merges(model: nn.Module) -> list[MergeHandle]:
    """Give every tuner layer of `model` a `merge` and `unmerge` that run gathered ([Note:
    merge_and_unload at stage 3])."""
    handles = []
    for layer in tuner_layers(model):
        for name in ("merge", "unmerge"):
            method = getattr(type(layer), name, None)
            if method is not None:
                layer.__dict__[name] = functools.partial(_gathered_call, layer, method)
        handles.append(MergeHandle(layer))
    return handles


def _gathered_call(layer: nn.Module, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from zeroinf.partition.gathered import gathered

    params = [p for p in layer.parameters() if not _written_by_an_enclosing_block(p)]
    with gathered(params, modify=True):
        return method(layer, *args, **kwargs)


def _written_by_an_enclosing_block(p: nn.Parameter) -> bool:
    found = owning_engine(p)
    return found is not None and found[0].all_units[found[1]].user_writer
