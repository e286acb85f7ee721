"""A parameter's whole optimizer state, read or written between steps: `zeroinf.optimizer_state`.

[Note: a parameter's optimizer state]
`torch.optim.AdamW` keeps each parameter's `step`, `exp_avg` and `exp_avg_sq` in `opt.state[p]`;
loops read it to log Adam's second moments and write it to reset a layer's moments after surgery
(a re-initialized head, new vocabulary rows, a loss spike). zeroinf.AdamW keeps them per unit,
sharded over the ranks, on the device, the host or NVMe, and split between tiers, with fp32 masters
beside them: `opt.state` stayed torch's empty dict, so `opt.state[p]["exp_avg"]` failed with a bare
KeyError and an assignment into it was ignored. DeepSpeed answers with `safe_get_full_optimizer_state`
/ `safe_set_full_optimizer_state`, FSDP2 with a DTensor per state. Here:

- `optimizer_state(opt, params)` gathers the whole state of each parameter asked for, shaped as
  the parameter, in fp32 on the CPU: `step`, `exp_avg`, `exp_avg_sq`, and `master` (the fp32 weights
  the step updates). Each unit holding one is read from its tier once; the ranks' owned pieces are
  summed into place by one all-reduce per unit (each element has exactly one owner, zeros elsewhere,
  so the sum is the value itself). A collective: every rank asks for the same parameters.
- `set_optimizer_state(opt, {p: {"exp_avg": t, ...}})` writes moments and step counts: each rank
  writes its owned piece of the given full tensor to the unit's tier (bf16 moments rounded as a
  load rounds them). Every rank passes the same values. `master` is not written here: the weights
  and their fp32 master change together through `zeroinf.gathered(..., modify=True)`.
- `opt.state[p]` names both instead of failing bare (`ShardedStateView`).

Between steps only: inside backward, or after a backward whose step ran inside it (the states are
partly updated until `step()` decides), the call stops and says so.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from zeroinf.comm import all_reduce
from zeroinf.optim.states import StateViews
from zeroinf.partition.flat_buffer import ParamSlot

if TYPE_CHECKING:
    from zeroinf.optim.sharded import ShardedOptimizerBase as AdamW


def _kinds(opt: AdamW) -> tuple[str, ...]:
    """The states `StateViews` holds, in its order, as the optimizer names them: master, then Adam's
    `exp_avg` and `exp_avg_sq` (or a torch optimizer's own names, optim/torch_optimizer.py)."""
    return ("master", *opt.state_names)


class ShardedStateView(defaultdict[torch.Tensor, Any]):
    """`opt.state` of a sharded optimizer: empty, as nothing is kept per parameter object, but a lookup
    names where the state is instead of a bare KeyError (and a write is refused, not ignored)."""

    def __init__(self, names: tuple[str, ...] = ("exp_avg", "exp_avg_sq")) -> None:
        super().__init__()
        self.names = names

    def __missing__(self, key: Any) -> Any:
        raise KeyError(
            "a zeroinf optimizer keeps no per-parameter entry in optimizer.state: the states are sharded over the "
            "ranks and kept on their tier. Read a parameter's whole state with zeroinf.optimizer_state(optimizer, "
            f"[param]) ({', '.join(('step', *self.names, 'master'))}) and write it with "
            "zeroinf.set_optimizer_state (both collectives, between steps)"
        )

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__missing__(key)


def _locate(opt: AdamW, params: Iterable[torch.Tensor]) -> dict[int, list[tuple[int, torch.Tensor]]]:
    """Requested parameters by unit index: (position in the unit, parameter), in the unit's order."""
    engine = opt.engine
    where: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for p in params:
        ui = engine._unit_of_param.get(id(p))
        if ui is None or ui >= len(engine.units):
            raise ValueError(
                f"zeroinf.optimizer_state: a parameter of shape {tuple(p.shape)} has no optimizer state: it is "
                "frozen (requires_grad=False at zeroinf.shard) or not a parameter of this optimizer's model"
            )
        unit = engine.units[ui]
        pi = next(i for i, q in enumerate(unit.params) if q is p)
        if all(q is not p for _, q in where.get(ui, [])):
            where.setdefault(ui, []).append((pi, p))
    return where


def _require_between_steps(opt: AdamW, op: str) -> None:
    opt.require_consistent_states()
    if opt.pending_save is not None:  # a background save reads these states
        opt.pending_save.wait()
    if opt.engine.in_backward or opt._session is not None:
        raise RuntimeError(
            f"zeroinf.{op}: the optimizer step of this backward ran (partly) inside it and is decided in "
            "optimizer.step(): call it between steps (after step(), or before the backward)"
        )


def _overlap(unit_start: int, unit_end: int, slot_start: int, slot_end: int) -> tuple[int, int] | None:
    start, end = max(unit_start, slot_start), min(unit_end, slot_end)
    return (start, end) if start < end else None


@torch.no_grad()
def optimizer_state(
    opt: AdamW, params: Iterable[torch.Tensor] | None = None, *, holder: int | None = None, master: bool = True
) -> dict[torch.Tensor, dict[str, Any]]:
    """The whole optimizer state of each of `params` (default: every trained parameter; gather what
    you need), keyed by parameter: `step` (a float tensor, as torch's), the optimizer's states
    (`exp_avg`, `exp_avg_sq` for Adam; `opt.state_names`) and `master`, fp32 tensors on the CPU shaped
    as the parameter. A collective (module docstring). `holder`: only that rank keeps the result (the
    others get an empty dict), so only one host holds the whole state; default every rank.
    `master=False` leaves the masters out (a third less to read and reduce with Adam)."""
    _require_between_steps(opt, "optimizer_state")
    engine = opt.engine
    chosen = [p for u in engine.units for p in u.params] if params is None else list(params)
    sharded = engine.policy.shard_optimizer and engine.topo.is_distributed
    out: dict[torch.Tensor, dict[str, Any]] = {}
    for ui, wanted in sorted(_locate(opt, chosen).items()):
        unit = engine.units[ui]
        views = opt.states.read_unit(ui)
        slots = [unit.layout.slots[pi] for pi, _ in wanted]
        numel = sum(s.numel for s in slots)
        first = 0 if master else 1  # StateViews: the master, then the states
        kinds = _kinds(opt)[first:]
        flat = torch.zeros(len(kinds), numel, dtype=torch.float32, device=engine.topo.device)
        offset = 0
        for slot in slots:
            piece = _overlap(unit.owned_start, unit.owned_end, slot.offset, slot.offset + slot.numel)
            if piece is not None:
                start, end = piece
                dst = slice(offset + start - slot.offset, offset + end - slot.offset)
                for k, view in enumerate(views[first : first + len(kinds)]):
                    flat[k, dst].copy_(view[start - unit.owned_start : end - unit.owned_start])
            offset += slot.numel
        if sharded:
            all_reduce(flat, engine.topo, async_op=False, what=f"optimizer states of unit {unit.name}")
        if holder is not None and holder != engine.topo.rank:
            continue
        flat = flat.cpu()
        offset = 0
        for (pi, p), slot in zip(wanted, slots, strict=True):
            out[p] = {"step": torch.tensor(float(opt.param_steps[ui][pi]))}
            for k, kind in enumerate(kinds):
                out[p][kind] = flat[k, offset : offset + slot.numel].view(slot.shape).clone()
            offset += slot.numel
    return out


def _write_owned_piece(unit: Any, slot: ParamSlot, view: torch.Tensor, value: Any) -> None:
    """Copy this rank's owned part of a parameter's full value into the unit's owned-range `view`."""
    piece = _overlap(unit.owned_start, unit.owned_end, slot.offset, slot.offset + slot.numel)
    if piece is None:
        return
    start, end = piece
    given = torch.as_tensor(value, dtype=torch.float32).reshape(-1)
    view[start - unit.owned_start : end - unit.owned_start].copy_(given[start - slot.offset : end - slot.offset])


@torch.no_grad()
def set_optimizer_state(opt: AdamW, states: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
    """Write states (`exp_avg`, `exp_avg_sq` for Adam: `opt.state_names`; full tensors shaped as the
    parameter) and `step` of the given
    parameters; keys left out keep their values. Every rank passes the same values. A collective
    in the sense that every rank must call it, as each writes only its own piece."""
    _require_between_steps(opt, "set_optimizer_state")
    engine = opt.engine
    engine.transfers.wait_uploads()  # the last step's parameter uploads may still read the masters rewritten here
    located = sorted(_locate(opt, states).items())
    for ui, wanted in located:
        for pi, p in wanted:
            _check_given(states[p], engine.units[ui].layout.slots[pi], opt.state_names)
    for ui, wanted in located:
        unit = engine.units[ui]
        if any(kind in states[p] for _, p in wanted for kind in opt.state_names):
            views = opt.states.read_unit(ui)
            for pi, p in wanted:
                for k, kind in enumerate(_kinds(opt)):
                    if kind in states[p]:
                        _write_owned_piece(unit, unit.layout.slots[pi], views[k], states[p][kind])
            opt.states.write_unit(ui, StateViews(*views))
        for pi, p in wanted:
            if "step" in states[p]:
                opt.param_steps[ui][pi] = int(float(torch.as_tensor(states[p]["step"])))


@torch.no_grad()
def set_masters(opt: AdamW, masters: Mapping[torch.Tensor, torch.Tensor]) -> None:
    """Write the fp32 master weights of the given parameters (full tensors shaped as each) and make
    the parameters their rounding, as a step does. For a load that carries masters finer than the
    weights loaded beside them (bf16 weights, fp32 masters: optim/torch_format.py). Every rank passes
    the same values and must call it (at stages 1-2 the parameters' refresh is an all-gather)."""
    _require_between_steps(opt, "set_masters")
    engine = opt.engine
    located = sorted(_locate(opt, masters).items())
    for ui, wanted in located:
        for pi, p in wanted:
            slot = engine.units[ui].layout.slots[pi]
            shape = tuple(torch.as_tensor(masters[p]).shape)
            if shape != tuple(slot.shape):
                raise ValueError(
                    f"zeroinf: the master weights of {slot.name} have shape {shape}, the parameter {tuple(slot.shape)}"
                )
    with opt.replacing_states():
        engine.transfers.wait_uploads()  # the last step's parameter uploads may still read these masters
        for ui, wanted in located:
            unit = engine.units[ui]
            views = opt.states.read_unit(ui)
            for pi, p in wanted:
                _write_owned_piece(unit, unit.layout.slots[pi], views[0], masters[p])
            opt.states.write_unit(ui, StateViews(*views))
            # One unit at a time (its states read whole: bounded memory), its refresh done before the next.
            unit.start_update_params(views[0]).wait()
            engine.transfers.wait_uploads()


def _check_given(given: Mapping[str, Any], slot: ParamSlot, names: tuple[str, ...]) -> None:
    unknown = set(given) - {"step", *names}
    if "master" in unknown:
        raise ValueError(
            "zeroinf.set_optimizer_state: the master weights change with the parameter they round to; write "
            f"{slot.name} inside `with zeroinf.gathered([param], modify=True)` (its master follows)"
        )
    if unknown:
        raise ValueError(
            f"zeroinf.set_optimizer_state: unknown state {sorted(unknown)} for {slot.name}; known: "
            f"{', '.join(('step', *names))}"
        )
    if "step" in given:
        step = float(torch.as_tensor(given["step"]))
        if step < 0 or step != int(step):
            raise ValueError(f"zeroinf.set_optimizer_state: step = {step} of {slot.name} is not a count of steps")
    for kind in names:
        if kind in given and tuple(torch.as_tensor(given[kind]).shape) != tuple(slot.shape):
            raise ValueError(
                f"zeroinf.set_optimizer_state: {kind} of {slot.name} has shape "
                f"{tuple(torch.as_tensor(given[kind]).shape)}, the parameter {tuple(slot.shape)}"
            )
