"""`torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` over a sharded model.

[Note: torch's clip_grad_norm_ over a sharded model]
The engine never leaves gradients in `p.grad` (it reduces each into its shard as autograd delivers
it and, by default, steps that unit inside backward), so torch's `clip_grad_norm_` over the model's
parameters used to find no gradient, return 0 and clip nothing: a ported loop (nanoGPT, an accelerate
loop's `accelerator.clip_grad_norm_`) trained unclipped without a word, as it does under DeepSpeed's
ZeRO-3. Clipping itself cannot happen there: a unit stepped inside backward is not clipped afterwards.
The engine clips exactly in `step()` when `Config.grad_clip_norm` is set (speculating inside backward
and undoing what clipping changes, optim/adamw.py), so the call has two outcomes:

- `grad_clip_norm == max_norm` (L2): the call returns the global gradient norm before clipping, the
  figure torch returns, computed now across shards (`AdamW.grad_norm_before_step`); the next
  `step()` clips with that very value. The loop keeps its line, and its logged norms are right.
- anything else (no `grad_clip_norm`, another `max_norm`, another norm type, part of the model's
  parameters, a mix with parameters the engine does not hold): an error naming the fix.

torch's `clip_grad_norm_` computes the norm with `_get_total_norm` and clips with
`_clip_grads_with_norm_`, both looked up in `torch.nn.utils.clip_grad` at call time (torch >= 2.6);
`install` wraps those two names there (and their public aliases) on the first `zeroinf.shard`. The
wrappers change nothing for parameters no sharded model holds, and catch the call however it was
imported (`from torch.nn.utils import clip_grad_norm_` before `import zeroinf` included). The
norm `_get_total_norm` returned (0 over no gradients) is the tensor the call returns: the wrapper
writes the global norm into it. A tensor of other origin passed to `clip_grads_with_norm_` is
refused. Older torch (2.4, 2.5) computes inline, so there `install` wraps `clip_grad_norm_` itself
as `torch.nn.utils.clip_grad_norm_` and `torch.nn.utils.clip_grad.clip_grad_norm_`: the same two
outcomes, except for a copy imported by name before the first `zeroinf.shard`.

`torch.nn.utils.clip_grad_value_` finds no `p.grad` either and clipped nothing. Clamping is
elementwise, so the engine does it on each reduced shard before its update (inside backward too)
when `Config.grad_clip_value` is set; the call with that value is then a check that passes (the
clamp happens at the step, on the gradient torch would clamp: averaged over ranks and micro-steps,
loss scale removed), and any other use over a sharded model's parameters is refused by name.
Parameters no sharded model holds are clamped as before, also in the same call. It is caught as
`torch.nn.utils.clip_grad_value_` (and in `torch.nn.utils.clip_grad`), the names loops call it by;
a copy imported by name before the first `zeroinf.shard` is not.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

_installed = False
_last_norm = threading.local()  # what the last `_get_total_norm` of this thread returned, and how


class ClipGradNormError(RuntimeError):
    """torch.nn.utils.clip_grad_norm_ over a sharded model's parameters cannot do what it asks."""


_SET_CONFIG = (
    "the engine keeps a sharded model's gradients in its shards, not in p.grad, and clips them exactly "
    "in optimizer.step() when Config.grad_clip_norm is set"
)


def install() -> None:
    """Wrap the two functions torch's `clip_grad_norm_` calls (idempotent; torch >= 2.6)."""
    global _installed
    if _installed:
        return
    _installed = True
    from torch.nn.utils import clip_grad

    _wrap_public(clip_grad, "clip_grad_value_", _refusing_sharded_clip_value)
    total_norm = getattr(clip_grad, "_get_total_norm", None)
    clip_with_norm = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if total_norm is None or clip_with_norm is None:  # torch < 2.6 computes inline (module docstring)
        _wrap_public(clip_grad, "clip_grad_norm_", _clip_grad_norm_through_engine)
        return
    wrapped_norm = _recording_total_norm(total_norm)
    wrapped_clip = _clip_through_engine(clip_with_norm)
    clip_grad._get_total_norm = wrapped_norm
    clip_grad._clip_grads_with_norm_ = wrapped_clip
    utils = torch.nn.utils
    if getattr(utils, "get_total_norm", None) is total_norm:
        utils.get_total_norm = wrapped_norm
    if getattr(utils, "clip_grads_with_norm_", None) is clip_with_norm:
        utils.clip_grads_with_norm_ = wrapped_clip


