"""Aligned host buffers and the fixed pool the I/O engine borrows them from.

O_DIRECT needs buffer addresses aligned to the filesystem's logical block; `torch.empty` gives no such
promise, so buffers are anonymous mmaps (page-aligned) wrapped as tensors, or, when CUDA is present,
page-locked allocations sliced to an aligned start so that host-to-device copies can be asynchronous.

The pool allocates all its buffers up front and never more: running out waits (up to a timeout) for
a holder to release one, so a leak or an undersized pool is a clear error instead of silent growth.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
import time
from dataclasses import dataclass, field

import torch

from zeroinf.aio.errors import BufferPoolTimeout
from zeroinf.memory import Ledger, Tier, format_bytes
from zeroinf.topology import cuda_in_use

PAGE_BYTES = mmap.PAGESIZE


def round_up(nbytes: int, alignment_bytes: int) -> int:
    return -(-nbytes // alignment_bytes) * alignment_bytes


def aligned_empty(nbytes: int, alignment_bytes: int = 4096, *, pin: bool | None = None) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of `nbytes` whose data_ptr is a multiple of `alignment_bytes`.

    pin=None pins exactly when this process computes on CUDA (`topology.cuda_in_use`). The memory is
    not zeroed when pinned.
    """
    if nbytes <= 0:
        raise ValueError(f"aligned_empty: nbytes={nbytes} must be positive")
    if pin is None:
        pin = cuda_in_use()
    if pin:  # GPU branch: the caching host allocator gives page-locked memory; slice to alignment
        raw = torch.empty(nbytes + alignment_bytes, dtype=torch.uint8, pin_memory=True)
        start = (-raw.data_ptr()) % alignment_bytes
        return raw[start : start + nbytes]
    if alignment_bytes > PAGE_BYTES:
        raw = aligned_empty(nbytes + alignment_bytes, PAGE_BYTES, pin=False)
        start = (-raw.data_ptr()) % alignment_bytes
        return raw[start : start + nbytes]
    # An anonymous mmap is page-aligned and zero-filled; the tensor keeps the mapping alive.
    return torch.frombuffer(mmap.mmap(-1, round_up(nbytes, PAGE_BYTES)), dtype=torch.uint8)[:nbytes]


def as_bytes(tensor: torch.Tensor, what: str = "tensor") -> torch.Tensor:
    """The flat uint8 view of a contiguous CPU tensor's bytes (no copy)."""
    if tensor.device.type != "cpu":
        raise ValueError(f"aio: {what} is on {tensor.device}; the engine moves CPU tensors only")
    if not tensor.is_contiguous():
        raise ValueError(
            f"aio: {what} of shape {tuple(tensor.shape)} and strides {tensor.stride()} is not "
            "contiguous; pass tensor.contiguous() or a slice of a flat buffer"
        )
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def memoryview_of(byte_tensor: torch.Tensor) -> memoryview:
    """A writable memoryview over a uint8 CPU tensor's memory, for os.preadv/os.pwritev.

    The view does not keep the tensor alive: the caller holds the tensor until the I/O finishes.
    """
    nbytes = byte_tensor.numel()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(byte_tensor.data_ptr())).cast("B")


@dataclass
class PoolBuffer:
    """One reserved buffer; release it with `pool.release(buf)` or use it as a context manager."""

    tensor: torch.Tensor
    index: int
    pool: BufferPool = field(repr=False)

    def __enter__(self) -> torch.Tensor:
        return self.tensor

    def __exit__(self, *exc: object) -> None:
        self.pool.release(self)


