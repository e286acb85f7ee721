"""`zeroinf.shard`: turn an ordinary module into a sharded one, and the engine state behind it.

The module keeps its class, its parameter objects, names and `state_dict` keys; its parameters
become views into the flat buffers of units. The engine object is the one attribute we attach
(`module._zeroinf_engine`), found again with `engine_of(module)`.

Gradient flow of one backward: each parameter's gradient lands in its unit's flat buffer
(runtime/hooks.py); on the micro-step that synchronizes, a unit whose gradients have all arrived
starts its collective at once, overlapping the rest of backward. At the start of a backward that
communicates, one small all-reduce makes the ranks agree on which parameters it reaches where
(runtime/reach.py), so a branch some ranks skip cannot desynchronize the collectives; at the end
the stragglers are reduced in unit order, and waited for.

Stage 3 adds the parameter movement (runtime/schedule.py decides, runtime/stage3_hooks.py wires
the forward's events, `pre_backward` here gathers a unit before its backward), and a unit is
released once its gradients are in. Stage 3 reduces gradients on every micro-step: keeping the
unsharded gradients of every unit across micro-steps would undo the point of sharding.
"""

from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from zeroinf.activations import ActivationOffloader, apply_activation_checkpointing, no_cache_in_training
from zeroinf.comm import all_reduce, broadcast_from_first
from zeroinf.config import DTYPES, Config
from zeroinf.memory import Ledger, Tier
from zeroinf.memory_text import MemoryReport
from zeroinf.partition.grad_pool import GradBufferPool
from zeroinf.partition.init import (
    InitFn,
    materialize_and_build,
    needs_materializing,
    refuse_changes_after_the_block,
)
from zeroinf.partition.intact import PassWrites, check_not_wrapped_in_ddp, check_params_intact
from zeroinf.partition.park import Realize
from zeroinf.partition.shard_home import MemoryHome, NvmeGradFiles, NvmeHome, NvmeParamFiles, ShardHome
from zeroinf.partition.state_entries import own_storages
from zeroinf.partition.unit import GradState, HomeFactory, ShardedUnit, ShardingPolicy
from zeroinf.partition.wrap import UnitSpec, discover_units
from zeroinf.planner.unit_plan import UnitShape, plan_units
from zeroinf.precision import buffer_in_compute_dtype, fp32_names, warn_if_upcast
from zeroinf.runtime import failed_backward, hooks, interrupts, module_methods, sync_switch
from zeroinf.runtime.reach import PENALTY_AT_STAGE_3, InputGradientPass, ReachAgreement
from zeroinf.runtime.schedule import UnshardScheduler
from zeroinf.runtime.stage3_hooks import Stage3Hooks
from zeroinf.runtime.streams import Transfers
from zeroinf.telemetry import CollectiveCounter, get_logger
from zeroinf.tiers.host import StepMemory, map_large_buffers, reuse_step_buffers
from zeroinf.tiers.io_traffic import IoTraffic
from zeroinf.tiers.nvme_tier import NvmeTier, open_grad_files, open_param_files
from zeroinf.topology import Topology, default_topology
from zeroinf.weights.source import CheckpointWeights, UnitWeights

if TYPE_CHECKING:
    from zeroinf.optim.pipeline import SubGroupPipeline
    from zeroinf.optim.states import OptimizerStateStore

ModuleT = TypeVar("ModuleT", bound=nn.Module)

_ATTR = "_zeroinf_engine"

# [Note: an fp16 backward without the loss scale]
# In fp16 the optimizer multiplies the loss by its scale before backward (`opt.backward(loss)`) and
# divides the gradients by it in `step()`. A plain `loss.backward()` (or accelerate's
# `accelerator.backward(loss)`) skipped the multiplication and nothing noticed: every gradient came
# out 65536 times too small (small ones flushed to zero in fp16), the reported norm too, so clipping
# never triggered and overflows went unseen, a silently different run. A backward that reaches the
# trainable units of an fp16 model with an optimizer therefore stops unless the scale was applied.
UNSCALED_FP16 = (
    "backward of an fp16 model whose loss was not scaled: with param_dtype fp16 call optimizer.backward(loss) "
    "instead of loss.backward() or accelerator.backward(loss) (it multiplies the loss by the dynamic loss "
    "scale that step() divides out again; zeroinf.integrations.Trainer does this itself)"
)


