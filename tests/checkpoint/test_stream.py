"""StreamWriter: pieces of any size and dtype land at the offsets it reports, with the checksums it
reports, through a small pool of staging buffers that wraps many times; a write error names the file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash

import zeroinf
from zeroinf.aio import AioConfig, AioEngine, BufferPool
from zeroinf.checkpoint.stream import StreamWriter

SRC = str(Path(zeroinf.__file__).resolve().parents[1])


@pytest.mark.parametrize("o_direct", [True, False])
def test_pieces_land_where_reported(tmp_path: Path, o_direct: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
    pieces = []
    for i in range(60):  # sizes from empty to several staging buffers
        n = int(torch.randint(0, 9000, (1,), generator=gen)) if i % 7 else 0
        t = torch.randint(0, 2, (n,), generator=gen) if dtypes[i % 5] is torch.bool else torch.randn(n, generator=gen)
        pieces.append(t.to(dtypes[i % 5]))
    path = str(tmp_path / "f.bin")
    cfg = AioConfig(block_bytes=4096, workers=2, queue_depth=2, o_direct=o_direct)
    with AioEngine(cfg) as engine, BufferPool(2, 8192) as pool, ThreadPoolExecutor(1) as hasher:
        writer = StreamWriter(path, engine, pool, hasher)
        reported = [writer.append(t) for t in pieces]
        size = writer.close()
        assert pool.free_count == 2  # every staging buffer came back
    expected = b"".join(t.view(torch.uint8).numpy().tobytes() for t in pieces)
    assert size == len(expected) == os.path.getsize(path)  # the O_DIRECT padding was cut
    data = open(path, "rb").read()
    assert data == expected
    offsets = [0]
    for t in pieces:
        offsets.append(offsets[-1] + t.numel() * t.element_size())
    for (at, digest), t, start in zip(reported, pieces, offsets, strict=False):
        assert at == start
        assert digest == xxhash.xxh3_64_hexdigest(data[start : start + t.numel() * t.element_size()])


def test_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "f.bin").write_bytes(b"keep")
    with AioEngine() as engine, BufferPool(1, 4096) as pool, ThreadPoolExecutor(1) as hasher:
        with pytest.raises(FileExistsError):
            StreamWriter(str(tmp_path / "f.bin"), engine, pool, hasher)
    assert (tmp_path / "f.bin").read_bytes() == b"keep"


SAVE_UNDER_A_FILE_SIZE_LIMIT = """
import json, os, resource, signal, sys, torch, zeroinf
import zeroinf.checkpoint as ck
root = sys.argv[1]
torch.manual_seed(0)
m = zeroinf.shard(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]), zeroinf.Config(stage=2))
o = zeroinf.AdamW(m, lr=1e-3)
ck.save(root, m, o, step=1)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed: a disk that fills up
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # the soft limit only, so it can be lifted
from zeroinf.aio import AioEngine, AioError, BufferPool
from zeroinf.checkpoint.stream import StreamWriter
from concurrent.futures import ThreadPoolExecutor
with AioEngine() as aio, BufferPool(2, 1 << 20) as pool, ThreadPoolExecutor(1) as hasher:  # no size hint
    writer = StreamWriter(os.path.join(root, "raw.bin"), aio, pool, hasher)
    try:
        writer.append(torch.ones(3 << 20, dtype=torch.uint8))
        writer.close()
        write_error = None
    except AioError as e:
        write_error = str(e)
        writer.abort()
os.remove(os.path.join(root, "raw.bin"))
background_error = None
pending = ck.save(root, m, o, step=3, blocking=False)  # the failure surfaces when it is finished
try:
    pending.wait()
except ck.CheckpointError as e:
    background_error = str(e)
try:
    ck.save(root, m, o, step=2)  # the size hint makes fallocate fail before any write
    print(json.dumps({"raised": False}))
except ck.CheckpointError as e:
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    print(json.dumps({"raised": True, "message": str(e), "loaded": ck.load(root, m, o)["step"],
                      "listing": sorted(os.listdir(root)), "write_error": write_error,
                      "background_error": background_error, "pending_cleared": o.pending_save is None}))
"""


def test_a_save_that_cannot_write_fails_naming_the_file_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_UNDER_A_FILE_SIZE_LIMIT, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["raised"], report
    assert ".tmp-step_00000002/rank00000.bin" in report["message"] and "EFBIG" in report["message"], report
    assert report["write_error"] and "raw.bin" in report["write_error"] and "EFBIG" in report["write_error"]
    background = report["background_error"]
    assert background and ".tmp-step_00000003/rank00000.bin" in background and "EFBIG" in background
    assert report["pending_cleared"]
    assert report["loaded"] == 1  # `latest` still names the complete checkpoint
    assert report["listing"] == ["latest", "step_00000001"]  # the partial save's folder was removed
    print(report["message"])
