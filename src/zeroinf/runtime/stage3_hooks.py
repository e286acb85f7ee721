"""Stage 3's module hooks: the events at which units are gathered and released in the forward.

runtime/schedule.py decides what to gather and when; this file wires the module events to it:
- the root module's forward begins a pass (the last step's parameter uploads are ordered first)
  and ends it;
- a unit's forward pre/post hooks gather and release it through the scheduler, and a hook on its
  outputs gathers it again before its backward (the engine's `_pre_backward`); a frozen unit has no
  gradients to tell when its backward is done, so the gradients of its inputs do;
- a module whose parameters belong to a unit it does not run inside (a head tied to an embedding
  of another unit) fetches that unit on demand and releases it after its forward, gathering it
  again before its backward;
- a unit module's own parameters read outside its forward during a pass (a head computed as
  `F.linear(x, self.tok_emb.weight)`) gather the unit and keep it to the pass's end
  (runtime/external_reads.py);
- `model.state_dict()` gathers one unit at a time into full copies.
"""

from __future__ import annotations

import collections
import functools
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroinf.partition.unit import ParamState, ShardedUnit
from zeroinf.partition.wrap import UnitSpec
from zeroinf.runtime import hooks
from zeroinf.runtime.external_reads import guard_reads
from zeroinf.runtime.schedule import PrefetchBudget, UnshardScheduler

if TYPE_CHECKING:
    from zeroinf.engine import Engine


