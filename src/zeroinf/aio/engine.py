"""The asynchronous I/O engine: tensors to and from file offsets, many requests in flight.

`AioEngine.read(tensor, file, offset)` / `write(...)` return an `AioHandle` at once; `handle.wait()`
blocks until the bytes are in the tensor (or the file) and re-raises any I/O error. A transfer is
split into blocks of `block_bytes` (see `plan_blocks`) that the backend's workers issue concurrently.

[Note: copies on the read path]
O_DIRECT moves data between the device and the buffer by DMA, so reading straight into the
destination costs no CPU copy. A block is read directly when its file range and its destination
address are both aligned; that holds for every whole block of a transfer whose file offset and
destination address are congruent modulo the alignment (in particular both aligned). Only the partial
blocks at the edges, or every block when the two are not congruent, go through the worker's bounce
buffer, and each of their bytes is copied exactly once. `AioStats.direct_bytes` and `bounce_bytes`
count both paths so tests assert it.

[Note: writes that do not cover whole aligned blocks]
An O_DIRECT write must cover whole aligned blocks, so an edge block is read first, the new bytes are
laid over it, and the block is written back (read-modify-write). Those are serialized by one lock so
two unaligned writes sharing a block do not lose each other's bytes. A write whose end is unaligned
may leave the file padded up to the next aligned boundary.
"""

from __future__ import annotations

import contextlib
import errno as errno_codes
import fcntl
import functools
import itertools
import logging
import os
import queue
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import xxhash

from zeroinf.aio.buffers import BufferPool, PoolBuffer, as_bytes, memoryview_of
from zeroinf.aio.config import AioConfig
from zeroinf.aio.errors import AioError, IntegrityError, ShortIOError
from zeroinf.memory import Ledger

logger = logging.getLogger("zeroinf.aio")
_engine_ids = itertools.count()  # tells apart the threads of several engines in one process


class DiskActivity:
    """Seconds during which at least one request of any engine in this process was in flight.

    The disk-busy share of a step is the growth of `busy_s()` over the step's wall time: the union
    of every engine's requests (parameters, gradients, optimizer states), so overlapping transfers
    count once. Shared by all engines of the process (`DISK_ACTIVITY`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._busy = 0.0

    def started(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter()
            self._in_flight += 1

    def finished(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy += time.perf_counter() - self._since

    def busy_s(self) -> float:
        with self._lock:
            ongoing = time.perf_counter() - self._since if self._in_flight else 0.0
            return self._busy + ongoing


DISK_ACTIVITY = DiskActivity()

FileRef = str | os.PathLike[str] | int
Op = Literal["read", "write"]
BlockJob = Callable[[torch.Tensor], None]  # runs one block's system calls, given a bounce buffer


@dataclass(frozen=True)
class Block:
    """One request to the kernel: the aligned file range it covers and the caller's bytes in it."""

    file_start: int
    file_end: int
    user_start: int  # absolute file offsets of the caller's bytes inside [file_start, file_end)
    user_end: int
    direct: bool  # True: the caller's memory is the I/O buffer; False: via the bounce buffer


def plan_blocks(
    offset: int, nbytes: int, buffer_addr: int, alignment_bytes: int, block_bytes: int
) -> list[Block]:
    """Split a transfer of `nbytes` at file `offset` from/to memory at `buffer_addr` into blocks.

    Pure function of its arguments (see [Note: copies on the read path]). alignment_bytes=1 means
    buffered I/O: every block is direct.
    """
    if nbytes <= 0:
        return []
    a = alignment_bytes
    end = offset + nbytes
    window_start, window_end = offset // a * a, -(-end // a) * a
    if (buffer_addr - offset) % a == 0:
        mid_start, mid_end = window_start + (a if offset != window_start else 0), end // a * a
        if mid_start < mid_end:
            blocks = []
            if window_start < mid_start:
                blocks.append(Block(window_start, mid_start, offset, mid_start, False))
            for s in range(mid_start, mid_end, block_bytes):
                e = min(s + block_bytes, mid_end)
                blocks.append(Block(s, e, s, e, True))
            if mid_end < window_end:
                blocks.append(Block(mid_end, window_end, mid_end, end, False))
            return blocks
    blocks = []
    for s in range(window_start, window_end, block_bytes):
        e = min(s + block_bytes, window_end)
        blocks.append(Block(s, e, max(s, offset), min(e, end), False))
    return blocks