def _wrap_public(clip_grad: Any, name: str, wrap: Callable[[Any], Any]) -> None:
    """Replace torch's function `name` by its wrapper, in `torch.nn.utils.clip_grad` and, where it is the
    same function, in `torch.nn.utils` (the two names loops call it by)."""
    original = getattr(clip_grad, name, None)
    if original is None:
        return
    wrapper = wrap(original)
    if getattr(torch.nn.utils, name, None) is original:
        setattr(torch.nn.utils, name, wrapper)
    setattr(clip_grad, name, wrapper)


def _refusing_sharded_clip_value(original: Callable[..., None]) -> Callable[..., None]:
    def clip_grad_value_(parameters: Any, clip_value: float, foreach: bool | None = None) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held = _sharded_parameters(params)
        if held is not None:
            _check_clip_value(held, float(clip_value))
            held_ids = {id(p) for p, _ in held}
            params = [p for p in params if id(p) not in held_ids]
            if not any(p.grad is not None for p in params):
                return  # torch's own call fails on an empty list
        original(params, clip_value, foreach)

    clip_grad_value_.__doc__ = original.__doc__
    clip_grad_value_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grad_value_


def _check_clip_value(held: list[tuple[torch.Tensor, Any]], clip_value: float) -> None:
    """`clip_grad_value_(..., clip_value)` over sharded parameters: what the engine does anyway, or refused."""
    call = f"torch.nn.utils.clip_grad_value_(..., {clip_value:g})"
    engines = {id(engine): engine for _, engine in held}
    for engine in engines.values():
        configured = engine.cfg.grad_clip_value
        if configured is None:
            raise ClipGradNormError(
                f"{call} over a sharded model's parameters would clip nothing: the engine keeps a sharded "
                "model's gradients in its shards, not in p.grad, and clamps them itself. Set "
                f"grad_clip_value={clip_value:g} in the zeroinf Config; this call then checks that value and "
                "every step clamps with it"
            )
        if configured != clip_value:
            raise ClipGradNormError(
                f"{call}, but the sharded model's Config.grad_clip_value is {configured:g} and the engine clamps "
                "with that: make them equal"
            )
        held_ids = {id(p) for p, e in held if e is engine}
        missing = [p for p in engine.trained_params if p.requires_grad and id(p) not in held_ids]
        if missing:
            raise ClipGradNormError(
                f"{call} over {len(held_ids)} of the sharded model's {len(engine.trained_params)} trained "
                "parameters: the engine clamps every gradient (Config.grad_clip_value); pass model.parameters()"
            )


