"""The optimizer step inside backward: zeroinf.AdamW steps each unit as its gradient completes.

[Note: the step inside backward]
Wherever the states are (`offload.step_in_backward`, optim `step_mode`), each unit is stepped
inside the last micro-step's backward as soon as its reduced gradient is complete (the engine
calls `_step_unit_in_backward`), while backward goes on with the other units: the state swaps
overlap backward's compute and I/O, and the reduced gradient is taken where the collective left it
(unit.py `hand_off`), so with one micro-step it never goes to its tier and back (8 bytes per
parameter per step when gradients are on NVMe) and is freed once its unit is stepped: on the
device, too, no gradient of the model's size exists (12 bytes per parameter instead of 16 at the
peak of a stage-3 run held on the device; FSDP2 keeps every gradient until its step). The states
are read ahead along the order in which the last step's backward completed the units
(`SubGroupStream`); `step()` steps the units completed at the end of backward and finishes. The
result is bitwise the step after backward:
the same kernel on the same values with the same hyperparameters. Two things need every gradient:
- Global-norm clipping and the fp16 overflow check. Without them ("final") each unit's step is
  final as it goes. With them ("speculative") units are stepped with coefficient 1 / loss scale,
  and `step()` computes the norm exactly as the step after backward would (every gradient landed
  on its tier first, so the same bits decide). If clipping triggered or fp16 overflowed, the step
  is undone: NVMe states were written to each sub-group's second swap slot, so the first still
  holds the old ones (disk space x2, no extra bytes moved); host and device states were copied
  before each update (12 bytes per stepped element of memory until `step()`, so `auto` speculates
  there only when asked: `step_in_backward = true`). Then the whole step is redone after backward
  with the clipped gradients (or skipped, the old parameters written back). After a step that clipped,
  the next one holds back (steps after backward): clipping tends to persist, and a run that clips
  every step then pays one undo, not one per step.
- Hyperparameters changed between backward and `step()`: a speculative step is redone with the
  new ones; a final step cannot be, so it completes with the backward-time values and `step()`
  raises, naming the groups. LR schedulers change them after `step()`, which is fine.
With the states in host memory and an accelerator computing backward (`offload.step_thread`),
each unit's CPU kernel runs on a worker thread (optim/background.py) and the rest of backward
keeps being queued meanwhile; the unit's upload and the release of its gradient follow on the
backward thread once its kernel is done, and the engine waits for the worker before backward ends.
`zero_grad()` between backward and `step()` is refused once units were stepped (the step cannot
be unmade without speculation). With gradient accumulation at stage 3 the earlier micro-steps'
shards are already on their tier; those units are stepped in `step()` as before.


[Note: states read while their unit's backward runs]
With the states on NVMe, a unit's sub-groups used to be read when its gradient was complete, one
sub-group ahead of the update: backward stood still while a unit's states crossed the disk one
piece at a time (1.31B GPT, fp32, fully on NVMe, 512 tokens, AMD EPYC: 10 s of the 33 s backward
blocked on those reads, the disk idle more than half the step). Now the engine calls
`_prepare_unit_in_backward` when a unit's backward begins (its parameters gathered, so its masters
are copied from the gathered shard rather than read from the parameter file): every sub-group of the
unit that finds a free staging slot starts reading, and the reads land while the unit's backward
computes. Slots still held by the previous unit's writes are reclaimed once those finish, never
waited for. `offload.buffer_count = "auto"` sizes the pool for that: two units' sub-groups and two
more, within 1 GiB (3 under `max_host_bytes`). The stream itself reads one sub-group ahead only:
reading further along the order would reach units not yet gathered, whose masters would come from
the parameter file, 4 more bytes per parameter a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zeroinf.comm import Handle
from zeroinf.engine import Engine
from zeroinf.memory import Tier
from zeroinf.optim.background import BackgroundSteps
from zeroinf.optim.nvme_states import NvmeStateStore
from zeroinf.optim.pipeline import Staged, SubGroup, SubGroupPipeline, SubGroupStream
from zeroinf.optim.states import ResidentStateStore, SplitStateStore
from zeroinf.optim.step_grads import GradsToHost
from zeroinf.runtime.hooks import weak_callable
from zeroinf.telemetry import phase_scope


@dataclass
class BackwardStep:
    """One optimizer step begun inside backward ([Note: the step inside backward])."""

    speculative: bool
    coef: float  # the gradient factor it stepped with: 1 / loss scale, no clipping
    hyper: list[dict[str, Any]]  # each group's hyperparameters (lr, betas, ...) at backward time
    stream: SubGroupStream
    stepped: list[int] = field(default_factory=list)  # units, in the order backward completed them
    squares: dict[int, torch.Tensor] = field(default_factory=dict)  # track_grad_norm: stepped units' squares
    handles: list[Handle] = field(default_factory=list)
    hyper_changed: RuntimeError | None = None


class StepInBackward:
    """What a sharded optimizer does inside backward ([Note: the step inside backward]). A part of
    optim/sharded.py's ShardedOptimizerBase (its base class) with a concept of its own: that class
    sets the attributes below and provides the update of one sub-group (`_update_fn`) and the loss scale."""

    engine: Engine
    states: ResidentStateStore | NvmeStateStore | SplitStateStore
    param_groups: list[dict[str, Any]]
    hyperparameter_keys: tuple[str, ...]  # the group entries an update reads
    pending_save: Any
    track_grad_norm: bool
    step_mode: str | None  # None, "final" or "speculative" (planner/unit_plan.py step_in_backward_mode)
    rollbacks: int  # speculative steps undone (clipping triggered, fp16 overflow, changed lr)
    _pipeline: SubGroupPipeline
    _unit_sub_groups: list[list[int]]
    _session: BackwardStep | None
    _expected_units: list[int]  # backward's order of completing units, learned each step
    _hold_back: bool  # the last step clipped: this one steps after backward (likely clips again)
    _background: BackgroundSteps | None  # kernels stepped inside backward on a worker thread
    # runtime/failed_backward.py: a backward that raised after a final step had stepped units in it
    _partly_stepped: RuntimeError | None
    # The update of one staged sub-group: (grad_of, done, handles, hyper, background, then) -> update
    _update_fn: Callable[..., Callable[[Staged], None]]

    @property
    def loss_scale(self) -> float:
        raise NotImplementedError

    def require_current(self) -> None:  # the optimizer's: stop once a newer optimizer took the states over
        raise NotImplementedError

    def _install_step_in_backward(self) -> None:
        """Give the engine the calls it makes in backward (weakly: a collected optimizer steps nothing)."""
        if self.step_mode is None:
            return
        if self.engine.backward_step is not None:
            raise RuntimeError(
                "a zeroinf.AdamW already steps this model inside backward (a new one takes the previous one's "
                "place through optim/succession.py, which unhooks it first: this is a bug)"
            )
        # Each held weakly (runtime/hooks.py weak_callable): a collected optimizer steps nothing.
        self.engine.backward_step = weak_callable(self._step_unit_in_backward)
        self.engine.backward_abandoned = weak_callable(self._abandon_backward_step)
        if self.states.staging_slots is not None:  # states that swap: read them ahead
            self.engine.backward_prepare = weak_callable(self._prepare_unit_in_backward)
        if self._wants_step_thread():
            self._background = BackgroundSteps()
            self.engine.backward_step_barrier = weak_callable(self._background.drain)

    def _wants_step_thread(self) -> bool:
        """`offload.step_thread`: states wholly in host memory (a CPU kernel, nothing to swap), and
        an accelerator computing backward beside it (or asked for explicitly)."""
        setting = self.engine.cfg.offload.step_thread
        resident_host = isinstance(self.states, ResidentStateStore) and self.states.tier is Tier.HOST
        if setting is False or not resident_host:
            return False
        return setting is True or self.engine.topo.device.type != "cpu"

    def _fp32(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        return grad if grad is None or grad.dtype == torch.float32 else grad.float()

    def _land_speculative(self, session: BackwardStep | None) -> None:
        """A speculative step inside backward kept its gradients: put every one on its tier, as a step
        after backward would find it, so the global norm is computed from the same values in the same
        places and the same bits decide the same way."""
        if session is not None and session.speculative:
            for unit in self.engine.units:
                unit.land_handed_off()
            self.engine.transfers.retire()

    def _hyperparameters(self) -> list[dict[str, Any]]:
        return [{k: group[k] for k in self.hyperparameter_keys} for group in self.param_groups]

    def _open_session(self) -> BackwardStep:
        """The first unit of a step is ready inside backward: get the states ready to be stepped."""
        if self.pending_save is not None:  # its writer still reads the states about to change
            self.pending_save.wait()
        engine = self.engine
        engine.transfers.retire()
        engine.transfers.wait_uploads()  # the last step's uploads have read the masters
        self.states.require_healthy()
        self.states.check("read")
        speculative = self.step_mode == "speculative"
        if speculative:
            self.states.speculate()
        expected = [k for ui in self._expected_units for k in self._unit_sub_groups[ui]]
        return BackwardStep(
            speculative=speculative,
            coef=1.0 / self.loss_scale,
            hyper=self._hyperparameters(),
            # one sub-group ahead along the order: the reads of a unit's states start with its backward
            # (`_prepare_unit_in_backward`); reading further ahead would read masters of units not
            # yet gathered from the parameter file ([Note: masters in the parameter file])
            stream=self._pipeline.open(expected, lookahead=1),
        )

    def _prepare_unit_in_backward(self, ui: int) -> None:
        """Unit `ui`'s backward begins: start reading its states into free staging slots, so they are
        in memory when its gradient is ([Note: states read while their unit's backward runs])."""
        if (self._hold_back and self.step_mode == "speculative") or not self._unit_sub_groups[ui]:
            return
        session = self._session = self._session or self._open_session()
        session.stream.prefetch(self._unit_sub_groups[ui])

    @torch.no_grad()
    def _step_unit_in_backward(self, ui: int) -> None:
        """Called by the engine in backward once unit `ui`'s reduced gradient is complete."""
        unit = self.engine.units[ui]
        if self._hold_back and self.step_mode == "speculative":
            return
        if not unit.grad_in_memory or not self._unit_sub_groups[ui]:
            return  # accumulated on its tier over micro-steps (or nothing owned): stepped in step()
        raw = self._fp32(unit.owned_grad())
        if raw is None:
            return
        session = self._session = self._session or self._open_session()
        if self.track_grad_norm and not session.speculative:  # the gradient is freed before step()
            session.squares[ui] = torch.linalg.vector_norm(raw, dtype=torch.float32) ** 2  # as optim/clip.py
        grad = raw * session.coef if session.coef != 1.0 else raw  # the original stays for a redo
        clip_value = self.engine.cfg.grad_clip_value
        if clip_value is not None:
            keep = grad is raw and session.speculative
            grad = grad.clamp(-clip_value, clip_value) if keep else grad.clamp_(-clip_value, clip_value)
        grads: list = [None] * len(self.engine.units)
        grads[ui] = grad
        crossing = GradsToHost(
            self.engine.transfers, grads, self.states.sub_groups, self._unit_sub_groups[ui], self.states.tier
        )

        def grad_of(sg: SubGroup) -> torch.Tensor:
            host_grad = crossing.get(sg)
            return host_grad if host_grad is not None else grad[sg.start : sg.end]

        indices = self._unit_sub_groups[ui]
        background = self._background

        def after_unit() -> None:  # once every sub-group of the unit is updated: its gradient is done with
            if session.speculative:
                unit.land_handed_off()
            else:
                unit.release_handed_off()

        remaining = [len(indices)]

        def after_sub_group() -> None:
            remaining[0] -= 1
            if remaining[0] == 0:
                after_unit()

        update = self._update_fn(grad_of, crossing.done, session.handles, session.hyper, background, after_sub_group)
        try:
            if background is not None:
                background.complete_finished()  # earlier units' uploads and releases, without waiting
            with phase_scope("zeroinf::optimizer"):
                for index in indices:
                    session.stream.update(index, update)
        except BaseException:
            self._session = None  # the stream is aborted and the store marked: every later step refuses
            raise
        session.stepped.append(ui)

    def _abandon_backward_step(self) -> None:
        """The backward that began this step raised midway (runtime/failed_backward.py [Note: a
        backward that raised]): a speculative step is undone; a final one that stepped units cannot
        be, and `require_whole_step` then refuses to go on."""
        if self._background is not None:
            self._background.drain()
        session, self._session = self._session, None
        if session is None:
            return
        if session.speculative:
            self._undo(session, restore_params=True)
            return
        session.stream.finish()
        for handle in session.handles:
            handle.wait()
        if session.stepped:
            self._partly_stepped = RuntimeError(
                f"a backward pass raised midway after offload.step_in_backward had already stepped "
                f"{len(session.stepped)} of {len(self.engine.units)} units inside it, with no way back (a final "
                "step keeps no copy of the old states): the model and optimizer are partly updated. Load the "
                "last checkpoint (zeroinf.load) to go on; for a loop that skips batches whose backward fails "
                "(out of memory), set offload.step_in_backward = false, or clip gradients (grad_clip_norm), "
                "under which the step inside backward is undone instead"
            )

    def require_whole_step(self) -> None:
        """Stop if a failed backward left the model partly stepped (see `_abandon_backward_step`)."""
        self.require_current()
        self.engine.settle_failed_backward()
        if self._partly_stepped is not None:
            raise self._partly_stepped

    def require_consistent_states(self) -> None:
        """Before the states are read to be kept (a checkpoint, `state_dict`): no step left them
        half-updated, through a failed backward or a step that stopped midway."""
        self.require_whole_step()
        self.states.require_healthy()

    @contextlib.contextmanager
    def replacing_states(self) -> Iterator[None]:
        """Around a load that writes every unit's states and parameters (`zeroinf.load`,
        `load_state_dict`): units a pass cut short left gathered or fetching are released first (their
        staging buffers are what the writes need), an earlier failure is forgotten for the writes, a
        load that stops midway marks the states failed again, and one that completes leaves a partly
        stepped model whole."""
        self.require_current()
        self.engine.release_gathered()
        if self._session is not None:  # a step inside backward still waiting for `step()`: moot, every
            self._abandon_backward_step()  # state is rewritten; its stream holds staging buffers the writes need
        self.states.forget_failure()
        try:
            yield
        except BaseException as exc:
            self.states.fail(exc)  # some units loaded, the others not
            raise
        self._partly_stepped = None

    def _undo(self, session: BackwardStep, restore_params: bool) -> None:
        """Roll a speculative step back: the states before it; with `restore_params`, the parameters too
        (a redo rewrites them otherwise)."""
        session.stream.finish()
        for handle in session.handles:
            handle.wait()
        self.engine.transfers.wait_uploads()  # writes of the stepped shards still read the masters
        self.states.rollback()
        self.rollbacks += 1
        if restore_params:
            handles = [self.engine.units[ui].start_update_params(self.states.read_unit(ui).master)
                       for ui in session.stepped]
            for handle in handles:
                handle.wait()
            self.engine.transfers.wait_uploads()

    def _check_hyperparameters(self, session: BackwardStep) -> None:
        """A final step used the hyperparameters of backward time; a change since then cannot apply to
        the units already stepped, so the whole step uses the old values and step() raises after."""
        now = self._hyperparameters()
        if now != session.hyper:
            changed = [i for i, (a, b) in enumerate(zip(now, session.hyper, strict=True)) if a != b]
            session.hyper_changed = RuntimeError(
                f"the hyperparameters of param group(s) {changed} changed between backward and optimizer.step(), "
                f"but offload.step_in_backward had already stepped {len(session.stepped)} units inside backward "
                "with the values they had then; this whole step used those values. Change hyperparameters "
                "before backward (LR schedulers do: scheduler.step() follows optimizer.step()), or set "
                "offload.step_in_backward = false"
            )
