"""The aio engine: block planning, round trips, concurrency, copies on the read path, fallback."""

from __future__ import annotations

import ctypes
import itertools
import os
import random
import threading
import warnings

import pytest
import torch

from zeroinf.aio import AioConfig, AioEngine, aligned_empty, plan_blocks
from zeroinf.memory import Ledger, Tier

KIB = 1024
SMALL = AioConfig(block_bytes=16 * KIB, queue_depth=4, workers=4)


@pytest.fixture
def engine() -> AioEngine:
    with AioEngine(SMALL) as e:
        yield e


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def buffer_at(nbytes: int, misalign: int) -> torch.Tensor:
    """A uint8 tensor of nbytes whose address is `misalign` bytes past a 4 KiB boundary."""
    return aligned_empty(nbytes + misalign + 1)[misalign : misalign + nbytes]


# ---- plan_blocks (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(200))
def test_plan_blocks_partitions_the_transfer(seed: int) -> None:
    rng = random.Random(seed)
    a, block = 4096, rng.choice([4096, 16384, 65536])
    offset = rng.choice([0, a * rng.randrange(8), rng.randrange(100_000)])
    nbytes = rng.choice([1, a, rng.randrange(1, 300_000)])
    addr = rng.choice([0, a * 7, rng.randrange(1, 10_000)])
    blocks = plan_blocks(offset, nbytes, addr, a, block)
    assert blocks[0].user_start == offset and blocks[-1].user_end == offset + nbytes
    for prev, b in itertools.pairwise(blocks):
        assert prev.user_end == b.user_start and prev.file_end <= b.file_start
    for b in blocks:
        assert b.file_start % a == 0 and b.file_end % a == 0 and 0 < b.file_end - b.file_start <= block
        assert b.file_start <= b.user_start < b.user_end <= b.file_end
        if b.direct:  # the caller's memory is used as the I/O buffer: it must be aligned
            assert (b.user_start, b.user_end) == (b.file_start, b.file_end)
            assert (addr + b.file_start - offset) % a == 0


def test_plan_blocks_aligned_transfer_is_all_direct() -> None:
    blocks = plan_blocks(8192, 10 * 4096, 4096 * 3, 4096, 16384)
    assert all(b.direct for b in blocks) and len(blocks) == 3


def test_plan_blocks_unaligned_end_bounces_only_the_tail() -> None:
    blocks = plan_blocks(0, 5 * 4096 + 100, 0, 4096, 16384)
    assert [b.direct for b in blocks] == [True, True, False]
    assert blocks[-1].user_end - blocks[-1].user_start == 100


def test_plan_blocks_buffered_is_all_direct() -> None:
    assert all(b.direct for b in plan_blocks(3, 100_001, 5, 1, 16384))


# ---- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_round_trip_random_sizes_and_offsets(engine: AioEngine, tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    path = tmp_path / "data"
    for _ in range(4):
        nbytes = rng.choice([1, 4096, 65536, rng.randrange(1, 200_000)])
        offset = rng.choice([0, 4096 * rng.randrange(1, 50), rng.randrange(0, 300_000)])
        src = buffer_at(nbytes, rng.choice([0, 0, 1, 64, 4095]))
        src.copy_(random_bytes(nbytes, seed))
        dst = buffer_at(nbytes, rng.choice([0, 0, 3, 512]))
        engine.write(src, path, offset).wait()
        engine.read(dst, path, offset).wait()
        assert torch.equal(src, dst), (nbytes, offset)
    assert engine.is_direct(path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float16])
def test_round_trip_dtypes_and_slices(engine: AioEngine, tmp_path, dtype: torch.dtype) -> None:
    flat = torch.arange(50_000).to(dtype)
    shard = flat[1234:40_000]  # a contiguous slice at an unaligned address
    engine.write(shard, tmp_path / "f", 4096).wait()
    out = torch.zeros_like(shard)
    assert engine.read(out, tmp_path / "f", 4096).wait() == shard.numel() * shard.element_size()
    assert torch.equal(out, shard)


