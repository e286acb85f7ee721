"""The CUDA tests compute on cuda:0 as a GPU user's process does: `ZEROINF_DEVICE=cuda` for each.

tests/conftest.py pins every test to the CPU (`ZEROINF_DEVICE=cpu`), which also tells the engine that
the process does not compute on CUDA (topology.py `cuda_in_use`), so host shards, gradients and
masters were made pageable, and the transfer test counted every copy of a steady step as pageable
(measured on an H200, stop 50: 4 of 4 at stage 3 with the optimizer on the host; 0 of 4 in a process
without that setting). A user's process on a GPU machine has it unset or "cuda".
"""

from __future__ import annotations

import pytest

from zeroinf.topology import DEVICE_ENV


@pytest.fixture(autouse=True)
def computes_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEVICE_ENV, "cuda")
