"""`zeroinf.ema_update`: an exponential moving average of a sharded model's weights, kept in a
second sharded model.

    ema = zeroinf.shard(build_model().requires_grad_(False), zeroinf.Config(stage=3, param_dtype="fp32", ...))
    ema.load_state_dict(model.state_dict())          # start from the trained model's weights
    for batch in loader:
        ...; opt.step(); opt.zero_grad()
        zeroinf.ema_update(ema, model, decay=0.999)  # ema <- decay * ema + (1 - decay) * model

`copy.deepcopy` and `torch.optim.swa_utils.AveragedModel` cannot copy a sharded model, and at
stage 3 its parameters are empty placeholders outside forward, so the usual EMA loop over
`model.parameters()` would average nothing. Here the EMA is a model of its own (frozen: it needs
no optimizer; sharded and offloaded like the trained one, so a model larger than memory has an EMA
larger than memory too), updated one unit at a time inside `zeroinf.gathered`: the trained model's
unit is gathered to read, the EMA's to write, and the new values land in every rank's EMA shard on
its tier. A collective: every rank calls it. Parameters are matched by name; floating-point
buffers are not averaged (as `AveragedModel(use_buffers=False)`).

[Note: an EMA averaged shard to shard]
Where the two models are sharded alike (the EMA built from the same class, sharded at stage 3 at the
same world size: each of its units holds the parameters of one of the model's units, of the same
names and shapes), this rank's shard of an EMA unit covers exactly the elements of its shard of the
model's unit. The average is elementwise, so each rank averages its own shards: read both from their
tiers (two NVMe reads in flight together), `lerp`, write the EMA's back. No all-gather, no unit held
whole, 1/world of the arithmetic; the gathered path remains for the rest (units kept whole, a unit
gathered at the time, EMAs laid out differently). Same values: `lerp` of the same elements.

Keep the EMA in fp32 (`param_dtype="fp32"` in its Config): in bf16, `(1 - decay) * (model - ema)`
with decay 0.999 is mostly below the rounding step of bf16 and would be lost. The trained model's
values are its compute-dtype parameters (bf16 under `param_dtype="bf16"`), what its forward uses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from zeroinf.engine import owning_engine, sharded_engine
from zeroinf.partition.gathered import gathered
from zeroinf.partition.unit import ParamState, ShardedUnit


def _unit_groups(pairs: list[tuple[nn.Parameter, nn.Parameter]]) -> Iterator[list[tuple[nn.Parameter, nn.Parameter]]]:
    """The (ema, model) pairs grouped by the unit holding the EMA parameter, or where the EMA's is
    whole (a frozen parameter below stage 3) by the unit holding the model's, so that each unit is
    gathered once; in order of first appearance (the same on every rank)."""
    groups: dict[object, list[tuple[nn.Parameter, nn.Parameter]]] = {}
    for ema_p, model_p in pairs:
        found = owning_engine(ema_p)
        side = "ema"
        if found is None:
            found, side = owning_engine(model_p), "model"
        key: object = (side, id(found[0]), found[1]) if found is not None else ("plain", id(ema_p))
        groups.setdefault(key, []).append((ema_p, model_p))
    yield from groups.values()


def _gathered_if_sharded(params: list[nn.Parameter], modify: bool) -> contextlib.AbstractContextManager[object]:
    """`zeroinf.gathered` over the sharded ones among `params` (plain ones are whole already)."""
    sharded = [p for p in params if owning_engine(p) is not None]
    return gathered(sharded, modify=modify) if sharded else contextlib.nullcontext()


@torch.no_grad()
def ema_update(ema: nn.Module, model: nn.Module, decay: float) -> None:
    """`ema <- decay * ema + (1 - decay) * model` for every parameter, matched by name, one unit of
    the EMA model at a time (see the module docstring). A collective."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"zeroinf.ema_update: decay = {decay!r}; use a number in [0, 1]")
    ema_params, model_params = dict(ema.named_parameters()), dict(model.named_parameters())
    if ema_params.keys() != model_params.keys():
        missing = sorted(model_params.keys() - ema_params.keys())[:3]
        extra = sorted(ema_params.keys() - model_params.keys())[:3]
        raise ValueError(
            f"zeroinf.ema_update: the EMA model's parameters do not match the model's (missing {missing}, "
            f"unexpected {extra}): build the EMA model from the same class and config"
        )
    local = _shard_to_shard(ema, model)
    if local:
        _average_shards(local, 1.0 - decay)
    averaged = {name for ema_unit, _ in local for name in ema_unit.param_names}
    pairs = [(ema_params[name], model_params[name]) for name in model_params if name not in averaged]
    for group in _unit_groups(pairs):
        ema_group, model_group = [e for e, _ in group], [m for _, m in group]
        with _gathered_if_sharded(model_group, modify=False), _gathered_if_sharded(ema_group, modify=True):
            for ema_p, model_p in group:
                if ema_p.shape != model_p.shape:
                    raise ValueError(
                        f"zeroinf.ema_update: shapes differ ({tuple(ema_p.shape)} in the EMA model, "
                        f"{tuple(model_p.shape)} in the model): build the EMA model from the same config"
                    )
                ema_p.lerp_(model_p.to(ema_p.dtype), 1.0 - decay)


def _shard_to_shard(ema: nn.Module, model: nn.Module) -> list[tuple[ShardedUnit, ShardedUnit]]:
    """(EMA unit, model unit) pairs averaged shard to shard ([Note: an EMA averaged shard to shard]):
    the same parameter names in the same layout, both sharded now. The same on every rank."""
    ema_engine, model_engine = sharded_engine(ema), sharded_engine(model)
    if ema_engine is None or model_engine is None:
        return []
    by_names = {tuple(u.param_names): u for u in model_engine.all_units}
    pairs = []
    for ema_unit in ema_engine.all_units:
        model_unit = by_names.get(tuple(ema_unit.param_names))
        if (
            model_unit is not None and model_unit.layout == ema_unit.layout
            and ema_unit.home is not None and model_unit.home is not None
            and ema_unit.state is ParamState.SHARDED and model_unit.state is ParamState.SHARDED
        ):
            pairs.append((ema_unit, model_unit))
    if pairs:
        if ema_engine.pending_save is not None:  # a background save of the EMA may still read its shards
            ema_engine.pending_save.wait()
        model_engine.transfers.order_uploads()  # the last step's new parameters, before they are read
    return pairs


def _average_shards(pairs: list[tuple[ShardedUnit, ShardedUnit]], weight: float) -> None:
    for ema_unit, model_unit in pairs:
        ema_home, model_home = ema_unit.home, model_unit.home
        assert ema_home is not None and model_home is not None
        model_home.start_load()  # both reads under way together (NVMe)
        ema_home.start_load()
        values = model_home.finish_load()
        shard = ema_home.finish_load()
        averaged = shard.lerp(values.to(shard.dtype), weight)  # a tensor of its own: the loaded ones are lent
        model_home.end_load()
        ema_home.end_load()
        ema_home.store(averaged)
