"""A checkpoint of a transformers model consolidated into a folder other tools load as is.

`zeroinf.checkpoint.save` records what it needs (`record`: the model's class, config and generation
config, a few KB of JSON in the manifest); `consolidate` then writes `config.json` (and
`generation_config.json`) beside the weights, so `from_pretrained(out)` needs nothing copied by
hand, and the weights in the Hub's layout, as the model's own `save_pretrained` writes them: its
checkpoint conversions reverted (weights/hf_conversion.py `hub_layout`: Mixtral's fused experts
written one tensor per expert, GPT-NeoX's head as `embed_out`), which vLLM and older transformers
expect. The model is rebuilt on the meta device from the recorded config (no weight memory).

Reverting works on the tensors of one unit at a time. Where it only renames (most tensors) they
are still streamed chunk by chunk; a unit whose tensors it reshapes (fused experts) is read whole,
in the output dtype, then reverted: consolidation then holds one such unit in memory (one
decoder layer's experts). A model class transformers lacks (remote code), or transformers not
installed, gets the model's own layout and a warning; transformers loads that too.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn

from zeroinf.checkpoint.format import write_atomic
from zeroinf.telemetry import get_logger
from zeroinf.weights.hf_conversion import Revert, transformers_model

CONFIG_FILES = {"config": "config.json", "generation_config": "generation_config.json"}


def record(model: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint keeps of `model` to write it back as a Hub folder; None unless it is a
    transformers model (a peft-wrapped one is written under its own names)."""
    hf: Any = transformers_model(model)
    if hf is None:
        return None
    config = json.loads(hf.config.to_json_string(use_diff=False))
    config["architectures"] = [type(hf).__name__]  # as save_pretrained sets it (vLLM picks its class by it)
    out: dict[str, Any] = {"class": type(hf).__name__, "config": config}
    generation = getattr(hf, "generation_config", None)
    if generation is not None and hf.can_generate():
        out["generation_config"] = json.loads(generation.to_json_string(use_diff=False))
    return out


def write_configs(out_dir: str, hf: dict[str, Any], dtype: torch.dtype) -> None:
    """config.json (saying the weights' `dtype`) and generation_config.json, as the model's
    `save_pretrained` writes them."""
    files = {"config": {**hf["config"], "dtype": str(dtype).removeprefix("torch.")}}
    if "generation_config" in hf:
        files["generation_config"] = hf["generation_config"]
    for key, content in files.items():
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        write_atomic(os.path.join(out_dir, CONFIG_FILES[key]), text.encode())


def meta_model(out_dir: str, hf: dict[str, Any]) -> nn.Module | None:
    """The recorded transformers model rebuilt on the meta device from the config `write_configs`
    wrote into `out_dir`; None (with a warning) where transformers or the class is missing."""
    try:
        import transformers
        from transformers.initialization import no_init_weights
    except ImportError:
        get_logger("checkpoint").warning("consolidate: transformers is not installed; writing the model's own layout")
        return None
    cls = getattr(transformers, hf["class"], None)
    if cls is None:
        get_logger("checkpoint").warning(
            f"consolidate: transformers has no class {hf['class']!r} (remote code?); writing the model's own layout"
        )
        return None
    config = transformers.AutoConfig.from_pretrained(out_dir)  # decodes what to_json_string encoded
    with torch.device("meta"), no_init_weights():
        model: nn.Module = cls(config)
    return model


def written_by_group(
    revert: Revert, groups: list[dict[str, torch.Tensor]]
) -> list[tuple[dict[str, torch.Tensor], dict[str, str] | None]]:
    """For each group: the tensors written (name -> meta tensor, in order) and, where reverting
    only renames, each written name's source name (the values stream as they are); else None
    (the group's values are read whole and reverted)."""
    out: list[tuple[dict[str, torch.Tensor], dict[str, str] | None]] = []
    for group in groups:
        written = revert(group) if group else {}
        out.append((written, _renamed_from(revert, group, written)))
    return out


def _renamed_from(
    revert: Revert, group: dict[str, torch.Tensor], written: dict[str, torch.Tensor]
) -> dict[str, str] | None:
    """Each written name's source name where reverting `group` only renames its tensors, else None."""
    sources: dict[str, str] = {}
    for name, t in group.items():
        try:
            alone = list(revert({name: t}).items())
        except Exception:  # an operation that needs the other tensors of its conversion
            return None
        if len(alone) != 1 or alone[0][0] not in written or any(
            (u.shape, u.dtype) != (t.shape, t.dtype) for u in (alone[0][1], written[alone[0][0]])
        ):
            return None
        sources[alone[0][0]] = name
    return sources if sources.keys() == written.keys() else None
