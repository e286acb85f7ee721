"""The sharded optimizer: an update over the shards a rank owns, behind the torch.optim.Optimizer protocol.

`ShardedOptimizerBase` is everything about stepping a sharded model but the update rule: each
unit's owned range has an fp32 master copy and up to two more states of the same size (Adam's
moments: in fp32, or in bf16 with `offload.moment_dtype`, optim/moments.py [Note: bf16 moments];
any elementwise torch optimizer's: optim/torch_optimizer.py). At stage 0 the owned range is the
whole flat buffer; from stage 1 on it is this rank's shard, so the optimizer-state bytes fall as
1/world_size. The states live on the tier `offload.optimizer` names (`device`, `host` or `nvme`,
see optim/states.py) and are stepped in sub-groups by the swap pipeline (optim/pipeline.py). A
subclass gives the update of one staged sub-group (`_update_sub_group`): `zeroinf.AdamW` runs
PyTorch's fused AdamW kernel (the memory-bandwidth bound on CPU, optim/adamw.py),
`zeroinf.ShardedOptimizer` any torch.optim optimizer whose update is elementwise. The update runs
where the states are: on the device, or on the CPU for host and nvme states.

A param group may hold any subset of the model's parameters (e.g. no weight decay for norms): the
owned range of each unit is cut into contiguous runs of parameters of one group. `param_groups`
hold the user's nn.Parameter objects and their hyperparameters, so LR schedulers work unchanged.

Step: the reduced gradients of the owned ranges -> one norm (all-reduced when sharded) that serves
both the fp16 overflow check and exact global clipping -> unscale and clip in one multiply ->
per sub-group: swap in, the update on the masters, cast into the compute params (once a unit's
whole owned range is updated), swap out -> all-gather (stages 1-2). By default each unit is stepped
inside backward instead, as its gradient completes: optim/backward_step.py, a base class.

[Note: the norm without clipping]
Without clipping and fp16 no step needs the global gradient norm, so none is computed; the Hugging
Face Trainer logs one every step, and its users read it to watch training (`track_grad_norm`,
which `zeroinf.integrations.Trainer` sets). A unit stepped inside backward ("final") frees its
gradient before `step()`, so its squared norm is taken then (a device scalar: no wait in backward)
and `step()` adds it in unit order with the others, the same fp32 value the gradient would give
there: the norm is the one clipping would compute, bit for bit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from zeroinf.comm import Handle, all_reduce
from zeroinf.engine import Engine, engine_of
from zeroinf.integrations.accelerate_loop import (
    SHARDED_KEY,
    accelerate_defers_step,
    accelerate_saves_state,
    load_sharded_state,
    sharded_state_dict,
)
from zeroinf.optim.background import BackgroundSteps
from zeroinf.optim.backward_step import BackwardStep, StepInBackward
from zeroinf.optim.clip import clip_coefficient, global_grad_norm
from zeroinf.optim.full_state import ShardedStateView
from zeroinf.optim.nvme_states import MasterHome
from zeroinf.optim.pipeline import Staged, StateViews, SubGroup, SubGroupPipeline
from zeroinf.optim.states import MasterSource, build_state_store
from zeroinf.optim.step_grads import GradOnDisk, GradsToHost
from zeroinf.optim.succession import RETIRED, inherit_states
from zeroinf.optim.torch_args import model_of_params
from zeroinf.optim.torch_format import full_optimizer_state_dict, load_full_optimizer_state_dict
from zeroinf.partition.placeholder_use import explain_placeholder_gradient
from zeroinf.partition.unit import GradState
from zeroinf.planner.unit_plan import step_in_backward_mode
from zeroinf.precision import DynamicLossScaler
from zeroinf.runtime import interrupts
from zeroinf.telemetry import phase


@dataclass(frozen=True)
class Run:
    """A contiguous run of one param group's elements inside a unit's owned range (owned-local)."""

    unit_index: int
    slot_index: int  # the parameter this run belongs to
    start: int
    end: int
    param_start: int = 0  # index of `start`'s element inside the parameter


GRAD_SCALER = (
    "torch.amp.GradScaler cannot drive zeroinf.AdamW: the engine keeps the gradients (reduced and sharded, "
    "never in p.grad), so the scaler finds none to unscale or check, and they would stay multiplied by its "
    "scale. Drop the GradScaler: for fp16 set Config(param_dtype='fp16') and call optimizer.backward(loss), "
    "which applies zeroinf's own dynamic loss scale; bf16 needs no scaling"
)


class ShardedOptimizerBase(StepInBackward, torch.optim.Optimizer):
    """A sharded model's optimizer without its update rule (see the module docstring); subclasses
    give `_update_sub_group` and the names of their states."""

    # torch.amp.GradScaler.step hands an optimizer with this flag its scale and found-inf tensors
    # (`grad_scale`, `found_inf` attributes) instead of checking p.grad itself, where it would stop
    # with "No inf checks were recorded for this optimizer": step() refuses them by name (GRAD_SCALER).
    _step_supports_amp_scaling = True
    # What the update calls the store's two states beside the master (`StateViews.exp_avg`, `.exp_avg_sq`),
    # as torch.optim names them in `optimizer.state[p]`; a subclass using one has one name.
    state_names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")
    keeps_step = True  # torch.optim's state of a stepped parameter holds `step` (Adam's; SGD's does not)
    # The param-group entries an update reads: a step inside backward uses their values at backward time.
    hyperparameter_keys: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay")

    @property
    def torch_group_settings(self) -> dict[str, Any]:
        """Settings torch's optimizer of the same rule keeps in each param group that `param_groups`
        here leave out (optim/torch_format.py): none, unless a subclass says."""
        return {}

    @property
    def display_name(self) -> str:
        """How messages name this optimizer: `zeroinf.AdamW`."""
        return f"zeroinf.{type(self).__name__}"

    def __init__(
        self,
        model: nn.Module | Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        param_groups: Iterable[dict[str, Any]] | None,
        defaults: dict[str, Any],
        track_grad_norm: bool,
    ) -> None:
        """`model`: the sharded model, or, as torch.optim optimizers take them, its parameters or param
        groups (`model.parameters()`, nanoGPT's decay/no-decay groups): every trainable parameter of
        one sharded model, frozen ones ignored (optim/torch_args.py [Note: torch.optim.AdamW's arguments]).

        `track_grad_norm`: compute the global gradient norm (`last_grad_norm`) every step, also when
        neither clipping nor fp16 needs it (one more read of each gradient shard and one scalar
        all-reduce a step), as the Hugging Face Trainer logs it ([Note: the norm without clipping])."""
        name = self.display_name
        if not isinstance(model, nn.Module):
            if param_groups is not None:
                raise TypeError(
                    f"{name}: param groups came both as the first argument and as param_groups=; pass them once"
                )
            model, param_groups = model_of_params(model, name)
        elif param_groups is not None:  # the same ownership checks as groups given in place of the model
            owner, param_groups = model_of_params(param_groups, name)
            if engine_of(owner) is not engine_of(model):
                raise ValueError(
                    f"{name}: param_groups= hold parameters of another sharded model than the one given; "
                    f"one {name} trains exactly one sharded model: build one per model"
                )
        self.engine: Engine = engine_of(model)
        self._retired = False  # a newer optimizer of this model took over the states (optim/succession.py)
        self._closed = False  # `close()` freed the states
        trainable = [p for u in self.engine.units for p in u.params]
        if not trainable:
            raise ValueError(
                f"{name}: the sharded model has no trainable parameters (requires_grad was False for all of them "
                "at zeroinf.shard). A frozen model (a reference model, a teacher) needs no optimizer: it runs "
                "forward and passes gradients back to its inputs without one. To train it, unfreeze it before "
                "zeroinf.shard"
            )
        # Built from the model: one group in `model.parameters()` order, as torch's optimizer over it, so
        # that torch.optim's state dicts index the same parameters (optim/torch_format.py).
        in_units = {id(p) for p in trainable}
        in_module_order = [p for p in self.engine.module.parameters() if id(p) in in_units]
        groups = list(param_groups) if param_groups is not None else [{"params": in_module_order}]
        super().__init__(groups, defaults)
        self.state = ShardedStateView(self.state_names)  # optim/full_state.py [Note: a parameter's optimizer state]
        self._check_groups_cover(trainable)
        fp16 = self.engine.cfg.param_dtype == "fp16"
        self.scaler = DynamicLossScaler(self.engine.cfg.loss_scale) if fp16 else None
        self.pending_save: Any = None  # a zeroinf.checkpoint.PendingSave writing these states
        self.last_step_skipped = False
        # The global gradient norm of the last step (before clipping), where the step computed it:
        # with grad_clip_norm, fp16 or track_grad_norm. Without them no step needs it: None.
        self.last_grad_norm: float | None = None
        self.track_grad_norm = bool(track_grad_norm)
        self._norm_before_step: float | None = None  # computed for clip_grad_norm_ before step()
        self.step_count = 0
        self._is_accelerate_prepared = True  # `accelerator.prepare` returns it unchanged, as the model
        self._allocate_states()
        self._groups_fixed = True  # add_param_group from here on is refused

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, while the constructor builds the groups; refused afterwards: each unit's owned
        range (its fp32 masters and moments) is cut by group when the optimizer is built, so a group
        added later would never be stepped (a parameter outside the model, or one frozen at shard)."""
        if getattr(self, "_groups_fixed", False):
            raise ValueError(
                f"{self.display_name}.add_param_group after the optimizer was built: its param groups are fixed then "
                "(each unit's fp32 masters and moments are cut by group), and the added parameters would never "
                "be stepped. Pass every group to the constructor. To train parameters later (unfreezing), "
                "make them trainable before zeroinf.shard and keep their group's lr at 0 until then; a tensor "
                "outside the sharded model needs its own torch optimizer"
            )
        super().add_param_group(param_group)

    # -- setup ----------------------------------------------------------------------------------------
    def _check_groups_cover(self, trainable: list[nn.Parameter]) -> None:
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [p for p in trainable if id(p) not in seen]
        if missing:
            raise ValueError(
                f"{self.display_name}: {len(missing)} trainable parameters are in no param group; every "
                "parameter of the sharded model must be in exactly one group"
            )

    def _allocate_states(self) -> None:
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        self.runs: list[list[Run]] = [[] for _ in self.param_groups]
        for ui, unit in enumerate(self.engine.units):
            for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
                gi = group_of[id(unit.params[piece.slot_index])]
                start, end = piece.start - unit.owned_start, piece.end - unit.owned_start
                self.runs[gi].append(Run(ui, piece.slot_index, start, end, piece.param_offset))
        offload = self.engine.cfg.offload
        units = self.engine.units
        if self.engine.optimizer_io is None:  # the model's first optimizer: the plan is of its states
            # (Lion's take 8 bytes an element, not Adam's 12: its host/NVMe split, and so whether
            # the shards can be the masters, follow); a successor keeps the store and plan it finds
            self.engine.unit_plan = self.engine.unit_plan.with_moments(len(self.state_names))
        # [Note: masters in the memory shard] (optim/states.py): such a unit's shard is its master.
        shared = self.engine.unit_plan.masters_in_memory_shard
        masters = MasterSource(
            [u.owned_numel for u in units],
            lambda i: units[i].share_master() if shared[i] else units[i].take_initial_master(),
            shared,
        )
        # None, "final" or "speculative": see optim/backward_step.py [Note: the step inside backward].
        self.step_mode = step_in_backward_mode(self.engine.cfg)
        shadow = self.step_mode == "speculative"
        in_param_file = self.engine.unit_plan.masters_in_param_file
        # A model that had an optimizer: its states (masters kept, moments reset) become this one's, and
        # its fp16 loss scale (the gradients' range, which a torch loop's GradScaler keeps across optimizers).
        previous = self.engine.optimizer_ref() if self.engine.optimizer_ref is not None else None
        inherited = inherit_states(self.engine, len(self.state_names))
        if previous is not None and previous.scaler is not None and self.scaler is not None:
            self.scaler.load_state_dict(previous.scaler.state_dict())
        self.states = inherited if inherited is not None else build_state_store(
            masters, offload, self.engine.ledger, self.engine.topo.rank, shadow=shadow,
            split=self.engine.unit_plan.optimizer_split(), tier=self.engine.nvme_tier,
            master_homes=[
                cast(MasterHome, unit.home) if held else None for unit, held in zip(units, in_param_file, strict=True)
            ],
            moments=len(self.state_names),
        )
        self._pipeline = SubGroupPipeline(self.states, offload.io_timeout_s)
        self._unit_sub_groups: list[list[int]] = [[] for _ in units]
        for sg in self.states.sub_groups:
            self._unit_sub_groups[sg.unit_index].append(sg.index)
        self._session = None
        self._expected_units = list(reversed(range(len(units))))  # backward's order, learned each step
        self.rollbacks = 0  # speculative steps undone (clipping triggered, fp16 overflow, changed lr)
        self.units_stepped_in_backward = 0  # in the last step
        self._hold_back = False  # the last step clipped: this one steps after backward (likely clips again)
        self._background: BackgroundSteps | None = None  # kernels stepped inside backward on a worker thread
        self._partly_stepped: RuntimeError | None = None  # backward_step.py `_abandon_backward_step`
        self._install_step_in_backward()
        self.engine.optimizer_io = (self.states, self._pipeline)  # for the engine's I/O report
        self.engine.optimizer_ref = weakref.ref(self)  # torch's clip_grad_norm_ asks it (optim/torch_clip.py)
        # Per sub-group: (param group, [(slot, start, end) relative to the sub-group, index of the cut's
        # first element inside its parameter]) per group it meets.
        self._sub_group_runs: list[list[tuple[int, list[tuple[int, int, int, int]]]]] = []
        for sg in self.states.sub_groups:
            pieces = []
            for gi, runs in enumerate(self.runs):
                cuts = [
                    (
                        r.slot_index, max(r.start, sg.start) - sg.start, min(r.end, sg.end) - sg.start,
                        r.param_start + max(r.start, sg.start) - r.start,
                    )
                    for r in runs
                    if r.unit_index == sg.unit_index and r.start < sg.end and sg.start < r.end
                ]
                if cuts:
                    pieces.append((gi, cuts))
            self._sub_group_runs.append(pieces)
        # The step count per parameter (unit, slot): like torch.optim, a parameter without a
        # gradient in a step is not stepped at all (no weight decay, no moment decay, no count).
        self.param_steps = [[0] * len(unit.params) for unit in self.engine.units]

    # -- the training-loop protocol ------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last step() skipped its update (fp16 overflow); accelerate reads this name so that
        the Trainer's LR scheduler does not advance on a skipped step."""
        return self.last_step_skipped

    @property
    def optimizer(self) -> ShardedOptimizerBase:
        """Itself: what accelerate's `AcceleratedOptimizer` calls the optimizer it wraps. `prepare`
        returns this one unwrapped, and `prepare_scheduler` matches a scheduler to its optimizer by
        this name (`accelerator.prepare(model, opt, loader, scheduler)` stopped there before)."""
        return self

    @phase("zeroinf::backward")
    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), with the fp16 loss scale applied (identical to loss.backward() otherwise)."""
        self.require_current()
        self.engine.loss_scaled = True  # engine.py [Note: an fp16 backward without the loss scale]
        try:
            (loss * self.scaler.scale if self.scaler is not None else loss).backward()
        except RuntimeError as err:  # partition/placeholder_use.py [Note: a parameter used outside ...]
            explained = explain_placeholder_gradient(err) if self.engine.cfg.stage == 3 else None
            if explained is None:
                raise
            raise explained from err

    def zero_grad(self, set_to_none: bool = True) -> None:
        if accelerate_defers_step(self.engine.cfg.grad_accum_steps):  # inside accelerator.accumulate
            return
        self.discard_gradients("optimizer.zero_grad()")

    @interrupts.entry_point
    def discard_gradients(self, caller: str) -> None:
        """Drop the gradients of the backward passes since the last step (what zero_grad does in
        PyTorch); refused where a backward already stepped units inside it."""
        self.require_whole_step()
        if self._session is not None:
            raise RuntimeError(
                f"{caller} after a backward that already stepped units inside it "
                "(offload.step_in_backward): call optimizer.step() first to finish the step, or set "
                "offload.step_in_backward = false to be able to discard gradients (a GAN's generator "
                "backward runs through the discriminator, whose gradients the loop then discards)"
            )
        self._norm_before_step = None
        self.engine.zero_grad()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over the gradients of the backward passes since the last one. As in
        torch.optim, `closure` (zeroing the gradients, computing the loss and calling backward) runs
        first, with gradients enabled, and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step()
        return loss

    @interrupts.entry_point
    @torch.no_grad()
    @phase("zeroinf::optimizer")
    def _step(self) -> None:
        if getattr(self, "found_inf", None) is not None or getattr(self, "grad_scale", None) is not None:
            raise RuntimeError(GRAD_SCALER)
        if accelerate_defers_step(self.engine.cfg.grad_accum_steps):  # integrations/accelerate_loop.py
            return
        if self.pending_save is not None:  # see zeroinf/checkpoint/saving.py [Note: saving without stopping ...]
            self.pending_save.wait()
        engine = self.engine
        self._settle_backward()
        engine.transfers.wait_uploads()  # the last step's parameter uploads have read the masters overwritten here
        session, self._session = self._session, None
        self.units_stepped_in_backward = len(session.stepped) if session is not None else 0
        self._land_speculative(session)
        grads, squares = self._step_gradients(session)
        present = [g for g in grads if isinstance(g, torch.Tensor)]
        need_norm = self.scaler is not None or engine.cfg.grad_clip_norm is not None or self.track_grad_norm
        self.last_step_skipped = False
        coef = 1.0
        early_norm, self._norm_before_step = self._norm_before_step, None
        if need_norm:
            total_norm = early_norm if early_norm is not None else self._global_norm(squares)
            scale = self.loss_scale
            if self.scaler is not None:
                overflow = not math.isfinite(total_norm)
                self.scaler.update(overflow, self.step_count + 1)
                if overflow:
                    self.last_step_skipped = True
                    if session is not None:
                        self._undo(session, restore_params=True)
                    self._release_grads()
                    self.states.traffic.end_step()
                    engine.end_step()
                    return
            total_norm /= scale
            coef = 1.0 / scale
            if engine.cfg.grad_clip_norm is not None:
                clip = clip_coefficient(total_norm, engine.cfg.grad_clip_norm)
                coef *= clip
                self._hold_back = clip < 1.0
            self.last_grad_norm = total_norm
        if session is not None and session.speculative:
            if coef == session.coef and session.hyper == self._hyperparameters():
                for ui in session.stepped:  # right as stepped: only the rest remains
                    grads[ui] = None
                present = [g for g in grads if isinstance(g, torch.Tensor)]
            else:  # clipping triggered (or hyperparameters changed): undo, then step everything anew
                self._undo(session, restore_params=False)
                session = None
        if coef != 1.0:
            for g in present:
                g.mul_(coef)
            for grad in grads:
                if isinstance(grad, GradOnDisk):
                    grad.coef = coef
        clip_value = engine.cfg.grad_clip_value  # elementwise, after the loss scale is removed
        if clip_value is not None:
            for g in present:
                g.clamp_(-clip_value, clip_value)
            for grad in grads:
                if isinstance(grad, GradOnDisk):
                    grad.clip_value = clip_value
        if session is not None:
            self._check_hyperparameters(session)
        self._update_states(grads, session)
        self._release_grads()
        self.step_count += 1
        self.states.traffic.end_step()
        engine.end_step()
        if session is not None and session.hyper_changed:
            raise session.hyper_changed

    def _step_gradients(
        self, session: BackwardStep | None
    ) -> tuple[list[torch.Tensor | GradOnDisk | None], list[torch.Tensor | float]]:
        """Per unit, the gradient the update reads (None: stepped inside backward for good), and
        the global norm's inputs in unit order."""
        # Gradient shards on NVMe are read one unit at a time during the update (`GradOnDisk`); their
        # squared norms were kept when they were written, so the global norm needs no read.
        grads: list[torch.Tensor | GradOnDisk | None] = [
            GradOnDisk(unit) if unit.grad_files is not None and unit.grad_state is not GradState.EMPTY
            and not unit.grad_in_memory
            else self._fp32(unit.owned_grad())
            for unit in self.engine.units
        ]
        if session is not None and not session.speculative:  # stepped as it went: nothing to decide
            for ui in session.stepped:
                grads[ui] = None
        # per unit in unit order: in memory, its square kept when written to NVMe (optim/clip.py), or
        # kept when the unit was stepped inside backward ([Note: the norm without clipping])
        kept = session.squares if session is not None else {}
        squares: list[torch.Tensor | float] = []
        for ui, g in enumerate(grads):
            if isinstance(g, GradOnDisk):
                squares.append(float(g.unit.grad_sq_norm or 0.0))
            elif g is not None:
                squares.append(g)
            elif ui in kept:
                squares.append(float(kept[ui]))
        return grads, squares

    def _global_norm(self, squares: list[torch.Tensor | float]) -> float:
        """The global gradient norm, still multiplied by the loss scale (one all-reduce when sharded)."""
        engine = self.engine
        sharded = engine.policy.shard_optimizer and engine.topo.is_distributed
        total_norm = float(global_grad_norm(squares, engine.topo, sharded))
        if sharded:
            engine.counter.add("all_reduce")
        return total_norm

    def grad_norm_before_step(self) -> float:
        """The global gradient norm the coming `step()` clips with (before clipping, loss scale
        removed), computed now, after the last backward of the step and before `step()`; the step
        then uses this very value. What `torch.nn.utils.clip_grad_norm_` over the sharded model's
        parameters returns (optim/torch_clip.py). A collective: every rank calls it."""
        engine = self.engine
        if engine.micro_step != engine.cfg.grad_accum_steps:
            raise RuntimeError(
                f"clip_grad_norm_ after {engine.micro_step} of the step's {engine.cfg.grad_accum_steps} backward "
                "passes: the engine clips the accumulated gradients in optimizer.step(), so ask for the norm "
                "after the step's last backward (in an accelerate loop: under `if accelerator.sync_gradients:`)"
            )
        if self._norm_before_step is None:
            self._settle_backward()
            self._land_speculative(self._session)  # as step() finds them: the same bits
            self._norm_before_step = self._global_norm(self._step_gradients(self._session)[1])
        return self._norm_before_step / self.loss_scale

    def _settle_backward(self) -> None:
        """What the backward left running is done, before the step reads its gradients: a backward
        that raised, the background kernels, an I/O error they met (it tells first), the backward
        count, and the gradients still on their way to the host (their NVMe norms are then set)."""
        self.require_whole_step()
        if self._background is not None:
            self._background.drain()
        self.states.require_healthy()
        self.engine.require_step_boundary()
        self.engine.transfers.retire()

    def _release_grads(self) -> None:
        for unit in self.engine.units:
            unit.release_handed_off()

    def _update_fn(
        self,
        grad_of: Callable[[SubGroup], torch.Tensor],
        done: Callable[[SubGroup], None],
        handles: list[Handle],
        hyper: list[dict[str, Any]] | None = None,
        background: BackgroundSteps | None = None,
        then: Callable[[], None] | None = None,
    ) -> Callable[[Staged], None]:
        """The update of one staged sub-group, then the unit's new params once its master is whole, then
        `then()`. With `background`, the update runs on its worker and the rest once it is done."""
        units, store, transfers = self.engine.units, self.states, self.engine.transfers

        def update(staged: Staged) -> None:
            sg = staged.sub_group
            grad = grad_of(sg)

            def complete() -> None:
                done(sg)
                master = store.collect_master(staged)
                if master is not None:  # a resident master (no staging buffer) stays as it is until wait_uploads
                    handles.append(units[sg.unit_index].start_update_params(master, stable=staged.buffer is None))
                    if staged.buffer is not None:  # a staging buffer, reused soon: uploads must have read it
                        transfers.wait_uploads()
                if then is not None:
                    then()

            if background is not None:  # only the kernel runs there; `complete` back on this thread

                def kernel() -> None:
                    with torch.no_grad():  # grad mode is per thread: the worker's starts enabled
                        self._update_sub_group(sg, staged.views, grad, hyper)

                background.submit(kernel, complete)
                return
            self._update_sub_group(sg, staged.views, grad, hyper)
            complete()

        return update

    def _update_states(self, grads: list[torch.Tensor | GradOnDisk | None], session: BackwardStep | None) -> None:
        """Swap in, update and swap out every sub-group with a gradient; write the new params. With a
        session, the sub-groups it stepped inside backward are done and its stream goes on."""
        units, store, transfers = self.engine.units, self.states, self.engine.transfers
        handles: list[Handle] = session.handles if session is not None else []
        on_disk: list[GradOnDisk | None] = [None]
        order = [sg.index for sg in store.sub_groups if grads[sg.unit_index] is not None]
        crossing = GradsToHost(transfers, grads, store.sub_groups, order, store.tier)

        def grad_of(sg: SubGroup) -> torch.Tensor:
            grad = grads[sg.unit_index]
            assert grad is not None
            if isinstance(grad, GradOnDisk):
                if on_disk[0] is not None and on_disk[0] is not grad:
                    on_disk[0].drop()  # sub-groups come unit by unit: the previous unit is done
                on_disk[0] = grad
                grad = grad.load()
            host_grad = crossing.get(sg)
            return host_grad if host_grad is not None else grad[sg.start : sg.end]

        update = self._update_fn(grad_of, crossing.done, handles, session.hyper if session is not None else None)
        if session is None:
            store.check("read")
            self._pipeline.run(order, update)
        else:
            for index in order:
                session.stream.update(index, update)
            session.stream.finish()
        if on_disk[0] is not None:
            on_disk[0].drop()
        for handle in handles:
            handle.wait()
        store.check("write")
        if session is not None:
            store.commit()
            rest = [store.sub_groups[i].unit_index for i in order]
            self._expected_units = list(dict.fromkeys(session.stepped + rest))  # next step's prefetch order
        stepped = set(session.stepped) if session is not None else set()
        for ui, (unit, steps, grad) in enumerate(zip(units, self.param_steps, grads, strict=True)):
            if grad is not None or ui in stepped:
                for slot, had in enumerate(unit.param_had_grad):
                    steps[slot] += int(had)

    def _update_sub_group(
        self, sg: SubGroup, views: StateViews, grad: torch.Tensor, hyper: list[dict[str, Any]] | None = None
    ) -> None:
        """The update over one staged sub-group's states and gradient, in place (with `hyper`: those
        hyperparameters instead of the groups' current ones). `self._sub_group_runs[sg.index]` cuts it
        by param group and parameter; `self.param_steps` counts each parameter's earlier steps."""
        raise NotImplementedError

    def _release_update(self) -> None:
        """Free what the update holds beside the states (retired or closed)."""

    # -- state ------------------------------------------------------------------------------------------
    @interrupts.entry_point
    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (owned ranges, as CPU or device tensors), hyperparameters and
        loss-scaler state. States on nvme are read one unit at a time. Called by accelerate's
        `save_state`: the whole state in torch.optim's format, on rank 0 (accelerate_loop.py)."""
        if accelerate_saves_state():  # [Note: accelerate's save_state of sharded states]
            sharded = sharded_state_dict(self)  # written by sharded_save_state's hook just before
            return sharded if sharded is not None else full_optimizer_state_dict(self, holder=0, masters=True)
        self.require_consistent_states()
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        units = [self.states.read_unit(ui) for ui in range(len(self.engine.units))]
        return {
            "master": [u.master for u in units],
            "exp_avg": [u.exp_avg for u in units],
            "exp_avg_sq": [u.exp_avg_sq for u in units],
            "state_names": list(self.state_names),  # what exp_avg and exp_avg_sq hold
            "param_steps": [list(steps) for steps in self.param_steps],
            "step_count": self.step_count,
            "param_groups": groups,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "world_size": self.engine.topo.world_size,
            "stage": self.engine.cfg.stage,
            "rank": self.engine.topo.rank,
        }

    @interrupts.entry_point
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.require_current()
        if self.pending_save is not None:  # its writer still reads the states about to be replaced
            self.pending_save.wait()
        if SHARDED_KEY in state:  # a folder zeroinf.save wrote for accelerate's save_state
            load_sharded_state(self, state)
            return
        if "master" not in state and {"state", "param_groups"} <= state.keys():  # torch.optim's format
            load_full_optimizer_state_dict(self, state)  # optim/torch_format.py
            return
        saved_names = list(state.get("state_names", ("exp_avg", "exp_avg_sq")))
        if saved_names != list(self.state_names):
            raise ValueError(
                f"{self.display_name}.load_state_dict: the state was saved by an optimizer keeping {saved_names} per "
                f"parameter, this one keeps {list(self.state_names)}: load it into the optimizer that saved it"
            )
        here = (self.engine.topo.world_size, self.engine.cfg.stage)
        there = (state["world_size"], state["stage"])
        if here != there:
            raise ValueError(
                f"optimizer state was saved at (world_size, stage) = {there} but this run is {here}; "
                "use zeroinf checkpoints to reshard"
            )
        topo = self.engine.topo
        if self.engine.policy.shard_optimizer and topo.is_distributed:
            # Each rank holds only its own shard: every rank must be given its own. Agreed by all ranks
            # (one tiny all-reduce), so all of them raise rather than one leaving the others to hang.
            given = torch.zeros(topo.world_size, dtype=torch.int64, device=topo.device)
            given[topo.rank] = int(state.get("rank", topo.rank))
            all_reduce(given, topo, async_op=False, what="the ranks of the optimizer states loaded")
            owners = [int(r) for r in given.tolist()]
            if owners != list(range(topo.world_size)):
                raise ValueError(
                    f"optimizer states of ranks {owners} loaded on ranks 0-{topo.world_size - 1}: at stage "
                    f"{self.engine.cfg.stage} each rank's state holds only its own shard (saving rank 0's alone, "
                    "as with DDP and accelerate's save_state, loses the others'). Save and load `opt.state_dict()` "
                    "on every rank, one file each, or use zeroinf.save / zeroinf.load (resharding, any world size)"
                )
        units = self.engine.units
        masters = state["master"]
        with self.replacing_states():
            self.engine.transfers.wait_uploads()  # uploads of the last step may still read the masters replaced here
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

    def prepare_retirement(self) -> None:
        """Before a newer optimizer of this model takes the states: stop unless at a step boundary
        with whole states (optim/succession.py)."""
        self.require_current()
        if self.pending_save is not None:  # its writer reads the states whose moments are about to be reset
            self.pending_save.wait()
        self.require_whole_step()
        if self._session is not None or self.engine.micro_step:
            raise RuntimeError(
                f"{self.display_name}: the previous optimizer of this model has the gradients of "
                f"{self.engine.micro_step} backward pass(es) not stepped yet: call its step() or zero_grad() "
                "before building a new one"
            )

    def retire(self) -> None:
        """Hand the states to a newer optimizer of this model: from here on every use of this one
        stops, naming the new one; the states are no longer this optimizer's to close."""
        if self._background is not None:
            self._background.close()
            self._background = None
        self._release_update()
        self._retired = True

    def require_current(self) -> None:
        if self._retired:
            raise RuntimeError(RETIRED)
        if self._closed:
            raise RuntimeError(
                f"this {self.display_name} was closed: its states (the fp32 master weights among them) are freed. "
                "Make a new optimizer for the model: it starts from the weights the model holds (optim/sharded.py "
                "[Note: an optimizer closed before the model])"
            )

    def close(self) -> None:
        """Free the optimizer states (for nvme: remove the swap files). Also done at exit."""
        if self._retired or self._closed:  # the states belong to the optimizer that replaced this one, or are gone
            return
        if self.pending_save is not None:  # its writer still reads the states
            self.pending_save.wait()
        if self.step_mode is not None:
            self.engine.backward_step = None
            self.engine.backward_prepare = None
        if self._background is not None:
            self.engine.backward_step_barrier = None
            self._background.close()
            self._background = None
        self._release_update()
        self.states.close()
        self._closed = True
        if self.engine.optimizer_ref is not None and self.engine.optimizer_ref() is self:
            # [Note: an optimizer closed before the model] Its states, the fp32 masters with them, are
            # gone, so no successor can inherit them (optim/succession.py): the model forgets it, and an
            # optimizer made later starts as the model's first, its masters from the units' values
            # (fp32 shards, a memory shard that held the master, or the NVMe parameter file: the same
            # numbers; a bf16/fp16 shard: rounded), and a weights-only `zeroinf.load` is let in.
            self.engine.optimizer_io = None
            self.engine.optimizer_ref = None
            for unit in self.engine.units:
                unit.release_master()
