"""Checkpoint reads through the aio engine from O_DIRECT descriptors (checkpoint/format.py [Note:
checkpoint reads bypass the page cache]): the same bytes as plain reads at unaligned offsets and
sizes, corruption still caught, a filesystem without O_DIRECT (tmpfs) read the plain way, and
`zeroinf.load` reading through the model's checkpoint lane."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import xxhash

import zeroinf
from tests._parity import build_model, global_batch
from zeroinf.aio import AioConfig, AioEngine
from zeroinf.checkpoint.format import CheckpointError, DataFiles


def _data_file(folder: Path, nbytes: int) -> tuple[dict, bytes]:
    data = bytes(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).tolist())
    (folder / "rank00000.bin").write_bytes(data)
    return {"rank00000.bin": {"size": nbytes}}, data


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
def test_direct_reads_give_the_plain_reads_bytes(tmp_path: Path, where: str) -> None:
    if where == "tmpfs":
        if not os.path.isdir("/dev/shm"):
            pytest.skip("no /dev/shm")
        tmp_path = Path(tempfile.mkdtemp(dir="/dev/shm"))
    size = 8 * 4096 + 1000
    files, data = _data_file(tmp_path, size)
    with AioEngine(AioConfig()) as aio:
        direct, plain = DataFiles(str(tmp_path), files, aio=aio), DataFiles(str(tmp_path), files)
        try:
            # aligned, unaligned, across 4 KiB blocks, and up to the file's last byte
            for offset, numel in [(0, 1024), (4, 1), (4100, 3000), (7, 2500), (24576 - 8, 500), (size - 400, 100)]:
                want = torch.frombuffer(bytearray(data[offset : offset + 4 * numel]), dtype=torch.float32)
                digest = xxhash.xxh3_64_hexdigest(data[offset : offset + 4 * numel])
                for reader in (direct, plain):
                    out = torch.empty(numel)
                    reader.read_into("rank00000.bin", offset, out, digest, "a piece")
                    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))  # random bits: NaNs too
            # where the filesystem takes O_DIRECT the reads went through the engine, else the plain way
            assert (aio.bytes_read > 0) == (direct._direct_fds["rank00000.bin"] is not None)
            with pytest.raises(CheckpointError, match="checksum mismatch in a piece"):
                direct.read_into("rank00000.bin", 8, torch.empty(16), "0" * 16, "a piece")
        finally:
            direct.close()
            plain.close()
    if where == "tmpfs":
        for f in tmp_path.iterdir():
            f.unlink()
        tmp_path.rmdir()


def test_load_reads_through_the_checkpoint_lane(tmp_path: Path) -> None:
    """The states come back through the model's checkpoint aio engine, and the run goes on as the
    one that saved it (world 1, stage 3, states on the host)."""
    def make():
        cfg = zeroinf.Config(stage=3, offload=zeroinf.OffloadConfig(params="host", optimizer="host"))
        model = zeroinf.shard(build_model(), cfg)
        return model, zeroinf.AdamW(model, lr=1e-3)

    def step(model, opt, s: int) -> float:
        x, y = global_batch(s, batch=4)
        loss = model(x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = make()
    step(model, opt, 0)
    zeroinf.save(tmp_path / "ckpt", model, opt, step=1)
    straight = [step(model, opt, s) for s in (1, 2)]
    resumed_model, resumed_opt = make()
    lane = zeroinf.engine_of(resumed_model).nvme_tier.engine("checkpoint")
    before = lane.bytes_read
    zeroinf.load(tmp_path / "ckpt", resumed_model, resumed_opt)
    assert lane.bytes_read - before >= 12 * sum(p.numel() for p in build_model().parameters())
    assert [step(resumed_model, resumed_opt, s) for s in (1, 2)] == straight
