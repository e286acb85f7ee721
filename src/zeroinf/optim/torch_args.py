"""What `torch.optim.AdamW` and `torch.optim.Adam` take, taken by zeroinf's optimizers.

A loop moving to zeroinf swaps the class and keeps the arguments (optim/adamw.py builds the
optimizer from what these functions return).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from zeroinf.engine import Engine


def refuse_unsupported(name: str, **flags: bool) -> None:
    """torch.optim's variants zeroinf's optimizers do not compute: refused when asked for, not ignored."""
    asked = sorted(flag for flag, value in flags.items() if value)
    if asked:
        raise ValueError(
            f"zeroinf.{name} does not implement {' or '.join(f'{n}=True' for n in asked)}: it computes torch's "
            f"default {name} (the fused kernel)"
        )


def model_of_params(
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], name: str = "zeroinf.AdamW"
) -> tuple[nn.Module, list[dict[str, Any]]]:
    """The sharded model that `params` (parameters, or param groups as torch.optim takes them) belong
    to, and the groups restricted to the parameters it trains.

    [Note: torch.optim.AdamW's arguments]
    A loop moving to zeroinf changes `torch.optim.AdamW` to `zeroinf.AdamW` and keeps its arguments:
    `model.parameters()`, or groups built from `named_parameters()` (nanoGPT's `configure_optimizers`
    decays matrices and not vectors), with `fused=True`. The optimizer still owns every trainable
    parameter of one sharded model (its fp32 masters live in it), so the parameters name the model;
    frozen ones are dropped from the groups as torch.optim skips them (they never get a gradient), and
    a trainable one left out is refused (`_check_groups_cover`), where torch.optim would leave it
    unchanged for good.
    """
    from zeroinf.engine import holding_engine_outside_units, owning_engine  # engine.py imports this module

    items: list[Any] = [params] if isinstance(params, torch.Tensor) else list(params)
    grouped = any(isinstance(item, dict) for item in items)
    if grouped and not all(isinstance(item, dict) for item in items):
        raise TypeError(f"{name}: pass parameters, or param groups (dicts), not a mix of both")
    groups: list[dict[str, Any]] = [dict(item) for item in items] if grouped else [{"params": items}]
    engines: dict[int, Engine] = {}
    strays = 0
    for group in groups:
        members = group["params"]
        group["params"] = [members] if isinstance(members, torch.Tensor) else list(members)
        for p in group["params"]:
            found = owning_engine(p)
            engine = found[0] if found is not None else holding_engine_outside_units(p)  # frozen, stages 0-2
            if engine is None:
                strays += 1
            else:
                engines[id(engine)] = engine
    if not engines:
        raise TypeError(
            f"{name}: these parameters belong to no sharded model. Shard it first, then build the "
            "optimizer: model = zeroinf.shard(model, cfg); opt = zeroinf.AdamW(model.parameters(), lr=...) "
            "(or zeroinf.AdamW(model, ...))"
        )
    if len(engines) > 1 or strays:
        raise ValueError(
            f"{name}: the parameters come from "
            + ("several sharded models" if len(engines) > 1 else f"a sharded model and {strays} other tensors")
            + f"; one {name} trains exactly one sharded model: build one per model"
        )
    owner = next(iter(engines.values()))
    for group in groups:
        group["params"] = [p for p in group["params"] if owner.trains(p)]  # kept if emptied: schedulers index groups
    return owner.module, groups
