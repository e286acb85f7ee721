"""`zeroinf.gathered`: the full values of some parameters of a sharded model, to read or to write.

    with zeroinf.gathered([model.lm_head.weight], modify=True):
        model.lm_head.weight.normal_(std=0.02)      # every rank does the same (or modifier_rank=0)
    # the new values are in every rank's shard, on its tier (NVMe included), and in the fp32 masters

A collective: every rank enters with the same parameters. Each unit holding one of them is
gathered (all-gathered at stage 3; at stages 0-2 parameters are whole already) and the parameters
are real, full tensors inside the block (which runs under `torch.no_grad()` with `modify=True`,
as writes to leaf parameters must). On leaving, units that were sharded are sharded again;
with `modify=True` the values are first committed: this rank's shard goes to its tier and the fp32
master weights take the new value of every element that changed (elements left alone keep their
unrounded fp32 masters, so a bf16 model loses nothing by being gathered). With `modifier_rank=r`,
rank r's values are broadcast first, for edits only one rank computes (r is a rank of the model's
process group, `Topology.rank`: the global rank unless the model was sharded over a group). Writes
are committed only when the block exits normally. Parameters built under `zeroinf.init()` and not
sharded yet work too: they are unparked for the block and parked again after it. Parameters a sharded model holds
outside its units (frozen ones at stages 0-2) are whole on every rank: they pass through as they
are (with `modifier_rank`, that rank's values are broadcast), so one call serves every stage (a
LoRA layer's merge reads its adapters and writes its frozen base weight).

A read block may hold training too (a penalty over `model.parameters()` added to the loss): forward,
backward and the optimizer step inside it train bitwise as they do without it; the block only keeps
its units whole (tests/partition/test_gathered.py). Gather what you need and no more: every unit
touched is whole in memory for the duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import cast

import torch
from torch import nn

from zeroinf.comm import broadcast_to_every_group
from zeroinf.engine import Engine, holding_engine_outside_units, owning_engine
from zeroinf.partition.init import park_of
from zeroinf.partition.intact import written_in_place
from zeroinf.partition.unit import ParamState
from zeroinf.runtime import hooks


class UnitGather:
    """One unit held by one `gathered` block."""

    def __init__(self, engine: Engine, index: int, modify: bool) -> None:
        self.engine, self.index, self.modify = engine, index, modify
        unit = engine.all_units[index]
        engine.settle_failed_backward()
        if engine.in_backward:
            raise RuntimeError(
                f"zeroinf.gathered: unit {unit.name} is in a backward pass; gather between optimizer steps"
            )
        if modify and unit.user_writer:
            raise RuntimeError(
                f"zeroinf.gathered: unit {unit.name} is already gathered for writing by an enclosing "
                "zeroinf.gathered(..., modify=True); gather every parameter you write in one call, and nest "
                "only reads inside it"
            )
        if modify and engine.pending_save is not None:  # its writer may still read what is written here
            engine.pending_save.wait()  # a collective, as this gather is
        self.was_sharded = unit.state is not ParamState.UNSHARDED and unit.user_gathers == 0
        unit.wait_unshard()
        unit.user_gathers += 1
        self.owned_before: torch.Tensor | None = None
        if modify:
            unit.user_writer = True
            self.owned_before = unit.param_flat[unit.owned_start : unit.owned_end].clone()

    def end(
        self, commit: bool, modifier_rank: int | None, exact: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Release the unit; with `commit` (and `modify`) its writes first become its own
        (`ShardedUnit.commit_user_writes`, `exact` passed on)."""
        unit, topo = self.engine.all_units[self.index], self.engine.topo
        try:
            unit.wait_refresh()  # a step inside a backward in the block refreshed it (unit.py)
            # a read nested in a block that writes this unit: the enclosing block's end commits its writes
            reads_only = not self.modify and not unit.user_writer
            replaced = unit.retake_replaced(keep_values=not reads_only)
            if replaced and reads_only and commit:
                raise RuntimeError(
                    f"parameter {replaced[0]} was given a new tensor (`p.data = ...`) inside "
                    "zeroinf.gathered(..., modify=False): a block that reads does not commit, and its values are "
                    "dropped; pass modify=True to keep them"
                )
            written = written_in_place(unit) if commit and reads_only else None
            if written is not None:  # partition/intact.py [Note: in-place writes to a sharded model's parameters]
                raise RuntimeError(
                    f"parameter {written} was written in place inside zeroinf.gathered(..., modify=False): a "
                    "block that reads does not commit, and the write would be lost when the unit is sharded "
                    "again; pass modify=True to keep it"
                )
            if commit and self.modify:
                assert self.owned_before is not None
                if modifier_rank is not None:
                    broadcast_to_every_group(unit.param_flat, topo, modifier_rank)
                unit.commit_user_writes(self.owned_before, self.engine.optimizer_states, self.index, exact)
        finally:
            if (commit and self.modify) or self.was_sharded:  # its writes committed, or gone with the copy
                unit.remember_versions()  # else a copy kept whole holds them: the next forward refuses it
            unit.user_gathers -= 1
            if self.modify:
                unit.user_writer = False
            if self.was_sharded:
                unit.reshard()


