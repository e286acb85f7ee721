"""`Transfers`, the owner of host<->device copies: on a CPU device the same calls copy (or do nothing)
at once; the pool hands buffers back by size, so a steady step allocates none; landings retire in the
order they were issued; the counters. The accelerator branches run in tests/gpu/."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from zeroinf.memory import Ledger, Tier
from zeroinf.runtime.streams import STAGING_TAG, Landing, Transfers, TransferStats, typed_view

CPU = torch.device("cpu")


def test_cpu_device_copies_nothing_to_the_device() -> None:
    transfers = Transfers(CPU, Ledger())
    host = torch.arange(10, dtype=torch.bfloat16)
    copy = transfers.to_device(host)
    assert copy.tensor.data_ptr() == host.data_ptr() and copy.done is None
    copy.wait_source_free()  # no-ops
    copy.release()
    assert transfers.h2d is None and transfers.d2h is None
    assert sum(transfers.stats.total.values()) == 0


def test_cpu_land_copies_then_adds_then_runs_its_cpu_part() -> None:
    transfers = Transfers(CPU, Ledger())
    target = torch.full((4,), 7.0)
    seen: list[float] = []
    first = transfers.land(torch.ones(4), target, accumulate=False, then=lambda: seen.append(float(target.sum())))
    assert first.retired and seen == [4.0]  # copied over the old values, not added to them
    transfers.land(torch.full((4,), 2.0), target, accumulate=True)
    assert torch.equal(target, torch.full((4,), 3.0))
    transfers.retire(first)  # idempotent
    transfers.retire()
    out = torch.empty(4)
    transfers.retire(transfers.to_host(target, out))
    assert torch.equal(out, target)
    # Nothing crossed between host and accelerator memory: the byte counters stay at zero.
    assert transfers.stats.total["d2h_copies"] == 0 and transfers.stats.total["pageable_copies"] == 0


def test_cpu_upload_casts_into_the_target() -> None:
    transfers = Transfers(CPU, Ledger())
    out = torch.zeros(5, dtype=torch.bfloat16)
    values = torch.linspace(0, 1, 5)
    transfers.upload(values, out)
    transfers.wait_uploads()
    assert torch.equal(out, values.to(torch.bfloat16))


def test_pool_reuses_buffers_by_size_and_accounts_them_on_the_ledger() -> None:
    ledger = Ledger()
    transfers = Transfers(CPU, ledger)
    pool = transfers.pool
    a = pool.acquire(64, "grad_to_host")
    assert transfers.stats.this_step["staging_allocations"] == 1
    assert ledger.live_bytes(Tier.HOST, "grad_to_host") == 64
    pool.release(a, tag="grad_to_host")
    assert ledger.live_bytes(Tier.HOST, STAGING_TAG) == 64
    transfers.end_step()
    b = pool.acquire(64)  # the same size again: the same memory, no allocation
    assert b.data_ptr() == a.data_ptr()
    c = pool.acquire(32)  # another size: a new buffer
    assert transfers.stats.this_step["staging_allocations"] == 1
    assert transfers.stats.last_step["staging_allocations"] == 1
    assert transfers.stats.total["staging_allocations"] == 2
    pool.release(b)
    pool.release(c)
    assert pool.free_count == 2 and pool.held_bytes == 96
    pool.clear()
    assert pool.free_count == 0 and pool.held_bytes == 0
    assert ledger.live_bytes(Tier.HOST) == 0


def test_typed_view_sees_a_byte_buffer_as_the_tensor_it_stands_for() -> None:
    like = torch.zeros(3, 2, dtype=torch.bfloat16)
    raw = torch.empty(like.numel() * like.element_size(), dtype=torch.uint8)
    view = typed_view(raw, like)
    assert view.shape == like.shape and view.dtype == like.dtype and view.data_ptr() == raw.data_ptr()
    assert typed_view(raw[:0], torch.zeros(0)).numel() == 0


@dataclass
class FakeEvent:
    """Stands in for a copy's event: `ready` says whether the copy has finished."""

    ready: bool = False
    waited: bool = False

    def query(self) -> bool:
        return self.ready

    def synchronize(self) -> None:
        self.waited, self.ready = True, True