class BufferPool:
    """`count` aligned host buffers of `buffer_bytes` each, reserved and released, never grown.

    The whole pool's bytes are reserved on the ledger's HOST tier (tag "aio_buffers" by default) for
    the pool's lifetime, since the memory is held whether or not a buffer is lent out.
    """

    def __init__(
        self,
        count: int,
        buffer_bytes: int,
        *,
        alignment_bytes: int = 4096,
        ledger: Ledger | None = None,
        tag: str = "aio_buffers",
        pin: bool | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"BufferPool: count={count} must be >= 1")
        if buffer_bytes < 1:
            raise ValueError(f"BufferPool: buffer_bytes={buffer_bytes} must be >= 1")
        self.count = count
        self.buffer_bytes = buffer_bytes
        self.ledger = ledger if ledger is not None else Ledger()
        self.tag = tag
        self._buffers = [aligned_empty(buffer_bytes, alignment_bytes, pin=pin) for _ in range(count)]
        self.ledger.reserve(Tier.HOST, count * buffer_bytes, tag)
        self._free = list(range(count - 1, -1, -1))  # a stack: the warmest buffer goes out first
        self._cond = threading.Condition()
        self._closed = False

    @property
    def pool_bytes(self) -> int:
        return self.count * self.buffer_bytes

    @property
    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def reserve(self, timeout_s: float | None = 30.0) -> PoolBuffer:
        """Take a free buffer, waiting up to `timeout_s` (None: forever) for one to be released."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError(f"BufferPool {self.tag!r} is closed")
                if self._free:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise BufferPoolTimeout(
                        f"BufferPool {self.tag!r}: all {self.count} buffers of "
                        f"{format_bytes(self.buffer_bytes)} are reserved and none was released within "
                        f"{timeout_s} s; release buffers when done (use `with pool.reserve() as buf`) "
                        "or build the pool with a larger count"
                    )
                self._cond.wait(remaining)
            index = self._free.pop()
        return PoolBuffer(self._buffers[index], index, self)

    def release(self, buf: PoolBuffer) -> None:
        with self._cond:
            if buf.pool is not self or buf.index in self._free:
                raise RuntimeError(
                    f"BufferPool {self.tag!r}: buffer {buf.index} released twice or to the wrong pool"
                )
            self._free.append(buf.index)
            self._cond.notify()

    def close(self) -> None:
        """Drop the buffers and return their bytes to the ledger. Idempotent."""
        with self._cond:
            if self._closed:
                return
            lent = self.count - len(self._free)
            if lent:
                raise RuntimeError(
                    f"BufferPool {self.tag!r}: closing with {lent} buffer(s) still reserved; "
                    "release them first"
                )
            self._closed = True
            self._buffers.clear()
            self._cond.notify_all()
        self.ledger.release(Tier.HOST, self.pool_bytes, self.tag)

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SizedPools:
    """Buffer pools of a few sizes under one ledger tag: a reservation of `nbytes` takes a buffer from
    the pool of the smallest size that holds it. Staging for shards of very different sizes (a LoRA
    model's adapter units beside its frozen base layers) then holds each in a buffer near its size,
    not every one in a buffer of the largest (planner/unit_plan.py `param_staging`)."""

    def __init__(
        self, classes: tuple[tuple[int, int], ...], *, alignment_bytes: int = 4096, ledger: Ledger | None = None,
        tag: str = "aio_buffers", pin: bool | None = None,
    ) -> None:
        if not classes:
            raise ValueError("SizedPools: no buffer sizes")
        self.ledger = ledger if ledger is not None else Ledger()
        self.pools = [
            BufferPool(count, size, alignment_bytes=alignment_bytes, ledger=self.ledger, tag=tag, pin=pin)
            for size, count in sorted(classes)
        ]

    @property
    def count(self) -> int:
        return sum(p.count for p in self.pools)

    @property
    def pool_bytes(self) -> int:
        return sum(p.pool_bytes for p in self.pools)

    def pool_for(self, nbytes: int) -> BufferPool:
        """The pool of the smallest buffers that hold `nbytes`."""
        for pool in self.pools:
            if pool.buffer_bytes >= nbytes:
                return pool
        largest = format_bytes(self.pools[-1].buffer_bytes)
        raise ValueError(f"SizedPools: {format_bytes(nbytes)} exceeds the largest buffer, {largest}")

    def free_count(self, nbytes: int) -> int:
        """Free buffers that could hold `nbytes` now (of the size it would take)."""
        return self.pool_for(nbytes).free_count

    def reserve(self, nbytes: int, timeout_s: float | None = 30.0) -> PoolBuffer:
        return self.pool_for(nbytes).reserve(timeout_s=timeout_s)

    @staticmethod
    def release(buf: PoolBuffer) -> None:
        buf.pool.release(buf)

    @property
    def all_free(self) -> bool:
        return all(p.free_count == p.count for p in self.pools)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
