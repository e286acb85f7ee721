"""Models for the construction tests: each built by a seeded function, so eager and `zeroinf.init`
builds draw the same random numbers.

`Custom` holds what a `reset_parameters`-only materialization gets wrong: a `torch.ones` norm
weight, a `randn` drawn in `__init__` (no `reset_parameters`), buffers computed in `__init__`
(persistent and not), and a parent that rescales its children's weights after building them
(a read-modify-write of parameters that are parked by then).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB = 64


class CustomBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm_weight = nn.Parameter(torch.ones(d))
        self.proj = nn.Linear(d, d)
        self.mix = nn.Parameter(torch.randn(d, d) * 0.02)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        angle = torch.cat([self.inv_freq, self.inv_freq])
        return x + self.proj(h) @ self.mix + 0.01 * torch.sin(angle)


class Custom(nn.Module):
    def __init__(self, d: int = 16, n_blocks: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([CustomBlock(d) for _ in range(n_blocks)])
        self.scale = nn.Parameter(torch.randn(d) * 0.1 + 1)
        self.register_buffer("positions", torch.arange(8).float() / 8)
        self.register_buffer("table", torch.outer(torch.arange(4.0), torch.arange(d / 1.0)).sin(), persistent=False)
        with torch.no_grad():  # a parent touching its children's (by now parked) weights
            for block in self.blocks:
                block.proj.weight.mul_(0.5)
        self.head = nn.Linear(d, VOCAB, bias=False)
        # the initialization of Hugging Face v4 and of many remote-code models: through `.data`
        self.emb.weight.data.normal_(mean=0.0, std=0.02)
        self.emb.weight.data[0].zero_()  # a padding row: a write to a part of it
        self.head.weight.data.normal_(mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx) * self.scale + self.positions[: idx.shape[1], None] + self.table[0]
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _hf(arch: str) -> nn.Module:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if arch == "gpt2":
        return GPT2LMHeadModel(
            GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, **common)
        )
    if arch == "llama":
        return LlamaForCausalLM(
            LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=32, **common)
        )
    if arch == "qwen2":
        return Qwen2ForCausalLM(
            Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, **common)
        )
    raise ValueError(arch)


def _gpt() -> nn.Module:
    from zeroinf.models.gpt import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=16, n_layer=3, n_head=2, d_model=32))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt": _gpt,
    "llama": lambda: _hf("llama"),
    "gpt2": lambda: _hf("gpt2"),
    "qwen2": lambda: _hf("qwen2"),
    "custom": Custom,
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name]()
