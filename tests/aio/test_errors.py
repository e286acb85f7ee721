"""Every I/O failure raises an AioError naming file, offset, bytes and operation; none is lost.

Disk-full, read-only and no-O_DIRECT filesystems are real: small tmpfs / ramfs mounts in a private
user+mount namespace (`unshare -Urm`), skipped with the reason where the kernel forbids it.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.aio import AioConfig, AioEngine, AioError, IntegrityError, ShortIOError

SRC = str(Path(zeroinf.__file__).resolve().parents[1])
SMALL = AioConfig(block_bytes=16 * 1024, queue_depth=4, workers=2)


def run_on_fresh_mount(tmp_path: Path, mount_args: str, script: str) -> dict:
    """Run `script` (which prints one JSON line; argv[1] is the mount point) with `mount_args`
    mounted at a fresh folder, in a private namespace so nothing leaks to the machine."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    shell = f'mount {mount_args} "$0" || exit 77; exec "$1" -c "$2" "$0"'
    proc = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "--mount",
            "sh",
            "-c",
            shell,
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
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


WRITE_AND_REPORT = """
import json, sys, warnings, torch
from zeroinf.aio import AioEngine, AioError
path = sys.argv[1] + "/f"
warnings.simplefilter("ignore")
with AioEngine() as engine:
    try:
        engine.write(torch.ones(NBYTES, dtype=torch.uint8), path, 4096).wait()
        print(json.dumps({"raised": False}))
    except AioError as exc:
        print(json.dumps({"raised": True, "errno": exc.errno, "op": exc.op, "path": exc.path,
                          "offset": exc.offset, "nbytes": exc.nbytes, "message": str(exc),
                          "bytes_written": engine.bytes_written}))
"""


def assert_names_everything(report: dict, op: str, path: str, offset: int, nbytes: int) -> None:
    assert report["raised"]
    assert (report["op"], report["path"], report["offset"], report["nbytes"]) == (op, path, offset, nbytes)
    for part in (op, path, str(offset), str(nbytes)):
        assert part in report["message"]


def test_disk_full_raises_enospc(tmp_path: Path) -> None:
    script = WRITE_AND_REPORT.replace("NBYTES", str(4 << 20))
    report = run_on_fresh_mount(tmp_path, "-t tmpfs -o size=1m tmpfs", script)
    assert report["raised"] and report["errno"] == errno.ENOSPC, report
    assert_names_everything(report, "write", str(tmp_path / "mnt" / "f"), 4096, 4 << 20)
    assert "ENOSPC" in report["message"] and report["bytes_written"] == 0


def test_read_only_folder_raises(tmp_path: Path) -> None:
    report = run_on_fresh_mount(tmp_path, "-t tmpfs -o ro tmpfs", WRITE_AND_REPORT.replace("NBYTES", "100"))
    assert report["raised"] and report["errno"] == errno.EROFS, report
    assert_names_everything(report, "write", str(tmp_path / "mnt" / "f"), 4096, 100)


def test_filesystem_without_o_direct_falls_back(tmp_path: Path) -> None:
    script = """
import json, sys, warnings, torch
from zeroinf.aio import AioEngine
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with AioEngine() as engine:
        src = torch.randint(0, 256, (300_001,), dtype=torch.uint8)
        engine.write(src, sys.argv[1] + "/a", 5).wait()
        engine.write(src, sys.argv[1] + "/b", 0).wait()
        dst = torch.empty_like(src)
        engine.read(dst, sys.argv[1] + "/a", 5).wait()
        direct = engine.is_direct(sys.argv[1] + "/a")
print(json.dumps({"equal": bool(torch.equal(src, dst)), "direct": direct,
                  "warnings": [str(w.message) for w in caught]}))
"""
    report = run_on_fresh_mount(tmp_path, "-t ramfs ramfs", script)  # ramfs refuses O_DIRECT
    assert report["equal"] and not report["direct"]
    assert len(report["warnings"]) == 1 and "does not support O_DIRECT" in report["warnings"][0]


def test_file_size_limit_raises_efbig(tmp_path: Path) -> None:
    script = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
