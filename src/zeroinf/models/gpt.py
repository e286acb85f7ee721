"""A GPT-style decoder: the demo model of `zeroinf train`, the tests and the benchmarks.

Byte-level by default (`vocab_size` 256). Pre-LayerNorm blocks of causal self-attention
(`F.scaled_dot_product_attention`) and a GELU MLP, a learned position embedding, a final LayerNorm
and an output head that is the token embedding itself when `tie_embeddings` is set.

The repeated `Block`s sit in `GPT.blocks`, an `nn.ModuleList`: the engine discovers each of them as
one unit; the embeddings, the final LayerNorm and the head form the root unit.

[Note: tied head] A tied head is not a second module sharing the embedding's Parameter; the logits
are `F.linear(h, tok_emb.weight)`. The weight is registered exactly once, so a flat buffer never
holds it twice and nothing needs to re-tie views after the engine repoints parameters.

[Note: CPU attention dtype] On the CPU, PyTorch's bf16 flash-attention backward is about twice as
slow as its fp32 one (measured on a 2-core AMX Xeon, torch 2.13: the whole step of the default
`zeroinf train` model ran 25% faster with attention in fp32). So on the CPU, q, k and v are upcast
for the attention alone; on accelerators attention runs in the parameter dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeroinf.planner.model_facts import device_type_of

EMBEDDING_INIT_STD = 0.02


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT; `GPTConfig.preset("small", n_layer=8)` starts from a named preset."""

    vocab_size: int = 256
    """Number of token ids; 256 for the byte-level demo corpus."""
    seq_len: int = 256
    """Longest sequence the position embedding covers (the context length), in tokens."""
    n_layer: int = 4
    """Number of transformer blocks (each one is a unit of the engine)."""
    n_head: int = 4
    """Attention heads per block; must divide `d_model`."""
    d_model: int = 256
    """Width of the residual stream."""
    d_ff: int | None = None
    """Hidden width of the MLP; None means `mlp_ratio * d_model`."""
    mlp_ratio: int = 4
    """MLP width as a multiple of `d_model`, used when `d_ff` is None."""
    dropout: float = 0.0
    """Dropout probability on attention weights and residual branches (0 disables it)."""
    tie_embeddings: bool = True
    """Use the token embedding as the output head (saves `vocab_size * d_model` parameters)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} = {value!r} is invalid: use a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model = {self.d_model} is invalid: it must divide by n_head = {self.n_head}")
        if self.d_ff is None:
            object.__setattr__(self, "d_ff", self.mlp_ratio * self.d_model)
        elif isinstance(self.d_ff, bool) or not isinstance(self.d_ff, int) or self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff = {self.d_ff!r} is invalid: use a positive integer or None")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout = {self.dropout!r} is invalid: use a number in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def param_count(self) -> int:
        """Number of parameters of `GPT(self)` (tied weights counted once)."""
        d, f = self.d_model, self.d_ff
        assert f is not None
        per_block = (
            2 * 2 * d  # two LayerNorms
            + d * 3 * d
            + 3 * d  # qkv projection
            + d * d
            + d  # attention output projection
            + d * f
            + f
            + f * d
            + d  # MLP
        )
        embeddings = self.vocab_size * d + self.seq_len * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return embeddings + self.n_layer * per_block + 2 * d + head

    @classmethod
    def preset(cls, name: str, **overrides: object) -> GPTConfig:
        """A named preset (see `PRESETS`), with fields replaced by `overrides` (None values ignored)."""
        if name not in PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}: use one of {sorted(PRESETS)}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        return dataclasses.replace(PRESETS[name], **changes)  # type: ignore[arg-type]


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(seq_len=128, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(seq_len=256, n_layer=4, n_head=4, d_model=256),
    "125m": GPTConfig(seq_len=1024, n_layer=18, n_head=12, d_model=768),
    "350m": GPTConfig(seq_len=1024, n_layer=28, n_head=16, d_model=1024),
    "1.3b": GPTConfig(seq_len=2048, n_layer=26, n_head=32, d_model=2048),
}
"""Named sizes: `tiny` for tests, `small` for the default run of `zeroinf train`, and models of about
the named parameter count (a 256-byte vocabulary has almost no embedding parameters, so these are a
few layers deeper than the GPT-3 models of the same name)."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through `F.scaled_dot_product_attention`."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [batch, time, width] -> [batch, head, time, head_dim]
        q, k, v = (t.view(batch, time, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        upcast = device_type_of(x) == "cpu" and x.dtype != torch.float32  # [Note: CPU attention dtype]
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(batch, time, width).to(x.dtype)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """Two Linears around a GELU."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        assert cfg.d_ff is not None
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block; the engine's unit of gathering."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """A decoder-only transformer; `forward(idx, targets)` returns the mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_final = nn.LayerNorm(cfg.d_model)
        # See [Note: tied head]: a tied model has no head module at all.
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialize: each layer's own `reset_parameters`, then N(0, 0.02) for the embeddings.

        Deterministic given the torch seed. The small embedding init keeps the first loss near
        ln(vocab_size) when the head is tied (PyTorch's N(0, 1) would make the first logits huge).
        """
        for module in self.modules():
            reset = getattr(module, "reset_parameters", None)
            if module is not self and reset is not None:
                reset()
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=EMBEDDING_INIT_STD)
        nn.init.normal_(self.pos_emb.weight, mean=0.0, std=EMBEDDING_INIT_STD)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, time, vocab] for token ids `idx` [batch, time]; the scalar fp32 mean
        cross-entropy (nats per token) instead when `targets` [batch, time] are given."""
        time = idx.shape[1]
        if time > self.cfg.seq_len:
            raise ValueError(f"sequence of {time} tokens is longer than the model's seq_len {self.cfg.seq_len}")
        positions = torch.arange(time, device=idx.device)
        x = self.dropout(self.tok_emb(idx) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x)
        logits = self.head(x) if self.head is not None else F.linear(x, self.tok_emb.weight)
        if targets is None:
            return logits
        # The loss in fp32 whatever the parameter dtype: log-softmax over 256+ classes in bf16/fp16 is lossy.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        """Parameters of this module, each shared tensor counted once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Approximate training FLOPs per token: 6 per weight plus the attention scores (PaLM appendix B)."""
        cfg = self.cfg
        weights = self.num_params() - cfg.seq_len * cfg.d_model
        attention = 12 * cfg.n_layer * cfg.d_model * cfg.seq_len
        return 6 * weights + attention
