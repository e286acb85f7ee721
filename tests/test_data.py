"""The corpus and the batch sampler: deterministic, rank slices that add up to the global batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zeroinf.data import BatchSampler, default_corpus_files, load_corpus, split_corpus


def test_default_corpus_is_the_stdlib_without_tests() -> None:
    files = default_corpus_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    excluded = {"site-packages", "test", "tests", "idlelib"}
    assert not any(excluded & set(f.parts) for f in files)
    assert any(f.name == "argparse.py" for f in files)


def test_load_corpus_default_respects_max_bytes() -> None:
    data = load_corpus(None, max_bytes=100_000)
    assert data.dtype == torch.uint8 and data.shape == (100_000,)
    first = default_corpus_files()[0].read_bytes()
    assert bytes(data[: min(len(first), 1000)].tolist()) == first[:1000]


def test_load_corpus_user_files(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"hello ")
    (tmp_path / "b.txt").write_bytes(b"world")
    data = load_corpus([tmp_path / "a.txt", str(tmp_path / "b.txt")], max_bytes=1000)
    assert bytes(data.tolist()) == b"hello world"


def test_load_corpus_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_corpus([tmp_path / "missing.txt"], max_bytes=1000)
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus([tmp_path / "empty.txt"], max_bytes=1000)


def test_split_holds_out_the_tail() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    train, val = split_corpus(data, val_fraction=0.1)
    assert torch.equal(torch.cat([train, val]), data) and len(val) == 10


def _corpus() -> torch.Tensor:
    return torch.randint(0, 256, (10_000,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


def test_batches_are_deterministic_shifted_and_step_dependent() -> None:
    sampler = BatchSampler(_corpus(), seq_len=16, global_batch=8, seed=3)
    x, y = sampler.batch(5)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, _ = BatchSampler(_corpus(), seq_len=16, global_batch=8, seed=3).batch(5)
    assert torch.equal(x, x2)
    assert not torch.equal(x, sampler.batch(6)[0])
    assert not torch.equal(x, BatchSampler(_corpus(), seq_len=16, global_batch=8, seed=4).batch(5)[0])


@pytest.mark.parametrize("world_size, grad_accum_steps", [(2, 1), (4, 2), (1, 4)])
def test_rank_and_micro_slices_concatenate_to_the_global_batch(world_size: int, grad_accum_steps: int) -> None:
    data, step = _corpus(), 7
    full_x, full_y = BatchSampler(data, seq_len=16, global_batch=8, seed=0).batch(step)
    pieces = [
        micro
        for rank in range(world_size)
        for micro in BatchSampler(
            data,
            seq_len=16,
            global_batch=8,
            seed=0,
            rank=rank,
            world_size=world_size,
            grad_accum_steps=grad_accum_steps,
        ).micro_batches(step)
    ]
    assert len(pieces) == world_size * grad_accum_steps
    assert all(x.shape == (8 // (world_size * grad_accum_steps), 16) for x, _ in pieces)
    assert torch.equal(torch.cat([x for x, _ in pieces]), full_x)
    assert torch.equal(torch.cat([y for _, y in pieces]), full_y)


def test_bad_divisibility_and_short_corpus_raise() -> None:
    with pytest.raises(ValueError, match="multiple of 6"):
        BatchSampler(_corpus(), seq_len=16, global_batch=8, world_size=3, grad_accum_steps=2)
    with pytest.raises(ValueError, match="shorter --seq-len"):
        BatchSampler(torch.zeros(10, dtype=torch.uint8), seq_len=16, global_batch=2)
