"""`zeroinf.save_pretrained`: a sharded model saved as a Hugging Face folder, one unit in memory.

    zeroinf.save_pretrained(model, "out")        # every rank calls it; rank 0 writes
    AutoModelForCausalLM.from_pretrained("out")  # or, for a peft model: PeftModel.from_pretrained(base, "out")

Hugging Face's own `model.save_pretrained(out)` works on a sharded model too, but it takes
`model.state_dict()`, which at stage 3 gathers the whole model into memory on every rank (each
unit all-gathered and copied), and every rank writes the same files. Here:
- a model (a transformers model, or any module): its weights stream out unit by unit through
  `save_pretrained_weights` (weights/export.py), so memory holds one unit; rank 0 writes them and,
  where the model has them, its `config` and `generation_config`; a transformers model's weights are
  written in the layout its own `save_pretrained` writes (fused MoE experts one tensor each, as on
  the Hub: weights/hf_conversion.py `hub_layout`);
- a peft model: what `PeftModel.save_pretrained` writes (the adapters and their config), gathered
  from the trainable units only: the frozen base is never gathered;
- a part of a sharded model, such as the base `merged = model.merge_and_unload()` returns (the
  merges ran gathered: integrations/peft_layers.py): its own weights under its own names.
A collective: every rank calls it, and it returns once the folder is complete.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zeroinf.engine import engine_containing
from zeroinf.integrations.peft_layers import is_peft_model, tuner_layers
from zeroinf.partition.gathered import gathered
from zeroinf.weights.export import save_pretrained_weights
from zeroinf.weights.hf_conversion import transformers_model


def save_pretrained(
    model: nn.Module, out_dir: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 10**9, on_each_node: bool = False,
) -> None:
    """Write sharded `model` as a Hugging Face folder (module docstring). `dtype`: of the floating
    weights written (default: the compute dtype); `max_shard_bytes`: split the weights into files of
    at most this size, with an index, as `save_pretrained` does. `on_each_node`: the first rank of
    each machine writes the folder to its own disk, not rank 0 alone (machines without a shared file
    system; the Trainer's `save_on_each_node`)."""
    engine = engine_containing(model)
    if engine is None:
        raise TypeError("zeroinf.save_pretrained: this module is not part of a sharded model: call zeroinf.shard first")
    out = os.fspath(out_dir)
    writer = engine.topo.leads
    if on_each_node:
        from zeroinf.checkpoint.common import node_leaders

        writer = node_leaders(engine)[1][engine.topo.rank] == engine.topo.rank
    if engine.module is model and is_peft_model(model):
        _save_adapters(model, out, dtype, writer)
    else:
        if engine.module is not model and tuner_layers(model):
            raise ValueError(
                "zeroinf.save_pretrained: this part of a sharded peft model still holds adapter layers; merge them "
                "first (`merged = model.merge_and_unload()`, then save `merged`), or save the peft model itself "
                "for its adapters"
            )
        save_pretrained_weights(
            model, out, dtype=dtype, max_shard_bytes=max_shard_bytes, hub_layout_of=transformers_model(model),
            engine=engine, write=writer,
        )
        if writer:
            write_configs(model, out)
    if engine.topo.is_distributed:
        torch.distributed.barrier(group=engine.topo.group)


def write_configs(model: nn.Module, out: str) -> None:
    """A transformers model's `config` and `generation_config` beside its weights (if it has them);
    the config names the model's class in `architectures`, as transformers' `save_pretrained` sets
    it (vLLM picks its model class by it; a model built from a config had none)."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "architectures") and hasattr(model, "can_generate"):
        config.architectures = [type(model).__name__]
    for attr in ("config", "generation_config"):
        config = getattr(model, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(out)


def _save_adapters(model: Any, out: str, dtype: torch.dtype | None, writer: bool) -> None:
    """`PeftModel.save_pretrained(out)` from the trainable parameters and the persistent buffers
    alone: peft takes what it saves (adapters, `modules_to_save`, VeRA's projections) from the state
    dict it is given, under the names `state_dict()` gives: every path to a tensor that several
    layers share (VB-LoRA's vector bank, VeRA's projections; peft saves the model-level one)."""
    # every rank gathers (a collective); the writer (rank 0, or each machine's first) copies and writes
    trainable = [(name, p) for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad]
    unique = list({id(p): p for _, p in trainable}.values())
    with gathered(unique):
        values = {id(p): p.detach().to("cpu", dtype=dtype, copy=True) for p in unique} if writer else {}
    if not writer:
        return
    state = {name: values[id(p)] for name, p in trainable}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                as_dtype = dtype if dtype is not None and b.is_floating_point() else b.dtype
                state[f"{path}.{name}" if path else name] = b.detach().to("cpu", dtype=as_dtype, copy=True)
    model.save_pretrained(out, state_dict=state)
