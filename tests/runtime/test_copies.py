"""Host-to-device shard copies: free on a CPU device; on CUDA, on a side stream, ordered before the
compute stream's next kernels, and the host source reusable once `wait_source_free` returns."""

from __future__ import annotations

import pytest
import torch

from zeroinf.runtime.copies import to_device


def test_cpu_device_copies_nothing() -> None:
    host = torch.arange(10, dtype=torch.bfloat16)
    copy = to_device(host, torch.device("cpu"))
    assert copy.tensor.data_ptr() == host.data_ptr() and copy.done is None
    copy.wait_source_free()  # a no-op


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream branch needs a CUDA device")
def test_cuda_copy_is_ordered_and_frees_its_source() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    host = torch.arange(1 << 22, dtype=torch.float32).pin_memory()
    torch.cuda._sleep(10_000_000)  # keep the compute stream busy: the side-stream copy must not wait for it
    copy = to_device(host, device)
    total = copy.tensor.sum()  # queued on the compute stream after its wait on the copy's event
    copy.wait_source_free()
    host.fill_(-1.0)  # the DMA has read the source: overwriting it must not change the device copy
    assert float(total) == pytest.approx(float(torch.arange(1 << 22, dtype=torch.float64).sum()), rel=1e-5)
    assert torch.equal(copy.tensor.cpu(), torch.arange(1 << 22, dtype=torch.float32))
