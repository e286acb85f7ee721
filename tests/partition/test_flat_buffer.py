"""FlatLayout is a pure function of shapes and world size: parameters in order on multiples of 64
elements, shards aligned, tiled exactly."""

from __future__ import annotations

import random

import pytest
import torch

from zeroinf.partition.flat_buffer import ALIGN_NUMEL, FlatLayout


def _random_shapes(rng: random.Random) -> list[tuple[str, torch.Size]]:
    shapes = []
    for i in range(rng.randint(1, 8)):
        ndim = rng.randint(0, 3)
        shapes.append((f"p{i}", torch.Size(rng.randint(1, 40) for _ in range(ndim))))
    return shapes


def check_layout(layout: FlatLayout, named_shapes: list[tuple[str, torch.Size]], world_size: int) -> None:
    # Slots: registration order from 0, each on the first multiple of ALIGN_NUMEL after the one
    # before, numel matching the shape.
    assert [s.name for s in layout.slots] == [n for n, _ in named_shapes]
    offset = 0
    for slot, (_, shape) in zip(layout.slots, named_shapes, strict=True):
        assert slot.shape == shape and slot.numel == shape.numel()
        assert slot.offset == offset and slot.end == offset + slot.numel and slot.offset % ALIGN_NUMEL == 0
        offset = -(-slot.end // ALIGN_NUMEL) * ALIGN_NUMEL
    assert layout.numel == sum(s.numel for s in layout.slots)

    # Padding: the smallest multiple of world_size * ALIGN_NUMEL that holds everything (at least one quantum).
    quantum = world_size * ALIGN_NUMEL
    assert layout.padded_numel % quantum == 0
    assert offset <= layout.padded_numel < max(offset, 1) + quantum

    # The gaps: exactly the elements no slot covers, in order, each range maximal.
    in_gap = torch.ones(layout.padded_numel, dtype=torch.bool)
    for slot in layout.slots:
        in_gap[slot.offset : slot.end] = False
    from_gaps = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for start, end in layout.gaps:
        assert start < end and not from_gaps[start:end].any()
        from_gaps[start:end] = True
    assert torch.equal(from_gaps, in_gap)
    assert all(a[1] < b[0] for a, b in zip(layout.gaps, layout.gaps[1:], strict=False))
    assert layout.shard_numel * world_size == layout.padded_numel
    assert layout.shard_numel % ALIGN_NUMEL == 0

    # Shard ranges tile [0, padded) exactly, in rank order.
    ranges = [layout.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
        assert end == start

    # Pieces of all shards: every real element exactly once, no padding, param offsets consistent.
    covered = torch.zeros(layout.padded_numel, dtype=torch.int64)
    per_param = [torch.zeros(s.numel, dtype=torch.int64) for s in layout.slots]
    for start, end in ranges:
        last_end = start
        for piece in layout.pieces(start, end):
            slot = layout.slots[piece.slot_index]
            assert start <= piece.start < piece.end <= end
            assert slot.offset <= piece.start and piece.end <= slot.end
            assert piece.param_offset == piece.start - slot.offset
            assert piece.numel == piece.end - piece.start
            assert piece.start >= last_end  # layout order, no overlap
            last_end = piece.end
            covered[piece.start : piece.end] += 1
            per_param[piece.slot_index][piece.param_offset : piece.param_offset + piece.numel] += 1
    slotted = torch.zeros(layout.padded_numel, dtype=torch.int64)
    for slot in layout.slots:
        slotted[slot.offset : slot.end] = 1
    assert torch.equal(covered, slotted)  # every parameter element once, no gap element
    assert all(torch.all(c == 1) for c in per_param)


def test_random_layouts_are_exact() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        named_shapes = _random_shapes(rng)
        world_size = rng.randint(1, 8)
        check_layout(FlatLayout.build(named_shapes, world_size), named_shapes, world_size)


def test_pieces_of_arbitrary_ranges() -> None:
    rng = random.Random(99)
    for _ in range(100):
        layout = FlatLayout.build(_random_shapes(rng), rng.randint(1, 8))
        a, b = sorted(rng.randint(0, layout.padded_numel) for _ in range(2))
        got = torch.zeros(layout.padded_numel, dtype=torch.int64)
        for piece in layout.pieces(a, b):
            got[piece.start : piece.end] += 1
        expected = torch.zeros(layout.padded_numel, dtype=torch.int64)
        for slot in layout.slots:
            expected[max(a, slot.offset) : min(b, slot.end)] = 1
        assert torch.equal(got, expected), (a, b, layout)


def test_pieces_cut_a_parameter_at_a_shard_boundary() -> None:
    layout = FlatLayout.build([("w", torch.Size([150])), ("b", torch.Size([50]))], world_size=2)
    assert [s.offset for s in layout.slots] == [0, 192]  # b on the next multiple of 64
    assert layout.padded_numel == 256 and layout.shard_numel == 128
    assert layout.gaps == ((150, 192), (242, 256))
    p0 = layout.pieces(*layout.shard_range(0))
    p1 = layout.pieces(*layout.shard_range(1))
    assert [(p.slot_index, p.start, p.end, p.param_offset) for p in p0] == [(0, 0, 128, 0)]
    assert [(p.slot_index, p.start, p.end, p.param_offset) for p in p1] == [(0, 128, 150, 128), (1, 192, 242, 0)]


def test_single_scalar_param() -> None:
    named_shapes = [("scale", torch.Size([]))]
    layout = FlatLayout.build(named_shapes, world_size=1)
    assert layout.numel == 1 and layout.padded_numel == ALIGN_NUMEL
    check_layout(layout, named_shapes, 1)
    (piece,) = layout.pieces(0, layout.padded_numel)
    assert (piece.slot_index, piece.start, piece.end, piece.param_offset) == (0, 0, 1, 0)


def test_world_larger_than_numel() -> None:
    named_shapes = [("a", torch.Size([3])), ("b", torch.Size([2]))]
    layout = FlatLayout.build(named_shapes, world_size=8)
    check_layout(layout, named_shapes, 8)
    assert layout.shard_numel == ALIGN_NUMEL  # one parameter per shard: each starts on ALIGN_NUMEL
    assert [p.slot_index for p in layout.pieces(*layout.shard_range(0))] == [0]
    assert [p.slot_index for p in layout.pieces(*layout.shard_range(1))] == [1]
    assert all(layout.pieces(*layout.shard_range(r)) == [] for r in range(2, 8))


def test_zero_numel_param_gets_no_piece() -> None:
    named_shapes = [("a", torch.Size([4])), ("empty", torch.Size([0, 3])), ("b", torch.Size([2]))]
    layout = FlatLayout.build(named_shapes, world_size=2)
    check_layout(layout, named_shapes, 2)
    assert layout.slots[1].offset == layout.slots[1].end == layout.slots[2].offset == ALIGN_NUMEL
    assert [p.slot_index for p in layout.pieces(0, layout.padded_numel)] == [0, 2]


def test_no_params() -> None:
    layout = FlatLayout.build([], world_size=4)
    assert layout.numel == 0 and layout.padded_numel == 4 * ALIGN_NUMEL
    assert layout.pieces(0, layout.padded_numel) == []


def test_exact_multiple_is_not_padded_further() -> None:
    layout = FlatLayout.build([("w", torch.Size([2 * ALIGN_NUMEL * 3]))], world_size=2)
    assert layout.padded_numel == layout.numel == 6 * ALIGN_NUMEL


@pytest.mark.parametrize("world_size", [0, -1])
def test_bad_world_size(world_size: int) -> None:
    with pytest.raises(ValueError, match="world_size"):
        FlatLayout.build([("w", torch.Size([4]))], world_size)
