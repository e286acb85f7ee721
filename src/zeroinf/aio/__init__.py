"""Asynchronous NVMe I/O: tensors to and from file offsets with O_DIRECT and many requests in flight.

See docs/aio.md for the design, the knobs and measured figures.
"""

from zeroinf.aio.buffers import BufferPool, PoolBuffer, aligned_empty, as_bytes
from zeroinf.aio.config import AioConfig
from zeroinf.aio.engine import (
    AioEngine,
    AioHandle,
    AioStats,
    Block,
    IoBackend,
    ThreadBackend,
    plan_blocks,
)
from zeroinf.aio.errors import AioError, BufferPoolTimeout, IntegrityError, ShortIOError

__all__ = [
    "AioConfig",
    "AioEngine",
    "AioError",
    "AioHandle",
    "AioStats",
    "Block",
    "BufferPool",
    "BufferPoolTimeout",
    "IntegrityError",
    "IoBackend",
    "PoolBuffer",
    "ShortIOError",
    "ThreadBackend",
    "aligned_empty",
    "as_bytes",
    "plan_blocks",
]