class IoBackend(Protocol):
    """Where block jobs run. Each job does its own system calls and reports its own result.

    A kernel-queue backend (io_uring, libaio) would split a job into prepare / syscall / complete
    phases; the thread backend matches fio's O_DIRECT throughput here, so none is provided.
    """

    name: str

    def submit(self, jobs: Sequence[BlockJob]) -> None: ...

    def close(self) -> None: ...


class ThreadBackend:
    """The portable default: one named thread per pool buffer calling preadv/pwritev, which release
    the GIL. Each thread keeps its bounce buffer for its lifetime, so none is allocated per request."""

    name = "threads"

    def __init__(self, pool: BufferPool, queue_depth: int, name: str = "zeroinf-aio") -> None:
        self._queue: queue.SimpleQueue[BlockJob | None] = queue.SimpleQueue()
        # More workers than queue_depth: cap the syscalls in flight. Otherwise workers are the cap.
        self._depth = threading.BoundedSemaphore(queue_depth) if queue_depth < pool.count else None
        self._threads = []
        for i in range(pool.count):
            thread = threading.Thread(
                target=self._work, args=(pool.reserve(timeout_s=0),), name=f"{name}-worker{i}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def submit(self, jobs: Sequence[BlockJob]) -> None:
        for job in jobs:
            self._queue.put(job)

    def _work(self, bounce: PoolBuffer) -> None:
        try:
            while (job := self._queue.get()) is not None:
                try:
                    if self._depth is None:
                        job(bounce.tensor)
                    else:
                        with self._depth:
                            job(bounce.tensor)
                except BaseException:  # jobs report their own errors; this is a bug in the engine
                    logger.exception("zeroinf.aio: a block job raised")
        finally:
            bounce.pool.release(bounce)

    def close(self) -> None:
        """Run the jobs already queued, then stop and join the threads."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            # A finalizer run by a garbage collection that one of these workers triggered (a deleted
            # model's): that worker ends on its own once its job returns.
            if thread is not threading.current_thread():
                thread.join()
        self._threads.clear()


@dataclass(frozen=True)
class AioStats:
    """Counters since the engine started (telemetry reads them; tests assert copies)."""

    bytes_read: int
    bytes_written: int
    reads: int
    writes: int
    direct_bytes: int  # bytes moved by the kernel straight to/from the caller's memory
    bounce_bytes: int  # bytes copied between a bounce buffer and the caller's memory
    bounce_copies: int  # number of such copies (one per bounced block)


@dataclass
class _File:
    fd: int
    path: str
    o_direct: bool
    identity: tuple[int, int]  # (st_dev, st_ino): the checksum key survives renames of the path


class AioHandle:
    """A request in flight. `wait()` returns the byte count or raises the request's AioError."""

    def __init__(self, op: Op, path: str, offset: int, nbytes: int) -> None:
        self.op, self.path, self.offset, self.nbytes = op, path, offset, nbytes
        self._event = threading.Event()
        self._error: BaseException | None = None
        # Monotonic times, for telemetry: how long the request was in flight vs how long anyone waited.
        self.issued_at = time.perf_counter()
        self.finished_at: float | None = None

    @property
    def in_flight_s(self) -> float:
        """Seconds from issue to completion (to now while still running)."""
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.issued_at

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> int:
        if not self._event.wait(timeout_s):
            raise TimeoutError(
                f"aio {self.op} of {self.nbytes} bytes at offset {self.offset} in {self.path!r} "
                f"did not finish within {timeout_s} s"
            )
        if self._error is not None:
            raise self._error
        return self.nbytes

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Wait for completion without raising the request's error; True when done."""
        return self._event.wait(timeout_s)

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self.finished_at = time.perf_counter()
        self._event.set()


class _Request:
    """One read or write: its blocks complete in any order; the last one finishes the handle."""

    def __init__(self, op: Op, file: _File, offset: int, byte_tensor: torch.Tensor, blocks: int) -> None:
        self.op, self.file, self.offset = op, file, offset
        self.byte_tensor = byte_tensor  # holds the caller's memory alive while blocks are in flight
        self.mv = memoryview_of(byte_tensor)
        self.nbytes = byte_tensor.numel()
        self.handle = AioHandle(op, file.path, offset, self.nbytes)
        self.error: BaseException | None = None
        self._remaining = blocks
        self._lock = threading.Lock()

    def block_done(self, error: BaseException | None) -> bool:
        """Record one block; True when it was the last."""
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            self._remaining -= 1
            return self._remaining == 0

    def fail(self, reason: str, cls: type[AioError] = AioError, errno: int | None = None) -> AioError:
        return cls(self.op, self.file.path, self.offset, self.nbytes, reason, errno)


class AioEngine:
    """Asynchronous reads and writes of CPU tensors at file offsets.

    Owns its worker threads (named "zeroinf-aio<engine>-worker<i>"), one bounce buffer per worker from a
    `BufferPool` reserved on the ledger's HOST tier, and the files it opened by path. Use as a
    context manager or call `close()`, which waits for requests in flight.
    """

    def __init__(
        self,
        config: AioConfig | None = None,
        *,
        ledger: Ledger | None = None,
        backend: IoBackend | None = None,
    ) -> None:
        self.config = config if config is not None else AioConfig()
        self.ledger = ledger if ledger is not None else Ledger()
        cfg = self.config
        self._pool = BufferPool(
            cfg.workers, cfg.block_bytes, alignment_bytes=cfg.alignment_bytes, ledger=self.ledger
        )
        self._backend = (
            backend
            if backend is not None
            else ThreadBackend(self._pool, cfg.queue_depth, name=f"zeroinf-aio{next(_engine_ids)}")
        )
        self._files: dict[str, _File] = {}
        self._files_lock = threading.Lock()
        self._rmw_lock = threading.Lock()  # see [Note: writes that do not cover whole aligned blocks]
        self._stats_lock = threading.Lock()
        self._counts = dict.fromkeys(AioStats.__dataclass_fields__, 0)
        self._checksums: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
        self._warned_buffered = False
        self._closed = False

    @property
    def backend_name(self) -> str:
        return self._backend.name

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- files -------------------------------------------------------------------------------

    def open_file(self, path: str | os.PathLike[str], *, create: bool = False) -> int:
        """Open (or return the already open) fd for `path`, with O_DIRECT when configured and the
        filesystem supports it. The engine closes it in `close_file` or `close`."""
        return self._open(os.path.abspath(os.fspath(path)), create, "open", 0, 0).fd

    def close_file(self, path: str | os.PathLike[str]) -> None:
        with self._files_lock:
            f = self._files.pop(os.path.abspath(os.fspath(path)), None)
        if f is not None:
            with self._stats_lock:
                self._checksums.pop(f.identity, None)
            os.close(f.fd)

    def is_direct(self, file: FileRef) -> bool:
        """Whether transfers to this file bypass the page cache (False after a fallback)."""
        return self._resolve(file, "open", 0, 0).o_direct

    def _open(self, path: str, create: bool, op: str, offset: int, nbytes: int) -> _File:
        with self._files_lock:
            f = self._files.get(path)
            if f is not None:
                return f
            flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
            fd, o_direct = -1, False
            try:
                if self.config.o_direct:
                    try:
                        fd, o_direct = os.open(path, flags | os.O_DIRECT, 0o600), True
                    except OSError as exc:
                        if exc.errno != errno_codes.EINVAL:  # this filesystem refuses O_DIRECT
                            raise
                        self._warn_buffered(path)
                if fd < 0:
                    fd = os.open(path, flags, 0o600)
            except OSError as exc:
                raise AioError.from_os_error(op, path, offset, nbytes, exc) from exc
            st = os.fstat(fd)
            f = _File(fd, path, o_direct, (st.st_dev, st.st_ino))
            self._files[path] = f
            return f

    def _warn_buffered(self, path: str) -> None:
        if not self._warned_buffered:
            self._warned_buffered = True
            message = (
                f"zeroinf.aio: the filesystem of {path!r} does not support O_DIRECT; falling back to "
                "buffered I/O (the page cache will hold copies of the data)"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=4)
            logger.warning(message)

    def _resolve(self, file: FileRef, op: Op | str, offset: int, nbytes: int) -> _File:
        if isinstance(file, int):  # a caller's fd: ask the kernel how it was opened
            try:
                o_direct = bool(fcntl.fcntl(file, fcntl.F_GETFL) & os.O_DIRECT)
                st = os.fstat(file)
            except OSError as exc:
                raise AioError.from_os_error(op, f"fd {file}", offset, nbytes, exc) from exc
            with contextlib.suppress(OSError):
                return _File(file, os.readlink(f"/proc/self/fd/{file}"), o_direct, (st.st_dev, st.st_ino))
            return _File(file, f"fd {file}", o_direct, (st.st_dev, st.st_ino))
        return self._open(os.path.abspath(os.fspath(file)), op == "write", op, offset, nbytes)

    # ---- requests ----------------------------------------------------------------------------

    def read(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> AioHandle:
        """Start reading `tensor.nbytes` bytes at `offset` of `file` into `tensor` (contiguous, CPU).

        Errors opening the file raise here; I/O errors raise from `handle.wait()`."""
        return self._submit("read", tensor, file, offset)

    def write(self, tensor: torch.Tensor, file: FileRef, offset: int = 0) -> AioHandle:
        """Start writing `tensor`'s bytes at `offset` of `file` (created if a missing path).

        The caller must not modify `tensor` until the handle is waited on."""
        return self._submit("write", tensor, file, offset)

    def _submit(self, op: Op, tensor: torch.Tensor, file: FileRef, offset: int) -> AioHandle:
        if self._closed:
            raise RuntimeError("AioEngine is closed")
        byte_tensor = as_bytes(tensor, f"the {op} tensor")
        if offset < 0:
            raise ValueError(f"aio {op}: offset={offset} must be >= 0")
        f = self._resolve(file, op, offset, byte_tensor.numel())
        alignment = self.config.alignment_bytes if f.o_direct else 1
        blocks = plan_blocks(
            offset, byte_tensor.numel(), byte_tensor.data_ptr(), alignment, self.config.block_bytes
        )
        request = _Request(op, f, offset, byte_tensor, len(blocks))
        DISK_ACTIVITY.started()
        if not blocks:
            self._finish(request)
            return request.handle
        try:
            self._backend.submit([functools.partial(self._run_block, request, b) for b in blocks])
        except BaseException:
            DISK_ACTIVITY.finished()
            raise
        return request.handle

    def _run_block(self, request: _Request, block: Block, bounce: torch.Tensor) -> None:
        error: BaseException | None = None
        if request.error is None:  # a failed request skips its remaining blocks
            try:
                if request.op == "read":
                    self._read_block(request, block, bounce)
                else:
                    self._write_block(request, block, bounce)
            except BaseException as exc:  # handed to the waiter, never lost in a worker
                error = exc
        if request.block_done(error):
            self._finish(request)

    def _read_block(self, request: _Request, block: Block, bounce: torch.Tensor) -> None:
        length = block.file_end - block.file_start
        needed = block.user_end - block.file_start
        if block.direct:
            start = block.file_start - request.offset
            self._pread(request, request.mv[start : start + length], block.file_start, needed)
            self._count(direct_bytes=length)
            return
        self._pread(request, memoryview_of(bounce[:length]), block.file_start, needed)
        user = slice(block.user_start - request.offset, block.user_end - request.offset)
        inner = slice(block.user_start - block.file_start, block.user_end - block.file_start)
        request.byte_tensor[user].copy_(bounce[inner])  # the one copy; torch releases the GIL
        self._count(bounce_bytes=block.user_end - block.user_start, bounce_copies=1)

    def _write_block(self, request: _Request, block: Block, bounce: torch.Tensor) -> None:
        length = block.file_end - block.file_start
        if block.direct:
            start = block.file_start - request.offset
            self._pwrite(request, request.mv[start : start + length], block.file_start)
            self._count(direct_bytes=length)
            return
        partial = block.user_start > block.file_start or block.user_end < block.file_end
        with self._rmw_lock if partial else contextlib.nullcontext():
            if partial:
                self._read_edges(request, block, bounce)
            user = slice(block.user_start - request.offset, block.user_end - request.offset)
            inner = slice(block.user_start - block.file_start, block.user_end - block.file_start)
            bounce[inner].copy_(request.byte_tensor[user])
            self._pwrite(request, memoryview_of(bounce[:length]), block.file_start)
        self._count(bounce_bytes=block.user_end - block.user_start, bounce_copies=1)

    def _read_edges(self, request: _Request, block: Block, bounce: torch.Tensor) -> None:
        """Fill the parts of an edge block the caller does not write with the file's bytes."""
        a = self.config.alignment_bytes if request.file.o_direct else 1
        length = block.file_end - block.file_start
        spans = []
        if block.user_start > block.file_start:
            spans.append((0, a))
        if block.user_end < block.file_end:
            spans.append((length - a, length))
        for lo, hi in spans:
            got = self._pread(request, memoryview_of(bounce[lo:hi]), block.file_start + lo, 0)
            bounce[lo + got : hi].zero_()  # past the end of the file

    def _pread(self, request: _Request, target: memoryview, file_offset: int, needed: int) -> int:
        """Read into `target` from `file_offset`; at least `needed` bytes must exist."""
        done, want = 0, len(target)
        while done < want:
            try:
                n = os.preadv(request.file.fd, [target[done:]], file_offset + done)
            except OSError as exc:
                raise self._os_error(request, exc, file_offset + done, want - done) from exc
            done += n
            # A short O_DIRECT read means end of file; retrying would be misaligned.
            if n == 0 or (done < want and request.file.o_direct):
                break
        if done < needed:
            file_bytes = file_offset + done
            with contextlib.suppress(OSError):
                file_bytes = os.fstat(request.file.fd).st_size
            raise request.fail(
                f"short read: the file ends at byte {file_bytes} but the data reaches byte "
                f"{file_offset + needed} (truncated by someone else?)",
                ShortIOError,
            )
        return done

    def _pwrite(self, request: _Request, source: memoryview, file_offset: int) -> None:
        done, want = 0, len(source)
        while done < want:
            try:
                n = os.pwritev(request.file.fd, [source[done:]], file_offset + done)
            except OSError as exc:
                raise self._os_error(request, exc, file_offset + done, want - done) from exc
            if n == 0:
                raise request.fail(
                    f"short write: the kernel accepted 0 of {want - done} bytes at {file_offset + done}",
                    ShortIOError,
                )
            done += n

    @staticmethod
    def _os_error(request: _Request, exc: OSError, at: int, nbytes: int) -> AioError:
        return AioError.from_os_error(
            request.op,
            request.file.path,
            request.offset,
            request.nbytes,
            exc,
            detail=f"block of {nbytes} bytes at {at}",
        )

    def _finish(self, request: _Request) -> None:
        DISK_ACTIVITY.finished()
        error = request.error
        if error is None and self.config.integrity:
            try:
                self._check_integrity(request)
            except IntegrityError as exc:
                error = exc
        if error is None:
            if request.op == "read":
                self._count(bytes_read=request.nbytes, reads=1)
            else:
                self._count(bytes_written=request.nbytes, writes=1)
        request.handle._finish(error)
        request.byte_tensor = request.mv = None  # type: ignore[assignment]  # drop the caller's memory

    def _check_integrity(self, request: _Request) -> None:
        digest = xxhash.xxh3_64_intdigest(request.mv)
        with self._stats_lock:
            sums = self._checksums.setdefault(request.file.identity, {})
            if request.op == "write":
                end = request.offset + request.nbytes
                if request.offset not in sums:  # a write over other shards makes their sums stale
                    for off in [o for o, (n, _) in sums.items() if o < end and request.offset < o + n]:
                        del sums[off]
                sums[request.offset] = (request.nbytes, digest)
                return
            stored = sums.get(request.offset)
        if stored is not None and stored[0] == request.nbytes and stored[1] != digest:
            raise request.fail(
                f"checksum mismatch: xxh3 {digest:#018x} read, {stored[1]:#018x} written", IntegrityError
            )

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self._counts[key] += value

    def stats(self) -> AioStats:
        with self._stats_lock:
            return AioStats(**self._counts)

    @property
    def bytes_read(self) -> int:
        return self.stats().bytes_read

    @property
    def bytes_written(self) -> int:
        return self.stats().bytes_written

    # ---- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Finish the requests in flight, stop the workers, close the files it opened, free the pool."""
        if self._closed:
            return
        self._closed = True
        self._backend.close()
        with self._files_lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            os.close(f.fd)
        self._pool.close()

    def __enter__(self) -> AioEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
