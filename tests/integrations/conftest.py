"""Shared fixtures of the integration tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """One CPU thread: on two shared cores, thread contention makes a 4-step run of a tiny model take
    seconds instead of a fraction of one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread() -> Iterator[None]:
    with single_thread():
        yield
