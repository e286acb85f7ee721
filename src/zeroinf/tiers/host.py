"""The host tier: CPU memory the engine owns, pinned when CUDA is present, counted on the ledger.

Shards that live on the host (optimizer states today; parameter and gradient shards with stage 3)
are plain CPU tensors. Two things make them a tier rather than ordinary tensors: they are
page-locked when there is a GPU, so that host <-> device copies can run asynchronously, and every
byte is reserved on the ledger's HOST tier under a tag, so host memory per step is a measured
figure. `max_host_bytes` in the config caps what the engine may hold there; `check_host_cap` is
the one place that compares a plan against it.
"""

from __future__ import annotations

import torch

from zeroinf.memory import Ledger, Tier, format_bytes


class HostCapError(MemoryError):
    """The planned host memory exceeds `offload.max_host_bytes`; the message says by how much."""


def pin_by_default() -> bool:
    """Host tensors are pinned exactly when a CUDA device can copy from them asynchronously."""
    return torch.cuda.is_available()


def host_zeros(
    numel: int, dtype: torch.dtype, ledger: Ledger, tag: str, *, pin: bool | None = None
) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor, reserved on the ledger's HOST tier under `tag`.

    Release it with `release_host(tensor, ledger, tag)` when it is dropped.
    """
    pin = pin_by_default() if pin is None else pin
    tensor = torch.zeros(numel, dtype=dtype, pin_memory=pin)
    ledger.reserve(Tier.HOST, tensor.numel() * tensor.element_size(), tag)
    return tensor


def release_host(tensor: torch.Tensor, ledger: Ledger, tag: str) -> None:
    """Return a `host_zeros` tensor's bytes to the ledger (the caller drops the tensor)."""
    ledger.release(Tier.HOST, tensor.numel() * tensor.element_size(), tag)


def check_host_cap(needed_bytes: int, max_host_bytes: int | None, what: str, fix: str) -> None:
    """Raise HostCapError when `needed_bytes` of host memory for `what` exceed the configured cap."""
    if max_host_bytes is None or needed_bytes <= max_host_bytes:
        return
    raise HostCapError(
        f"{what} needs {needed_bytes} bytes ({format_bytes(needed_bytes)}) of host memory but "
        f"offload.max_host_bytes = {max_host_bytes} ({format_bytes(max_host_bytes)}); {fix}"
    )
