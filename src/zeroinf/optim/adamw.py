"""zeroinf.AdamW: AdamW over the shards a rank owns, behind the torch.optim.Optimizer protocol.

Each unit's owned range has an fp32 master copy and two fp32 moments (the optimizer states).
At stage 0 the owned range is the whole flat buffer; from stage 1 on it is this rank's shard, so
the optimizer-state bytes fall as 1/world_size. The states live on the tier `offload.optimizer`
names (`device`, `host` or `nvme`, see optim/states.py) and are stepped in sub-groups by the
swap pipeline (optim/pipeline.py). The update itself is PyTorch's fused AdamW kernel (the
memory-bandwidth bound on CPU) run over views of a sub-group, one call per param group; it runs
where the states are: on the device, or on the CPU for host and nvme states.

A param group may hold any subset of the model's parameters (e.g. no weight decay for norms): the
owned range of each unit is cut into contiguous runs of parameters of one group. `param_groups`
hold the user's nn.Parameter objects and their hyperparameters, so LR schedulers work unchanged.

Step: the reduced gradients of the owned ranges -> one norm (all-reduced when sharded) that serves
both the fp16 overflow check and exact global clipping -> unscale and clip in one multiply ->
per sub-group: swap in, fused AdamW on the masters, cast into the compute params (once a unit's
whole owned range is updated), swap out -> all-gather (stages 1-2). Nothing touches the states
before the norm is known, so an fp16 overflow skips the step without any I/O.
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
from zeroinf.optim.pipeline import Staged, StateViews, SubGroup, SubGroupPipeline
from zeroinf.optim.states import MasterSource, build_state_store
from zeroinf.partition.unit import GradState, ShardedUnit
from zeroinf.precision import DynamicLossScaler
from zeroinf.runtime.streams import Landing, Transfers, typed_view
from zeroinf.telemetry import phase


@dataclass(frozen=True)
class Run:
    """A contiguous run of one param group's elements inside a unit's owned range (owned-local)."""

    unit_index: int
    slot_index: int  # the parameter this run belongs to
    start: int
    end: int


class _GradOnDisk:
    """A unit's reduced gradient shard on NVMe: read when its first sub-group is updated, kept
    for that unit's other sub-groups, then dropped (one unit's shard in memory at a time)."""

    def __init__(self, unit: ShardedUnit) -> None:
        self.unit, self.coef = unit, 1.0
        self._loaded: torch.Tensor | None = None

    def load(self) -> torch.Tensor:
        if self._loaded is None:
            self._loaded = self.unit.owned_grad()
            assert self._loaded is not None
            if self.coef != 1.0:
                self._loaded.mul_(self.coef)
        return self._loaded

    def drop(self) -> None:
        self._loaded = None
        self.unit.release_owned_grad()


class _GradsToHost:
    """Gradients reduced on the device for a step on the CPU (optimizer states on host or nvme,
    gradients on the device): each sub-group's gradient slice crosses through a pool buffer of the
    transfer owner, the next one's copy in flight while this one is updated."""

    def __init__(self, transfers: Transfers, grads: list, sub_groups: list[SubGroup], order: list[int]) -> None:
        self.transfers, self.grads, self.sub_groups, self.order = transfers, grads, sub_groups, order
        self._position = {index: pos for pos, index in enumerate(order)}
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor, Landing]] = {}

    def _start(self, pos: int) -> None:
        if pos >= len(self.order) or pos in self._in_flight:
            return
        sg = self.sub_groups[self.order[pos]]
        grad = self.grads[sg.unit_index]
        if not isinstance(grad, torch.Tensor) or grad.device.type == "cpu":
            return
        piece = grad[sg.start : sg.end]
        raw = self.transfers.pool.acquire(piece.numel() * piece.element_size(), "grad_to_host")
        host = typed_view(raw, piece)
        self._in_flight[pos] = (raw, host, self.transfers.to_host(piece, host))

    def get(self, sg: SubGroup) -> torch.Tensor | None:
        """The host copy of `sg`'s gradient slice, or None when it needs none."""
        pos = self._position[sg.index]
        self._start(pos)
        self._start(pos + 1)
        if pos not in self._in_flight:
            return None
        _, host, landing = self._in_flight[pos]
        self.transfers.retire(landing)
        return host

    def done(self, sg: SubGroup) -> None:
        entry = self._in_flight.pop(self._position[sg.index], None)
        if entry is not None:
            self.transfers.pool.release(entry[0], tag="grad_to_host")


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
        fp16 = self.engine.cfg.param_dtype == "fp16"
        self.scaler = DynamicLossScaler(self.engine.cfg.loss_scale) if fp16 else None
        self.pending_save: Any = None  # a zeroinf.checkpoint.PendingSave writing these states
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
        for ui, unit in enumerate(self.engine.units):
            for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
                gi = group_of[id(unit.params[piece.slot_index])]
                start, end = piece.start - unit.owned_start, piece.end - unit.owned_start
                self.runs[gi].append(Run(ui, piece.slot_index, start, end))
        offload = self.engine.cfg.offload
        units = self.engine.units
        masters = MasterSource([u.owned_numel for u in units], lambda i: units[i].take_initial_master())
        self.states = build_state_store(masters, offload, self.engine.ledger, self.engine.topo.rank)
        self._pipeline = SubGroupPipeline(self.states, offload.io_timeout_s)
        self.engine.optimizer_io = (self.states, self._pipeline)  # for the engine's I/O report
        # Per sub-group: (param group, [(slot, start, end) relative to the sub-group]) per group it meets.
        self._sub_group_runs: list[list[tuple[int, list[tuple[int, int, int]]]]] = []
        for sg in self.states.sub_groups:
            pieces = []
            for gi, runs in enumerate(self.runs):
                cuts = [
                    (r.slot_index, max(r.start, sg.start) - sg.start, min(r.end, sg.end) - sg.start)
                    for r in runs
                    if r.unit_index == sg.unit_index and r.start < sg.end and sg.start < r.end
                ]
                if cuts:
                    pieces.append((gi, cuts))
            self._sub_group_runs.append(pieces)
        # Adam's step count per parameter (unit, slot): like torch.optim, a parameter without a
        # gradient in a step is not stepped at all (no weight decay, no moment decay, no count).
        self.param_steps = [[0] * len(unit.params) for unit in self.engine.units]
        # The fused kernel increments the step tensors it is given; these are set to each parameter's
        # count before every call (one tensor per cut: a parameter split over sub-groups is counted once).
        self._step_tensors: dict[tuple[int, int], list[torch.Tensor]] = {}

    # -- the training-loop protocol ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() skipped its update (fp16 overflow); accelerate reads this name so that
        the Trainer's LR scheduler does not advance on a skipped step."""
        return self.last_step_skipped

    @phase("zeroinf::backward")
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the fp16 loss scale applied (identical to loss.backward() otherwise)."""
        (loss * self.scaler.scale if self.scaler is not None else loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    @torch.no_grad()
    @phase("zeroinf::optimizer")
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise NotImplementedError("zeroinf.AdamW.step does not take a closure")
        if self.pending_save is not None:  # see zeroinf/checkpoint/saving.py [Note: saving without stopping ...]
            self.pending_save.wait()
        engine = self.engine
        engine.require_step_boundary()
        # Gradients still on their way to the host arrive (their NVMe norms are set), and the last
        # step's parameter uploads have read the masters this step overwrites.
        engine.transfers.retire()
        engine.transfers.wait_uploads()
        # Gradient shards on NVMe are read one unit at a time during the update (`_GradOnDisk`); their
        # squared norms were kept when they were written, so the global norm needs no read.
        grads: list[torch.Tensor | _GradOnDisk | None] = [
            _GradOnDisk(unit) if unit.grad_files is not None and unit.grad_state is not GradState.EMPTY
            else self._fp32(unit.owned_grad())
            for unit in engine.units
        ]
        present = [g for g in grads if isinstance(g, torch.Tensor)]
        on_disk_sq = sum(float(g.unit.grad_sq_norm or 0.0) for g in grads if isinstance(g, _GradOnDisk))
        sharded = engine.policy.shard_optimizer and engine.topo.is_distributed
        need_norm = self.scaler is not None or engine.cfg.grad_clip_norm is not None
        self.last_step_skipped = False
        if need_norm:
            total_norm = float(global_grad_norm(present, engine.topo, sharded, extra_sq=on_disk_sq))
            if sharded:
                engine.counter.add("all_reduce")
            scale = self.loss_scale
            if self.scaler is not None:
                overflow = not math.isfinite(total_norm)
                self.scaler.update(overflow, self.step_count + 1)
                if overflow:
                    self.last_step_skipped = True
                    self.states.traffic.end_step()
                    engine.end_step()
                    return
            total_norm /= scale
            coef = 1.0 / scale
            if engine.cfg.grad_clip_norm is not None:
                coef *= clip_coefficient(total_norm, engine.cfg.grad_clip_norm)
            if coef != 1.0:
                for g in present:
                    g.mul_(coef)
                for g in grads:
                    if isinstance(g, _GradOnDisk):
                        g.coef = coef
            self.last_grad_norm = total_norm
        self._update_states(grads)
        self.step_count += 1
        self.states.traffic.end_step()
        engine.end_step()

    def _fp32(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad if grad is None or grad.dtype == torch.float32 else grad.float()

    def _update_states(self, grads: list[torch.Tensor | None]) -> None:
        """Swap in, update and swap out every sub-group with a gradient; write the new params."""
        units, store, transfers = self.engine.units, self.states, self.engine.transfers
        handles = []
        on_disk: list[_GradOnDisk | None] = [None]
        order = [sg.index for sg in store.sub_groups if grads[sg.unit_index] is not None]
        crossing = _GradsToHost(transfers, grads, store.sub_groups, order) if store.tier is not Tier.DEVICE else None

        def update(staged: Staged) -> None:
            sg = staged.sub_group
            grad = grads[sg.unit_index]
            assert grad is not None
            if isinstance(grad, _GradOnDisk):
                if on_disk[0] is not None and on_disk[0] is not grad:
                    on_disk[0].drop()  # sub-groups come unit by unit: the previous unit is done
                on_disk[0] = grad
                grad = grad.load()
            host_grad = crossing.get(sg) if crossing is not None else None
            self._adamw(sg, staged.views, host_grad if host_grad is not None else grad[sg.start : sg.end])
            if crossing is not None:
                crossing.done(sg)
            master = store.collect_master(staged)
            if master is not None:
                handles.append(units[sg.unit_index].start_update_params(master))
                if store.staging_slots is not None:  # a staging buffer, reused soon: uploads must have read it
                    transfers.wait_uploads()

        store.check("read")
        self._pipeline.run(order, update)
        if on_disk[0] is not None:
            on_disk[0].drop()
        for handle in handles:
            handle.wait()
        store.check("write")
        for unit, steps, grad in zip(units, self.param_steps, grads, strict=True):
            if grad is not None:
                for slot, had in enumerate(unit.param_had_grad):
                    steps[slot] += int(had)

    def _adamw(self, sg: SubGroup, views: StateViews, grad: torch.Tensor) -> None:
        """The fused AdamW kernel over one sub-group, one call per param group it holds."""
        had_grad, steps = self.engine.units[sg.unit_index].param_had_grad, self.param_steps[sg.unit_index]
        for gi, all_cuts in self._sub_group_runs[sg.index]:
            cuts = [(slot, a, b) for slot, a, b in all_cuts if had_grad[slot]]
            if not cuts:
                continue
            group = self.param_groups[gi]
            beta1, beta2 = group["betas"]
            step_tensors = self._steps_for(sg.index, gi, len(all_cuts), grad.device)[: len(cuts)]
            for t, (slot, _, _) in zip(step_tensors, cuts, strict=True):
                t.fill_(float(steps[slot]))
            functional_adamw(
                [views.master[a:b] for _, a, b in cuts],
                [grad[a:b] for _, a, b in cuts],
                [views.exp_avg[a:b] for _, a, b in cuts],
                [views.exp_avg_sq[a:b] for _, a, b in cuts],
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

    # -- state ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (owned ranges, as CPU or device tensors), hyperparameters and
        loss-scaler state. States on nvme are read one unit at a time."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        units = [self.states.read_unit(ui) for ui in range(len(self.engine.units))]
        return {
            "master": [u.master for u in units],
            "exp_avg": [u.exp_avg for u in units],
            "exp_avg_sq": [u.exp_avg_sq for u in units],
            "param_steps": [list(steps) for steps in self.param_steps],
            "step_count": self.step_count,
            "param_groups": groups,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "world_size": self.engine.topo.world_size,
            "stage": self.engine.cfg.stage,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.pending_save is not None:  # its writer still reads the states about to be replaced
            self.pending_save.wait()
        here = (self.engine.topo.world_size, self.engine.cfg.stage)
        there = (state["world_size"], state["stage"])
        if here != there:
            raise ValueError(
                f"optimizer state was saved at (world_size, stage) = {there} but this run is {here}; "
                "use zeroinf checkpoints to reshard"
            )
        self.engine.transfers.wait_uploads()  # uploads of the last step may still read the masters replaced here
        units = self.engine.units
        masters = state["master"]
        for ui in range(len(units)):
            self.states.write_unit(ui, StateViews(masters[ui], state["exp_avg"][ui], state["exp_avg_sq"][ui]))
        self.param_steps = [[int(n) for n in steps] for steps in state["param_steps"]]
        self.step_count = state["step_count"]
        for group, saved in zip(self.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        handles = [unit.start_update_params(m) for unit, m in zip(units, masters, strict=True)]
        for handle in handles:
            handle.wait()
        self.engine.transfers.wait_uploads()  # the caller's tensors may change once this returns

    def close(self) -> None:
        """Free the optimizer states (for nvme: remove the swap files). Also done at exit."""
        if self.pending_save is not None:  # its writer still reads the states
            self.pending_save.wait()
        self.states.close()
