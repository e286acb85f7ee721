"""Initializations that overwrite a whole parameter, recognized so the park can draw them in pieces.

See park.py [Note: a large parameter drawn in pieces]. `whole_overwrite(func, args, kwargs)`
answers, for a torch function about to run on a parked parameter, whether it writes every element
without reading any (a random draw or a fill) and, if so, how to write one piece: the parameter,
and a function filling a fresh flat tensor of the parameter's dtype as the call fills the whole.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

Fill = Callable[[torch.Tensor], Any]

# A parameter at least this large, built on the CPU in fp32, is drawn in pieces of PIECE_NUMEL
# elements (a multiple of 16: the CPU generator's normal_ works in blocks of 16, so its stream is
# the same cut there; measured for normal_ and uniform_, state after the draw included). Read at
# use, so tests may lower both.
DRAW_MIN_BYTES = 32 * 2**20
PIECE_NUMEL = 4 * 2**20


def piece_bounds(numel: int, per: int | None = None) -> Iterator[tuple[int, int]]:
    """[start, end) of consecutive pieces of `per` elements (PIECE_NUMEL); the last one holds the
    remainder, and is never shorter than 16 elements (a normal_ of fewer draws element by element,
    another stream)."""
    starts = list(range(0, numel, per or PIECE_NUMEL))
    if len(starts) > 1 and numel - starts[-1] < 16:
        starts.pop()
    for i, start in enumerate(starts):
        yield start, starts[i + 1] if i + 1 < len(starts) else numel


def _bind(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _init_fill(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Fill] | None:
    init = nn.init
    if func not in (init.normal_, init.uniform_, init.constant_, init.ones_, init.zeros_, init.kaiming_uniform_):
        return None
    a = _bind(func, args, kwargs)
    tensor, generator = a["tensor"], a.get("generator")
    if func is init.normal_:
        mean, std = a["mean"], a["std"]
        return tensor, lambda t: t.normal_(mean, std, generator=generator)
    if func is init.uniform_:
        low, high = a["a"], a["b"]
        return tensor, lambda t: t.uniform_(low, high, generator=generator)
    if func is init.kaiming_uniform_:  # torch's own arithmetic for the bound (fan from the shape)
        if 0 in tensor.shape:
            return None
        gain = init.calculate_gain(a["nonlinearity"], a["a"])
        bound = math.sqrt(3.0) * gain / math.sqrt(init._calculate_correct_fan(tensor, a["mode"]))
        return tensor, lambda t: t.uniform_(-bound, bound, generator=generator)
    value = {init.ones_: 1.0, init.zeros_: 0.0}.get(func, a.get("val"))
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return tensor, lambda t: t.fill_(value)


def _method_fill(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Fill] | None:
    if not args or not isinstance(args[0], torch.Tensor):
        return None
    tensor, rest = args[0], args[1:]
    generator = kwargs.get("generator")
    if func is torch.Tensor.normal_:
        mean = rest[0] if len(rest) > 0 else kwargs.get("mean", 0.0)
        std = rest[1] if len(rest) > 1 else kwargs.get("std", 1.0)
        return tensor, lambda t: t.normal_(mean, std, generator=generator)
    if func is torch.Tensor.uniform_:
        low = rest[0] if len(rest) > 0 else kwargs.get("from", 0.0)
        high = rest[1] if len(rest) > 1 else kwargs.get("to", 1.0)
        return tensor, lambda t: t.uniform_(low, high, generator=generator)
    if func is torch.Tensor.zero_ and not rest and not kwargs:
        return tensor, lambda t: t.zero_()
    if func is torch.Tensor.fill_ and len(rest) == 1 and not kwargs:
        value = rest[0]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return tensor, lambda t: t.fill_(value)
    return None


def whole_overwrite(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor, Fill] | None:
    """(the tensor written, how to fill a piece of it) when `func(*args, **kwargs)` overwrites every
    element of a tensor without reading it; None otherwise (or when in doubt)."""
    try:
        return _init_fill(func, args, kwargs) or _method_fill(func, args, kwargs)
    except (TypeError, KeyError, IndexError):  # arguments not as expected: let the call run as is
        return None
