"""`StreamWriter`: append-only writes of one checkpoint file, with the disk busy while the caller works.

A checkpoint file is a stream of pieces (state slices, buffers) appended in order. Writing each piece
with a buffered `write` makes the caller wait for the page cache and then for `fsync`, so reading the
states, hashing them and writing them happen one after the other (0.56x of the disk's write
bandwidth at 1e8 parameters). Here the caller's only work per piece is one copy into an aligned
staging buffer, while a helper thread computes the piece's xxh3 (which releases the GIL). A full
staging buffer is handed to the aio engine, whose workers write it with O_DIRECT (1 MiB blocks,
many in flight) while the caller fills the next one. A fixed pool of staging buffers bounds the
memory: when all are in flight the caller waits for the oldest.

The last, partial buffer is written padded to the alignment O_DIRECT needs, and the file is then
truncated to its exact size before the fsync, so the padding never reaches the reader.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Executor

import torch
import xxhash

from zeroinf.aio import AioEngine, AioError, BufferPool, PoolBuffer
from zeroinf.aio.buffers import round_up
from zeroinf.aio.engine import AioHandle
from zeroinf.checkpoint.format import as_bytes, tensor_bytes

STAGING_BYTES = 16 * 1024 * 1024  # one staging buffer: 16 blocks of 1 MiB in flight per submit
STAGING_COUNT = 4


class StreamWriter:
    """Appends pieces to `path` (created, must not exist) through `engine`, staging in `pool`'s buffers.

    `hasher`: an executor (one thread is enough) that computes checksums beside the copy.
    `size_hint`: the bytes expected (at least); the file is preallocated to it and cut to the real size.

    `append` returns the piece's file offset and xxh3-64; `close` waits for every write, truncates
    to the exact size, fsyncs and returns the size. Write errors (ENOSPC, EIO, ...) raise the aio
    engine's AioError, which names the file, offset and operation, from `append` or `close`.
    """

    def __init__(
        self, path: str, engine: AioEngine, pool: BufferPool, hasher: Executor, size_hint: int = 0
    ) -> None:
        self.path, self.engine, self.pool, self._hasher = path, engine, pool, hasher
        self.alignment = engine.config.alignment_bytes if engine.config.o_direct else 1
        if pool.buffer_bytes % engine.config.alignment_bytes:
            raise ValueError(f"StreamWriter: staging buffers of {pool.buffer_bytes} bytes are not aligned")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            if size_hint > 0:  # allocate the extents up front (fewer, larger ones; ENOSPC before any write)
                try:
                    os.posix_fallocate(fd, 0, round_up(size_hint, self.alignment))
                except OSError as exc:
                    raise AioError.from_os_error("fallocate", path, 0, size_hint, exc) from exc
        finally:
            os.close(fd)  # the engine reopens it with O_DIRECT
        self.fd = engine.open_file(path)
        self.size = 0  # bytes appended so far
        self.size_submitted = 0  # bytes handed to the engine (the next staging buffer's file offset)
        self._current: PoolBuffer | None = None
        self._fill = 0  # bytes of the current staging buffer in use
        self._in_flight: deque[tuple[AioHandle, PoolBuffer]] = deque()
        self._closed = False

    def append(self, t: torch.Tensor) -> tuple[int, str]:
        """Queue the bytes of tensor `t`; return (file offset, xxh3-64 hex of its bytes)."""
        src = tensor_bytes(t)
        at = self.size
        # xxh3 releases the GIL: hash on the helper thread while this one copies into staging.
        digest = self._hasher.submit(xxhash.xxh3_64_hexdigest, as_bytes(src))
        pos, n = 0, src.numel()
        while pos < n:
            if self._current is None:
                self._current = self._take_buffer()
                self._fill = 0
            room = self.pool.buffer_bytes - self._fill
            take = min(room, n - pos)
            self._current.tensor[self._fill : self._fill + take].copy_(src[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == self.pool.buffer_bytes:
                self._submit()
        self.size += n
        return at, digest.result()

    def _take_buffer(self) -> PoolBuffer:
        if self.pool.free_count == 0 and self._in_flight:
            self._retire_oldest()
        return self.pool.reserve()

    def _retire_oldest(self) -> None:
        handle, buf = self._in_flight.popleft()
        try:
            handle.wait()
        finally:
            buf.pool.release(buf)

    def _submit(self) -> None:
        """Write the current staging buffer at its file offset (padded to the alignment if partial)."""
        assert self._current is not None
        buf, fill = self._current, self._fill
        self._current = None
        start = self.size_submitted
        nbytes = round_up(fill, self.alignment)
        if nbytes > fill:
            buf.tensor[fill:nbytes].zero_()
        try:
            handle = self.engine.write(buf.tensor[:nbytes], self.fd, start)
        except BaseException:
            buf.pool.release(buf)
            raise
        self._in_flight.append((handle, buf))
        self.size_submitted = start + fill

    def close(self) -> int:
        """Finish every write, cut the padding, fsync; return the file's size. Idempotent."""
        if self._closed:
            return self.size
        self._closed = True
        try:
            if self._current is not None and self._fill:
                self._submit()
            while self._in_flight:
                self._retire_oldest()
        finally:
            self.abort()
        os.truncate(self.path, self.size)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return self.size

    def abort(self) -> None:
        """Wait (without raising) for writes in flight and give every buffer back; the file stays partial."""
        while self._in_flight:
            handle, buf = self._in_flight.popleft()
            handle.wait_done()
            buf.pool.release(buf)
        if self._current is not None:
            self.pool.release(self._current)
            self._current = None
        self._closed = True
        self.engine.close_file(self.path)
