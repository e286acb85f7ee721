"""AioConfig: the knobs of the asynchronous I/O engine, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass

from zeroinf.config import ConfigError

MIB = 1024 * 1024


@dataclass(frozen=True)
class AioConfig:
    """How the engine splits and issues transfers.

    The defaults match the best sequential O_DIRECT setting measured on the project's NVMe disk
    (1 MiB requests, 8 in flight, see docs/aio.md); `zeroinf bench-io --sweep` finds yours.
    """

    block_bytes: int = 1 * MIB
    """Size of one request to the kernel. A transfer larger than this is split into blocks issued
    concurrently. Must be a positive multiple of `alignment_bytes`."""

    queue_depth: int = 8
    """Most blocks in flight at once across the whole engine (the device's queue depth). With the
    thread backend each worker has at most one block in flight, so the effective depth is
    min(queue_depth, workers)."""

    workers: int = 8
    """Threads issuing the pread/pwrite system calls (they release the GIL). Each owns one bounce
    buffer of `block_bytes` from the engine's pool."""

    o_direct: bool = True
    """Open files with O_DIRECT (bypass the page cache). Falls back to buffered I/O, with one warning,
    on filesystems that refuse it (tmpfs, some network filesystems)."""

    alignment_bytes: int = 4096
    """Alignment O_DIRECT requires of file offsets, sizes and buffer addresses: the filesystem's
    logical block (4 KiB covers 512-byte and 4 KiB devices). A power of two."""

    integrity: bool = False
    """Store an xxh3-64 checksum of every write and verify it when the same (file, offset, bytes)
    is read back; a mismatch raises IntegrityError. Costs one extra pass over the data."""

    def __post_init__(self) -> None:
        a = self.alignment_bytes
        if a <= 0 or a & (a - 1):
            raise ConfigError("aio.alignment_bytes", a, "use a power of two: 4096 (or 512 for old disks)")
        if self.block_bytes <= 0 or self.block_bytes % a:
            raise ConfigError(
                "aio.block_bytes",
                self.block_bytes,
                f"use a positive multiple of alignment_bytes={a}, e.g. {MIB} (1 MiB)",
            )
        if self.queue_depth < 1:
            raise ConfigError("aio.queue_depth", self.queue_depth, "use at least 1, e.g. 8")
        if self.workers < 1:
            raise ConfigError("aio.workers", self.workers, "use at least 1, e.g. 8")