class Engine:
    def __init__(
        self, module: nn.Module, cfg: Config, topo: Topology, ledger: Ledger | None = None,
        init_fn: InitFn | None = None, weights: CheckpointWeights | None = None,
    ) -> None:
        self.module, self.cfg, self.topo = module, cfg, topo
        self.ledger = ledger or Ledger()
        self.counter = CollectiveCounter()
        self.transfers = Transfers(topo.device, self.ledger)  # every host<->device copy (runtime/streams.py)
        self.grad_pool = GradBufferPool(topo.device)  # gradient buffers reused within a backward
        self.policy = ShardingPolicy(cfg.resolved_stage)
        for name, p in module.named_parameters():
            if not p.is_floating_point():
                raise TypeError(f"zeroinf shards floating-point parameters only; {name} is {p.dtype}")
            if p.dtype == torch.float64:  # would be trained in fp32 (the widest master) without a word
                raise TypeError(
                    f"{name} is float64, but zeroinf computes in Config.param_dtype (fp32, bf16 or fp16) with "
                    "fp32 master weights: sharding would train it in fp32. Convert the model first "
                    "(model.float()) if that is what you want"
                )
        warn_if_upcast(module, cfg.param_torch_dtype, topo.rank)
        split, any_size = cfg.split_min_numel, cfg.split_any_size
        # what the model keeps in fp32 under a narrower compute dtype (precision.py [Note: parameters the
        # model keeps in fp32]): fp32 twins of their units, fp32 buffers
        keep = fp32_names(module, cfg)
        specs = discover_units(
            module, cfg.unit_classes, split_min_numel=split, split_any_size=any_size, keep_fp32=keep
        )
        self.specs = specs  # the trainable units: gradients, optimizer, checkpoints
        # Stage 3 shards frozen parameters too (a LoRA fine-tune's base): units of their own,
        # gathered like the rest, with no gradient and no optimizer state.
        frozen_specs = (
            discover_units(module, cfg.unit_classes, False, True, split, any_size, keep_fp32=keep)
            if cfg.stage == 3 else []
        )
        self.all_specs = specs + frozen_specs
        self.weights = weights
        # What to build for each unit, computed before any memory is touched; `zeroinf.plan` reads the same.
        self.unit_plan = plan_units(
            [UnitShape.of(spec) for spec in self.all_specs], cfg, topo.world_size, topo.device.type
        )
        offload = cfg.offload
        offloaded = "device" != offload.params or "device" != offload.optimizer or "device" != offload.gradients
        # glibc's thresholds: building, freed buffers go back to the OS; training, they are reused
        # (tiers/host.py [Note: glibc's thresholds while building and while training]).
        if offloaded:
            map_large_buffers()
        self._resident_names = {spec.key for spec in self.all_specs if self._is_resident(spec)}
        # Every NVMe engine and swap file of this rank (shards, optimizer states, checkpoints) comes from here.
        self.nvme_tier = NvmeTier(cfg.offload, topo.process_rank, self.ledger)
        weakref.finalize(self, self.nvme_tier.close)
        self.param_files: NvmeParamFiles | None = None
        self._home_factory = self._make_home_factory(self.all_specs) if self.policy.shard_params else None
        self.grad_files: NvmeGradFiles | None = None
        if cfg.offload.gradients == "nvme":
            self.grad_files = open_grad_files(self.unit_plan, self.nvme_tier)
            weakref.finalize(self, self.grad_files.close)
        # Built under zeroinf.init (parked parameters) or on the meta device: unit by unit.
        refuse_changes_after_the_block(module)  # made between a zeroinf.init block and this shard, and lost
        self._built_from_meta = needs_materializing(module)
        if self._built_from_meta or weights is not None:
            built: list[ShardedUnit] = materialize_and_build(  # type: ignore[assignment]
                module, self.all_specs, self._build_unit, topo.device, init_fn, weights
            )
            if weights is not None:
                weights.release_scratch()
        else:
            if init_fn is not None:
                with torch.no_grad():
                    module.apply(init_fn)
            built = [self._build_unit(spec) for spec in self.all_specs]
        if self.param_files is not None:
            self.param_files.max_pending_writes = None
        self.units = built[: len(specs)]
        self.frozen_units = built[len(specs) :]
        self.all_units = built  # trainable first: a trainable unit's index is the same in both lists
        # Training from here: also after a build under zeroinf.init without offload, whose 1 MiB
        # building threshold would otherwise stay and fault every large buffer in afresh each step
        # (98M GPT in memory, bf16, 2 ranks: 1.27 s/step against 0.93 built eagerly).
        reuse_step_buffers()
        module.to(topo.device)  # buffers and frozen parameters; unit parameters are already there
        # Frozen parameters and floating-point buffers take the compute dtype in place (as
        # `module.to(param_dtype)` would), so mixed-dtype arithmetic does not upcast activations
        # (precision.py [Note: which buffers take the compute dtype]).
        for pname, p in module.named_parameters():
            if keep is not None and keep(pname):  # kept in fp32: a unit's fp32 twin, or frozen and whole
                if p.dtype != torch.float32 and p.numel() > 0:
                    p.data = p.data.float()
            elif p.dtype != cfg.param_torch_dtype and p.numel() > 0:
                p.data = p.data.to(cfg.param_torch_dtype)
        for path, sub in module.named_modules():
            for name, b in sub._buffers.items():
                if b is None:
                    continue
                if keep is not None and b.is_floating_point() and keep(f"{path}.{name}" if path else name):
                    sub._buffers[name] = b.float()
                else:
                    sub._buffers[name] = buffer_in_compute_dtype(sub, name, b, cfg.param_torch_dtype)
        self._unit_of_param = {id(p): ui for ui, u in enumerate(self.all_units) for p in u.params}
        # Parameters of this model in no unit (frozen ones at stages 0-2): whole on every rank.
        self._outside_params = {id(p) for p in module.parameters() if id(p) not in self._unit_of_param}
        # Every rank starts from the first rank's module state, as DDP's constructor and FSDP's
        # sync_module_states make it: the units' parameters were broadcast as they were laid out
        # (partition/unit.py), here the buffers and the parameters in no unit. A model built from
        # another seed on each rank would otherwise train one set of weights with other buffers.
        broadcast_from_first(
            [*(p for p in module.parameters() if id(p) in self._outside_params), *module.buffers()], topo,
            "the buffers and the parameters outside units at shard",
        )
        self.trained_params = [p for u in self.units for p in u.params]  # those of the trainable units
        self.micro_step = 0  # backward passes since the last optimizer step
        # fp16: set by whoever applies the loss scale (AdamW.backward, the Trainer integration) and
        # checked when backward begins ([Note: an fp16 backward without the loss scale])
        self.loss_scaled = False
        self.step_memory = StepMemory(cfg.reuse_step_memory, topo.device.type)  # decided after the first step
        weakref.finalize(self, self.step_memory.release)  # tiers/host.py [Note: the heap after a model is deleted]
        self._in_backward = False
        self._agreement: ReachAgreement | None = None  # this backward's (runtime/reach.py)
        self._input_gradient_pass: InputGradientPass | None = None  # runtime/reach.py
        self._sync_this_backward = False
        self._reducing: deque[int] = deque()
        self._reductions_in_flight = self.unit_plan.reductions_in_flight
        # runtime/failed_backward.py [Note: a backward that raised]: set when one is noticed, until zero_grad;
        # the optimizer's part of ending it (set by zeroinf.AdamW when it steps inside backward)
        self.backward_failed = False
        self.backward_abandoned: Callable[[], None] | None = None
        # Set by zeroinf.AdamW when it steps units inside backward (optim/adamw.py [Note: the step
        # inside backward]): called with a unit's index once its reduced gradient is complete.
        self.backward_step: Callable[[int], None] | None = None
        # Called with a unit's index when its backward begins (the unit is gathered): the optimizer
        # starts reading that unit's states, so they arrive while its backward computes.
        self.backward_prepare: Callable[[int], None] | None = None
        # Called before backward's last hook touches the units: the optimizer's background kernels finish.
        self.backward_step_barrier: Callable[[], None] | None = None
        # Set by zeroinf.AdamW: its state store and sub-group pipeline, for `optimizer_states` and `io_report`.
        self.optimizer_io: tuple[OptimizerStateStore, SubGroupPipeline] | None = None
        self.optimizer_ref: Callable[[], Any] | None = None  # a weak reference to that zeroinf.AdamW
        self._step_in_this_backward = False
        # A checkpoint of this model being written in the background (checkpoint/saving.py
        # PendingSave): what changes parameters outside a step (`zeroinf.gathered` writes) waits for it.
        self.pending_save: Any = None
        self._hook_handles = [
            h
            for ui, unit in enumerate(self.units)
            for h in hooks.register_grad_ready_hooks(unit.params, functools.partial(self._on_grad_ready, ui))
        ]
        self._hook_handles.append(hooks.register_input_hook(module, lambda _: self._check_before_forward()))
        self.pass_writes = PassWrites(self.all_units)  # partition/intact.py: the model's own bumps in a pass
        self._hook_handles.append(hooks.register_output_hook(module, lambda _: self.pass_writes.end_pass()))
        if cfg.cast_forward_inputs and cfg.param_dtype != "fp32":  # Config.cast_forward_inputs
            self._hook_handles.append(hooks.register_input_cast(module, cfg.param_torch_dtype))
        # The pass begins in the outermost backward, where the model's output gets its gradient (see
        # `_begin_backward_at_output`).
        self._hook_handles.append(hooks.register_output_hook(module, self._begin_backward_at_output))
        self.scheduler: UnshardScheduler | None = None
        if self.policy.shard_params:
            stage3 = Stage3Hooks(self)
            self.scheduler = stage3.scheduler
            self._hook_handles += stage3.install()
        self.activation_offloader: ActivationOffloader | None = None
        if cfg.activation_checkpointing:
            self._setup_activation_checkpointing()
        self.io = IoTraffic(self)
        interrupts.install()  # runtime/interrupts.py [Note: Ctrl-C inside the engine]

    def __reduce_ex__(self, protocol: Any) -> Any:
        """`torch.save(model)` and `copy.deepcopy(model)` reach the engine through the module's
        attributes; it holds swap files, I/O threads and this process's shards, which no copy can
        own. Refused with the ways that work, instead of pickle's "cannot pickle '_thread.lock'"."""
        raise TypeError(hooks.UNPICKLABLE)

    def _check_before_forward(self) -> None:
        """partition/intact.py: a DDP wrapper; parameters converted, resized or written in place after
        `shard`. DDP's constructor broadcast rank 0's values into the parameters, the values every rank
        holds already: once it is refused, that write is not reported again."""
        try:
            check_not_wrapped_in_ddp(self.module)
        except RuntimeError:
            for unit in self.all_units:
                unit.remember_versions()
            raise
        check_params_intact(self.all_units)
        self.settle_failed_backward()
        self.pass_writes.begin_forward()

    def unit_index_of(self, param: torch.Tensor) -> int | None:
        """The unit holding `param`, or None (frozen, or not this model's)."""
        return self._unit_of_param.get(id(param))

    def trains(self, param: torch.Tensor) -> bool:
        """Whether a trainable unit holds `param` (frozen units come after the trainable ones)."""
        ui = self.unit_index_of(param)
        return ui is not None and ui < len(self.units)

    @property
    def optimizer_states(self) -> Any:
        """The optimizer's state store (fp32 masters and moments per unit), once one is built."""
        return self.optimizer_io[0] if self.optimizer_io is not None else None

    def _is_resident(self, spec: UnitSpec) -> bool:
        """Stage 3 keeps the root unit and units below `persist_threshold_bytes` unsharded."""
        return self.unit_plan.unit(spec.key).resident

    def _make_home_factory(self, specs: list[UnitSpec]) -> HomeFactory:
        """Where each stage-3 shard lives: resident units on the device, the others on the tier the unit
        plan gives them (offload.params; with a host/NVMe split, per unit)."""
        plan, device, ledger, transfers = self.unit_plan, self.topo.device, self.ledger, self.transfers
        files = None
        if Tier(self.cfg.offload.params) is Tier.NVME or plan.nvme_param_units:
            self.param_files = files = open_param_files(plan, self.nvme_tier)
            if files is not None:  # None: every unit is resident, nothing goes to NVMe
                files.max_pending_writes = 1  # while building (see NvmeParamFiles); lifted once built
                weakref.finalize(self, files.close)  # removes the swap files on clean shutdown

        def home(name: str, initial: torch.Tensor, resident: bool) -> ShardHome:
            tier = Tier.DEVICE if resident else plan.unit(name).param_tier
            if tier is Tier.NVME:
                assert files is not None
                return NvmeHome(name, initial, files, device, transfers)
            return MemoryHome(initial, tier, device, ledger, transfers, alias=resident)

        return home

    def _build_unit(
        self, spec: UnitSpec, realize: Realize | None = None
    ) -> ShardedUnit:
        params = [p for _, p in spec.params]
        stored = self.weights is not None and self.weights.covers(params)
        # a unit of parameters the model keeps in fp32 is laid out, gathered and reduced in fp32
        dtype = torch.float32 if spec.fp32 else self.cfg.param_torch_dtype
        grad_buffer = self.cfg.reduce_torch_dtype if spec.fp32 else DTYPES[self.unit_plan.grad_buffer_dtype]
        return ShardedUnit(
            spec.key, list(spec.params), self.topo, self.policy, dtype,
            self.cfg.reduce_torch_dtype, self.ledger, self.cfg.bucket_bytes, self.counter,
            keep_fp32_master=not self._built_from_meta and not spec.frozen,
            resident=spec.key in self._resident_names,
            home_factory=self._home_factory,
            grad_tier=Tier(self.cfg.offload.gradients),
            grad_files=self.grad_files,
            source=UnitWeights(self.weights, params) if stored and self.weights is not None else None,
            frozen=spec.frozen,
            transfers=self.transfers,
            realize=realize,
            grad_pool=self.grad_pool,
            grad_buffer_dtype=grad_buffer,
        )

    def _setup_activation_checkpointing(self) -> None:
        # The blocks, not the layers split from the root: recomputing a head saves nothing (the loss
        # keeps its output) and costs its matmul again.
        paths = {spec.name for spec in self.all_specs if spec.name and not spec.split}
        outermost = list({
            id(spec.module): spec.module for spec in self.all_specs
            if spec.name in paths and not any(spec.name.startswith(f"{other}.") for other in paths)
        }.values())
        if self.cfg.offload_activations:
            self.activation_offloader = ActivationOffloader(self.ledger, self.transfers)
        apply_activation_checkpointing(outermost, self.cfg.checkpoint_every, self.activation_offloader)
        self._hook_handles += no_cache_in_training(self.module)

    # -- stage 3: the forward's hooks are runtime/stage3_hooks.py; these are the backward's entries --
    @property
    def in_backward(self) -> bool:
        """Inside a backward of this model (a checkpoint's recompute finds its unit gathered)."""
        return self._in_backward

    def settle_failed_backward(self) -> None:
        """From outside autograd: end a backward of this model that raised midway, if one did
        (runtime/failed_backward.py [Note: a backward that raised])."""
        if self._in_backward and not failed_backward.backward_running():
            failed_backward.abandon(self)

    def release_gathered(self) -> None:
        """Before new values are written into every unit (a load): no unit stays gathered or fetching
        from a pass that never ended (a forward that raised midway holds its prefetched shards'
        staging buffers, which the writes need). The next pass gathers again what it uses."""
        self.settle_failed_backward()
        if self.scheduler is not None:
            self.scheduler.release_all()

    def pre_backward(self, index: int) -> None:
        """Unit `index`'s backward is about to run: gather it (through the scheduler)."""
        self._begin_backward_once()
        if self._input_gradient_pass is not None:
            self._input_gradient_pass.gather(self.all_units[index])
            return
        assert self.scheduler is not None
        self.scheduler.pre_backward(index)
        if self._step_in_this_backward and self.backward_prepare is not None and index < len(self.units):
            self.backward_prepare(index)

    def gather_for_backward(self, units: list[ShardedUnit]) -> None:
        """Units fetched for a module outside them (runtime/stage3_hooks.py), before its backward."""
        self._begin_backward_once()
        for unit in units:
            if self._input_gradient_pass is not None:
                self._input_gradient_pass.gather(unit)
            else:
                unit.wait_unshard()

    # -- backward -------------------------------------------------------------------------------------
    def _on_grad_ready(self, unit_index: int, param_index: int) -> None:
        self._begin_backward_once()
        self._settle_agreement()
        unit = self.units[unit_index]
        if unit.arrived(param_index) and unit.grad_state in (GradState.REDUCING, GradState.REDUCED):
            raise RuntimeError(
                f"{unit.param_names[param_index]} got a second gradient in one backward, after its unit "
                f"{unit.name} was reduced (and perhaps stepped). Autograd delivers a weight's gradient once "
                "per backward unless backwards run inside it: reentrant activation checkpointing "
                "(use_reentrant=True) with the weight used in several segments. Use use_reentrant=False "
                "(Hugging Face's default) or Config.activation_checkpointing"
            )
        if unit.accumulate_grad(param_index) and self._sync_this_backward and not unit.reduce_at_end:
            unit.start_reduce_grads()
            if self.scheduler is not None:
                self.scheduler.release(unit_index)
            # Finishing the oldest reduction as a new one starts bounds the unsharded gradient buffers
            # alive (stages 2-3) and starts the reduced shard on its way to its tier while backward
            # goes on (a host shard: the owner's d2h copy; see partition/unit_grads.py [Note: where a
            # reduced gradient lands]).
            self._reducing.append(unit_index)
            while len(self._reducing) > self._reductions_in_flight:
                reduced = self._reducing.popleft()
                self.units[reduced].wait_reduce_grads()
                if self._step_in_this_backward and self.backward_step is not None:
                    self.backward_step(reduced)

    def _begin_backward_at_output(self, output: Any) -> None:
        """Begin the engine's backward pass when the model's output gets its gradient. The first
        gradient hook would begin it too, but with reentrant activation checkpointing that hook can
        run inside a backward nested in a segment's backward, and the end of the nested one would
        end the pass (and count a micro-step) while the outer backward still runs."""
        if torch.is_grad_enabled() and not self._in_backward:
            hooks.register_pre_backward(output, self._begin_backward_once)

    def _begin_backward_once(self) -> None:
        if not self._in_backward:
            self._begin_backward()

    def _begin_backward(self) -> None:
        self._agreement = None
        if (
            self.units and not hooks.reaches_any(self.trained_params)
            and not hooks.behind_reentrant_checkpoint() and not self._reached_on_another_rank()
        ):
            self._begin_input_gradient_pass()
            return
        if self.backward_failed:
            raise RuntimeError(failed_backward.FAILED_BACKWARD)
        if self.micro_step >= self.cfg.grad_accum_steps and self.units:
            if self.optimizer_io is None:  # e.g. torch.optim.AdamW(model.parameters()): it saw no gradients
                raise RuntimeError(
                    f"backward pass {self.micro_step + 1} since the model was sharded, and no zeroinf optimizer "
                    "steps it: build the optimizer with zeroinf.AdamW(model, ...), or shard a torch optimizer's "
                    "update with zeroinf.ShardedOptimizer(torch.optim.SGD, model.parameters(), lr=...). A "
                    "torch.optim optimizer over model.parameters() finds no gradients there (the engine keeps "
                    "them, reduced and sharded) and changes nothing"
                )
            raise RuntimeError(
                f"backward pass {self.micro_step + 1} since the last optimizer step, but grad_accum_steps is "
                f"{self.cfg.grad_accum_steps}: call optimizer.step() (and zero_grad()) every "
                f"{self.cfg.grad_accum_steps} backward passes, or change grad_accum_steps"
            )
        requested = sync_switch.requested_sync(self.module)  # runtime/sync_switch.py [Note: no_sync ...]
        if requested is not None and self.units:
            last = self.micro_step + 1 == self.cfg.grad_accum_steps
            if requested != last:
                raise RuntimeError(sync_switch.mismatch(requested, self.micro_step, self.cfg.grad_accum_steps))
        scaled, self.loss_scaled = self.loss_scaled, False
        if self.cfg.param_dtype == "fp16" and self.optimizer_io is not None and not scaled:
            raise RuntimeError(UNSCALED_FP16)
        self._in_backward = True
        self.grad_pool.open()
        last = self.micro_step + 1 == self.cfg.grad_accum_steps
        self._sync_this_backward = self._next_backward_syncs()
        self._step_in_this_backward = last and self.backward_step is not None
        for unit in self.units:
            unit.hand_off = self._step_in_this_backward
        if self._sync_this_backward and self.topo.is_distributed and self.units and self._agreement is None:
            self._agree_on_reached_params()
        if self.scheduler is not None:
            self.scheduler.begin_backward()
        hooks.queue_end_of_backward(self._end_backward)

    # runtime/reach.py [Note: gradients that reach some ranks only]
    def _agree_on_reached_params(self) -> None:
        self._agreement = ReachAgreement(self.units, self.topo.everyone, self.counter)

    def _settle_agreement(self) -> None:
        if self._agreement is not None:
            self._agreement.settle()

    def _next_backward_syncs(self) -> bool:
        """Whether the backward starting now communicates (the last micro-step, or every one)."""
        last = self.micro_step + 1 == self.cfg.grad_accum_steps
        return last or self.cfg.sync_every_micro_step or self.policy.shard_params

    def _reached_on_another_rank(self) -> bool:
        """This rank's backward reaches no unit parameter: is it one for the inputs' gradients? Where
        the ranks communicate in this backward they must all take it for the same kind, so there the
        reach all-reduce decides (waited for at once; only ranks that reach nothing ask): a training
        backward if any rank reaches a parameter (this one then contributes zeros)."""
        if not (self._next_backward_syncs() and self.topo.is_distributed):
            return False
        self._agree_on_reached_params()
        self._settle_agreement()
        assert self._agreement is not None
        return self._agreement.reached_anywhere

    # runtime/reach.py [Note: a backward for the inputs' gradients]
    def _begin_input_gradient_pass(self) -> None:
        if self.policy.shard_params and torch.is_grad_enabled():
            raise RuntimeError(PENALTY_AT_STAGE_3)
        self._in_backward = True  # an activation-checkpoint recompute in it finds its unit gathered
        self._input_gradient_pass = InputGradientPass()
        hooks.queue_end_of_backward(self._end_input_gradient_pass)

    def _end_input_gradient_pass(self) -> None:
        self.pass_writes.end_pass()
        assert self._input_gradient_pass is not None
        self._input_gradient_pass.release_all()
        self._input_gradient_pass = None
        self._in_backward = False

    def _end_backward(self) -> None:
        try:
            self._finish_backward()
        except BaseException:  # a collective or an I/O error at the end: the pass ended midway all the same
            failed_backward.abandon(self)
            raise

    def _finish_backward(self) -> None:
        self.pass_writes.end_pass()
        self._settle_agreement()
        if self.backward_step_barrier is not None:
            self.backward_step_barrier()
        self._in_backward = False
        if self.units:  # a frozen model (nothing to train) is never stepped: its backwards are not micro-steps
            self.micro_step += 1
        for unit in self.units:
            unit.end_backward()
        if self._sync_this_backward and self.units:
            self._reduce_all()
        self._reducing.clear()
        if self.grad_files is not None:
            self.grad_files.drain()
        if self.scheduler is not None:
            self.scheduler.end_backward()
        self.grad_pool.close()

    def _reduce_all(self) -> None:
        """Agree across ranks on which parameters got gradients (unless the start of backward has),
        then reduce every unit that has any."""
        agreed = [had for u in self.units for had in u.param_had_grad]
        agreed_at_start = self._agreement is not None and self._agreement.every_parameter_reached
        if self.topo.is_distributed and not agreed_at_start:
            flags = torch.tensor(agreed, dtype=torch.int32, device=self.topo.device)
            all_reduce(flags, self.topo.everyone, async_op=False, what="which parameters got gradients")
            self.counter.add("all_reduce")
            agreed = (flags > 0).tolist()
        offset = 0
        for unit in self.units:
            n = len(unit.params)
            unit.param_had_grad = agreed[offset : offset + n]
            offset += n
            if any(unit.param_had_grad) and unit.grad_state is GradState.EMPTY:
                unit.materialize_zero_grad()  # this rank had no gradient, others did: contribute zeros
            unit.start_reduce_grads()
        for unit in self.units:
            unit.wait_reduce_grads()

    # -- step boundary ----------------------------------------------------------------------------------
    def require_step_boundary(self) -> None:
        self.settle_failed_backward()
        if self.backward_failed:
            raise RuntimeError(failed_backward.FAILED_BACKWARD)
        if self.micro_step == 0 and any(p.grad is not None for p in self.trained_params):
            # The engine never leaves a gradient in p.grad of a unit parameter: someone put these there
            # and stepped without a backward, as torch.distributed.checkpoint's get_optimizer_state_dict
            # and set_optimizer_state_dict do to create an optimizer's state.
            raise RuntimeError(
                "optimizer.step() without a backward pass, over gradients placed in p.grad by hand (as "
                "torch.distributed.checkpoint's get_/set_optimizer_state_dict do to create optimizer state): "
                "zeroinf.AdamW keeps its states sharded on their tiers, not in optimizer.state, and takes "
                "gradients from backward only. Save and load them with zeroinf.save / zeroinf.load (sharded, "
                "resharding to any world size), or whole in torch.optim's format with "
                "zeroinf.full_optimizer_state_dict / load_full_optimizer_state_dict; the model's weights alone: "
                "model.state_dict() / load_state_dict"
            )
        if self.micro_step != self.cfg.grad_accum_steps:
            raise RuntimeError(
                f"optimizer.step() after {self.micro_step} backward passes, but grad_accum_steps is "
                f"{self.cfg.grad_accum_steps}: step once every {self.cfg.grad_accum_steps} backward passes"
            )
        # A gradient in `p.grad` means a parameter no trainable unit holds: added after `shard` (a
        # replaced head, `resize_token_embeddings`) or unfrozen after it. No optimizer would ever step
        # it. (Unit parameters never keep `p.grad`: the engine takes each gradient as it arrives.)
        stray = [name for name, p in self.module.named_parameters() if p.grad is not None and not self.trains(p)]
        if stray:
            raise RuntimeError(
                f"{stray[:3]}{f' and {len(stray) - 3} more' if len(stray) > 3 else ''} got gradients, but no "
                "zeroinf unit trains them: parameters added after zeroinf.shard (a replaced module, "
                "resize_token_embeddings) or unfrozen after it are not sharded, and no optimizer steps them. "
                "Make such changes before zeroinf.shard (with zeroinf.from_pretrained: in prepare=)"
            )

    def end_step(self) -> None:
        self.transfers.order_uploads()  # whatever runs after the step reads the new parameters
        self.step_memory.after_step()
        self.io.end_step()
        self.micro_step = 0
        self.counter.end_step()
        self.transfers.end_step()
        self.ledger_step_peaks = self.ledger.snapshot()
        self.ledger.reset_peak()

    def zero_grad(self) -> None:
        self.settle_failed_backward()
        self.backward_failed = False
        self.grad_pool.close()
        # Discarded gradients (a GAN's generator step backpropagates through the discriminator, whose
        # optimizer then zeroes them): the next backward starts a new accumulation.
        self.micro_step = 0
        for unit in self.units:
            unit.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    def close(self) -> None:
        """Finish pending I/O and remove this rank's parameter swap files (also done at exit), and
        the fp32 values `zeroinf.init(exact_masters=True)` kept for masters no optimizer took."""
        for unit in self.units:
            unit.drop_kept_masters()
        self.transfers.close()
        if self.param_files is not None:
            self.param_files.close()
        if self.grad_files is not None:
            self.grad_files.close()
        self.nvme_tier.close()

    def io_report(self) -> dict[str, Any]:
        """NVMe traffic of this rank (tiers/io_traffic.py `IoTraffic.report`)."""
        return self.io.report()

    def memory_report(self) -> dict[str, Any]:
        report: dict[str, Any] = self.ledger.snapshot()
        # Bytes per parameter of this rank's share (model size / world), live and peak, per tier: with
        # the optimizer on the host and stepped inside backward, host is 12 plus the staging.
        params_per_rank = sum(u.layout.numel for u in self.all_units) / self.topo.world_size
        for tier in ("device", "host", "nvme"):
            for kind in ("live", "peak"):
                value = report[tier][f"{kind}_bytes"] / params_per_rank if params_per_rank else 0.0
                report[tier][f"{kind}_bytes_per_param"] = value
        report["io"] = self.io_report()
        report["collectives_last_step"] = dict(self.counter.last_step)
        report["collectives_total"] = dict(self.counter.total)
        report["transfers"] = self.transfers.stats.report()
        report["units"] = len(self.all_units)
        report["frozen_units"] = len(self.frozen_units)
        report["resident_units"] = sum(u.resident for u in self.all_units)
        report["step_memory"] = self.step_memory.report()  # Config.reuse_step_memory, as decided
        if self.scheduler is not None:
            traces = (self.scheduler.forward_trace, self.scheduler.backward_trace)
            report["trace_departures"] = sum(t.departures for t in traces)
        return report


