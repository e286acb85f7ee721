"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms") as a plain torch optimizer.

    opt = zeroinf.ShardedOptimizer(zeroinf.Lion, model.parameters(), lr=1e-4, weight_decay=0.1)

Torch has no Lion; DeepSpeed ships one (its config's "Lion": optimizer_from_deepspeed builds this one
over the shards), as do lion-pytorch and bitsandbytes. The update is elementwise with one state
(`exp_avg`), so `zeroinf.ShardedOptimizer` runs it over each rank's piece on any tier:

    c = beta1 * m + (1 - beta1) * g;  p = p * (1 - lr * wd) - lr * sign(c);  m = beta2 * m + (1 - beta2) * g

`sign(0)` is 0, as in the paper and lion-pytorch: a parameter whose gradient and momentum are both
zero (an embedding row no batch used yet) stays where it is. DeepSpeed's kernels take the sign bit
instead (`copysign`) and move it by `lr`; that is the one difference. It works on any torch tensor
and keeps its state in the parameter's dtype; the defaults are the paper's (betas 0.9, 0.99; the
learning rate 3-10x smaller than AdamW's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion's sign update with decoupled weight decay (module docstring)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr > 0.0:
            raise ValueError(f"Lion: lr = {lr} must be positive")
        if not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2:
            raise ValueError(f"Lion: betas = {betas} must be two values in [0, 1)")
        if weight_decay < 0.0:
            raise ValueError(f"Lion: weight_decay = {weight_decay} must not be negative")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), decay = group["lr"], group["betas"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss
