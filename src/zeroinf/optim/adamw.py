"""zeroinf.AdamW and zeroinf.Adam: torch's AdamW and Adam over the shards a rank owns.

Each unit's owned range has an fp32 master copy and two moments (the moments in fp32, or in bf16
with `offload.moment_dtype`: optim/moments.py [Note: bf16 moments]); everything but the update is
optim/sharded.py's. The update is PyTorch's fused AdamW kernel (the memory-bandwidth bound on CPU)
run over views of a sub-group, one call per param group; it runs where the states are: on the
device, or on the CPU for host and nvme states.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.adam import adam as functional_adam
from torch.optim.adamw import adamw as functional_adamw

from zeroinf.memory import Tier
from zeroinf.optim.moments import Bf16MomentStep, Piece, param_key
from zeroinf.optim.pipeline import StateViews, SubGroup
from zeroinf.optim.sharded import GRAD_SCALER, Run, ShardedOptimizerBase
from zeroinf.optim.torch_args import refuse_unsupported

__all__ = ["GRAD_SCALER", "Adam", "AdamW", "Run"]


class AdamW(ShardedOptimizerBase):
    # The update over fp32 masters and moments: torch's AdamW (weight decay applied to the weights);
    # `Adam` below takes torch's Adam (weight decay added to the gradient, L2), same signature.
    _update = staticmethod(functional_adamw)

    def __init__(
        self,
        model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        param_groups: Iterable[dict[str, Any]] | None = None,
        track_grad_norm: bool = False,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        """`model`: the sharded model, or, as `torch.optim.AdamW` takes them, its parameters or param
        groups (`model.parameters()`, nanoGPT's decay/no-decay groups): every trainable parameter of
        one sharded model, frozen ones ignored (optim/torch_args.py [Note: torch.optim.AdamW's arguments]).

        `track_grad_norm`: compute the global gradient norm (`last_grad_norm`) every step, also when
        neither clipping nor fp16 needs it (one more read of each gradient shard and one scalar
        all-reduce a step), as the Hugging Face Trainer logs it (optim/sharded.py [Note: the norm
        without clipping])."""
        refuse_unsupported(
            type(self).__name__,
            amsgrad=amsgrad, maximize=maximize, capturable=capturable, differentiable=differentiable,
        )
        del foreach, fused  # how torch would run the update: zeroinf's own is fused already
        name = type(self).__name__
        if not lr >= 0:
            raise ValueError(f"{name}: lr = {lr!r} is invalid; use a non-negative number")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"{name}: betas = {betas!r} are invalid; use two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"{name}: eps = {eps!r} is invalid; use a positive number")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(model, param_groups, defaults, track_grad_norm)
        # The fused kernel increments the step tensors it is given; these are set to each parameter's
        # count before every call (one tensor per cut: a parameter split over sub-groups is counted once).
        self._step_tensors: dict[tuple[int, int], list[torch.Tensor]] = {}
        # bf16 moments (self.engine.cfg.offload.moment_dtype): the update runs in fp32 windows ([Note: bf16 moments]).
        self._bf16_moments: Bf16MomentStep | None = None
        if self.engine.cfg.offload.moment_dtype == "bf16":
            self._bf16_moments = Bf16MomentStep(
                self.engine.ledger, Tier.DEVICE if self.engine.cfg.offload.optimizer == "device" else Tier.HOST,
                max((sg.numel for sg in self.states.sub_groups), default=1),
            )
            self._param_keys = [[param_key(name) for name in unit.param_names] for unit in self.engine.units]

    def _update_sub_group(
        self, sg: SubGroup, views: StateViews, grad: torch.Tensor, hyper: list[dict[str, Any]] | None = None
    ) -> None:
        """The fused AdamW kernel over one sub-group, one call per param group it holds (with `hyper`:
        those hyperparameters instead of the groups' current ones)."""
        had_grad, steps = self.engine.units[sg.unit_index].param_had_grad, self.param_steps[sg.unit_index]
        for gi, all_cuts in self._sub_group_runs[sg.index]:
            cuts = [cut for cut in all_cuts if had_grad[cut[0]]]
            if not cuts:
                continue
            group = self.param_groups[gi] if hyper is None else hyper[gi]
            beta1, beta2 = group["betas"]
            if self._bf16_moments is not None:
                keys = self._param_keys[sg.unit_index]
                self._bf16_moments.step(
                    [
                        Piece(views.master[a:b], grad[a:b], views.exp_avg[a:b], views.exp_avg_sq[a:b], keys[slot],
                              param_start, steps[slot])
                        for slot, a, b, param_start in cuts
                    ],
                    lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                    update=self._update,
                )
                continue
            step_tensors = self._steps_for(sg.index, gi, len(all_cuts), grad.device)[: len(cuts)]
            for t, (slot, *_) in zip(step_tensors, cuts, strict=True):
                t.fill_(float(steps[slot]))
            self._update(
                [views.master[a:b] for _, a, b, _ in cuts],
                [grad[a:b] for _, a, b, _ in cuts],
                [views.exp_avg[a:b] for _, a, b, _ in cuts],
                [views.exp_avg_sq[a:b] for _, a, b, _ in cuts],
                [],
                step_tensors,
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    def _steps_for(self, sg_index: int, group_index: int, n: int, device: torch.device) -> list[torch.Tensor]:
        """The step tensors of one (sub-group, param group) call, made once."""
        key = (sg_index, group_index)
        tensors = self._step_tensors.get(key)
        if tensors is None or tensors[0].device != device:
            tensors = [torch.zeros((), dtype=torch.float32, device=device) for _ in range(n)]
            self._step_tensors[key] = tensors
        return tensors

    @property
    def torch_group_settings(self) -> dict[str, Any]:
        """The settings torch's own AdamW (Adam) keeps in each param group beside the hyperparameters,
        as zeroinf runs the update: the fused kernel (optim/torch_format.py exports them, so a torch
        optimizer loading the export runs the same kernel, bit for bit)."""
        return {
            "amsgrad": False, "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
            "fused": True, "decoupled_weight_decay": self._update is functional_adamw,
        }

    def _release_update(self) -> None:
        if self._bf16_moments is not None:
            self._bf16_moments.close()
            self._bf16_moments = None


class Adam(AdamW):
    """`torch.optim.Adam` over a sharded model: AdamW's engine with Adam's update, whose weight decay
    is an L2 term added to the gradient (after clipping, as in torch) instead of a decay of the
    weights; default `weight_decay=0`, where the two are the same. Arguments as `AdamW`, and torch's
    `decoupled_weight_decay=True`, which makes it AdamW."""

    _update = staticmethod(functional_adam)

    def __init__(
        self,
        model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        decoupled_weight_decay: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, lr, betas, eps, weight_decay, **kwargs)
        if decoupled_weight_decay:  # torch.optim.Adam(decoupled_weight_decay=True) is AdamW
            self._update = functional_adamw  # type: ignore[assignment]  # the same signature but one keyword
