"""Pinned host memory (tiers/host.py `pinned_zeros`): exact pages, only for what crosses to the device.

On the CPU the choice of what is pinned is checked through a recording stand-in; on CUDA (`-m gpu`)
the allocation itself: page-locked, zero, exactly its pages (no power-of-two rounding), and usable
by an asynchronous copy."""

from __future__ import annotations

import mmap

import pytest
import torch

from zeroinf.memory import Ledger, Tier
from zeroinf.optim.states import ResidentStateStore
from zeroinf.tiers import host


def test_only_the_master_of_host_optimizer_states_is_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    pinned: list[int] = []

    def record(numel: int, dtype: torch.dtype) -> torch.Tensor:
        pinned.append(numel)
        return torch.zeros(numel, dtype=dtype)

    monkeypatch.setattr(host, "pinned_zeros", record)
    monkeypatch.setattr(host, "pin_by_default", lambda: True)  # as on a CUDA run
    masters = [torch.randn(300), torch.randn(500)]
    ledger = Ledger()
    store = ResidentStateStore([m.clone() for m in masters], Tier.HOST, ledger, None)
    assert pinned == [300, 500], "the master crosses to the device (updated parameters); moments never do"
    assert ledger.live_bytes(Tier.HOST) == 3 * 4 * 800
    for views, master in zip(store.states, masters, strict=True):
        assert torch.equal(views.master, master)
        assert not views.exp_avg.any() and not views.exp_avg_sq.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a CUDA device")
def test_pinned_zeros_takes_exactly_its_pages_and_copies_asynchronously() -> None:
    numel = (3 << 20) + 7  # 12 MiB + 28 bytes: the caching allocator would take 16 MiB
    t = host.pinned_zeros(numel, torch.float32)
    assert t.is_pinned() and t.numel() == numel and not t.any()
    # Its storage is the registered mapping (whole pages, under 13 MiB), not an allocator block
    # (whose storage would report the 12 MiB + 28 bytes asked for, out of a 16 MiB block).
    storage_bytes = t.untyped_storage().nbytes()
    assert storage_bytes % mmap.PAGESIZE == 0 and storage_bytes < 13 << 20, storage_bytes
    t.copy_(torch.arange(numel, dtype=torch.float32))
    on_device = t.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(on_device.cpu(), t)
    del t, on_device  # unregistered with the mapping; a second one registers afresh
    assert host.pinned_zeros(1000, torch.bfloat16).is_pinned()
