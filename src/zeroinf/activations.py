"""Activation checkpointing of units, and offload of the checkpointed inputs to host memory.

With `Config.activation_checkpointing`, every `checkpoint_every`-th unit (not the root) runs its
forward through non-reentrant `torch.utils.checkpoint`: only its inputs are kept, and its forward
is recomputed in backward. The unit's parameters are gathered for the recompute by the same hook
that gathers them for backward (it fires on the unit's outputs before any of its backward runs),
so stage 3 needs nothing special.

With `Config.offload_activations`, those kept inputs move to host memory as forward goes on and
come back when backward needs them: the checkpoint saves its inputs through
`torch.autograd.graph.saved_tensors_hooks`, so an outer pair of pack/unpack hooks sees exactly
those tensors (the ops inside the checkpoint are handled by the checkpoint's own, inner hooks).
The moves go through the engine's transfer owner (runtime/streams.py): on an accelerator, out on
its d2h stream into a pinned buffer of its pool (the same sizes come back every step, so a steady
step allocates none), and back on its h2d stream, ordered after the outgoing copy by its event;
the buffer returns to the pool once the copy back has read it. On a CPU-only machine the move is
a plain copy into a separate host tensor (the host is the device). Either way the bytes held are
on the host tier of the ledger (tag "activation_offload").

[Note: no KV cache in a checkpointed training forward]
Hugging Face models build a KV cache in every forward unless told not to (`config.use_cache` is
on by default). In a checkpointed layer the recompute appends to it again, so the cache a training
step returns holds every layer's keys and values twice (3.4B Llama, 4 x 2048 tokens: 5.4 GB held
for nothing; measured on a 134M Llama, 4 x 1024 tokens, bf16 on the CPU: peak RSS 5459 -> 5250
MiB, same losses, `benchmarks/vs_peers.py --preset small --ckpt --seq 1024 --batch 4`), and under
`torch.compile` the update is a side effect the compiler will not trace inside a checkpoint, so
those layers run eagerly. Hugging Face's own gradient checkpointing turns
the cache off in training forwards; `no_cache_in_training` does the same for ours (a training forward:
the module in train mode with grad enabled; evaluation and `generate` keep their cache).

[Note: how the forward is wrapped]
`torch.utils.checkpoint.checkpoint` needs the function to recompute, so the unit module's `forward`
is replaced on the instance by a wrapper that calls the original inside the checkpoint. The
module's class, names and state_dict keys are unchanged; the recompute calls the original forward
directly, so the forward hooks of the unit do not fire twice.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from zeroinf.memory import Ledger, Tier
from zeroinf.runtime import hooks
from zeroinf.runtime.streams import Landing, Transfers, typed_view
from zeroinf.telemetry import get_logger

TAG = "activation_offload"


@dataclass
class Packed:
    """A saved tensor while it lives on the host."""

    host: torch.Tensor
    nbytes: int
    raw: torch.Tensor | None = None  # the pool buffer under `host` (accelerator)
    landing: Landing | None = None  # the copy out (accelerator)


class ActivationOffloader:
    """Pack hook: copy a saved tensor to host memory; unpack hook: bring it back to its device."""

    def __init__(self, ledger: Ledger, transfers: Transfers) -> None:
        self.ledger, self.transfers = ledger, transfers
        self.offloaded_bytes = 0  # cumulative, for telemetry

    def pack(self, tensor: torch.Tensor) -> Packed:
        nbytes = tensor.numel() * tensor.element_size()
        self.offloaded_bytes += nbytes
        if tensor.device.type == "cpu" or not self.transfers.accelerated:  # host is the device: a plain copy
            host = torch.empty(tensor.shape, dtype=tensor.dtype)
            self.transfers.to_host(tensor, host)
            self.ledger.reserve(Tier.HOST, nbytes, TAG)
            return Packed(host, nbytes)
        # accelerator branch
        raw = self.transfers.pool.acquire(nbytes, TAG)
        host = typed_view(raw, tensor)
        return Packed(host, nbytes, raw, self.transfers.to_host(tensor, host))

    def unpack(self, packed: Packed) -> torch.Tensor:
        if packed.raw is None:
            if packed.nbytes:
                self.ledger.release(Tier.HOST, packed.nbytes, TAG)
            return packed.host
        # accelerator branch: back on the h2d stream after the copy out; the buffer is lent again once read
        copy = self.transfers.to_device(packed.host, after=packed.landing)
        copy.release()  # the tensor is autograd's now, not engine memory
        self.transfers.pool.release(packed.raw, after=copy.done, tag=TAG)
        return copy.tensor

    def context(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


# [Note: a recompute that fails where the forward ran]
# A module that keeps state from one call to the next sees other inputs in its recompute than in its
# forward: Hugging Face's XLM builds its own KV cache in every forward, whatever `use_cache` says, and
# each attention appends its keys to it, so the recompute meets keys twice as long and a mask
# `expand` fails in backward (benchmarks/hf_sweep.py --checkpointing zeroinf: the one type of 150;
# Hugging Face does not offer gradient checkpointing for XLM either). That error came out of
# torch.utils.checkpoint's unpack hook with nothing saying a recompute was running; it is now
# raised from one that names the unit, the cause and the fix.
def _checkpointed(forward: Callable[..., Any], offloader: ActivationOffloader | None, what: str) -> Callable[..., Any]:
    @functools.wraps(forward)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        calls = 0

        def run(*a: Any, **k: Any) -> Any:
            nonlocal calls
            calls += 1  # 1: the forward, 2: the recompute in backward
            try:
                return forward(*a, **k)
            except Exception as exc:
                if calls == 1 or type(exc).__module__ == checkpoint.__module__:
                    raise  # the forward's own, or torch's: a mismatch it names, its early stop of the recompute
                raise RuntimeError(
                    f"activation checkpointing: recomputing {what} in backward failed where its forward ran "
                    f"({type(exc).__name__}: {exc}). The module gives another result the second time it is "
                    "called on the same inputs: it keeps state between calls (a KV cache it builds itself "
                    "and appends to, as Hugging Face's XLM does, or a counter it reads). Set "
                    "activation_checkpointing=False for this model, or make the module's forward depend on "
                    "its inputs alone"
                ) from exc

        ctx = offloader.context() if offloader is not None else contextlib.nullcontext()
        with ctx:
            return checkpoint(run, *args, use_reentrant=False, **kwargs)

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
        module.forward = _checkpointed(module.forward, offloader, f"unit {type(module).__name__}")
        count += 1
    return count


def no_cache_in_training(module: nn.Module) -> list[RemovableHandle]:
    """Training forwards of a Hugging Face-style model (a `config.use_cache`, a forward taking
    `use_cache`) get `use_cache=False` ([Note: no KV cache in a checkpointed training forward])."""
    if getattr(getattr(module, "config", None), "use_cache", None) is None:
        return []
    params = list(inspect.signature(module.forward).parameters.values())
    names = [p.name for p in params]
    if "use_cache" in names:
        position = names.index("use_cache")  # passed positionally there: left alone
    elif any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        position = len(names)
    else:
        return []
    told = False

    def rewrite(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        nonlocal told
        if not (module.training and torch.is_grad_enabled()) or len(args) > position:
            return None
        if kwargs.get("use_cache") is False:
            return None
        if not told:
            get_logger().info(
                "activation checkpointing: training forwards run with use_cache=False (no KV cache), as with "
                "Hugging Face's own gradient checkpointing"
            )
            told = True
        return {**kwargs, "use_cache": False}

    return [hooks.register_input_rewrite(module, rewrite)]
