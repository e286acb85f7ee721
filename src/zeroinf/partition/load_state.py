"""`model.load_state_dict(...)` on a sharded model: the loaded values become the units' own.

`nn.Module.load_state_dict` copies each value into the parameter its key names. On a sharded model
that copy alone fails or is lost: at stage 3 the parameter is an empty placeholder outside its
unit's use (a size-mismatch error), and at every stage the optimizer's fp32 masters, from which the
next step writes the parameters, would keep the old values: the loaded weights would be undone,
silently, by the next `opt.step()`. So every sharded model carries PyTorch's public load hooks
(nothing patched): when loading reaches a unit's module, the unit is gathered for writing as
`zeroinf.gathered(..., modify=True)` does, PyTorch's own copies run into its full parameters, and
once the module's subtree is loaded the writes are committed: this rank's shard to its tier
(NVMe included) and the masters to the loaded values, unrounded (fp32 weights loaded into a bf16
model keep their fp32 precision in the masters). Values given in the parameters' own dtype (a bf16
state dict into a bf16 model) change a master only where they change the parameter, as
`zeroinf.gathered` writes do: such a state dict says nothing finer, and reloading the model's own
`state_dict()` after `opt.load_state_dict` restored the fp32 masters must not round them.
One unit at a time; a unit none of whose keys the state dict holds (`strict=False`, e.g. adapters
only) is not gathered. A load into a submodule (`model.blocks[0].attn.load_state_dict(...)`) works
the same way: every module owning parameters of a unit holds the unit for its own load unless an
enclosing module's load holds it. Buffers, and parameters in no unit, load as PyTorch loads them.
A collective, like `state_dict()`: every rank calls it with the same keys. Adam's moments are left
alone, as `nn.Module.load_state_dict` leaves a torch optimizer's.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from zeroinf.engine import Engine
from zeroinf.partition.gathered import UnitGather
from zeroinf.runtime import hooks

# (parameter's index in its unit, the names it has relative to the module whose load holds the unit)
_Entries = list[tuple[int, list[str]]]


@dataclass
class _Hold:
    """A unit gathered for writing while its module loads, and which keys fill which parameters."""

    gather: UnitGather
    keys: dict[int, str]  # parameter index in the unit -> the state-dict key it was loaded from
    state_dict: Mapping[str, Any]


class StateDictLoader:
    """The load hooks of one sharded model (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held: dict[int, _Hold] = {}  # unit index -> its hold, while a load runs
        self._acquired: dict[int, list[int]] = {}  # id(module) -> units its pre-hook gathered
        # id(module) -> (module, unit index -> entries): the units a module's load must hold.
        self._plan: dict[int, tuple[nn.Module, dict[int, _Entries]]] = {}
        for ui, spec in enumerate(engine.all_specs):
            # A unit's own module loads all of it; the model itself for the root unit.
            self._add(spec.module, ui, spec.module.named_parameters(remove_duplicate=False))
        # Every module owning parameters of a unit holds that unit for its own load too, unless an
        # enclosing module's load holds it already: a load into a submodule
        # (`model.blocks[0].attn.load_state_dict(...)`), a tied weight or a module registered under
        # two paths outside its unit's module.
        for m in engine.module.modules():
            direct: dict[int, list[tuple[str, nn.Parameter]]] = {}
            for n, p in m._parameters.items():
                owner = engine.unit_index_of(p) if p is not None else None
                if owner is not None and p is not None:
                    direct.setdefault(owner, []).append((n, p))
            for ui, named in direct.items():
                if ui not in self._plan.get(id(m), (m, {}))[1]:  # its own unit's module covers it
                    self._add(m, ui, named)

    def _add(self, module: nn.Module, ui: int, named: Any) -> None:
        index = {id(p): i for i, p in enumerate(self.engine.all_units[ui].params)}
        names: dict[int, list[str]] = {}
        for name, p in named:
            if id(p) in index:
                names.setdefault(index[id(p)], []).append(name)
        if names:
            _, units = self._plan.setdefault(id(module), (module, {}))
            units.setdefault(ui, []).extend(names.items())

    def install(self) -> list[RemovableHandle]:
        # hooks.eager: outside torch.compile's tracing and outside inference mode (runtime/hooks.py)
        handles = []
        for module, units in self._plan.values():
            handles += hooks.register_load_hooks(
                module, hooks.eager(functools.partial(self._pre, units=units)), hooks.eager(self._post)
            )
        if id(self.engine.module) not in self._plan:  # refuse assign=True even where no unit starts
            refuse = hooks.eager(functools.partial(self._pre, units={}))
            handles += hooks.register_load_hooks(self.engine.module, refuse, None)
        return handles

    def _pre(
        self, module: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict[str, Any],
        *_: Any, units: dict[int, _Entries],
    ) -> None:
        if local_metadata.get("assign_to_params_buffers"):
            raise RuntimeError(
                "load_state_dict(..., assign=True) on a model sharded by zeroinf would replace its sharded "
                "parameters by the given tensors; call it with assign=False (the default): the values are "
                "copied into every rank's shard, on its tier, and into the fp32 masters"
            )
        if module is self.engine.module:
            self._release_all(commit=False)  # a load that raised midway left its units gathered
        acquired = self._acquired.setdefault(id(module), [])
        for ui, entries in units.items():
            if ui in self.held:  # held by an enclosing module's load
                continue
            keys = {}
            for pi, names in entries:
                key = next((prefix + n for n in names if prefix + n in state_dict), None)
                if key is not None:
                    keys[pi] = key
            if keys:
                self.held[ui] = _Hold(UnitGather(self.engine, ui, modify=True), keys, state_dict)
                acquired.append(ui)

    def _post(self, module: nn.Module, _incompatible: Any) -> None:
        for ui in reversed(self._acquired.pop(id(module), [])):
            hold = self.held.pop(ui)
            hold.gather.end(commit=True, modifier_rank=None, exact=self._exact(ui, hold))

    def _release_all(self, commit: bool) -> None:
        self._acquired.clear()
        while self.held:
            _, hold = self.held.popitem()
            hold.gather.end(commit=commit, modifier_rank=None)

    def _exact(self, ui: int, hold: _Hold) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The loaded values of this rank's owned range in fp32, and where they are, for the masters;
        None where the parameters are fp32 themselves (the copy was exact) or the unit has no masters.
        Only values given in another dtype than the parameter's count: one given in the parameter's
        own dtype says no more than the parameter's value, so where that did not change the finer
        master stays (a bf16 `model.state_dict()` loaded after the optimizer's state, which restored
        the fp32 masters, must not round them)."""
        unit = self.engine.all_units[ui]
        if unit.frozen or unit.param_flat.dtype == torch.float32:
            return None
        start, end = unit.owned_start, unit.owned_end
        device = unit.param_flat.device
        mask = torch.zeros(end - start, dtype=torch.bool, device=device)
        values = torch.zeros(end - start, dtype=torch.float32, device=device)
        for piece in unit.layout.pieces(start, end):
            key = hold.keys.get(piece.slot_index)
            source = hold.state_dict[key] if key is not None else None
            if not isinstance(source, torch.Tensor) or not source.is_floating_point():
                continue
            if source.dtype == unit.param_flat.dtype:
                continue  # no finer than the parameter: its master changes only where its value does
            if tuple(source.shape) != tuple(unit.layout.slots[piece.slot_index].shape):
                continue  # PyTorch reports the mismatch and copies nothing
            flat = source.detach().reshape(-1)[piece.param_offset : piece.param_offset + piece.numel]
            values[piece.start - start : piece.end - start] = flat.to(device, torch.float32)
            mask[piece.start - start : piece.end - start] = True
        return mask, values


def install_load_hooks(engine: Engine) -> list[RemovableHandle]:
    """Make `engine.module.load_state_dict` load into the units (the module docstring)."""
    return StateDictLoader(engine).install()