def _describe(p: torch.Tensor, i: int) -> str:
    return f"parameter {i} (shape {tuple(p.shape)}, dtype {p.dtype})"


@contextlib.contextmanager
def gathered(
    params: torch.Tensor | Iterable[torch.Tensor], modify: bool = False, modifier_rank: int | None = None
) -> Iterator[list[torch.Tensor]]:
    """Gather `params` (parameters of sharded models) for the block; see the module docstring."""
    wanted = [params] if isinstance(params, torch.Tensor) else list(params)
    parked = [cast(nn.Parameter, p) for p in wanted if park_of(p) is not None]  # parks hold parameters only
    units: dict[tuple[int, int], tuple[Engine, int]] = {}
    whole: list[tuple[torch.Tensor, Engine]] = []  # held by a sharded model outside its units: whole already
    for i, p in enumerate(wanted):
        if park_of(p) is not None:
            continue
        found = owning_engine(p)
        holder = holding_engine_outside_units(p) if found is None else None
        if holder is not None:
            whole.append((p, holder))
            continue
        if found is None:
            raise ValueError(
                f"zeroinf.gathered: {_describe(p, i)} belongs to no sharded model (nor to one being built under "
                "zeroinf.init); call `model = zeroinf.shard(model, cfg)` first. A plain (or frozen) parameter "
                "is whole already and needs no gathering"
            )
        engine, ui = found
        units.setdefault((id(engine), ui), (engine, ui))
    held: list[UnitGather] = []
    with hooks.outside_inference_mode():  # runtime/hooks.py [Note: the engine outside inference mode]
        try:
            for engine, ui in units.values():  # first-appearance order: the same on every rank
                held.append(UnitGather(engine, ui, modify))
        except BaseException:
            for gather in reversed(held):
                gather.end(commit=False, modifier_rank=None)
            raise
        for p in parked:
            park = park_of(p)
            assert park is not None
            park.unpark([p])
    ok = False
    try:
        with torch.no_grad() if modify else contextlib.nullcontext():  # in-place writes to leaf parameters
            yield wanted
        ok = True
    finally:
        errors: list[BaseException] = []
        with hooks.outside_inference_mode():
            for gather in reversed(held):
                try:
                    gather.end(commit=ok, modifier_rank=modifier_rank)
                except BaseException as exc:  # noqa: BLE001 - release every unit, then raise the first
                    errors.append(exc)
            _repark(parked, broadcast_from=modifier_rank if ok and modify else None)
            if ok and modify and modifier_rank is not None:
                _broadcast_whole(whole, modifier_rank)
        if errors:
            raise errors[0]


def _broadcast_whole(params: list[tuple[torch.Tensor, Engine]], src: int) -> None:
    """Rank `src`'s values of parameters held whole outside units (the `modifier_rank` promise)."""
    for p, engine in params:
        with torch.no_grad():
            broadcast_to_every_group(p.data, engine.topo, src)


def _repark(params: list[nn.Parameter], broadcast_from: int | None) -> None:
    from zeroinf.partition.init import _active

    for p in params:
        park = next(pk for pk in _active if pk.owns_slot(p))
        if broadcast_from is not None:
            with torch.no_grad():
                broadcast_to_every_group(p.data, park.topo, broadcast_from)
        park.park(p)
