"""The global gradient norm over shards, exact across ranks, and the clip coefficient.

Each rank sums the squares of the gradient range it owns (padding holds zeros); one all-reduce
adds them when the ranges are shards. A non-finite norm means some gradient overflowed somewhere,
so the same reduction serves the fp16 overflow check.

[Note: one norm wherever the gradients are]
The clip coefficient is max_norm / norm, so a norm one ulp off scales every gradient differently
and the runs part ways for good. Gradient shards written to NVMe keep their squared norm from write
time; those used to be summed in double (Python floats) and added before the in-memory units'
squares, summed in fp32: the same gradients gave a norm differing in its last bit depending on where
they were. That broke placement invariance with `offload.gradients = "nvme"` and clipping (a 1000-step
bf16 soak, resumed at step 500, left the straight run: the resumed first step kept its gradients in
memory where the straight run had them on disk). Now each unit's square is the same fp32 value
either way and all are added in fp32 in unit order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zeroinf.comm import all_reduce
from zeroinf.topology import Topology

CLIP_EPS = 1e-6  # the same epsilon as torch.nn.utils.clip_grad_norm_


def global_grad_norm(
    owned_grads: Sequence[torch.Tensor | float], topo: Topology, sharded: bool
) -> torch.Tensor:
    """L2 norm of all gradients, as an fp32 scalar tensor; `sharded` says the ranges differ per rank.

    `owned_grads` holds, per unit in unit order, its owned gradient or, for a shard already written
    to NVMe, the squared norm kept at write time (the fp32 value of the same expression). Either way
    the squares are added in fp32 in unit order ([Note: one norm wherever the gradients are])."""
    device = next((g.device for g in owned_grads if isinstance(g, torch.Tensor)), topo.device)
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in owned_grads:
        if isinstance(g, torch.Tensor):
            sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        else:
            sq += g  # an fp32 value: exact as a Python float, and added in fp32
    if sharded:
        if sq.device != topo.device:  # host shards under NCCL: the collective runs on the device
            sq = sq.to(topo.device)
        all_reduce(sq, topo, async_op=False, what="the gradient norm")
    return sq.sqrt()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor torch.nn.utils.clip_grad_norm_ applies: max_norm / (norm + eps), at most 1, computed
    as torch computes it, in fp32 (a Python float holds it exactly, and multiplying an fp32 gradient
    by it is torch's multiply). In double it was often one fp32 ulp off torch's for the same norm;
    Adam turns gradients that are numerical noise around zero (the query and key of attention over
    one position, weights a later normalization makes scale-free) into steps of about lr whose signs
    follow those last bits, so two such coefficients left the same model 1e-3 apart after four steps,
    in plain PyTorch too."""
    norm = torch.tensor(total_norm, dtype=torch.float32)
    return float(torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))
