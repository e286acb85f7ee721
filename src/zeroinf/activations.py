"""Activation checkpointing of units, and offload of the checkpointed inputs to host memory.

With `Config.activation_checkpointing`, every `checkpoint_every`-th unit (not the root) runs its
forward through non-reentrant `torch.utils.checkpoint`: only its inputs are kept, and its forward
is recomputed in backward. The unit's parameters are gathered for the recompute by the same hook
that gathers them for backward (it fires on the unit's outputs before any of its backward runs),
so stage 3 needs nothing special.

With `Config.offload_activations`, those kept inputs move to host memory as forward goes on
(pinned, on a side stream, when CUDA is present) and come back when backward needs them: the
checkpoint saves its inputs through `torch.autograd.graph.saved_tensors_hooks`, so an outer pair
of pack/unpack hooks sees exactly those tensors (the ops inside the checkpoint are handled by the
checkpoint's own, inner hooks). On a CPU-only machine the move is a copy into a separate host
buffer; its bytes are accounted on the host tier of the ledger (tag "activation_offload").

[Note: how the forward is wrapped]
`torch.utils.checkpoint.checkpoint` needs the function to recompute, so the unit module's `forward`
is replaced on the instance by a wrapper that calls the original inside the checkpoint. The
module's class, names and state_dict keys are unchanged; the recompute calls the original forward
directly, so the forward hooks of the unit do not fire twice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from zeroinf.memory import Ledger, Tier

TAG = "activation_offload"


class ActivationOffloader:
    """Pack hook: copy a saved tensor to host memory; unpack hook: bring it back to its device."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.pin = torch.cuda.is_available()
        self.offloaded_bytes = 0  # cumulative, for telemetry
        self._live: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor, int]:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
        host.copy_(tensor, non_blocking=self.pin)
        nbytes = host.numel() * host.element_size()
        self.ledger.reserve(Tier.HOST, nbytes, TAG)
        self.offloaded_bytes += nbytes
        return tensor.device, host, nbytes

    def unpack(self, packed: tuple[torch.device, torch.Tensor, int]) -> torch.Tensor:
        device, host, nbytes = packed
        tensor = host.to(device, non_blocking=self.pin)
        if nbytes:
            self.ledger.release(Tier.HOST, nbytes, TAG)
        return tensor

    def context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _checkpointed(forward: Callable[..., Any], offloader: ActivationOffloader | None) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        ctx = offloader.context() if offloader is not None else contextlib.nullcontext()
        with ctx:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    wrapper.__zeroinf_checkpointed__ = True  # type: ignore[attr-defined]
    return wrapper


def apply_activation_checkpointing(
    modules: list[nn.Module], every: int, offloader: ActivationOffloader | None
) -> int:
    """Checkpoint every `every`-th module of `modules` (unit modules, in order); returns how many."""
    count = 0
    for i, module in enumerate(modules):
        if i % every != 0 or getattr(module.forward, "__zeroinf_checkpointed__", False):
            continue
        module.forward = _checkpointed(module.forward, offloader)  # type: ignore[method-assign]
        count += 1
    return count
