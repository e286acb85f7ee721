"""The built-in Llama-family decoder (no transformers import) has transformers' units and parameter
count, and a forward close to transformers' (saved activations, matmul FLOPs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroinf.planner import decoder
from zeroinf.planner.model_facts import from_hf, from_module, hf_inputs

BASE = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**BASE, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "llama-bias-tied": {**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
                        "tie_word_embeddings": True},
    "mistral": {**BASE, "model_type": "mistral", "sliding_window": 128},
    "qwen2": {**BASE, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**BASE, "model_type": "qwen3", "head_dim": 32},
    "qwen3-default-head-dim": {**BASE, "model_type": "qwen3"},
}


def hf_facts(data: dict[str, Any]) -> Any:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**data))
    return from_module(model, hf_inputs)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_same_units_and_parameters_as_transformers(name: str, tmp_path: Path) -> None:
    data = CONFIGS[name]
    assert decoder.supports(data)
    (tmp_path / "config.json").write_text(json.dumps(data))
    ours = from_hf(tmp_path)
    theirs = hf_facts(data)
    assert ours.units == theirs.units
    assert ours.param_count == theirs.param_count
    mine = ours.pass_facts(2, 64, "fp32", torch.device("cpu"))
    ref = theirs.pass_facts(2, 64, "fp32", torch.device("cpu"))
    assert mine is not None and ref is not None
    assert mine.matmul_flops == pytest.approx(ref.matmul_flops, rel=0.02)
    assert mine.saved_bytes == pytest.approx(ref.saved_bytes, rel=0.02)


@pytest.mark.parametrize(
    "data",
    [
        {**BASE, "model_type": "mixtral", "num_local_experts": 8},
        {**BASE, "model_type": "llama", "num_experts": 4},
        {**BASE, "model_type": "gpt2"},
        {**BASE, "model_type": "qwen2", "layer_types": ["full_attention", "sliding_attention"]},
        {"model_type": "llama"},
    ],
)
def test_other_configs_go_through_transformers(data: dict[str, Any]) -> None:
    assert not decoder.supports(data)
