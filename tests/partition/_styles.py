"""Ways PyTorch code builds parameters and buffers, one small module each, for the construction tests.

Each maps a (batch, D) tensor to another. tests/partition/test_construction_styles.py builds a
model of all of them under `zeroinf.init()` and compares it with eager construction.
"""

from __future__ import annotations

import torch
from torch import nn

D = 24


class _Style(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the one built-in module each style holds
        return torch.tanh(self.inner(x))


class Linear(_Style):  # reset_parameters
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)


class LinearNoBias(_Style):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D, bias=False)


class OnesParameter(nn.Module):  # a norm weight: torch.ones in __init__, no reset_parameters
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class DrawnParameter(nn.Module):  # torch.randn arithmetic in __init__
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D) * 0.1 + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class XavierEmpty(nn.Module):  # torch.empty, then nn.init on the registered parameter
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(D, D))
        nn.init.xavier_uniform_(self.w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w)


class Orthogonal(_Style):  # nn.init.orthogonal_: a QR decomposition of the parameter's values
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)
        nn.init.orthogonal_(self.inner.weight)


class NoGradNormal(nn.Module):  # an in-place draw under no_grad
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(D, D))
        with torch.no_grad():
            self.w.normal_(0, 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + x @ self.w


class DataAssigned(_Style):  # `.data = ` a new tensor
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)
        self.inner.weight.data = torch.randn(D, D) * 0.05


class DataDrawn(_Style):  # in-place through `.data`
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)
        self.inner.weight.data.normal_(0, 0.05)
        self.inner.bias.data.zero_()


class Identity(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


class ComputedBuffers(_Style):  # torch.arange buffers, persistent and not, and one computed from a weight
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(D, D)
        self.register_buffer("scale", torch.arange(D).float() / D + 0.5)
        self.register_buffer("offset", torch.linspace(-1, 1, D), persistent=False)
        self.register_buffer("row_sums", self.inner.weight.detach().sum(1).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale + self.offset + self.row_sums


class ParameterFromParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(D))
        self.b = nn.Parameter(self.a.detach() * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.a + self.b


class Containers(nn.Module):  # ParameterList and ParameterDict
    def __init__(self) -> None:
        super().__init__()
        self.listed = nn.ParameterList([nn.Parameter(torch.randn(D) * 0.1) for _ in range(3)])
        self.named = nn.ParameterDict({"s": nn.Parameter(torch.rand(D)), "t": nn.Parameter(torch.full((D,), 0.25))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for p in self.listed:
            x = x + p
        return x * self.named["s"] + self.named["t"]


class Norms(nn.Module):  # LayerNorm, RMSNorm, BatchNorm1d (running statistics and an int64 counter)
    def __init__(self) -> None:
        super().__init__()
        self.layer, self.rms, self.batch = nn.LayerNorm(D), nn.RMSNorm(D), nn.BatchNorm1d(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.batch(self.rms(self.layer(x)))


class Convolution(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.unsqueeze(1)).mean(1)


class Attention(nn.Module):  # in_proj_weight: torch.empty + its own _reset_parameters
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.unsqueeze(1)
        return x + self.attn(s, s, s, need_weights=False)[0].squeeze(1)


class Recurrent(nn.Module):  # GRU: its _flat_weights list refers to the parameters
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(D, D, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gru(x.unsqueeze(1))[0].squeeze(1)


class WeightNorm(_Style):  # a parametrization: original0/original1, the weight computed from them
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))


class SpectralNorm(_Style):  # a parametrization with power-iteration buffers drawn in __init__
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))


class OwnGenerator(nn.Module):  # a draw from a generator of its own, not the global one
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(D, generator=torch.Generator().manual_seed(7)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w


class Literals(nn.Module):  # torch.tensor from Python values, a 0-d buffer
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.5] * D))
        self.register_buffer("k", torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w * self.k


class Bilinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bilinear = nn.Bilinear(D, D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.bilinear(x, x))


class EmbeddingWithPadding(nn.Module):  # normal_ then the padding row zeroed
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, D, padding_idx=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.emb(torch.arange(x.shape[0]) % 10)


class PReLU(nn.Module):  # torch.full in __init__
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.PReLU(D, init=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x)


STYLES: list[type[nn.Module]] = [
    Linear, LinearNoBias, OnesParameter, DrawnParameter, XavierEmpty, Orthogonal, NoGradNormal, DataAssigned,
    DataDrawn, Identity, ComputedBuffers, ParameterFromParameter, Containers, Norms, Convolution, Attention,
    Recurrent, WeightNorm, SpectralNorm, OwnGenerator, Literals, Bilinear, EmbeddingWithPadding, PReLU,
]


class AllStyles(nn.Module):
    """Every style, then a head tied to the first Linear's weight; afterwards the parent's own code
    halves every `inner` weight through `.data`, as GPT-2's scaled projections are set (on the
    weight-normed Linear that reads its computed weight and changes nothing, as in eager code)."""

    def __init__(self) -> None:
        super().__init__()
        self.styles = nn.ModuleList([style() for style in STYLES])
        self.head = nn.Linear(D, D)
        self.head.weight = self.styles[0].inner.weight
        for name, module in self.named_modules():
            if name.endswith("inner") and isinstance(module, nn.Linear):
                module.weight.data.mul_(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for style in self.styles:
            x = style(x)
        return self.head(x)
