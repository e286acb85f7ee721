"""The only place zeroinf registers hooks on the user's modules and parameters.

Hook actions are idempotent where they can be re-entered (a parameter reused twice in one forward
still reports its gradient once: autograd sums into the leaf before AccumulateGrad runs).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def register_grad_ready_hooks(
    params: list[nn.Parameter], on_ready: Callable[[int], None]
) -> list[RemovableHandle]:
    """Call `on_ready(i)` after autograd has accumulated params[i].grad in a backward pass."""
    handles = []
    for index, param in enumerate(params):

        def hook(_: torch.Tensor, index: int = index) -> None:
            on_ready(index)

        handles.append(param.register_post_accumulate_grad_hook(hook))
    return handles


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    """Run `callback` once the current autograd backward pass has finished (call from inside a hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
