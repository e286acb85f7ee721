"""zeroinf.AdamW: AdamW over the shards a rank owns, behind the torch.optim.Optimizer protocol.

Each unit's owned range has an fp32 master copy and two fp32 moments (the optimizer states).
At stage 0 the owned range is the whole flat buffer; from stage 1 on it is this rank's shard, so
the optimizer-state bytes fall as 1/world_size. The update itself is PyTorch's fused AdamW kernel
(the memory-bandwidth bound on CPU) run over views of the owned ranges, one call per param group.

A param group may hold any subset of the model's parameters (e.g. no weight decay for norms): the
owned range of each unit is cut into contiguous runs of parameters of one group. `param_groups`
hold the user's nn.Parameter objects and their hyperparameters, so LR schedulers work unchanged.

Step: the reduced gradients of the owned ranges -> one norm (all-reduced when sharded) that serves
both the fp16 overflow check and exact global clipping -> unscale and clip in one multiply ->
fused AdamW on the masters -> cast into the compute params -> all-gather (stages 1-2).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw as functional_adamw

from zeroinf.engine import Engine, engine_of
from zeroinf.memory import Tier
from zeroinf.optim.clip import clip_coefficient, global_grad_norm
from zeroinf.precision import DynamicLossScaler


@dataclass(frozen=True)
class Run:
    """A contiguous run of one param group's elements inside a unit's owned range (owned-local)."""

    unit_index: int
    start: int
    end: int


class AdamW(torch.optim.Optimizer):
    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        param_groups: Iterable[dict[str, Any]] | None = None,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"AdamW: lr = {lr!r} is invalid; use a non-negative number")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"AdamW: betas = {betas!r} are invalid; use two numbers in [0, 1)")
        if not eps > 0:
            raise ValueError(f"AdamW: eps = {eps!r} is invalid; use a positive number")
        self.engine: Engine = engine_of(model)
        trainable = [p for u in self.engine.units for p in u.params]
        groups = list(param_groups) if param_groups is not None else [{"params": trainable}]
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(groups, defaults)
        self._check_groups_cover(trainable)
        self.scaler = DynamicLossScaler(self.engine.cfg.loss_scale) if self.engine.cfg.param_dtype == "fp16" else None
        self.last_step_skipped = False
        self.step_count = 0
        self._allocate_states()

    # -- setup ----------------------------------------------------------------------------------------
    def _check_groups_cover(self, trainable: list[nn.Parameter]) -> None:
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [p for p in trainable if id(p) not in seen]
        if missing:
            raise ValueError(
                f"AdamW: {len(missing)} trainable parameters are in no param group; every parameter of the "
                "sharded model must be in exactly one group"
            )

    def _allocate_states(self) -> None:
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self.runs: list[list[Run]] = [[] for _ in self.param_groups]
        self.master: list[torch.Tensor] = []
        self.exp_avg: list[torch.Tensor] = []
        self.exp_avg_sq: list[torch.Tensor] = []
        for ui, unit in enumerate(self.engine.units):
            master = unit.take_initial_master()
            self.master.append(master)
            self.exp_avg.append(torch.zeros_like(master))
            self.exp_avg_sq.append(torch.zeros_like(master))
            self.engine.ledger.reserve(Tier.DEVICE, 3 * master.numel() * 4, "optimizer_state")
            for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
                gi = group_of[id(unit.params[piece.slot_index])]
                start, end = piece.start - unit.owned_start, piece.end - unit.owned_start
                runs = self.runs[gi]
                if runs and runs[-1].unit_index == ui and runs[-1].end == start:
                    runs[-1] = Run(ui, runs[-1].start, end)  # merge neighbours of the same group
                else:
                    runs.append(Run(ui, start, end))
        # One step counter per run: the fused kernel increments every tensor of its list.
        self.run_steps = [[torch.zeros((), dtype=torch.float32) for _ in runs] for runs in self.runs]

    # -- the training-loop protocol ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the fp16 loss scale applied (identical to loss.backward() otherwise)."""
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise NotImplementedError("zeroinf.AdamW.step does not take a closure")
        engine = self.engine
        engine.require_step_boundary()
        grads = [self._fp32(unit.owned_grad()) for unit in engine.units]
        present = [g for g in grads if g is not None]
        sharded = engine.policy.shard_optimizer and engine.topo.is_distributed
        need_norm = self.scaler is not None or engine.cfg.grad_clip_norm is not None
        self.last_step_skipped = False
        if need_norm:
            total_norm = float(global_grad_norm(present, engine.topo, sharded))
            if sharded:
                engine.counter.add("all_reduce")
            scale = self.loss_scale
            if self.scaler is not None:
                overflow = not math.isfinite(total_norm)
                self.scaler.update(overflow, self.step_count + 1)
                if overflow:
                    self.last_step_skipped = True
                    engine.end_step()
                    return
            total_norm /= scale
            coef = 1.0 / scale
            if engine.cfg.grad_clip_norm is not None:
                coef *= clip_coefficient(total_norm, engine.cfg.grad_clip_norm)
            if coef != 1.0:
                for g in present:
                    g.mul_(coef)
            self.last_grad_norm = total_norm
        self._adamw(grads)
        handles = [unit.start_update_params(m) for unit, m in zip(engine.units, self.master, strict=True)]
        for handle in handles:
            handle.wait()
        self.step_count += 1
        engine.end_step()

    def _fp32(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad if grad is None or grad.dtype == torch.float32 else grad.float()

    def _adamw(self, grads: list[torch.Tensor | None]) -> None:
        for group, runs, steps in zip(self.param_groups, self.runs, self.run_steps, strict=True):
            live = [(r, s) for r, s in zip(runs, steps, strict=True) if grads[r.unit_index] is not None]
            if not live:
                continue
            beta1, beta2 = group["betas"]
            functional_adamw(
                [self.master[r.unit_index][r.start : r.end] for r, _ in live],
                [grads[r.unit_index][r.start : r.end] for r, _ in live],  # type: ignore[index]
                [self.exp_avg[r.unit_index][r.start : r.end] for r, _ in live],
                [self.exp_avg_sq[r.unit_index][r.start : r.end] for r, _ in live],
                [],
                [s for _, s in live],
                fused=True,
                amsgrad=False,
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=False,
            )

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (owned ranges), hyperparameters and loss-scaler state."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {
            "master": [t.clone() for t in self.master],
            "exp_avg": [t.clone() for t in self.exp_avg],
            "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
            "run_steps": [[float(s) for s in steps] for steps in self.run_steps],
            "step_count": self.step_count,
            "param_groups": groups,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "world_size": self.engine.topo.world_size,
            "stage": self.engine.cfg.stage,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        here = (self.engine.topo.world_size, self.engine.cfg.stage)
        there = (state["world_size"], state["stage"])
        if here != there:
            raise ValueError(
                f"optimizer state was saved at (world_size, stage) = {there} but this run is {here}; "
                "use zeroinf checkpoints to reshard"
            )
        for mine, theirs in (("master", state["master"]), ("exp_avg", state["exp_avg"]), ("exp_avg_sq", state["exp_avg_sq"])):
            for dst, src in zip(getattr(self, mine), theirs, strict=True):
                dst.copy_(src)
        for steps, values in zip(self.run_steps, state["run_steps"], strict=True):
            for s, v in zip(steps, values, strict=True):
                s.fill_(v)
        self.step_count = state["step_count"]
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        handles = [unit.start_update_params(m) for unit, m in zip(self.engine.units, self.master, strict=True)]
        for handle in handles:
            handle.wait()
