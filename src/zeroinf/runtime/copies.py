"""Host-to-device copies of parameter shards on a side stream, so they overlap compute on accelerators.

On a CPU device the host buffer is the device tensor: nothing is copied and nothing here runs.
On CUDA (and other stream-based accelerators) a shard that lives on the host or NVMe must reach the
device before its all-gather. Issued on the compute stream, the copy would wait behind the kernels
queued for the current unit; on a side stream it runs beside them, and only the gather (queued
after the compute stream waits on the copy's event) is ordered after it. The CPU never blocks.

Two hazards come with an asynchronous copy out of a host buffer, and `HostCopy` handles both:
- the destination is allocated on the side stream but used on the compute stream, so it is marked
  with `record_stream` (the caching allocator must not reuse it until the compute stream is done);
- the host buffer (an NVMe staging buffer, or the host home) must not be overwritten or returned to
  its pool until the DMA has read it: `HostCopy.wait_source_free()` waits for the copy's event.

Accelerator-neutral APIs only (torch.Stream, torch.Event, torch.accelerator); these branches are
exercised on GPU machines, not by the CPU test suite.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class HostCopy:
    """A shard on its way to the device: `tensor` is usable on the compute stream right away."""

    tensor: torch.Tensor
    done: torch.Event | None = None  # None: no copy was made (CPU device, or already on the device)

    def wait_source_free(self) -> None:
        """Block until the copy has read its host source (a no-op on CPU)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None


@functools.cache
def _side_stream(device: torch.device) -> torch.Stream:
    return torch.Stream(device=device)


def to_device(source: torch.Tensor, device: torch.device) -> HostCopy:
    """Start copying `source` (host memory, pinned when CUDA is present) to `device` on a side stream."""
    if source.device == device:
        return HostCopy(source)
    # GPU branch: CPU devices return above (host and device are the same memory).
    side = _side_stream(device)
    compute = torch.accelerator.current_stream(device)
    done = torch.Event(device=device)
    with side:
        tensor = source.to(device, non_blocking=True)
        done.record(side)
    compute.wait_event(done)  # the gather and the kernels that follow see the copied shard
    tensor.record_stream(compute)
    return HostCopy(tensor, done)
