"""The layout of a unit's flat buffer: a pure function of parameter shapes and the world size.

Parameters are laid in registration order, each starting on a multiple of `ALIGN_NUMEL` (64
elements), zeros between them; the total is padded so that it splits into `world_size` equal shards
whose starts are multiples of it too. Rank r owns the range [r * shard_numel, (r + 1) * shard_numel).

[Note: why every parameter starts on 64 elements]
A shard boundary (and a sub-group's, optim/pipeline.py) cuts a parameter in two, and the optimizer
steps each piece as a tensor of its own. PyTorch's fused CPU AdamW runs a tensor's elements in
vectors (of 8 on the AVX-512 EPYC where it was found) and its last `numel % 8` in a scalar loop
whose rounding differs in the last bit now and then, so an element landing in a piece's tail
rounded otherwise than in the whole parameter: ConvBERT at world 2 ended one bias element 5.8e-11
away from DDP's, where every other weight of every type was bitwise DDP's (benchmarks/hf_sweep.py).
With parameters and shards both on multiples of 64, every cut inside a parameter falls on a
multiple of 64 of its own elements, each element takes the path it takes in plain PyTorch, and two
ranks are bitwise DDP (tests/test_parity.py `test_two_ranks_are_bitwise_plain_data_parallelism`).
The views are also aligned as the caching allocator aligns a tensor of their own (128 bytes in
bf16), as vectorized kernels like, and as FSDP1 pads its flat parameters for. The cost: under 64
elements per parameter, and none where every size is a multiple of 64 (all 291 tensors of a 7B Llama).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

ALIGN_NUMEL = 64


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lies in its unit's unsharded flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that falls inside a shard: flat [start, end) and param-local offset."""

    slot_index: int
    start: int  # in unsharded flat coordinates
    end: int
    param_offset: int  # where `start` falls inside the parameter's own flattened numel

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class FlatLayout:
    slots: tuple[ParamSlot, ...]
    world_size: int
    padded_numel: int

    @classmethod
    def build(cls, named_shapes: Iterable[tuple[str, Sequence[int]]], world_size: int) -> FlatLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        slots, offset = [], 0
        for name, shape in named_shapes:
            numel = int(torch.Size(shape).numel())
            slots.append(ParamSlot(name, torch.Size(shape), offset, numel))
            offset += -(-numel // ALIGN_NUMEL) * ALIGN_NUMEL  # the next one on a multiple of ALIGN_NUMEL
        quantum = world_size * ALIGN_NUMEL
        padded = max(quantum, -(-offset // quantum) * quantum)
        return cls(tuple(slots), world_size, padded)

    @property
    def numel(self) -> int:
        """Numel of the real parameters (without padding)."""
        return sum(slot.numel for slot in self.slots)

    @functools.cached_property
    def gaps(self) -> tuple[tuple[int, int], ...]:
        """The [start, end) ranges no parameter covers (between parameters and at the end): zeros."""
        out, filled = [], 0
        for slot in self.slots:
            if slot.offset > filled:
                out.append((filled, slot.offset))
            filled = slot.end
        if self.padded_numel > filled:
            out.append((filled, self.padded_numel))
        return tuple(out)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, start: int, end: int) -> list[Piece]:
        """The parameter pieces inside flat range [start, end), in layout order (padding excluded)."""
        out = []
        for i, slot in enumerate(self.slots):
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if lo < hi:
                out.append(Piece(i, lo, hi, lo - slot.offset))
        return out
