"""`zeroinf.from_pretrained`: a sharded Hugging Face model from a local folder, never whole in memory.

    model = zeroinf.from_pretrained("path/to/llama", cfg)                   # stage 3, say params on NVMe
    model = zeroinf.from_pretrained(path, cfg, prepare=lambda m: get_peft_model(m, lora))   # LoRA

1. The folder is checked (config.json, the safetensors files and their headers: a missing shard or a
   truncated file is refused before anything is built).
2. The model is built from its config under `zeroinf.init(cfg, defer_values=True)`: every module's
   own code runs (buffers such as rotary tables are computed as Hugging Face computes them), but
   each parameter becomes a meta placeholder as soon as it is registered, so no memory is touched
   and no random numbers are drawn for weights that the files will replace.
3. `prepare(model)` runs inside the same construction context with values switched back on: new
   parameters (LoRA adapters) are built and initialized for real, and code that asks a base
   weight's device gets the real one. A base weight that `prepare` reads is read whole from the
   files then (`resize_token_embeddings` copies the old rows and averages them): it is held like a
   built parameter from there on, and shard does not read it again.
4. Every other stored key is matched to a parameter (by the names it had before `prepare`) and checked,
   through transformers' checkpoint conversions where the model's names and layout differ from the
   files' (renamed keys; experts stored one tensor each but fused in the model, read by ranges all
   the same: weights/hf_conversion.py).
5. `zeroinf.shard(model, cfg, weights=...)` builds unit by unit: each rank reads only the byte
   ranges of its own shards, straight into the shard's tier; fp32 masters are read from the files
   (exact fp32 whatever the compute dtype) when an optimizer takes them. Host memory stays about one
   unit's shard. Persistent buffers are read whole.

The weights equal `AutoModelForCausalLM.from_pretrained(path)`'s, converted to `cfg.param_dtype`
(tied embeddings stay tied; the model is returned in eval mode, as Hugging Face returns it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from zeroinf.config import Config
from zeroinf.engine import shard
from zeroinf.optional import require
from zeroinf.partition.init import init
from zeroinf.topology import Topology, default_topology
from zeroinf.weights.hf_conversion import key_by_model
from zeroinf.weights.safetensors_folder import SafetensorsFolder, WeightsError
from zeroinf.weights.source import CheckpointWeights, persistent_buffers

Prepare = Callable[[nn.Module], nn.Module]

_LOCAL = "a local folder is read: download the model first (`hf download ORG/NAME --local-dir DIR`)"
_PLACED = "zeroinf places every shard itself: choose tiers with Config(offload=OffloadConfig(...)) or offload='auto'"
LOADING_ONLY_KWARGS = {
    # transformers' from_pretrained arguments that from_config does not take (it stopped with "__init__() got an
    # unexpected keyword argument"), and what does their job here
    "quantization_config": (
        "quantized bases (bitsandbytes QLoRA, GPTQ, AWQ) are not supported: zeroinf keeps the base in the compute "
        "dtype and shards and offloads it instead (Config(param_dtype='bf16', offload=OffloadConfig(params='nvme', "
        "nvme_dir=...))): LoRA on a base larger than memory, at 2 bytes per base parameter on the disk"
    ),
    "load_in_4bit": "see quantization_config", "load_in_8bit": "see quantization_config",
    "device_map": _PLACED, "max_memory": _PLACED, "offload_folder": _PLACED, "offload_state_dict": _PLACED,
    "offload_buffers": _PLACED,
    "low_cpu_mem_usage": "always so here: each rank reads only its own shards' bytes",
    "revision": _LOCAL, "cache_dir": _LOCAL, "token": _LOCAL, "subfolder": _LOCAL, "local_files_only": _LOCAL,
    "force_download": _LOCAL, "proxies": _LOCAL,
    "variant": "the folder's model.safetensors (or its index) is read; point at a folder holding the variant's files",
    "use_safetensors": "safetensors files are always what is read",
}


def from_pretrained(
    path: str | os.PathLike[str],
    cfg: Config | Mapping[str, Any] | None = None,
    *,
    prepare: Prepare | None = None,
    topology: Topology | None = None,
    auto_class: Any = None,
    **hf_kwargs: Any,
) -> nn.Module:
    """A sharded model of the Hugging Face folder `path`; see the module docstring.

    `hf_kwargs` go to `from_config` (e.g. `attn_implementation`); arguments only transformers'
    loader takes (`device_map`, `quantization_config`, `revision`, ...) are refused naming what does
    their job here (`LOADING_ONLY_KWARGS`); the compute dtype is
    `cfg.param_dtype` (a `dtype`/`torch_dtype` argument must agree with it). `auto_class` defaults
    to `transformers.AutoModelForCausalLM` where the config has a causal LM, else
    `AutoModelForImageTextToText` (a VLM), else `AutoModel`.
    """
    transformers = require("transformers", "zeroinf.from_pretrained")
    AutoConfig = transformers.AutoConfig
    GenerationConfig = transformers.GenerationConfig

    path = os.fspath(path)
    cfg = Config.of(cfg, "zeroinf.from_pretrained")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise WeightsError(f"{path}: no config.json: not a Hugging Face model folder")
    refused = {k: LOADING_ONLY_KWARGS[k] for k in hf_kwargs if k in LOADING_ONLY_KWARGS}
    if refused:
        raise TypeError(
            "zeroinf.from_pretrained: " + "; ".join(f"{k}= is not taken: {why}" for k, why in refused.items())
        )
    for name in ("dtype", "torch_dtype"):
        asked = hf_kwargs.pop(name, None)
        if asked is not None and asked != "auto" and asked != cfg.param_torch_dtype:
            raise ValueError(
                f"from_pretrained: {name}={asked} but cfg.param_dtype is {cfg.param_dtype}; the compute dtype is "
                "the config's (set Config(param_dtype=...))"
            )
    if cfg.is_auto:  # the placement from the config alone (every parameter trainable: conservative for LoRA)
        from zeroinf.planner.api import resolve_for_ranks
        from zeroinf.planner.model_facts import from_hf

        facts = from_hf(path, auto_class=auto_class)
        cfg, _ = resolve_for_ranks(cfg, facts, topology or default_topology(cfg.collective_timeout_s))
    folder = SafetensorsFolder(path)
    try:
        config = AutoConfig.from_pretrained(path)
        quantized = getattr(config, "quantization_config", None)
        if quantized:
            fields = quantized if isinstance(quantized, dict) else vars(quantized)
            method = fields.get("quant_method", "")
            raise WeightsError(
                f"{path}: a quantized checkpoint (config.json's quantization_config, method {method!r}): its files "
                "hold quantized tensors (packed weights and scales) that zeroinf cannot train or shard. Load the "
                "model's unquantized release (bf16 or fp32 weights); zeroinf shards and offloads it instead"
            )
        if auto_class is None:  # a causal LM where there is one, else a VLM's or the bare model (planner's rule)
            from zeroinf.planner.model_facts import auto_class_for

            auto_class = auto_class_for(config)
        with init(cfg, topology=topology, defer_values=True) as park:
            # in the compute dtype, as transformers' from_pretrained(dtype=...) builds: what `prepare` adds
            # (LoRA adapters, made in their base layer's dtype) is then built as it would be there
            model = auto_class.from_config(config, dtype=cfg.param_torch_dtype, **hf_kwargs)
            names: dict[int, list[str]] = {}
            for name, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), []).append(name)
            buffers = persistent_buffers(model)
            key_by_model(folder, model)  # transformers' renamings and fused experts (weights/hf_conversion.py)
            read_early: dict[int, list[str]] = {}  # parameters `prepare` read: their values are in the park
            if prepare is not None:
                park.defer_values = False  # what `prepare` adds (adapters) is built for real
                park.fill_deferred = functools.partial(_stored_values, folder, names, read_early)
                model = prepare(model)
                park.fill_deferred = None
        weights = CheckpointWeights(
            folder, model, names={pid: ns for pid, ns in names.items() if pid not in read_early}, buffers=buffers,
            read_early={key for keys in read_early.values() for key in keys},
        )
        model = shard(model, cfg, topology=topology, weights=weights)
        weights.load_buffers()
    finally:
        folder.close()
    if os.path.isfile(os.path.join(path, "generation_config.json")) and hasattr(model, "generation_config"):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()
    return model


def _stored_values(
    folder: SafetensorsFolder, names: dict[int, list[str]], read: dict[int, list[str]], p: nn.Parameter
) -> torch.Tensor:
    """A parameter's stored values, read whole because `prepare` reads them (resize_token_embeddings
    copies the old rows); its keys are noted in `read`, so that shard neither reads it again nor
    takes the keys for unexpected ones."""
    keys = [key for key in names.get(id(p), []) if key in folder]
    if not keys:
        raise WeightsError(
            f"prepare= reads a parameter of shape {tuple(p.shape)} that no weights file holds (only parameters "
            "built from the folder's config have stored values)"
        )
    read[id(p)] = keys
    return folder.read(keys[0])
