"""optim/background.py: CPU kernels on one worker thread, completions on the caller's, in order."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zeroinf
from zeroinf import OffloadConfig
from zeroinf.optim.background import BackgroundSteps
from zeroinf.topology import Topology


def test_kernels_run_on_the_worker_and_completions_in_order_on_the_caller() -> None:
    steps = BackgroundSteps()
    ran: list[tuple[str, int, str]] = []
    release = threading.Event()
    for i in range(3):

        def kernel(i: int = i) -> None:
            if i == 0:
                release.wait(5)
            ran.append(("kernel", i, threading.current_thread().name))

        steps.submit(kernel, lambda i=i: ran.append(("complete", i, threading.current_thread().name)))
    steps.complete_finished()  # the first kernel is still waiting: nothing completes, nothing blocks
    assert not [r for r in ran if r[0] == "complete"]
    release.set()
    steps.drain()
    assert [i for kind, i, _ in ran if kind == "complete"] == [0, 1, 2]
    assert all(name.startswith("zeroinf-step") for kind, _, name in ran if kind == "kernel")
    assert all(name == threading.current_thread().name for kind, _, name in ran if kind == "complete")
    steps.close()


def test_a_failed_kernel_raises_and_nothing_after_it_completes() -> None:
    steps = BackgroundSteps()
    completed: list[int] = []
    finished = threading.Event()

    def boom() -> None:
        raise ValueError("kernel failed")

    def slow() -> None:
        time.sleep(0.05)
        finished.set()

    steps.submit(lambda: None, lambda: completed.append(0))
    steps.submit(boom, lambda: completed.append(1))
    steps.submit(slow, lambda: completed.append(2))
    with pytest.raises(ValueError, match="kernel failed"):
        steps.drain()
    assert completed == [0]
    assert finished.is_set()  # the later kernel was let finish before the error came out
    steps.drain()  # nothing left
    steps.close()


def test_backward_returns_with_nothing_in_the_background() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0,
        offload=OffloadConfig(params="host", optimizer="host", gradients="host", step_thread=True),
    )
    sharded = zeroinf.shard(model, cfg, Topology.single(torch.device("cpu")))
    opt = zeroinf.AdamW(sharded, lr=1e-2)
    assert opt._background is not None
    for _ in range(2):
        opt.backward(sharded(torch.randn(8, 16)).square().mean())
        assert not opt._background._queue  # the engine drained before backward's end
        opt.step()
        opt.zero_grad()
    assert opt._background.submitted > 0 and opt.units_stepped_in_backward > 0
    opt.close()
    # "auto" on a CPU device: no worker (backward and the step would share the cores)
    auto = zeroinf.AdamW(
        zeroinf.shard(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)),
                      zeroinf.Config(stage=3, offload=OffloadConfig(optimizer="host")),
                      Topology.single(torch.device("cpu"))),
    )
    assert auto._background is None
