"""The methods `zeroinf.shard` gives the sharded module in place of nn.Module's and Hugging Face's own,
which read the parameters where a sharded model keeps none (installed as instance attributes, as
runtime/sync_switch.py installs DDP's and FSDP2's switches).

- `zero_grad`: discards the gradients the engine holds (nn.Module's only cleared `p.grad`).
- `num_parameters` (a Hugging Face model's): each parameter at its full size, not its placeholder's.
"""

from __future__ import annotations

import types

from torch import nn

from zeroinf.partition.unit import full_numel


def install(module: nn.Module) -> None:
    module.__dict__["zero_grad"] = types.MethodType(_zero_grad, module)
    if callable(getattr(module, "num_parameters", None)):  # a Hugging Face model's: placeholders count 0
        module.__dict__["num_parameters"] = types.MethodType(_num_parameters, module)


def _num_parameters(module: nn.Module, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
    """Hugging Face's `model.num_parameters()` on a sharded model: the elements each parameter has in
    the model, where the method itself counted a stage-3 placeholder's none (a 112,448-parameter
    Llama reported 38,464, its resident parts; the plain Trainer's `total_flos` comes from this
    count). The same arguments and exclusions as Hugging Face's."""
    embeddings = (
        {f"{name}.weight" for name, sub in module.named_modules() if isinstance(sub, nn.Embedding)}
        if exclude_embeddings else set()
    )
    return sum(
        full_numel(p) for name, p in module.named_parameters()
        if name not in embeddings and (p.requires_grad or not only_trainable)
    )


def _zero_grad(module: nn.Module, set_to_none: bool = True) -> None:
    """`model.zero_grad()` on a sharded model discards the gradients the engine holds, as it does in
    PyTorch: nn.Module's own only cleared `p.grad`, where the engine keeps none, so the backward
    passes since the last step stayed counted and added (a DCGAN loop's `netD.zero_grad()`, after the
    generator's backward ran through the discriminator, then stopped at the next backward with
    "backward pass 2 since the last optimizer step"). Through the optimizer where there is one: it
    refuses where a backward already stepped units inside it."""
    from zeroinf.engine import engine_of  # it installs these methods: imported here

    engine = engine_of(module)
    optimizer = engine.optimizer_ref() if engine.optimizer_ref is not None else None
    if optimizer is not None:
        optimizer.discard_gradients("model.zero_grad()")
    else:
        engine.zero_grad()
