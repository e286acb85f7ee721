"""A model that exercises what stage 3 must handle in models we did not write.

- a parameter tied across units (block 1's inner Linear weight is also the root's `mix` weight),
- a unit called twice in one forward (block 0),
- one unit's module used inside another unit's forward (block 2 calls block 0's `inner`),
- parameters that get no gradient (an unused branch in every block, a frozen root Linear),
- buffers read in forward, parameters at several depths (block, block.inner, block.inner.norm),
- keyword arguments and dict / tuple outputs.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, D = 64, 32


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)) * self.scale


class ZooBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.gate = nn.Parameter(torch.full((D,), 0.5))
        self.unused = nn.Linear(D, D)  # never called: no gradient, ever
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, D))
        self.peer: Inner | None = None  # another unit's module, set by the model

    def forward(self, x: torch.Tensor, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.inner(x) / temperature) * self.gate + self.shift
        if self.peer is not None:
            h = h + 0.5 * self.peer(h)
        return {"hidden": x + h, "aux": h.pow(2).mean()}


class Zoo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        nn.init.normal_(self.tok.weight, std=0.1)
        self.blocks = nn.ModuleList([ZooBlock() for _ in range(3)])
        self.blocks[2].peer = self.blocks[0].inner
        self.mix = nn.Linear(D, D, bias=False)
        self.mix.weight = self.blocks[1].inner.lin.weight  # tied across units
        self.frozen = nn.Linear(D, D)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(D, VOCAB)

    def features(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx)
        aux = torch.zeros((), device=x.device)
        for i in (0, 0, 1, 2):  # block 0 runs twice
            out = self.blocks[i](x, temperature=2.0 if i else 1.0)
            x, aux = out["hidden"], aux + out["aux"]
        return x, aux

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x, aux = self.features(idx)
        x = x + self.mix(x) * 0.1 + self.frozen(x) * 0.1
        logits = self.head(x).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * aux.float()
