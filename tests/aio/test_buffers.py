"""Aligned buffers and the fixed pool: alignment, exhaustion, release, the ledger."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from zeroinf.aio import BufferPool, BufferPoolTimeout, aligned_empty, as_bytes
from zeroinf.memory import Ledger, Tier


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 1 << 20, 3 * (1 << 20) + 17])
@pytest.mark.parametrize("alignment", [512, 4096, 65536])
def test_aligned_empty(nbytes: int, alignment: int) -> None:
    buf = aligned_empty(nbytes, alignment, pin=False)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    assert buf.data_ptr() % alignment == 0
    buf.fill_(7)
    assert int(buf[-1]) == 7


def test_as_bytes_views_without_copy() -> None:
    t = torch.arange(10, dtype=torch.bfloat16)
    b = as_bytes(t)
    assert b.numel() == 20 and b.data_ptr() == t.data_ptr()
    with pytest.raises(ValueError, match="not contiguous"):
        as_bytes(torch.zeros(4, 4)[:, 1])


def test_pool_buffers_are_distinct_aligned_and_accounted() -> None:
    ledger = Ledger()
    pool = BufferPool(3, 8192, ledger=ledger, pin=False)
    assert ledger.live_bytes(Tier.HOST, "aio_buffers") == 3 * 8192
    bufs = [pool.reserve() for _ in range(3)]
    assert len({b.tensor.data_ptr() for b in bufs}) == 3
    assert all(b.tensor.data_ptr() % 4096 == 0 and b.tensor.numel() == 8192 for b in bufs)
    for b in bufs:
        pool.release(b)
    pool.close()
    assert ledger.live_bytes(Tier.HOST, "aio_buffers") == 0
    assert ledger.peak_bytes(Tier.HOST) == 3 * 8192


def test_pool_exhaustion_times_out_with_a_clear_message() -> None:
    pool = BufferPool(2, 4096, pin=False)
    held = [pool.reserve(), pool.reserve()]
    t0 = time.monotonic()
    with pytest.raises(BufferPoolTimeout, match=r"all 2 buffers .* none was released within 0.1 s"):
        pool.reserve(timeout_s=0.1)
    assert time.monotonic() - t0 >= 0.09
    pool.release(held.pop())
    with pool.reserve(timeout_s=0) as tensor:  # the context manager releases it
        assert tensor.numel() == 4096
    assert pool.free_count == 1
    pool.release(held.pop())
    pool.close()


def test_pool_waiter_wakes_on_release() -> None:
    pool = BufferPool(1, 4096, pin=False)
    held = pool.reserve()
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.reserve(timeout_s=5)), name="test-waiter")
    waiter.start()
    time.sleep(0.05)
    assert not got
    pool.release(held)
    waiter.join(timeout=5)
    assert got and got[0].index == held.index
    pool.release(got[0])
    pool.close()


def test_pool_misuse_is_an_error() -> None:
    pool = BufferPool(1, 4096, pin=False)
    buf = pool.reserve()
    with pytest.raises(RuntimeError, match="still reserved"):
        pool.close()
    pool.release(buf)
    with pytest.raises(RuntimeError, match="released twice"):
        pool.release(buf)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.reserve(timeout_s=0)
    with pytest.raises(ValueError, match="count"):
        BufferPool(0, 4096)