def shard(
    module: ModuleT, cfg: Config | Mapping[str, Any] | None = None, topology: Topology | None = None,
    init_fn: InitFn | None = None,
    weights: CheckpointWeights | None = None,
) -> ModuleT:
    """Shard `module` in place according to `cfg` (default: `Config()`) and return it.

    `topology` defaults to the default process group (initialized here from torchrun's environment
    if it is not yet), or a single process. A module
    built under `zeroinf.init()` is materialized here unit by unit; `init_fn(module)` runs on every
    module while its unit is unsharded (after `reset_parameters`), for custom initialization.
    `weights` (zeroinf.from_pretrained builds it): parameters it covers are read from its files,
    each rank reading only its own shards, unit by unit.
    """
    if hasattr(module, _ATTR):
        raise RuntimeError("zeroinf.shard: this module is already sharded")
    cfg = Config.of(cfg, "zeroinf.shard")
    from zeroinf.integrations.peft_layers import install_gathered_merges, refuse_unsupported_adapters

    refuse_unsupported_adapters(module, checkpointing=cfg.activation_checkpointing is True)
    topo = (topology or default_topology(cfg.collective_timeout_s)).with_config(cfg)
    if topo.check_collectives and topo.rank == 0:
        get_logger().warning(
            "collective checks are on (Config.check_collectives or ZEROINF_CHECK_COLLECTIVES=1): each collective "
            "waits for a check across ranks first (for finding where ranks diverge; turn it off to train at speed)"
        )
    if cfg.is_auto:
        cfg = resolve_auto(module, cfg, topo)
        refuse_unsupported_adapters(module, checkpointing=cfg.activation_checkpointing is True)
    engine = Engine(module, cfg, topo, init_fn=init_fn, weights=weights)
    setattr(module, _ATTR, engine)
    from zeroinf.partition.load_state import install_load_hooks  # it builds on this module: imported here

    engine._hook_handles += install_load_hooks(engine)  # model.load_state_dict loads into the units
    engine._hook_handles.append(hooks.register_state_dict_hook(module, own_storages(engine.all_units)))
    engine._hook_handles += install_gathered_merges(module)  # type: ignore[arg-type]  # peft's merges run gathered
    if engine.policy.shard_params and topo.is_distributed:
        # What Hugging Face reads (its FSDP2 integration sets it too) to keep every rank running the
        # same modules while parameters are sharded: `generate` defaults to `synced_gpus=True` at
        # world > 1 (a rank that has finished goes on running forward passes until every rank has),
        # and the encoders with LayerDrop (wav2vec2, HuBERT, WavLM, ...) run every layer. On every
        # submodule, since those encoders ask of themselves, as FSDP1 marks every module it manages.
        # Only with other ranks to keep in step: a process alone has nothing to sync, and
        # Seq2SeqTrainer passes `synced_gpus=True` to `generate` for a marked model whatever the
        # world, whose first all-reduce then stopped a single process without a process group.
        # (The ignore: the stub of nn.Module.__setattr__ takes tensors and modules only, not this flag.)
        for sub in module.modules():
            sub._is_fsdp_managed_module = True  # type: ignore[assignment]
            # torch.compile reads the same flag and refuses to trace a module so marked unless this one
            # is set too; true here as well: the module keeps its own nn.Parameter objects.
            sub._fsdp_use_orig_params = True  # type: ignore[assignment]
    sync_switch.install(module)  # DDP's no_sync, FSDP2's set_requires_gradient_sync: checked, not ignored
    module_methods.install(module)  # zero_grad discards the engine's gradients; HF's num_parameters full sizes
    # accelerate's guard against double wrapping: `accelerator.prepare` returns the model unchanged
    # (integrations/trainer.py [Note: accelerate and the sharded model]).
    module._is_accelerate_prepared = True  # type: ignore[assignment]
    _engines.add(engine)
    from zeroinf.optim import torch_clip  # it asks this module for a parameter's engine: imported here

    torch_clip.install()  # torch's clip_grad_norm_ over this model's parameters asks the engine
    return module


