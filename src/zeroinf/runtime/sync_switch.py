"""DDP's and FSDP2's gradient-sync switches on a sharded model, for loops that accumulate with them.

[Note: no_sync on a sharded model]
A DDP loop accumulates micro-steps inside `with model.no_sync():` and runs the step's last backward
outside it, where DDP reduces; nanoGPT sets DDP's `model.require_backward_grad_sync` itself, and
FSDP2 loops call `model.set_requires_gradient_sync(False)`. After `zeroinf.shard` replaces the
wrapper, those lines met a plain module: `no_sync` raised AttributeError, the flag was set and read
by nobody. zeroinf counts the micro-steps of a step itself (`Config.grad_accum_steps`: where to
reduce, how to size the gradient buffers, when the step may run inside backward), so the switches
cannot redefine the count; they state which backward is the last one, and the engine checks that
statement against its count when each backward begins. A loop whose switches agree with
`grad_accum_steps` runs unchanged (accelerate's `accumulate`, which calls `no_sync` at world > 1,
included); one that disagrees stops at the first backward that shows it, naming the setting to
change. Until a loop uses a switch, nothing is checked.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from torch import nn

FLAG = "require_backward_grad_sync"  # DDP's attribute: False inside no_sync


def install(module: nn.Module) -> None:
    """Give the sharded root `no_sync()` and `set_requires_gradient_sync()` unless it has its own."""
    if not hasattr(module, "no_sync"):
        module.__dict__["no_sync"] = types.MethodType(_no_sync, module)
    if not hasattr(module, "set_requires_gradient_sync"):
        module.__dict__["set_requires_gradient_sync"] = types.MethodType(_set_requires_gradient_sync, module)


@contextlib.contextmanager
def _no_sync(module: nn.Module) -> Iterator[None]:
    """DDP's `no_sync`: backward passes in the block are not the last of their step."""
    before = module.__dict__.get(FLAG, _UNSET)
    module.__dict__[FLAG] = False
    try:
        yield
    finally:
        if before is _UNSET:
            del module.__dict__[FLAG]
        else:
            module.__dict__[FLAG] = before


def _set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
    """FSDP2's switch: whether the following backward passes are the last of their step."""
    module.__dict__[FLAG] = bool(requires_gradient_sync)


_UNSET = object()


def requested_sync(module: nn.Module) -> bool | None:
    """What the loop said of the backward beginning now (True: the step's last), or None if it never
    used a switch."""
    value = module.__dict__.get(FLAG, _UNSET)
    return None if value is _UNSET else bool(value)


def mismatch(requested: bool, micro_step: int, grad_accum_steps: int) -> str:
    """The error when a switch says otherwise than the engine's count for backward `micro_step + 1`."""
    where = (
        f"backward pass {micro_step + 1} of a step, marked the step's last (outside model.no_sync(), or "
        "require_backward_grad_sync / set_requires_gradient_sync(True))"
        if requested
        else f"backward pass {micro_step + 1} of a step, inside model.no_sync() (or with gradient sync switched off)"
    )
    return (
        f"{where}, but Config.grad_accum_steps = {grad_accum_steps} makes it "
        f"{'not ' if requested else ''}the last: zeroinf counts a step's backward passes itself; set "
        "grad_accum_steps to the number of backward passes per optimizer step (those inside no_sync plus the "
        "last one)"
    )
