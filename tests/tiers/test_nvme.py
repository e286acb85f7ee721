"""Per-rank swap files: layout planning, preallocation, swaps, leftovers, clean removal, errors."""

from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.aio import AioConfig, AioEngine, AioError, ShortIOError
from zeroinf.memory import Ledger, Tier
from zeroinf.tiers.nvme import NvmeSwap, SwapLeftoverError, plan_swap_layout

SRC = str(Path(zeroinf.__file__).resolve().parents[1])
SMALL = AioConfig(block_bytes=64 * 1024, queue_depth=4, workers=2)
SHARDS = {
    (f"layers.{i}", kind): 1000 * (i + 1) + 13 * len(kind)
    for i in range(5)
    for kind in ("param", "exp_avg", "exp_avg_sq")
}


@pytest.fixture
def engine() -> AioEngine:
    with AioEngine(SMALL, ledger=Ledger()) as e:
        yield e


def test_plan_swap_layout_is_aligned_and_disjoint(tmp_path: Path) -> None:
    layout = plan_swap_layout(SHARDS, tmp_path, rank=3)
    assert set(layout.file_bytes) == {"param", "exp_avg", "exp_avg_sq"}
    for kind, file_bytes in layout.file_bytes.items():
        slots = sorted((s for (u, k), s in layout.slots.items() if k == kind), key=lambda s: s.offset_bytes)
        assert all(s.path == str(tmp_path / f"zeroinf-rank3-{kind}.swap") for s in slots)
        assert all(s.offset_bytes % 4096 == 0 for s in slots)
        assert all(a.offset_bytes + a.nbytes <= b.offset_bytes for a, b in itertools.pairwise(slots))
        assert slots[-1].offset_bytes + slots[-1].nbytes <= file_bytes and file_bytes % 4096 == 0
    assert layout.slot("layers.2", "exp_avg").nbytes == SHARDS[("layers.2", "exp_avg")]
    with pytest.raises(KeyError, match="no slot for unit 'layers.9'"):
        layout.slot("layers.9", "param")
    with pytest.raises(ValueError, match="letters, digits"):
        plan_swap_layout({("u", "exp/avg"): 10}, tmp_path, rank=0)


def test_swap_round_trip_preallocation_ledger_and_removal(tmp_path: Path, engine: AioEngine) -> None:
    layout = plan_swap_layout(SHARDS, tmp_path, rank=0)
    with NvmeSwap(layout, engine) as swap:
        for kind, file_bytes in layout.file_bytes.items():
            st = os.stat(layout.path(kind))
            assert st.st_size == file_bytes and st.st_blocks * 512 >= file_bytes  # preallocated
            assert engine.ledger.live_bytes(Tier.NVME, kind) == file_bytes
        shards = {key: torch.randn(n // 4 + 1)[: n // 4] for key, n in SHARDS.items() if n % 4 == 0}
        shards |= {key: torch.randint(0, 256, (n,), dtype=torch.uint8) for key, n in SHARDS.items() if n % 4}
        handles = [swap.swap_out(u, k, t) for (u, k), t in shards.items()]
        for h in handles:
            h.wait()
        outs = {key: torch.empty_like(t) for key, t in shards.items()}
        handles = [swap.swap_in(u, k, outs[(u, k)]) for (u, k) in shards]
        for h in handles:
            h.wait()
        assert all(torch.equal(outs[key], shards[key]) for key in shards)
        with pytest.raises(ValueError, match="the tensor has 8 bytes"):
            swap.swap_out("layers.0", "param", torch.zeros(2))
    assert not list(tmp_path.glob("*.swap"))
    assert engine.ledger.live_bytes(Tier.NVME) == 0


def test_leftover_from_a_crashed_run_is_replaced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    script = """
import os, sys
from zeroinf.aio import AioEngine
from zeroinf.tiers.nvme import NvmeSwap, plan_swap_layout
engine = AioEngine()
NvmeSwap(plan_swap_layout({("u", "param"): 5000}, sys.argv[1], rank=0), engine)
os._exit(1)  # a crash: no close()
"""
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], timeout=60, env={**os.environ, "PYTHONPATH": SRC}
    )
    leftover = tmp_path / "zeroinf-rank0-param.swap"
    assert leftover.exists()
    with open(leftover, "r+b") as f:
        f.write(b"\xff" * 5000)  # what the crashed run had written
    with AioEngine(SMALL) as engine:
        layout = plan_swap_layout({("u", "param"): 5000}, tmp_path, rank=0)
        with caplog.at_level("WARNING", logger="zeroinf"), NvmeSwap(layout, engine) as swap:
            fresh = torch.ones(5000, dtype=torch.uint8)
            swap.swap_in("u", "param", fresh).wait()
            assert not fresh.any()  # a new, preallocated file: the crashed run's bytes are gone
            data = torch.arange(5000, dtype=torch.uint8)
            swap.swap_out("u", "param", data).wait()
            back = torch.empty_like(data)
            swap.swap_in("u", "param", back).wait()
            assert torch.equal(back, data)
        assert "did not shut down cleanly" in caplog.text and "rank0-param.swap" in caplog.text
    assert not leftover.exists()


