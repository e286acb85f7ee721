"""The host tier: CPU memory the engine owns, pinned when CUDA is present, counted on the ledger.

Shards that live on the host (optimizer states today; parameter and gradient shards with stage 3)
are plain CPU tensors. Two things make them a tier rather than ordinary tensors: they are
page-locked when there is a GPU, so that host <-> device copies can run asynchronously, and every
byte is reserved on the ledger's HOST tier under a tag, so host memory per step is a measured
figure. `max_host_bytes` in the config caps what the engine may hold there; `check_host_cap` is
the one place that compares a plan against it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import mmap
import weakref
from collections.abc import Callable

import torch

from zeroinf.config import AUTO
from zeroinf.memory import Ledger, Tier, format_bytes
from zeroinf.topology import cuda_in_use


class HostCapError(MemoryError):
    """The planned host memory exceeds `offload.max_host_bytes`; the message says by how much."""


def pin_by_default() -> bool:
    """Host tensors are pinned exactly when this process computes on a CUDA device, which copies
    from them asynchronously (pinning on a CPU run would only create a CUDA context)."""
    return cuda_in_use()


def host_zeros(
    numel: int, dtype: torch.dtype, ledger: Ledger, tag: str, *, pin: bool | None = None
) -> torch.Tensor:
    """A zero-filled 1-D CPU tensor, reserved on the ledger's HOST tier under `tag`.

    Release it with `release_host(tensor, ledger, tag)` when it is dropped.
    """
    pin = pin_by_default() if pin is None else pin
    tensor = pinned_zeros(numel, dtype) if pin else torch.zeros(numel, dtype=dtype)
    ledger.reserve(Tier.HOST, tensor.numel() * tensor.element_size(), tag)
    return tensor


def pinned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, page-locked 1-D CPU tensor that takes exactly its own pages.

    Why not `torch.zeros(..., pin_memory=True)`: PyTorch's caching host allocator rounds every
    pinned block up to a power of two, and pinned pages are resident. With one tensor per unit and
    state kind, a 6.7B Llama's layers (202M parameters, 810 MB per fp32 state) took 1 GiB each:
    27 GiB of the 102.5 GiB peak RSS measured on an H100 machine (optimizer on the host) were that
    rounding. Here the pages come from an anonymous mapping (zero-filled, exact) that CUDA
    registers (`cudaHostRegister`) and unregisters when the mapping is dropped. Where registration
    is unavailable or fails, the caching allocator's pinned memory is used instead (rounded, still
    correct)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = max(numel * itemsize, 1)
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    try:  # GPU branch
        cudart = torch.cuda.cudart()
        region = mmap.mmap(-1, length)
        tensor = torch.frombuffer(region, dtype=torch.uint8)
        ptr = tensor.data_ptr()
        if int(cudart.cudaHostRegister(ptr, length, 0)) != 0:
            raise RuntimeError("cudaHostRegister failed")
    except (AttributeError, RuntimeError, OSError, TypeError):
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    # Unregister before the mapping goes: the finalizer runs when the last view's storage (which
    # holds `region`) is freed, while the pages are still mapped.
    weakref.finalize(region, cudart.cudaHostUnregister, ptr)
    return tensor[: numel * itemsize].view(dtype)


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


# -- the C allocator (glibc) ----------------------------------------------------------------------------------
# [Note: glibc's thresholds while building and while training]
# glibc serves an allocation above its mmap threshold with a fresh mapping, unmapped again on free:
# the memory goes back to the OS at once, but the next allocation of that size faults its pages in
# again, one by one, zero-filled by the kernel. Below the threshold, memory comes from the heap and is
# reused without faults, but freed chunks stay with the process as fragments. By default the
# threshold rises (up to 32 MiB) as mapped chunks are freed, and the heap is trimmed only when its
# free top exceeds twice the threshold. Two phases want different settings:
#
# - Building, under `zeroinf.init` and while an offloaded engine builds its units: parameters are
#   built, parked or sharded, and freed one after another, and each must go back to the OS
#   (`map_large_buffers`: 1 MiB, plus `return_freed_memory` after each unit).
# - Training (`reuse_step_buffers`, set by every engine once its units are built): a step frees and
#   reallocates the same buffers every time (a unit's gathered parameters and gradients, activations
#   and their gradients on a CPU device). At 1 MiB every one of them was faulted in afresh each step:
#   98M GPT, optimizer on host, 2 ranks, 3.38 s/step against 2.19 with the setting below. A fixed
#   32 MiB threshold (glibc's own maximum) with a 64 MiB trim threshold reuses them as glibc's default
#   does once warmed up, and, being fixed, keeps it from drifting: fully offloaded, peak RSS grew 1.11x
#   from 38M to 152M parameters (1.02x at 1 MiB, 1.21x with glibc's moving default). Larger buffers
#   are still mapped and returned when freed.
# - Training, from the second step where `Config.reuse_step_memory` says so (`StepMemory`):
#   nothing is mapped any more and the heap's top is never trimmed, so what a step frees stays for
#   the next. A unit's gathered parameters and gradient buffer above 32 MiB, and the weight gradients
#   autograd computes for them, were otherwise mapped and faulted in afresh every step (1.31B GPT
#   fully on NVMe, bf16: 2.1-2.4M faults, 8.7 GB a step, 20.3 against 18.1 s/step; measured before
#   gradient buffers were pooled within the backward, partition/grad_pool.py). With a 1 GiB trim
#   threshold a 1.0B GPT's step freed more than that at the top and faulted it back in. The price
#   is the heap's fragments: the step's buffers take 1.5-3x what they hold at once (docs/design.md).
#   From the second step, not the first: the optimizer's states, made in the first step and kept for
#   the run, stay mapped and never interleave with the step's buffers on the heap (switched at
#   build, peak RSS was 5.6 bytes per parameter higher).
#
# All are process-wide and need glibc; elsewhere they do nothing.

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc mallopt parameters
DEFAULT_MMAP_MAX = 65536  # glibc's default count of mapped chunks
KEEP_TRIM_THRESHOLD = -1  # never trim the heap's top (glibc: -1 disables trimming)
BUILD_MMAP_THRESHOLD_BYTES = 1 << 20
STEP_MMAP_THRESHOLD_BYTES = 32 << 20
STEP_TRIM_THRESHOLD_BYTES = 64 << 20


@functools.cache
def _libc(symbol: str) -> Callable[..., int] | None:
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol) if name else None
    except (OSError, AttributeError):  # not glibc
        return None


def return_freed_memory() -> None:
    """Give freed heap memory back to the OS (glibc). Materializing unit after unit frees
    megabytes at a time in an order the allocator cannot coalesce; without this the process keeps
    about a third of the model as fragmented heap (measured: 119 MiB RSS for 72 MiB of shards, 75 with it).
    """
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


_trim_pending = False


def _trim_at_collection_end(phase: str, info: dict[str, int]) -> None:
    global _trim_pending
    if phase == "stop" and _trim_pending:
        _trim_pending = False
        return_freed_memory()


def return_freed_memory_after_collection() -> None:
    """`return_freed_memory` once the garbage collection running now (if any) has freed what it found:
    called from a finalizer, the objects it collects are not freed yet; otherwise at the next one. The
    callback stays registered (removing it while the collector calls the list would skip another's)."""
    global _trim_pending
    _trim_pending = True
    if _trim_at_collection_end not in gc.callbacks:
        gc.callbacks.append(_trim_at_collection_end)


def map_large_buffers() -> None:
    """While building: allocations of 1 MiB and more are mapped, so freeing them returns memory to
    the OS ([Note: glibc's thresholds while building and while training])."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        mallopt(M_MMAP_THRESHOLD, BUILD_MMAP_THRESHOLD_BYTES)


def reuse_step_buffers() -> None:
    """While training: buffers up to 32 MiB are reused from the heap step after step
    ([Note: glibc's thresholds while building and while training])."""
    mallopt = _libc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
        mallopt(M_MMAP_THRESHOLD, STEP_MMAP_THRESHOLD_BYTES)
        mallopt(M_TRIM_THRESHOLD, STEP_TRIM_THRESHOLD_BYTES)


def keep_step_memory() -> bool:
    """From the second step on: every buffer comes from the heap, which keeps what is freed for the
    next step ([Note: glibc's thresholds while building and while training]). True where it was set."""
    mallopt = _libc("mallopt")
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD))


def wants_kept_step_memory(setting: bool | str, device_type: str) -> bool:
    """`Config.reuse_step_memory` resolved after the first step: "auto" keeps the step's memory where
    the CPU computes (the step's buffers are host memory there; an accelerator's allocator caches its
    own) and the machine still has as much memory available as this process holds, so a run sized to
    the machine's limit keeps its leaner peak."""
    if isinstance(setting, bool):
        return setting
    from zeroinf.planner.profile import available_ram_bytes, rss_bytes

    return device_type == "cpu" and available_ram_bytes() >= rss_bytes()



class StepMemory:
    """`Config.reuse_step_memory` over one engine's run: decided once its first step is done and,
    under "auto", given back for good once the machine has less memory available than the process
    holds. The heap's fragments can grow for a while after the switch (0.5B GPT fp32, parameters on
    NVMe: peak RSS 2.1 GB after the first step, 4.0 GB by step 17 and flat after, against 2.75 GB
    mapped): the speed is taken while there is room for that, not at a run's memory limit.

    [Note: the heap after a model is deleted]
    A deleted model's host memory went back to the heap, not to the OS: the heap is trimmed only
    above its threshold (never while step memory is kept, a process-wide setting), so a notebook that
    dropped a model still held about half its peak (a 100M-parameter model, host states: 0.88 GB of
    RSS after `del model, opt; gc.collect()`, from 0.24 before it was built and 2.09 while it
    trained; 0.33 once trimmed). Now the engine's finalizer calls `release`: the last engine keeping
    step memory restores the training thresholds, and once the collection that freed the model has
    ended (its tensors are freed after the finalizers run) the heap's free memory goes back to the
    OS (`return_freed_memory`)."""

    kept_by_engines = 0  # engines whose step memory is kept: the setting is the process's

    def __init__(self, setting: bool | str, device_type: str) -> None:
        self.setting, self.device_type = setting, device_type
        self.steps = 0
        self.kept = False
        self.undone = False  # kept, then given back: memory ran short

    def after_step(self) -> None:
        self.steps += 1
        if self.steps == 1:
            self.kept = wants_kept_step_memory(self.setting, self.device_type) and keep_step_memory()
            StepMemory.kept_by_engines += self.kept
        elif self.kept and self.setting == AUTO and not wants_kept_step_memory(AUTO, self.device_type):
            reuse_step_buffers()
            return_freed_memory()
            self.kept, self.undone = False, True
            StepMemory.kept_by_engines -= 1

    def release(self) -> None:
        """The engine is gone (its finalizer): [Note: the heap after a model is deleted]."""
        if self.kept:
            self.kept = False
            StepMemory.kept_by_engines -= 1
            if StepMemory.kept_by_engines == 0:
                reuse_step_buffers()
        return_freed_memory_after_collection()

    def report(self) -> str:
        """What `memory_report()` shows: "kept", "returned", or "undone" (kept, then given back)."""
        return "kept" if self.kept else "undone" if self.undone else "returned"
