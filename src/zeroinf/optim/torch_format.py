"""A sharded optimizer's state in torch.optim's own format, out and in: `zeroinf.full_optimizer_state_dict`.

[Note: the optimizer state in torch.optim's format]
`opt.state_dict()` of a zeroinf optimizer is this rank's shard per unit (resumable at the same world
size and stage), and `zeroinf.save` is sharded and reshards; neither is what a plain PyTorch loop
can load. Moving a run between zeroinf and plain PyTorch (a DDP or single-GPU run continued with
zeroinf once the model outgrew the GPU; a zeroinf run continued, evaluated or inspected without it)
needs the other format: torch.optim's `{"state": {index: {"step", "exp_avg", ...}}, "param_groups":
[{..., "params": [indices]}]}`, indices counting the parameters of the param groups in order. FSDP2
answers with `get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True))`; DeepSpeed has
no way back to a torch optimizer's state.

- `full_optimizer_state_dict(opt)` builds it from `optimizer_state` (optim/full_state.py): whole
  fp32 tensors on the CPU, on every rank, a collective. Only parameters stepped at least once have
  state, as in torch; `step` only where the optimizer keeps one (Adam's, not SGD's). The groups are
  `opt.param_groups` with their hyperparameters and, for zeroinf.AdamW, the settings of torch's
  AdamW that run its update (`fused=True`: a torch AdamW loading the dict takes its groups' settings
  and would otherwise run its for-loop kernel, which rounds differently in the last bit). It holds
  the optimizer's whole state in host memory (8 bytes per parameter for Adam; the masters are not
  read): for a model whose state does not fit, `zeroinf.save`, and a state that does not fit is
  refused on every rank before anything is gathered. `holder=r`: only rank r keeps it (the others
  get a dict that names r and holds nothing, refused by the loader). `masters=True` adds what torch
  does not keep and an exact resume needs under "zeroinf" (the fp32 masters, finer than bf16
  weights; the step count; the loss scaler), which torch's `load_state_dict` ignores: accelerate's
  save_state (integrations/accelerate_loop.py [Note: accelerate's save_state of sharded states]).
  The indices follow the groups: built from the model, `model.parameters()` order.
- `load_full_optimizer_state_dict(opt, sd)` writes such a dict (from `torch.optim.X.state_dict()`
  of the same parameters in the same groups) into the sharded optimizer through
  `set_optimizer_state`: every parameter's states and step, zeros and step 0 where the dict has
  none, and each group's hyperparameters the optimizer reads. A mismatch of groups or their sizes,
  a state the optimizer does not keep (Adam's `max_exp_avg_sq` from `amsgrad=True`) or a missing
  `step` the update needs is refused naming it. What "zeroinf" carries loads too (the masters
  through `set_masters`, which also rounds the parameters from them). `opt.load_state_dict` takes
  this format as well as its own.

The weights are not part of it, as in torch: `model.state_dict()` / `model.load_state_dict()`
carry them (the fp32 masters follow a load exactly). Parity both ways, continued training bitwise
equal to the plain loop: tests/optim/test_torch_format.py.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from zeroinf.comm import all_reduce
from zeroinf.optim.full_state import optimizer_state, set_masters, set_optimizer_state
from zeroinf.planner.profile import available_ram_bytes

if TYPE_CHECKING:
    from zeroinf.optim.sharded import ShardedOptimizerBase


ZEROINF_KEY = "zeroinf"  # what a torch optimizer ignores: the masters, the step count, the loss scaler


def _params(opt: ShardedOptimizerBase) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


@torch.no_grad()
def full_optimizer_state_dict(
    opt: ShardedOptimizerBase, *, holder: int | None = None, masters: bool = False
) -> dict[str, Any]:
    """The optimizer's state as `torch.optim.Optimizer.state_dict()` gives it for the same parameters
    and groups ([Note: the optimizer state in torch.optim's format]). A collective. `holder`: only
    that rank gets the states (the others a dict naming it, without any); `masters`: add what a
    torch optimizer does not keep but an exact resume needs, under the key "zeroinf"."""
    params = _params(opt)
    _require_room(opt, holder, masters)
    full = optimizer_state(opt, params, holder=holder, master=masters)
    groups, start = [], 0
    for group in opt.param_groups:
        count = len(group["params"])
        settings = {**opt.torch_group_settings, **{k: v for k, v in group.items() if k != "params"}}
        groups.append({**settings, "params": list(range(start, start + count))})
        start += count
    if holder is not None and holder != opt.engine.topo.rank:
        return {"state": {}, "param_groups": groups, ZEROINF_KEY: {"held_by_rank": holder}}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, p in enumerate(params):
        read = full[p]
        if float(read["step"]) == 0:  # never stepped: torch keeps no state for it
            continue
        entry = {"step": read["step"]} if opt.keeps_step else {}
        entry.update({name: read[name] for name in opt.state_names})
        state[index] = entry
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    if masters:
        out[ZEROINF_KEY] = {
            "optimizer": opt.display_name,
            "master": {index: full[p]["master"] for index, p in enumerate(params)},
            "step_count": opt.step_count,
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
        }
    return out


def _require_room(opt: ShardedOptimizerBase, holder: int | None, masters: bool) -> None:
    """Refuse, on every rank alike, a whole state that the host keeping it has no memory for: it would
    be killed for memory midway (the others then waiting in the next collective)."""
    engine = opt.engine
    topo = engine.topo
    numel = sum(unit.layout.numel for unit in engine.units)  # the groups cover every trained unit
    need = numel * 4 * (len(opt.state_names) + int(masters))  # fp32, whole
    holders_here = 1 if holder is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    short = float(holder in (None, topo.rank) and need * holders_here > 0.9 * available_ram_bytes())
    verdict = torch.tensor([short], device=topo.device)
    if topo.is_distributed:
        all_reduce(verdict, topo, async_op=False, what="whether the whole optimizer state fits")
    if verdict.item():
        raise MemoryError(
            f"{opt.display_name}: its whole state ({need / 2**30:.1f} GiB in fp32) does not fit "
            "in the host memory available to the rank that would hold it; save it sharded with zeroinf.save "
            "(every rank writes its own piece; zeroinf.load reshards to any world size), and under accelerate call "
            "zeroinf.integrations.sharded_save_state(accelerator) once, which makes save_state do that"
        )


@torch.no_grad()
def load_full_optimizer_state_dict(opt: ShardedOptimizerBase, state_dict: Mapping[str, Any]) -> None:
    """Write torch.optim's state dict of the same parameters and groups into the sharded optimizer
    ([Note: the optimizer state in torch.optim's format]). Every rank passes the same dict; the
    masters, step count and loss scaler under "zeroinf" load too where the dict has them."""
    name = opt.display_name
    extras: Mapping[str, Any] = state_dict.get(ZEROINF_KEY) or {}
    _require_held(opt, extras)
    saved_groups = list(state_dict["param_groups"])
    sizes = [len(g["params"]) for g in opt.param_groups]
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise ValueError(
            f"zeroinf.load_full_optimizer_state_dict: the state dict has param groups of {saved_sizes} parameters, "
            f"{name} of {sizes}: build both optimizers over the same parameters in the same groups (frozen "
            "parameters are in no group of a zeroinf optimizer)"
        )
    params = _params(opt)
    saved: Mapping[Any, Mapping[str, Any]] = state_dict["state"]
    known = {"step", *opt.state_names}
    states: dict[torch.Tensor, dict[str, Any]] = {}
    for index, p in enumerate(params):
        entry = saved.get(index, saved.get(str(index)))  # JSON-like dicts key by strings
        if not entry:  # never stepped there: the torch optimizer starts it afresh
            states[p] = {"step": 0, **{n: torch.zeros(_shape(opt, p)) for n in opt.state_names}}
            continue
        unknown = sorted(set(entry) - known)
        if unknown:
            raise ValueError(
                f"zeroinf.load_full_optimizer_state_dict: parameter {index} has state {unknown}, which {name} does "
                f"not keep (it keeps {sorted(known)}); a torch optimizer with other settings saved it (Adam's "
                "max_exp_avg_sq comes from amsgrad=True)"
            )
        if "step" not in entry and opt.keeps_step:
            raise ValueError(
                f"zeroinf.load_full_optimizer_state_dict: parameter {index} has no `step`, which {name}'s update "
                "needs (its bias corrections): the state dict comes from an optimizer of another kind"
            )
        # An optimizer without a step count (SGD) still needs the parameter counted as stepped: at 0 its
        # next step would be a first one, which makes the states anew (SGD's momentum restarted from the
        # gradient; optim/torch_optimizer.py [Note: a torch optimizer over shards]).
        step = entry.get("step", 1)
        states[p] = {**{n: entry[n] for n in opt.state_names if n in entry}, "step": step}
    set_optimizer_state(opt, states)
    for group, saved_group in zip(opt.param_groups, saved_groups, strict=True):
        for key in opt.hyperparameter_keys:
            if key in saved_group:
                group[key] = tuple(saved_group[key]) if isinstance(group.get(key), tuple) else saved_group[key]
    if "master" in extras:
        saved_masters: Mapping[Any, Any] = extras["master"]
        given = {i: saved_masters.get(i, saved_masters.get(str(i))) for i in range(len(params))}
        set_masters(opt, {p: given[i] for i, p in enumerate(params) if given[i] is not None})
    if "step_count" in extras:
        opt.step_count = int(extras["step_count"])
    if opt.scaler is not None and extras.get("scaler") is not None:
        opt.scaler.load_state_dict(extras["scaler"])


def _require_held(opt: ShardedOptimizerBase, extras: Mapping[str, Any]) -> None:
    """Refuse, on every rank alike, a dict from a rank that did not hold the state (`holder`)."""
    topo = opt.engine.topo
    stubs = torch.tensor([float("held_by_rank" in extras)], device=topo.device)
    if topo.is_distributed:
        all_reduce(stubs, topo, async_op=False, what="whether every rank was given the optimizer state")
    if stubs.item() > 0:
        raise ValueError(
            f"{opt.display_name}: {int(stubs.item())} rank(s) were given an optimizer state dict without the state, "
            "written by a rank that did not hold it (the whole state is gathered on one rank alone, as for "
            "accelerate's save_state): load the file rank 0 saved on every rank (with save_on_each_node on "
            "several machines, copy it to each), or save sharded with zeroinf.save / zeroinf.load"
        )


def _shape(opt: ShardedOptimizerBase, p: torch.Tensor) -> tuple[int, ...]:
    """A parameter's full shape (at stage 3 the parameter itself is an empty placeholder)."""
    engine = opt.engine
    unit = engine.units[engine._unit_of_param[id(p)]]
    return tuple(next(slot.shape for slot, q in zip(unit.layout.slots, unit.params, strict=True) if q is p))