def test_files_of_a_live_run_are_reported_in_use(tmp_path: Path, engine: AioEngine) -> None:
    layout = plan_swap_layout({("u", "exp_avg"): 4096}, tmp_path, rank=0)
    with NvmeSwap(layout, engine), pytest.raises(SwapLeftoverError, match="in use by a running process"):
        NvmeSwap(layout, engine)


def test_missing_folder_is_created(tmp_path: Path, engine: AioEngine) -> None:
    layout = plan_swap_layout({("u", "param"): 4096}, tmp_path / "absent", rank=0)
    with NvmeSwap(layout, engine):
        assert os.path.isfile(layout.path("param"))
    assert (tmp_path / "absent").is_dir()  # the folder stays; the files go


def test_a_folder_another_rank_created_meanwhile_is_success(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks race to create the folder: the one whose mkdir finds it already there goes on."""
    from zeroinf.tiers import nvme

    folder = tmp_path / "swap"
    real_isdir = os.path.isdir
    seen = []

    def isdir_racing(path: str) -> bool:  # the first check runs before the other rank's mkdir
        seen.append(path)
        if len(seen) == 1:
            os.mkdir(path)
            return False
        return real_isdir(path)

    monkeypatch.setattr(nvme.os.path, "isdir", isdir_racing)
    nvme.ensure_swap_folder(str(folder))
    assert real_isdir(folder)


def test_missing_parent_of_the_folder(tmp_path: Path, engine: AioEngine) -> None:
    layout = plan_swap_layout({("u", "param"): 4096}, tmp_path / "no" / "absent", rank=0)
    with pytest.raises(AioError, match=r"absent' does not exist.*parent .*/no' does not exist either") as info:
        NvmeSwap(layout, engine)
    assert info.value.op == "create" and info.value.path == layout.path("param")
    assert not (tmp_path / "no").exists()


def test_truncated_swap_file_is_a_short_read(tmp_path: Path, engine: AioEngine) -> None:
    layout = plan_swap_layout({("a", "param"): 10_000, ("b", "param"): 10_000}, tmp_path, rank=0)
    with NvmeSwap(layout, engine) as swap:
        swap.swap_out("b", "param", torch.ones(10_000, dtype=torch.uint8)).wait()
        os.truncate(layout.path("param"), 12_288 + 5000)
        with pytest.raises(ShortIOError, match="truncated") as info:
            swap.swap_in("b", "param", torch.empty(10_000, dtype=torch.uint8)).wait()
        assert (info.value.offset, info.value.nbytes) == (12_288, 10_000)


def test_disk_too_small_fails_at_preallocation(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    script = """
import json, sys, warnings
from zeroinf.aio import AioEngine, AioError
from zeroinf.tiers.nvme import NvmeSwap, plan_swap_layout
warnings.simplefilter("ignore")
layout = plan_swap_layout({("u", "param"): 1 << 20, ("u", "exp_avg"): 4 << 20}, sys.argv[1], rank=0)
with AioEngine() as engine:
    try:
        NvmeSwap(layout, engine)
        report = {"raised": False}
    except AioError as exc:
        report = {"raised": True, "errno": exc.errno, "op": exc.op, "path": exc.path, "nbytes": exc.nbytes}
    import os
    report["left"] = sorted(os.listdir(sys.argv[1]))
    report["nvme_bytes"] = engine.ledger.live_bytes("nvme")
print(json.dumps(report))
"""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            'mount -t tmpfs -o size=2m tmpfs "$0" || exit 77; exec "$1" -c "$2" "$0"',
            str(mnt),
            sys.executable,
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    if proc.returncode == 77 or proc.stderr.startswith("unshare:"):
        pytest.skip(f"cannot mount in a user namespace here: {proc.stderr.strip()[:200]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["raised"] and report["errno"] == errno.ENOSPC, report
    assert (report["op"], report["nbytes"]) == ("fallocate", 4 << 20)
    assert report["path"].endswith("zeroinf-rank0-exp_avg.swap")
    assert report["left"] == [] and report["nvme_bytes"] == 0  # the failed start cleaned up