def test_adjacent_unaligned_writes_do_not_clobber_each_other(engine: AioEngine, tmp_path) -> None:
    sizes = [random.Random(i).randrange(1, 9000) for i in range(60)]
    shards = [random_bytes(n, i) for i, n in enumerate(sizes)]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    handles = [engine.write(s, tmp_path / "f", o) for s, o in zip(shards, offsets, strict=True)]
    for h in handles:
        h.wait()
    whole = torch.empty(sum(sizes), dtype=torch.uint8)
    engine.read(whole, tmp_path / "f", 0).wait()
    assert torch.equal(whole, torch.cat(shards))


def test_many_concurrent_requests(tmp_path) -> None:
    with AioEngine(AioConfig(block_bytes=8 * KIB, queue_depth=2, workers=4)) as engine:
        shards = [random_bytes(20_000, i) for i in range(300)]
        handles = [engine.write(s, tmp_path / f"f{i % 3}", (i // 3) * 20480) for i, s in enumerate(shards)]
        assert all(h.wait() == 20_000 for h in handles)
        outs = [torch.empty(20_000, dtype=torch.uint8) for _ in shards]
        handles = [engine.read(o, tmp_path / f"f{i % 3}", (i // 3) * 20480) for i, o in enumerate(outs)]
        for h in handles:
            h.wait()
        assert all(torch.equal(a, b) for a, b in zip(shards, outs, strict=True))
        stats = engine.stats()
        assert stats.reads == stats.writes == 300
        assert stats.bytes_read == stats.bytes_written == 300 * 20_000


def test_zero_byte_request_completes(engine: AioEngine, tmp_path) -> None:
    assert engine.write(torch.empty(0), tmp_path / "f", 0).wait() == 0


def test_non_contiguous_tensor_is_refused(engine: AioEngine, tmp_path) -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        engine.write(torch.zeros(8, 8).t(), tmp_path / "f", 0)


# ---- [Note: copies on the read path] ------------------------------------------------------


def test_aligned_read_goes_straight_into_the_destination(engine: AioEngine, tmp_path, monkeypatch) -> None:
    nbytes = 40 * 4096
    src = random_bytes(nbytes, 0)
    engine.write(src, tmp_path / "f", 8192).wait()
    dst = aligned_empty(nbytes)
    targets: list[int] = []
    real_preadv = os.preadv

    def recording_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        targets.append(ctypes.addressof(ctypes.c_ubyte.from_buffer(buffers[0])))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", recording_preadv)
    before = engine.stats()
    engine.read(dst, tmp_path / "f", 8192).wait()
    after = engine.stats()
    assert torch.equal(dst, src)
    assert after.bounce_copies == before.bounce_copies and after.bounce_bytes == before.bounce_bytes
    assert after.direct_bytes - before.direct_bytes == nbytes
    # Every read landed inside the destination itself: zero copies beyond the kernel's DMA.
    assert len(targets) == nbytes // SMALL.block_bytes
    assert all(dst.data_ptr() <= t < dst.data_ptr() + nbytes for t in targets)


def test_unaligned_read_copies_each_byte_exactly_once(engine: AioEngine, tmp_path) -> None:
    nbytes = 100_000
    src = random_bytes(nbytes, 1)
    engine.write(src, tmp_path / "f", 4096).wait()
    dst = buffer_at(nbytes, 7)
    before = engine.stats()
    engine.read(dst, tmp_path / "f", 4096).wait()
    after = engine.stats()
    assert torch.equal(dst, src)
    assert after.bounce_bytes - before.bounce_bytes == nbytes
    assert after.direct_bytes == before.direct_bytes


def test_aligned_read_with_unaligned_size_bounces_only_the_tail(engine: AioEngine, tmp_path) -> None:
    nbytes = 10 * 4096 + 123
    engine.write(random_bytes(nbytes, 2), tmp_path / "f", 0).wait()
    before = engine.stats()
    engine.read(aligned_empty(nbytes), tmp_path / "f", 0).wait()
    assert engine.stats().bounce_bytes - before.bounce_bytes == 123


# ---- fallback, lifetime, ledger -----------------------------------------------------------


def test_refused_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch) -> None:
    """Simulated refusal; tests/aio/test_errors.py has the real one on ramfs."""
    real_open = os.open

    def refusing_open(path, flags, mode=0o777):  # what ramfs and some network filesystems do
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument", str(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refusing_open)
    with AioEngine(SMALL) as engine:
        with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
            engine.write(random_bytes(5000, 3), tmp_path / "a", 3).wait()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second file must not warn again
            src = buffer_at(70_000, 5)
            src.copy_(random_bytes(70_000, 4))
            engine.write(src, tmp_path / "b", 11).wait()
            dst = buffer_at(70_000, 9)
            before = engine.stats()
            engine.read(dst, tmp_path / "b", 11).wait()
        assert torch.equal(dst, src)
        assert not engine.is_direct(tmp_path / "b")
        assert engine.stats().bounce_bytes == before.bounce_bytes  # buffered: no alignment, no copy


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_round_trip_on_tmpfs() -> None:
    # tmpfs accepts O_DIRECT since Linux 6.6 and refuses it before: either way the data comes back.
    path = f"/dev/shm/zeroinf-test-{os.getpid()}"
    try:
        with AioEngine(SMALL) as engine, warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            src = random_bytes(100_000, 6)
            engine.write(src, path, 777).wait()
            dst = torch.empty_like(src)
            engine.read(dst, path, 777).wait()
        assert torch.equal(src, dst)
    finally:
        if os.path.exists(path):
            os.remove(path)


def test_caller_fd_is_accepted(engine: AioEngine, tmp_path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    try:
        src = random_bytes(30_000, 5)
        engine.write(src, fd, 100).wait()
        dst = torch.empty_like(src)
        engine.read(dst, fd, 100).wait()
        assert torch.equal(src, dst) and engine.is_direct(fd)
    finally:
        os.close(fd)


def test_close_finishes_requests_and_releases_everything(tmp_path) -> None:
    ledger = Ledger()
    engine = AioEngine(SMALL, ledger=ledger)
    assert ledger.live_bytes(Tier.HOST, "aio_buffers") == SMALL.workers * SMALL.block_bytes
    workers = [t for t in threading.enumerate() if t.name.startswith("zeroinf-aio")]
    prefixes = {t.name.rsplit("-", 1)[0] for t in workers}
    assert any(sum(t.name.startswith(p + "-worker") for t in workers) == SMALL.workers for p in prefixes)
    handles = [engine.write(random_bytes(50_000, i), tmp_path / "f", i * 53_248) for i in range(20)]
    engine.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("zeroinf-aio") and t in workers]
    assert all(h.done() for h in handles)
    assert ledger.live_bytes(Tier.HOST, "aio_buffers") == 0
    assert engine.bytes_written == 20 * 50_000
    with pytest.raises(RuntimeError, match="closed"):
        engine.read(torch.empty(10), tmp_path / "f", 0)
    engine.close()  # idempotent


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_bytes": 1000}, "block_bytes"),
        ({"workers": 0}, "workers"),
        ({"queue_depth": 0}, "queue_depth"),
        ({"alignment_bytes": 3000}, "alignment_bytes"),
    ],
)
def test_config_validation_names_the_field_and_fix(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"aio\.{field}` = .* is invalid: use"):
        AioConfig(**kwargs)


def test_closing_the_thread_backend_from_one_of_its_workers_ends_every_worker() -> None:
    """A deleted model's finalizer may run on one of its own I/O workers (a garbage collection that
    worker's job triggered): close() there joins the others, and that worker ends once its job returns."""
    from zeroinf.aio.buffers import BufferPool
    from zeroinf.aio.engine import ThreadBackend

    pool = BufferPool(3, 4096)
    backend = ThreadBackend(pool, queue_depth=3, name="zeroinf-test-close")
    workers = list(backend._threads)
    errors: list[BaseException] = []

    def job(_: torch.Tensor) -> None:
        try:
            backend.close()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    backend.submit([job])  # type: ignore[list-item]
    for thread in workers:
        thread.join(timeout=10)
    assert errors == [] and not any(t.is_alive() for t in workers)
