"""The NVMe park store (tiers/park_file.py) on a real disk: slices written chunk by chunk through its
staging buffers come back bitwise through `take` and `take_into`, converted to the output's dtype,
across several 16 MiB chunks with an unaligned tail, and with writes of other slices still in flight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zeroinf.tiers.park_file import CHUNK_BYTES, NvmeParkStore


def test_take_into_reads_back_every_chunk_and_converts(tmp_path: Path) -> None:
    store = NvmeParkStore(str(tmp_path), rank=0, timeout_s=60.0)
    try:
        gen = torch.Generator().manual_seed(0)
        numel = (5 * CHUNK_BYTES) // (2 * 4) + 77  # 2.5 chunks of fp32, then a tail of 77 elements
        big = torch.randn(numel, generator=gen)
        small = torch.randn(1000, generator=gen)
        store.put(0, big, numel, torch.float32)
        store.put(1, big.to(torch.bfloat16), numel, torch.bfloat16)  # parked narrower
        store.put(2, small, 1024, torch.float32)  # padded slot; its writes may still be in flight

        same = torch.empty(numel)
        store.take_into(0, same)
        assert torch.equal(same, big)
        widened = torch.empty(numel)  # bf16 slot read into fp32: converted chunk by chunk
        store.take_into(1, widened)
        assert torch.equal(widened, big.to(torch.bfloat16).float())
        narrowed = torch.empty(numel, dtype=torch.bfloat16)  # fp32 slot into a bf16 flat buffer range
        store.take_into(0, narrowed)
        assert torch.equal(narrowed, big.to(torch.bfloat16))
        head = torch.empty(1000)  # only the values, not the padding
        store.take_into(2, head)
        assert torch.equal(head, small)
        assert torch.equal(store.take(0, torch.device("cpu")), big)  # `take` agrees
    finally:
        store.close()


def test_take_into_more_than_the_slot_is_refused(tmp_path: Path) -> None:
    store = NvmeParkStore(str(tmp_path), rank=0, timeout_s=60.0)
    try:
        store.put(0, torch.ones(10), 10, torch.float32)
        with pytest.raises(ValueError, match="holds 10 elements, asked for 11"):
            store.take_into(0, torch.empty(11))
    finally:
        store.close()


def test_pieces_and_reading_only(tmp_path: Path) -> None:
    """`put_pieces` (values drawn piece by piece, pieces of any length) lands as one `put` would; after
    `reading_only` the store keeps two staging buffers and still reads back and writes every chunk."""
    from zeroinf.tiers.park_file import READING_BUFFERS, STAGING_BUFFERS

    store = NvmeParkStore(str(tmp_path), rank=0, timeout_s=60.0)
    try:
        gen = torch.Generator().manual_seed(1)
        numel = (3 * CHUNK_BYTES) // 2 + 1001  # about 3 staging chunks in bf16, pieces cut off the boundaries
        values = torch.randn(numel, generator=gen)
        cuts = [0, 5, 4096 * 3 + 7, numel // 2, numel]
        pieces = [values[a:b] for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        store.put_pieces(0, iter(pieces), numel + 64, torch.bfloat16)
        assert len(store._staging) == STAGING_BUFFERS
        store.reading_only()
        assert len(store._staging) == READING_BUFFERS
        back = torch.empty(numel)
        store.take_into(0, back)
        assert torch.equal(back, values.to(torch.bfloat16).float())
        store.put(1, values, numel, torch.float32)  # writes go on with the buffers kept
        again = torch.empty(numel)
        store.take_into(1, again)
        assert torch.equal(again, values)
    finally:
        store.close()
