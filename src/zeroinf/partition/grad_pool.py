"""Gradient buffers reused from unit to unit within one backward, where the device is the CPU.

[Note: why gradient buffers are pooled within a backward]
A unit's unsharded gradient buffer (and, between ranks, the buffer its shard is reduced into) lives
from the unit's first gradient until its reduction, or until the optimizer stepped it inside
backward: a short stretch of the backward, after which the next unit asks for a buffer of the same
size (a transformer's layers are units of one size). On an accelerator the caching allocator hands
the freed memory out again. On a CPU device every buffer is a glibc allocation, and above glibc's
32 MiB mmap ceiling (units of more than 8M fp32 parameters) each is a fresh mapping, faulted in page
by page and zero-filled by the kernel, then unmapped when freed: 1.0B GPT in fp32, parameters on NVMe,
optimizer on the host, world 1, 0.94M of the step's 3.81M minor faults (3.8 GB of fresh pages).

The pool keeps a freed buffer for the next unit of the same size, only while a backward runs: it
opens when the backward begins and empties when it ends, and a buffer given back outside a backward
is freed at once. So it never holds memory through a forward or an optimizer step, and inside the
backward a freed buffer only waits for the next unit's request, which would otherwise allocate the
same bytes: the step's peak stays what it was. A buffer is given back only by its one owner, once
nothing reads it any more (its collective waited, its copy made, the optimizer done with it). On an
accelerator `take` allocates and `give` drops: the caching allocator already does this, and orders
the reuse after the copies still reading a buffer.
"""

from __future__ import annotations

import torch


class GradBufferPool:
    """Free gradient buffers by (numel, dtype), kept between `open()` and `close()` on a CPU device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = device.type == "cpu"
        self._open = False
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.reused = 0  # requests served by a buffer given back earlier (in total)

    def open(self) -> None:
        """A backward begins: freed buffers are kept for the next request of their size."""
        self._open = self.enabled

    def close(self) -> None:
        """The backward ended: free what is kept, and free at once what is given back from now on."""
        self._open = False
        self._free.clear()

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized 1-D buffer of `numel` elements of `dtype` on the device."""
        free = self._free.get((numel, dtype))
        if free:
            self.reused += 1
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=self.device)

    def give(self, buffer: torch.Tensor) -> None:
        """The caller's buffer from `take`, which nothing reads or writes any more."""
        if self._open:
            self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)

    @property
    def held_bytes(self) -> int:
        """Bytes of the free buffers kept now."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)
