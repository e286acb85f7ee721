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
  from the trainable units only: the frozen base is never gathered.
A collective: every rank calls it, and it returns once the folder is complete.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from zeroinf.engine import engine_of
from zeroinf.partition.gathered import gathered
from zeroinf.weights.export import save_pretrained_weights
from zeroinf.weights.hf_conversion import transformers_model


def save_pretrained(
    model: nn.Module, out_dir: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> None:
    """Write sharded `model` as a Hugging Face folder (module docstring). `dtype`: of the floating
    weights written (default: the compute dtype); `max_shard_bytes`: split the weights into files of
    at most this size, with an index, as `save_pretrained` does."""
    engine = engine_of(model)
    out = os.fspath(out_dir)
    if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
        _save_adapters(model, out, dtype)
    else:
        save_pretrained_weights(
            model, out, dtype=dtype, max_shard_bytes=max_shard_bytes, hub_layout_of=transformers_model(model)
        )
        if engine.topo.rank == 0:
            write_configs(model, out)
    if engine.topo.is_distributed:
        torch.distributed.barrier(group=engine.topo.group)


def write_configs(model: nn.Module, out: str) -> None:
    """A transformers model's `config` and `generation_config` beside its weights (if it has them)."""
    for attr in ("config", "generation_config"):
        config = getattr(model, attr, None)
        if config is not None and callable(getattr(config, "save_pretrained", None)):
            config.save_pretrained(out)


def _save_adapters(model: Any, out: str, dtype: torch.dtype | None) -> None:
    """`PeftModel.save_pretrained(out)` from the trainable parameters alone: peft takes what it saves
    (adapters, `modules_to_save`) from the state dict it is given."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    with gathered([p for _, p in trainable]):
        state = {name: p.detach().to("cpu", dtype=dtype, copy=True) for name, p in trainable}
    if engine_of(model).topo.rank == 0:
        model.save_pretrained(out, state_dict=state)