class Stage3Hooks:
    """Installs stage 3's forward hooks on an engine's module and answers them (module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        cfg = engine.cfg
        budget = PrefetchBudget(
            prefetch_bytes=cfg.prefetch_bytes,
            max_live_bytes=cfg.max_live_bytes if cfg.max_live_bytes is not None else 2**62,
        )
        self.scheduler = UnshardScheduler(engine.all_units, budget)
        cache = engine.param_files.cache if engine.param_files is not None else None
        if cache is not None:  # the parameter cache evicts along the traced order of units
            names = [u.name for u in engine.all_units]
            self.scheduler.on_traced = lambda order: cache.policy.set_order([names[i] for i in order])
        self._index_of = {id(unit): i for i, unit in enumerate(engine.all_units)}
        self._external: dict[int, list[ShardedUnit]] = {}  # id(module) -> units fetched for it on demand
        self._fetch_external_eagerly = hooks.eager(self._fetch_external)  # called from traceable hooks
        self._release_external_eagerly = hooks.eager(self._release_external)
        # unit -> its training forwards that registered no pre-backward hook (inside a reentrant checkpoint)
        self._forwards_without_hook: collections.Counter[int] = collections.Counter()

    def install(self) -> list[RemovableHandle]:
        engine, module = self.engine, self.engine.module
        handles = hooks.register_forward_hooks(module, self._root_pre_forward, self._root_post_forward)
        handles.append(
            module._register_state_dict_hook(
                hooks.eager(lambda m, state_dict, prefix, local_metadata: self.gather_full_state(state_dict, prefix))
            )
        )
        unit_modules = set()
        own_params: dict[int, dict[str, ShardedUnit]] = {}  # id(unit module) -> its own parameters' units
        for ui, spec in enumerate(engine.all_specs):
            unit = engine.all_units[ui]
            if spec.name and not unit.resident:
                unit_modules.add(id(spec.module))
                handles += self._unit_hooks(ui, spec)
                owned_here = {id(p) for p in unit.params}
                for pname, p in spec.module._parameters.items():
                    if p is not None and id(p) in owned_here:
                        own_params.setdefault(id(spec.module), {})[pname] = unit
        by_id = {id(spec.module): spec.module for spec in engine.all_specs}
        for mid, names in own_params.items():
            handles.append(guard_reads(by_id[mid], names, self._read_outside_forward))  # type: ignore[arg-type]
        for m in module.modules():
            indices = {engine.unit_index_of(p) for p in m.parameters(recurse=False)}
            owned = [engine.all_units[i] for i in sorted(i for i in indices if i is not None)]
            units = tuple(u for u in owned if not u.resident)
            if units and id(m) not in unit_modules:
                handles += hooks.register_forward_hooks(
                    m,
                    functools.partial(self._external_pre_forward, owned=units),
                    self._external_post_forward,
                    traceable=True,
                )
        return handles

    def _unit_hooks(self, ui: int, spec: UnitSpec) -> list[RemovableHandle]:
        """The forward hooks of non-resident unit `ui` (and the hook on its inputs, frozen)."""
        handles = hooks.register_forward_hooks(
            spec.module, lambda m: self._unit_pre_forward(ui), lambda m, out: self._unit_post_forward(ui, out)
        )
        if spec.frozen:  # no gradients to say when it is done: the gradients of its inputs do
            handles.append(hooks.register_input_hook(spec.module, lambda ins: self._frozen_inputs(ui, ins)))
        return handles

    def gather_full_state(self, state_dict: dict[str, Any], prefix: str = "") -> None:
        """Fill `state_dict` entries of sharded parameters with full copies, one unit at a time.

        A collective: every rank must call it (as `model.state_dict()` does at stage 3).
        """
        names_of: dict[int, list[str]] = {}  # every name of a parameter (tied ones have several)
        for name, p in self.engine.module.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(prefix + name)
        for unit in self.engine.all_units:
            was_sharded = unit.state is not ParamState.UNSHARDED
            unit.wait_unshard()
            for p in unit.params:
                full = p.detach().clone()
                for name in names_of.get(id(p), []):
                    if name in state_dict:
                        state_dict[name] = full
            if was_sharded:
                unit.reshard()

    def _read_outside_forward(self, unit: ShardedUnit) -> None:
        """A unit module's own parameter is read while the unit is not gathered (external_reads.py)."""
        self.scheduler.read_outside(self._index_of[id(unit)])

    def _root_pre_forward(self, _: nn.Module) -> None:
        self.engine.transfers.order_uploads()  # parameters updated by the last step, before any kernel reads them
        self._forwards_without_hook.clear()
        self.scheduler.begin_forward(training=torch.is_grad_enabled())

    def _root_post_forward(self, _: nn.Module, output: Any) -> None:
        self.scheduler.end_forward()

    def _unit_pre_forward(self, index: int) -> None:
        if self.engine.in_backward:  # activation-checkpoint recompute: the unit stays until its grads are in
            if self._forwards_without_hook[index] > 0:  # [Note: a reentrant checkpoint around a unit's hooks]
                self._forwards_without_hook[index] -= 1
                self.engine.pre_backward(index)
            else:
                self.engine.all_units[index].wait_unshard()
            return
        self.scheduler.pre_forward(index)

    def _unit_post_forward(self, index: int, output: Any) -> None:
        engine = self.engine
        if engine.in_backward:
            return
        self.scheduler.post_forward(index)
        if torch.is_grad_enabled():
            hooks.register_pre_backward(output, lambda: engine.pre_backward(index))
        elif self.scheduler.training_pass:
            self._forwards_without_hook[index] += 1

    # [Note: a reentrant checkpoint around a unit's hooks]
    # A unit's forward inside `checkpoint(layer, x, use_reentrant=True)` (a user's own call, or transformers
    # up to 5.17, whose layers checkpoint `__call__`) runs under no_grad: its output has no grad_fn for the
    # pre-backward hook, and its hooks run again in the recompute, inside backward. That recompute is
    # the unit's backward beginning, so it is taken as its pre-backward: the backward trace sees the
    # unit, the backward plan prefetches, the forward keeps the tail for it (`kept_for_backward`), and
    # a step inside backward prepares the unit's states. Before, the backward trace missed such units:
    # every one but the last was gathered again (Llama, 3 units, transformers 5.17: 5 all-gathers a
    # step instead of 3). A non-reentrant checkpoint's forward runs with grad and registers its hook:
    # its recompute only waits for the unit.

    def _frozen_inputs(self, index: int, inputs: Any) -> None:
        """A frozen unit is released in backward once the gradients of its inputs are computed."""
        if torch.is_grad_enabled() and not self.engine.in_backward:
            scheduler = self.scheduler
            hooks.register_pre_backward(inputs, lambda: scheduler.release(index))

    def _external_pre_forward(self, module: nn.Module, owned: tuple[ShardedUnit, ...]) -> None:
        """A module whose parameters belong to a unit that is not gathered: fetch them on demand.
        Usually the module runs inside its unit's forward and there is nothing to do: that path
        only reads unit states, so `torch.compile` traces it into the unit's graph (the units are
        passed as objects, not indices: an index would be a constant the compiled graph is
        specialized on, one recompile per unit)."""
        if any(unit.state is not ParamState.UNSHARDED for unit in owned):
            self._fetch_external_eagerly(module, owned)

    def _fetch_external(self, module: nn.Module, owned: tuple[ShardedUnit, ...]) -> None:
        fetched = [unit for unit in owned if unit.state is not ParamState.UNSHARDED]
        for unit in fetched:
            unit.wait_unshard()
        self._external[id(module)] = fetched

    def _external_post_forward(self, module: nn.Module, output: Any) -> None:
        if self._external:  # something was fetched for a module (rare): was it this one?
            self._release_external_eagerly(module, output)

    def _release_external(self, module: nn.Module, output: Any) -> None:
        fetched = self._external.pop(id(module), None)
        if not fetched:
            return
        if torch.is_grad_enabled():
            hooks.register_pre_backward(output, lambda: self.engine.gather_for_backward(fetched))
        for unit in fetched:
            unit.reshard()