def _clip_grad_norm_through_engine(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`clip_grad_norm_` itself, for torch < 2.6 (which has no `_get_total_norm` to wrap)."""

    def clip_grad_norm_(
        parameters: Any, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held = _sharded_parameters(params)
        if held is None:
            return original(params, max_norm, norm_type, error_if_nonfinite, foreach)
        total_norm = torch.zeros((), dtype=torch.float32)  # what torch returns over no gradient, filled
        _last_norm.value = (weakref.ref(total_norm), float(norm_type), bool(error_if_nonfinite))
        _clip_sharded(params, held, float(max_norm), total_norm)
        return total_norm

    clip_grad_norm_.__doc__ = original.__doc__
    clip_grad_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grad_norm_


def _recording_total_norm(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def get_total_norm(
        tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None
    ) -> torch.Tensor:
        result = original(tensors, norm_type, error_if_nonfinite, foreach)
        _last_norm.value = (weakref.ref(result), float(norm_type), bool(error_if_nonfinite))
        return result

    get_total_norm.__doc__ = original.__doc__
    get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    return get_total_norm


def _clip_through_engine(original: Callable[..., None]) -> Callable[..., None]:
    def clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None
    ) -> None:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        held = _sharded_parameters(params)
        if held is None:
            original(params, max_norm, total_norm, foreach)
            return
        _clip_sharded(params, held, float(max_norm), total_norm)

    clip_grads_with_norm_.__doc__ = original.__doc__
    clip_grads_with_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return clip_grads_with_norm_


def _sharded_parameters(params: Iterable[torch.Tensor]) -> list[tuple[torch.Tensor, Any]] | None:
    """(parameter, engine) for each parameter a sharded model trains; None if there is none."""
    from zeroinf.engine import owning_engine

    held = []
    for p in params:
        found = owning_engine(p)
        if found is not None:
            held.append((p, found[0]))
    return held or None


def _clip_sharded(
    params: list[torch.Tensor], held: list[tuple[torch.Tensor, Any]], max_norm: float, total_norm: torch.Tensor
) -> None:
    engines = {id(engine): engine for _, engine in held}
    if len(engines) > 1:
        raise ClipGradNormError(
            "clip_grad_norm_ over the parameters of several sharded models: clip each model in its own call "
            "(each engine clips its own gradients)"
        )
    engine = next(iter(engines.values()))
    held_ids = {id(p) for p, _ in held}
    stray = [p for p in params if id(p) not in held_ids and p.grad is not None]
    if stray:
        raise ClipGradNormError(
            f"clip_grad_norm_ over a sharded model's parameters and {len(stray)} other parameters with gradients: "
            "one norm cannot cover both (the sharded model's gradients are in its shards); clip them in separate calls"
        )
    missing = [p for p in engine.trained_params if p.requires_grad and id(p) not in held_ids]
    if missing:
        raise ClipGradNormError(
            f"clip_grad_norm_ over {len(held_ids)} of the sharded model's {len(engine.trained_params)} trained "
            f"parameters: {_SET_CONFIG}, over all of them; pass model.parameters()"
        )
    record = getattr(_last_norm, "value", None)
    if record is None or record[0]() is not total_norm:
        raise ClipGradNormError(
            "clip_grads_with_norm_ with a norm computed elsewhere over a sharded model's parameters: the norm of "
            f"their p.grad is 0 ({_SET_CONFIG}); call torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) "
            "with grad_clip_norm = max_norm, or read optimizer.last_grad_norm after step()"
        )
    _, norm_type, error_if_nonfinite = record
    configured = engine.cfg.grad_clip_norm
    if configured is None:
        raise ClipGradNormError(
            f"torch.nn.utils.clip_grad_norm_(..., max_norm={max_norm:g}) over a sharded model's parameters would "
            f"clip nothing: {_SET_CONFIG}. Set grad_clip_norm={max_norm:g} in the zeroinf Config; this call then "
            "returns the norm as before and the step clips with it"
        )
    if max_norm != configured:
        raise ClipGradNormError(
            f"clip_grad_norm_ with max_norm={max_norm:g}, but the sharded model's Config.grad_clip_norm is "
            f"{configured:g} and the engine clips with that: make them equal"
        )
    if norm_type != 2.0:
        raise ClipGradNormError(
            f"clip_grad_norm_ with norm_type={norm_type:g} over a sharded model's parameters: the engine clips by "
            "the L2 norm (Config.grad_clip_norm); use norm_type=2"
        )
    ref = engine.optimizer_ref
    optimizer = ref() if ref is not None else None
    if optimizer is None:
        raise ClipGradNormError(
            "clip_grad_norm_ over a sharded model that no zeroinf.AdamW steps: build the optimizer with "
            "zeroinf.AdamW(model, ...)"
        )
    norm = optimizer.grad_norm_before_step()
    if error_if_nonfinite and not math.isfinite(norm):
        raise RuntimeError(
            f"clip_grad_norm_(error_if_nonfinite=True): the sharded model's gradient norm is {norm} (with fp16 the "
            "step skips this update and lowers the loss scale; pass error_if_nonfinite=False to let it)"
        )
    with torch.no_grad():
        total_norm.fill_(norm)
