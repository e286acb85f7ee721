"""glibc's thresholds (tiers/host.py [Note: glibc's thresholds while building and while training]):
while building, a freed large buffer goes back to the OS, so the next one faults its pages in again;
while training, a buffer freed and reallocated every step is reused without page faults."""

from __future__ import annotations

import gc
import resource

import pytest
import torch

from zeroinf.tiers import host

NBYTES = 8 << 20  # a unit's gradient or gathered parameters at small scale: between the two thresholds
ROUNDS = 8


def _faults_reallocating() -> int:
    """Minor page faults while a buffer is allocated, written, and freed ROUNDS times.

    The garbage collector is off meanwhile: a collection could run the finalizer of an engine left
    by an earlier test, whose `return_freed_memory` (malloc_trim) gives the heap back mid-loop."""
    gc.collect()
    gc.disable()
    try:
        torch.empty(NBYTES, dtype=torch.uint8).fill_(1)  # the first round may fault anywhere
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(ROUNDS):
            buf = torch.empty(NBYTES, dtype=torch.uint8)
            buf.fill_(1)
            del buf
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    finally:
        gc.enable()


@pytest.mark.skipif(host._libc("mallopt") is None, reason="needs glibc")
def test_building_returns_large_buffers_and_training_reuses_them() -> None:
    try:
        host.map_large_buffers()
        mapped = _faults_reallocating()
        host.reuse_step_buffers()
        reused = _faults_reallocating()
    finally:
        host.reuse_step_buffers()  # the setting any offloaded engine leaves
    assert mapped >= ROUNDS  # faulted in afresh every round (page by page, or by huge pages)
    assert reused < mapped // 8
