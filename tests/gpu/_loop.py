"""The training loop the CUDA tests share: a sharded model on cuda:0, the parity batches moved there."""

from __future__ import annotations

from typing import Any

import torch

import zeroinf
from tests._parity import global_batch


def train_then_close(model: torch.nn.Module, opt: Any, steps: int,
                     device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """`steps` optimizer steps; the losses and the fp32 weights on the CPU, then the optimizer and
    engine closed (their swap files and threads released before the next placement)."""
    losses = []
    for step in range(steps):
        x, y = (t.to(device) for t in global_batch(step))
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: t.detach().float().cpu() for n, t in model.state_dict().items()}
    opt.close()
    zeroinf.engine_of(model).close()
    return losses, weights
