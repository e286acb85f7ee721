"""Weights of a split layer read outside the layer's own forward, during a pass.

[Note: a split layer's weight read outside its forward]
`Config.split_root` makes a large embedding or head a unit of its own (partition/wrap.py [Note:
large layers outside the blocks are units of their own]), gathered by its forward hooks. Model code
may read its weight elsewhere: a GPT whose head is `F.linear(x, self.tok_emb.weight)` (our own
demo model, minGPT), DETR's `query_position_embeddings.weight`, CLIP's interpolated positions.
Outside the hooks the weight is the empty placeholder, and such a read computed on a 0 x 0 tensor
("mat1 and mat2 shapes cannot be multiplied (256x64 and 0x0)").

So a split layer's `_parameters` is a `GuardedParameters`: `module.weight` goes through its
`__getitem__` (nn.Module.__getattr__), and a read while the unit is not gathered, during a pass,
gathers it first and keeps it gathered until the pass ends (the scheduler's `release_all`), since
autograd may have saved the weight for the backward; from then on the unit is kept through every
pass (`UnshardScheduler.read_outside`), which costs, for that layer, what the unsplit root did.
Every rank runs the same model code, so every rank reads, and gathers, at the same point
(DeepSpeed's ZeRO-3 fetches such "external parameters" the same way). Outside a pass nothing is
gathered: the placeholder answers shape-free metadata reads (dtype, device) as before. Code paths
that enumerate parameters (`named_parameters`, `state_dict`) read the dict without `__getitem__`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from zeroinf.partition.unit import ParamState, ShardedUnit


class GuardedParameters(dict):  # nn.Module annotates `_parameters` as dict[str, Parameter | None]
    """A split layer's `_parameters`: reading a sharded parameter during a pass gathers its unit."""

    def __init__(self, params: dict[str, Any], units: dict[str, ShardedUnit], on_read: Callable[[ShardedUnit], None]):
        super().__init__(params)
        self.units = units  # parameter name -> the unit holding it (a frozen twin holds some)
        self.on_read = on_read

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        unit = self.units.get(key)
        if unit is not None and unit.state is not ParamState.UNSHARDED:
            self.on_read(unit)
        return value


class GuardHandle:
    """Puts a plain dict back as the module's `_parameters` (the engine's handles are removed on close)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        guarded = self.module.__dict__.get("_parameters")
        if isinstance(guarded, GuardedParameters):
            self.module.__dict__["_parameters"] = dict(guarded)


def guard_reads(
    module: nn.Module, units: dict[str, ShardedUnit], on_read: Callable[[ShardedUnit], None]
) -> GuardHandle:
    """Route reads of `module`'s own parameters named in `units` through `on_read` while not gathered."""
    module.__dict__["_parameters"] = GuardedParameters(module._parameters, units, on_read)
    return GuardHandle(module)
