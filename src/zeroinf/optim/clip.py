"""The global gradient norm over shards, exact across ranks, and the clip coefficient.

Each rank sums the squares of the gradient range it owns (padding holds zeros); one all-reduce
adds them when the ranges are shards. A non-finite norm means some gradient overflowed somewhere,
so the same reduction serves the fp16 overflow check.
"""

from __future__ import annotations

import torch

from zeroinf.comm import all_reduce
from zeroinf.topology import Topology

CLIP_EPS = 1e-6  # the same epsilon as torch.nn.utils.clip_grad_norm_


def global_grad_norm(
    owned_grads: list[torch.Tensor], topo: Topology, sharded: bool, extra_sq: float = 0.0
) -> torch.Tensor:
    """L2 norm of all gradients, as an fp32 scalar tensor; `sharded` says the ranges differ per rank.

    `extra_sq` adds squared norms computed earlier (gradient shards already written to NVMe)."""
    device = owned_grads[0].device if owned_grads else topo.device
    sq = torch.full((), extra_sq, dtype=torch.float32, device=device)
    for g in owned_grads:
        sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
    if sharded:
        if sq.device != topo.device:  # host shards under NCCL: the collective runs on the device
            sq = sq.to(topo.device)
        all_reduce(sq, topo, async_op=False)
    return sq.sqrt()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies: max_norm / (norm + eps), at most 1."""
    return min(1.0, max_norm / (total_norm + CLIP_EPS))