def test_landings_retire_in_issue_order_and_count_stalls() -> None:
    """The FIFO behind asynchronous landings (driven by hand: on a CPU device every landing is done
    at once): finished ones retire as later ones are issued, waiting for one retires the older first,
    a wait on an unfinished copy is a stall, and no more than MAX_PENDING_LANDINGS stay queued."""
    transfers = Transfers(CPU, Ledger())
    order: list[int] = []
    events = [FakeEvent() for _ in range(7)]
    landings = [Landing(e, then=lambda i=i: order.append(i), queued=True) for i, e in enumerate(events)]
    events[0].ready = True
    transfers._landings.extend(landings[:2])
    transfers._retire_ready()  # landing 0 has arrived: its CPU part runs; landing 1 has not
    assert order == [0] and not landings[1].retired
    transfers.retire(landings[2 - 1])
    assert order == [0, 1] and transfers.stats.total["stalls"] == 1
    transfers._landings.extend(landings[2:])  # five in flight, one over the cap
    transfers._retire_ready()
    assert order == [0, 1, 2] and events[2].waited
    transfers.retire(landings[4])  # landing 3 first
    assert order == [0, 1, 2, 3, 4]
    transfers.retire()
    assert order == list(range(7)) and all(landing.retired for landing in landings)


def test_stats_keep_this_step_last_step_and_total() -> None:
    stats = TransferStats()
    stats.add("h2d_bytes", 10)
    stats.add("h2d_copies")
    stats.end_step()
    stats.add("h2d_bytes", 5)
    report = stats.report()
    assert report["last_step"]["h2d_bytes"] == 10 and report["last_step"]["h2d_copies"] == 1
    assert report["total"]["h2d_bytes"] == 15
    assert set(report["last_step"]) == set(TransferStats.KEYS)


def test_close_finishes_transfers_and_frees_the_pool() -> None:
    ledger = Ledger()
    transfers = Transfers(CPU, ledger)
    transfers.pool.release(transfers.pool.acquire(128))
    transfers.close()
    assert ledger.live_bytes(Tier.HOST) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams need a CUDA device")
def test_cuda_copy_is_ordered_and_frees_its_source() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    transfers = Transfers(device, Ledger())
    host = torch.arange(1 << 22, dtype=torch.float32).pin_memory()
    torch.cuda._sleep(10_000_000)  # keep the compute stream busy: the h2d copy must not wait for it
    copy = transfers.to_device(host)
    total = copy.tensor.sum()  # queued on the compute stream after its wait on the copy's event
    copy.wait_source_free()
    host.fill_(-1.0)  # the DMA has read the source: overwriting it must not change the device copy
    assert float(total) == pytest.approx(float(torch.arange(1 << 22, dtype=torch.float64).sum()), rel=1e-5)
    assert torch.equal(copy.tensor.cpu(), torch.arange(1 << 22, dtype=torch.float32))
    assert transfers.stats.total["h2d_copies"] == 1 and transfers.stats.total["pageable_copies"] == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy streams need a CUDA device")
def test_cuda_upload_is_ordered_before_the_next_reader() -> None:
    """An upload leaves the compute stream free until `order_uploads` (its next reader); a kernel
    queued after that sees the new values, cast on the device (fp32 host -> bf16 parameters)."""
    device = torch.device("cuda", torch.cuda.current_device())
    transfers = Transfers(device, Ledger())
    out = torch.zeros(1 << 20, dtype=torch.bfloat16, device=device)
    values = torch.full((1 << 20,), 3.0).pin_memory()
    transfers.upload(values, out)
    assert len(transfers._unordered_uploads) == 1  # the compute stream has not been made to wait
    transfers.order_uploads()
    assert not transfers._unordered_uploads
    total = out.float().sum()
    transfers.wait_uploads()
    assert float(total) == 3.0 * (1 << 20)
    assert transfers.stats.total["h2d_copies"] == 1 and transfers.stats.total["pageable_copies"] == 0
