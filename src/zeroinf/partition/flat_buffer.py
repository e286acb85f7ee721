"""The layout of a unit's flat buffer: a pure function of parameter shapes and the world size.

Parameters are laid end to end in registration order; the total is padded so that it splits into
`world_size` equal shards whose starts are `ALIGN_NUMEL`-aligned (64 elements: 128-256 bytes, good for
vectorized kernels and collectives). Rank r owns the range [r * shard_numel, (r + 1) * shard_numel).
"""

from __future__ import annotations

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
            offset += numel
        quantum = world_size * ALIGN_NUMEL
        padded = max(quantum, -(-offset // quantum) * quantum)
        return cls(tuple(slots), world_size, padded)

    @property
    def numel(self) -> int:
        """Numel of the real parameters (without padding)."""
        return self.slots[-1].end if self.slots else 0

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
