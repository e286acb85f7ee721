"""A deleted model and optimizer release everything their engine held
(runtime/hooks.py [Note: hooks that hold the engine weakly]).

A sweep in one process (Optuna trials, a notebook cell run again) builds, trains and deletes one
model after another. The engine's gradient hooks used to hold it strongly from the parameters, where
Python's collector cannot see the cycle: each deleted model kept its shards, host states, I/O
threads, open files and NVMe swap files until the process ended. Here, after `del model, opt` and
`gc.collect()`: the engine is gone, no zeroinf thread is left, no descriptor points into the swap
folder and the folder is empty, for stages 1-3 with the optimizer states, parameters and gradients on
the host and on NVMe, the step on a worker thread, and a background checkpoint save still pending
(its writes end first, and a warning says the checkpoint was never published); each configuration
built twice in the same folder (a sweep). The same at world 2 in one spawned group.
"""

from __future__ import annotations

import functools
import gc
import os
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks
from tests.test_several_models import Block  # a residual LayerNorm-Linear-tanh block
from zeroinf.runtime.hooks import weak_callable

CASES: dict[str, dict[str, Any]] = {
    "stage 1, optimizer on NVMe": {"stage": 1, "offload": {"optimizer": "nvme"}},
    "stage 2, optimizer on the host": {"stage": 2, "offload": {"optimizer": "host"}},
    "stage 3, on the host, step thread": {
        "stage": 3, "offload": {"params": "host", "optimizer": "host", "step_thread": True},
    },
    "stage 3, everything on NVMe": {
        "stage": 3, "offload": {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"},
    },
    "stage 3, NVMe, a background save pending": {
        "stage": 3, "offload": {"params": "nvme", "optimizer": "nvme"}, "save": True,
    },
}


class Net(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, d), nn.Linear(d, 8)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _zeroinf_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("zeroinf")}


def _threads_after_release(before: set[threading.Thread], timeout_s: float = 10.0) -> list[str]:
    """zeroinf's threads started since `before`, once those that exit on their own (a freed
    executor's worker) have done so."""
    deadline = time.monotonic() + timeout_s
    while (_zeroinf_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return sorted(t.name for t in _zeroinf_threads() - before)


def _descriptors_into(folder: Path) -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed while listed
            continue
    return [link for link in links if link.startswith(str(folder))]


def _build_train_delete(case: dict[str, Any], swap: Path, world: int = 1) -> weakref.ref[Any]:
    """Build, train two steps (and start a background save if asked), delete; the engine, weakly."""
    offload = {**case["offload"], "nvme_dir": str(swap)}
    cfg = zeroinf.Config(stage=case["stage"], persist_threshold_bytes=0, offload=offload, unit_classes=["Block"])
    torch.manual_seed(0)
    model = zeroinf.shard(Net(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    x = torch.randn(8 // world, 8)
    for _ in range(2):
        opt.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    pending = None
    if case.get("save"):  # its writer thread still reads the states when the model is deleted
        pending = zeroinf.save(str(swap.parent / "checkpoints"), model, opt, 2, blocking=False)
    engine = weakref.ref(zeroinf.engine_of(model))
    if pending is None:
        del model, opt
        gc.collect()
        return engine
    deadline = time.monotonic() + 60
    while not pending.done_writing() and time.monotonic() < deadline:  # until then its thread holds the engine
        time.sleep(0.05)
    with pytest.warns(RuntimeWarning, match=r"blocking=False\) of step_00000002 was never finished"):
        del model, opt, pending
        gc.collect()
    assert [p.name for p in (swap.parent / "checkpoints").iterdir()] == [".tmp-step_00000002"]
    shutil.rmtree(swap.parent / "checkpoints")
    return engine


def _released(case: dict[str, Any], swap: Path, world: int = 1) -> list[str]:
    """What a deleted model left behind (nothing: []), two builds in a row in the same folder."""
    left = []
    for build in range(2):
        before = _zeroinf_threads()  # an earlier test's model still alive in this process keeps its own
        engine = _build_train_delete(case, swap, world)
        if engine() is not None:
            left.append(f"build {build}: the engine is still alive")
        if threads := _threads_after_release(before):
            left.append(f"build {build}: threads {threads}")
        if descriptors := _descriptors_into(swap):
            left.append(f"build {build}: open files {descriptors}")
        if files := sorted(p.name for p in swap.rglob("*") if p.is_file()):
            left.append(f"build {build}: swap files {files}")
    return left


def test_a_deleted_model_and_optimizer_release_everything(tmp_path: Path) -> None:
    for i, (name, case) in enumerate(CASES.items()):
        swap = tmp_path / str(i) / "swap"
        swap.mkdir(parents=True)
        assert _released(case, swap) == [], name


def _world2(rank: int, world: int, folder: str) -> list[str]:
    swap = Path(folder) / f"rank{rank}" / "swap"
    swap.mkdir(parents=True)
    return _released(CASES["stage 3, everything on NVMe"], swap, world)


def test_at_world_2_every_rank_releases_everything(tmp_path: Path) -> None:
    assert run_ranks(_world2, 2, str(tmp_path)) == [[], []]


class _Target:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def on_ready(self, unit: int, param: int) -> None:
        self.calls.append((unit, param))


def test_a_weak_callable_calls_while_its_object_lives_and_does_nothing_after() -> None:
    target = _Target()
    call = weak_callable(functools.partial(target.on_ready, 3))
    call(1)
    assert target.calls == [(3, 1)]
    alive = weakref.ref(target)
    del target
    gc.collect()
    assert alive() is None  # the callable did not keep it
    call(2)  # nothing to call: no error
    plain = print
    assert weak_callable(plain) is plain  # not bound to an object: kept as is
