"""Crash safety and refusal of damaged checkpoints (world 1, in this process; no process group)."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import shutil
import signal
import time

import pytest
import torch

import zeroinf
import zeroinf.checkpoint as ck
from tests._parity import LR, build_model, global_batch


def _make(dim: int = 0):
    torch.manual_seed(0)
    model = build_model() if not dim else torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(4)])
    m = zeroinf.shard(model, zeroinf.Config(stage=2))
    return m, zeroinf.AdamW(m, lr=LR)


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("good"))
    m, o = _make()
    x, y = global_batch(0)
    o.backward(m(x, y))
    o.step()
    o.zero_grad()
    ck.save(root, m, o, step=1, extra={"pos": 1})
    return os.path.join(root, "step_00000001")


def _damaged(good: str, tmp_path, how: str) -> tuple[str, str]:
    bad = str(tmp_path / "bad")
    shutil.copytree(good, bad)
    target = os.path.join(bad, "rank00000.bin")
    if how == "flip":
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    elif how == "truncate":
        os.truncate(target, os.path.getsize(target) - 100)
    elif how == "missing":
        os.remove(target)
    elif how == "manifest":
        target = os.path.join(bad, "manifest.json")
        text = open(target).read().replace('"step": 1', '"step": 7')
        open(target, "w").write(text)
    return bad, target


@pytest.mark.parametrize("how,what", [
    ("flip", "checksum mismatch"), ("truncate", "truncated"), ("missing", "missing"), ("manifest", "checksum"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(good: str, tmp_path, how: str, what: str) -> None:
    bad, target = _damaged(good, tmp_path, how)
    m, o = _make()
    with pytest.raises(ck.CheckpointError) as err:
        ck.load(bad, m, o)
    assert target in str(err.value) and what in str(err.value), str(err.value)
    with pytest.raises(ck.CheckpointError, match=os.path.basename(target)):
        ck.verify(bad)


def test_undamaged_checkpoint_verifies_and_loads(good: str) -> None:
    assert ck.verify(good)["step"] == 1
    m, o = _make()
    assert ck.load(good, m, o)["extra"] == {"pos": 1}


@pytest.mark.parametrize("pointer", [b"step_0000\xb0001", b"step_00000001\x00", b"", b"step_00000002"])
def test_a_damaged_latest_pointer_is_refused_naming_it(good: str, tmp_path, pointer: bytes) -> None:
    root = tmp_path / "root"
    shutil.copytree(good, root / "step_00000001")
    (root / "latest").write_bytes(pointer)  # invalid UTF-8 raised a bare UnicodeDecodeError before
    m, o = _make()
    with pytest.raises(ck.CheckpointError, match=r"latest: points at"):
        ck.load(str(root), m, o)


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference(good: str) -> None:
    torch.manual_seed(0)
    wider = zeroinf.shard(torch.nn.Sequential(torch.nn.Linear(8, 8)), zeroinf.Config(stage=2))
    with pytest.raises(ck.CheckpointError, match=r"does not fit this model: parameters missing"):
        ck.load(good, wider, zeroinf.AdamW(wider, lr=LR))
    torch.manual_seed(0)
    m, o = _make()
    name = next(iter(m.state_dict()))
    reshaped = os.path.join(os.path.dirname(good), "reshaped")
    shutil.copytree(good, reshaped, dirs_exist_ok=True)
    from zeroinf.checkpoint.format import encode_manifest, read_manifest

    body = read_manifest(reshaped)
    body["params"][name]["shape"] = [*body["params"][name]["shape"], 1]
    with open(os.path.join(reshaped, "manifest.json"), "wb") as f:
        f.write(encode_manifest(body))
    with pytest.raises(ck.CheckpointError, match=rf"parameter {name} has shape"):
        ck.load(reshaped, m, o)


def _save_forever(root: str) -> None:
    m, o = _make(dim=512)  # ~1M parameters: 12 MB per save, so kills land inside saves
    for step in range(1, 10_000):
        with zeroinf.gathered(list(m.parameters()), modify=True):
            for p in m.parameters():
                p.fill_(float(step))
        state = o.state_dict()
        o.load_state_dict({**state, "master": [torch.full_like(t, float(step)) for t in state["master"]]})
        ck.save(root, m, o, step=step)


def test_kill_during_save_leaves_last_complete_checkpoint(tmp_path) -> None:
    # forkserver: children fork from a clean server that preloaded torch (fast, and no fork of a
    # process whose OpenMP threads are running, which can hang the child)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "zeroinf", "tests.checkpoint.test_safety"])
    partial_seen = 0
    for seed in range(5):
        root = str(tmp_path / f"run{seed}")
        proc = ctx.Process(target=_save_forever, args=(root,))
        proc.start()
        deadline = time.monotonic() + 120  # generous: a busy 2-core machine starts the child slowly
        while not os.path.exists(os.path.join(root, "latest")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert os.path.exists(os.path.join(root, "latest")), "the saving process wrote no checkpoint in 120 s"
        time.sleep(random.Random(seed).uniform(0.0, 0.5))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        partial_seen += any(n.startswith(".tmp-") for n in os.listdir(root))
        info = ck.verify(root)  # the checkpoint `latest` names is complete and intact
        m, o = _make(dim=512)
        loaded = ck.load(root, m, o)
        assert loaded["step"] == info["step"] >= 1
        masters = o.state_dict()["master"]
        units = o.engine.units
        assert all(torch.all(t[: u.layout.numel] == loaded["step"]) for t, u in zip(masters, units, strict=True))
        for name in os.listdir(root):
            if name.startswith(".tmp-"):  # never chosen by `latest`; loaded by hand: refused unless whole
                try:
                    ck.verify(os.path.join(root, name))  # killed after its manifest: complete and intact
                except ck.CheckpointError as e:
                    assert name in str(e)
    print(f"partial checkpoints left by the kills: {partial_seen} of 5")