def resolve_auto(module: nn.Module, cfg: Config, topo: Topology) -> Config:
    """The "auto" placement fields of `cfg` chosen by `zeroinf.plan` for this module (rank 0 decides,
    every rank builds the same); the choice and its prediction are logged."""
    from zeroinf.planner.api import resolve_for_ranks
    from zeroinf.planner.report import format_estimate

    chosen, result = resolve_for_ranks(cfg, module, topo)
    if result is not None and result.best is not None:
        get_logger().info("auto placement (zeroinf.plan): %s", format_estimate(result.best))
    return chosen


_engines: weakref.WeakSet[Engine] = weakref.WeakSet()  # every live engine, to find a parameter's


def owning_engine(param: torch.Tensor) -> tuple[Engine, int] | None:
    """The engine and unit index holding `param` (a parameter of a sharded model), or None."""
    for engine in list(_engines):
        ui = engine.unit_index_of(param)
        if ui is not None:
            return engine, ui
    return None


def holding_engine_outside_units(param: torch.Tensor) -> Engine | None:
    """The engine of the sharded model that holds `param` outside its units (a frozen parameter at
    stages 0-2: whole on every rank, nothing to gather), or None."""
    for engine in list(_engines):
        if id(param) in engine._outside_params:
            return engine
    return None


def sharded_engine(module: nn.Module) -> Engine | None:
    """The engine behind `module` if it is sharded, else None."""
    return getattr(module, _ATTR, None)


def engine_containing(module: nn.Module) -> Engine | None:
    """The engine of the sharded model `module` is part of (itself, or a submodule), or None."""
    engine = sharded_engine(module)
    if engine is not None:
        return engine
    return next((e for e in list(_engines) if any(m is module for m in e.module.modules())), None)


def engine_of(module: nn.Module) -> Engine:
    engine = sharded_engine(module)
    if engine is None:
        raise TypeError("this module is not sharded: call `model = zeroinf.shard(model, cfg)` first")
    return engine


def memory_report(module: nn.Module) -> MemoryReport:
    """Live and peak bytes per tier (by tag) and collectives per step, from the engine's own accounting.

    `peak_bytes` covers the window since the last optimizer step; `last_step` holds the previous
    step's snapshot (peaks included). A dict; `print()` shows it as a short table (memory_text.py).
    """
    engine = engine_of(module)
    report = MemoryReport(engine.memory_report())
    report["last_step"] = getattr(engine, "ledger_step_peaks", None)
    return report
