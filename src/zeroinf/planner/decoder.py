"""A Llama-family decoder built from a Hugging Face config.json without importing transformers.

`zeroinf plan --hf` must answer in seconds; importing transformers and its model code takes longer
than everything else the plan does. For the common dense decoders (model_type llama, mistral,
qwen2, qwen3) this module builds a model with the same parameter names and shapes as
`AutoModelForCausalLM.from_config` (embed_tokens, layers.N.self_attn.{q,k,v,o}_proj, mlp.{gate,up,
down}_proj, the RMSNorms, lm_head, tied or not), on the meta device, and a forward of the same
structure (RMSNorm, rotary embedding, grouped-query SDPA, SwiGLU, cross-entropy) for the meta-tensor
pass. Any other config (or one with keys this module does not know to be harmless, such as experts)
goes through transformers. tests/planner/test_decoder.py checks units and parameter counts against
transformers for each type.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

TYPES = {"llama", "mistral", "qwen2", "qwen3"}
STRUCTURAL = {  # keys that change the model's structure; their presence sends the config to transformers
    "num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok",
    "hybrid_override_pattern", "block_types", "cross_attention_layers", "vision_config", "text_config",
    "use_sliding_window_per_layer", "no_rope_layers",
}


REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def supports(data: dict[str, Any]) -> bool:
    """Whether `data` (a config.json) describes a model this module builds exactly."""
    if data.get("model_type") not in TYPES or STRUCTURAL & set(data) or any(k not in data for k in REQUIRED):
        return False
    layer_types = data.get("layer_types")
    return layer_types is None or len(set(layer_types)) <= 1


class _Linear(nn.Linear):
    """An `nn.Linear` on the meta device without init (the planner reads shapes only; `reset_parameters`
    and `skip_init` cost seconds of first-use imports). Split from the root like transformers' lm_head."""

    zeroinf_splittable = True

    def __init__(self, inputs: int, outputs: int, bias: bool = True) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = inputs, outputs
        self.weight = nn.Parameter(torch.empty(outputs, inputs, device="meta"))
        if bias:
            self.bias = nn.Parameter(torch.empty(outputs, device="meta"))
        else:
            self.register_parameter("bias", None)  # as nn.Linear does


def _linear(inputs: int, outputs: int, bias: bool = True) -> nn.Linear:
    return _Linear(inputs, outputs, bias)


def head_dim(c: dict[str, Any]) -> int:
    """As the transformers configs default it (Qwen3: 128; the others: hidden / heads)."""
    if c.get("head_dim"):
        return int(c["head_dim"])
    return 128 if c["model_type"] == "qwen3" else c["hidden_size"] // c["num_attention_heads"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: dict[str, Any], qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        self.heads, self.kv_heads = heads, c.get("num_key_value_heads") or heads
        self.head_dim = head_dim(c)
        out_bias = bool(c.get("attention_bias", False)) and c["model_type"] not in ("qwen2",)
        self.q_proj = _linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = _linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = _linear(hidden, self.kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = _linear(heads * self.head_dim, hidden, bias=out_bias)
        eps = c.get("rms_norm_eps", 1e-6)
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        hidden, inner, bias = c["hidden_size"], c["intermediate_size"], bool(c.get("mlp_bias", False))
        self.gate_proj = _linear(hidden, inner, bias=bias)
        self.up_proj = _linear(hidden, inner, bias=bias)
        self.down_proj = _linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        kind = c["model_type"]
        qkv_bias = kind == "qwen2" or bool(c.get("attention_bias", False))
        self.self_attn = Attention(c, qkv_bias, qk_norm=kind == "qwen3")
        self.mlp = MLP(c)
        eps = c.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(c["hidden_size"], eps)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c: dict[str, Any]) -> None:
        super().__init__()
        # Meta tensors without init: `normal_` on the meta device would import torch._dynamo (2 s).
        self.embed_tokens = nn.Embedding(
            c["vocab_size"], c["hidden_size"], _weight=torch.empty(c["vocab_size"], c["hidden_size"], device="meta")
        )
        self.layers = nn.ModuleList([Layer(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c.get("rms_norm_eps", 1e-6))


class Decoder(nn.Module):
    """`XForCausalLM` of a Llama-family config: the same parameter names and shapes, on the meta device."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.lm_head = _linear(config["hidden_size"], config["vocab_size"], bias=False)
        if config.get("tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head_dim = head_dim(config)
        self.rope_theta = float(config.get("rope_theta", 10000.0))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        inv = 1.0 / self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=x.device).float() / self.head_dim)
        freqs = torch.outer(torch.arange(t, device=x.device).float(), inv)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.model.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