""" + WRITE_AND_REPORT.replace("NBYTES", str(2 << 20))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SRC},
    )
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["raised"] and report["errno"] == errno.EFBIG, report
    assert_names_everything(report, "write", str(tmp_path / "f"), 4096, 2 << 20)


@pytest.mark.parametrize("op", ["read", "write"])
def test_device_error_raises_eio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    with AioEngine(SMALL) as engine:
        engine.write(torch.zeros(100_000, dtype=torch.uint8), tmp_path / "f", 0).wait()

        def failing(*args: object) -> int:  # simulated: no unprivileged way to make a disk fail
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "preadv" if op == "read" else "pwritev", failing)
        before = engine.stats()
        handle = getattr(engine, op)(torch.zeros(100_000, dtype=torch.uint8), tmp_path / "f", 8192)
        with pytest.raises(AioError) as info:
            handle.wait()
        err = info.value
        assert (err.op, err.path, err.offset, err.nbytes, err.errno) == (
            op,
            str(tmp_path / "f"),
            8192,
            100_000,
            errno.EIO,
        )
        assert "EIO" in str(err) and str(tmp_path / "f") in str(err) and "8192" in str(err)
        assert engine.stats().bytes_read == before.bytes_read  # nothing reported as done
        assert engine.stats().bytes_written == before.bytes_written
        restored = pickle.loads(pickle.dumps(err))
        assert (restored.op, restored.offset, restored.errno) == (
            "read" if op == "read" else "write",
            8192,
            errno.EIO,
        )


def test_zero_byte_write_raises_short_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with AioEngine(SMALL) as engine:
        engine.open_file(tmp_path / "f", create=True)
        monkeypatch.setattr(os, "pwritev", lambda *args: 0)
        with pytest.raises(ShortIOError, match="short write"):
            engine.write(torch.zeros(5000, dtype=torch.uint8), tmp_path / "f", 0).wait()


@pytest.mark.parametrize("misalign", [0, 3])
def test_truncation_by_someone_else_is_a_short_read(tmp_path: Path, misalign: int) -> None:
    with AioEngine(SMALL) as engine:
        engine.write(torch.ones(200_000, dtype=torch.uint8), tmp_path / "f", 0).wait()
        os.truncate(tmp_path / "f", 150_000)
        dst = torch.zeros(200_000 + misalign, dtype=torch.uint8)[misalign:]
        with pytest.raises(ShortIOError, match=r"ends at byte 150000 .*truncated") as info:
            engine.read(dst, tmp_path / "f", 0).wait()
        assert (info.value.op, info.value.offset, info.value.nbytes) == ("read", 0, 200_000)


def test_missing_folder_and_missing_file(tmp_path: Path) -> None:
    with AioEngine(SMALL) as engine:
        path = tmp_path / "no-such-folder" / "f"
        with pytest.raises(AioError, match="ENOENT") as info:
            engine.write(torch.zeros(10), path, 4096)
        assert (info.value.op, info.value.path, info.value.offset, info.value.nbytes) == (
            "write",
            str(path),
            4096,
            40,
        )
        with pytest.raises(AioError, match=r"aio read of 40 bytes at offset 0 .*ENOENT"):
            engine.read(torch.zeros(10), tmp_path / "absent", 0)


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="root writes through chmod; test_read_only_folder_raises "
    "covers a folder that is really not writable",
)
def test_folder_without_write_permission(tmp_path: Path) -> None:
    folder = tmp_path / "locked"
    folder.mkdir(mode=0o500)
    with AioEngine(SMALL) as engine, pytest.raises(AioError, match="EACCES"):
        engine.write(torch.zeros(10), folder / "f", 0)


def test_integrity_mode_catches_a_corrupted_byte(tmp_path: Path) -> None:
    config = AioConfig(block_bytes=16 * 1024, workers=2, integrity=True)
    with AioEngine(config) as engine:
        shard = torch.randint(0, 256, (50_000,), dtype=torch.uint8)
        engine.write(shard, tmp_path / "f", 8192).wait()
        out = torch.empty_like(shard)
        engine.read(out, tmp_path / "f", 8192).wait()  # intact: verifies silently
        fd = os.open(tmp_path / "f", os.O_RDWR)
        os.pwrite(fd, bytes([(int(shard[777]) + 1) % 256]), 8192 + 777)
        os.fsync(fd)
        os.close(fd)
        with pytest.raises(IntegrityError, match=r"checksum mismatch") as info:
            engine.read(out, tmp_path / "f", 8192).wait()
        assert (info.value.path, info.value.offset, info.value.nbytes) == (str(tmp_path / "f"), 8192, 50_000)
        # A later write over part of the shard makes its checksum stale, not a false alarm.
        engine.write(torch.zeros(100, dtype=torch.uint8), tmp_path / "f", 9000).wait()
        engine.read(out, tmp_path / "f", 8192).wait()
