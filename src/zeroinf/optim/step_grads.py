"""Where the optimizer step that runs after backward takes each unit's reduced gradient from.

- `GradOnDisk`: a gradient shard on NVMe (`offload.gradients = "nvme"`), read when the unit's first
  sub-group is updated and kept for its other sub-groups: one unit's shard in memory at a time.
- `GradsToHost`: gradients reduced on the accelerator for an update on the CPU (optimizer states on
  the host or NVMe): each sub-group's slice crosses through the transfer owner's pool
  (runtime/streams.py), the next one's copy in flight while this one is updated.
"""

from __future__ import annotations

import torch

from zeroinf.memory import Tier
from zeroinf.optim.pipeline import SubGroup
from zeroinf.partition.unit import ShardedUnit
from zeroinf.runtime.streams import Landing, Transfers, typed_view


class GradOnDisk:
    """A unit's reduced gradient shard on NVMe: read when its first sub-group is updated, kept
    for that unit's other sub-groups, then dropped (one unit's shard in memory at a time)."""

    def __init__(self, unit: ShardedUnit) -> None:
        self.unit, self.coef = unit, 1.0
        self.clip_value: float | None = None  # Config.grad_clip_value, applied after `coef`
        self._loaded: torch.Tensor | None = None

    def load(self) -> torch.Tensor:
        if self._loaded is None:
            self._loaded = self.unit.owned_grad()
            assert self._loaded is not None
            if self.coef != 1.0:
                self._loaded.mul_(self.coef)
            if self.clip_value is not None:
                self._loaded.clamp_(-self.clip_value, self.clip_value)
        return self._loaded

    def drop(self) -> None:
        self._loaded = None
        self.unit.release_owned_grad()


class GradsToHost:
    """Gradients reduced on the device for a step on the CPU (optimizer states on host or nvme,
    gradients on the device): each sub-group's gradient slice crosses through a pool buffer of the
    transfer owner, the next one's copy in flight while this one is updated. With the states on the
    device (`states_tier` DEVICE) nothing crosses: `get` gives None and the update reads the gradient
    where it is."""

    def __init__(
        self, transfers: Transfers, grads: list, sub_groups: list[SubGroup], order: list[int], states_tier: Tier
    ) -> None:
        self.transfers, self.grads, self.sub_groups, self.order = transfers, grads, sub_groups, order
        self._crosses = states_tier is not Tier.DEVICE
        self._position = {index: pos for pos, index in enumerate(order)}
        self._in_flight: dict[int, tuple[torch.Tensor, torch.Tensor, Landing]] = {}

    def _start(self, pos: int) -> None:
        if not self._crosses or pos >= len(self.order) or pos in self._in_flight:
            return
        sg = self.sub_groups[self.order[pos]]
        grad = self.grads[sg.unit_index]
        if not isinstance(grad, torch.Tensor) or grad.device.type == "cpu":
            return
        piece = grad[sg.start : sg.end]
        raw = self.transfers.pool.acquire(piece.numel() * piece.element_size(), "grad_to_host")
        host = typed_view(raw, piece)
        self._in_flight[pos] = (raw, host, self.transfers.to_host(piece, host))

    def get(self, sg: SubGroup) -> torch.Tensor | None:
        """The host copy of `sg`'s gradient slice, or None when it needs none."""
        pos = self._position[sg.index]
        self._start(pos)
        self._start(pos + 1)
        if pos not in self._in_flight:
            return None
        _, host, landing = self._in_flight[pos]
        self.transfers.retire(landing)
        return host

    def done(self, sg: SubGroup) -> None:
        entry = self._in_flight.pop(self._position[sg.index], None)
        if entry is not None:
            self.transfers.pool.release(entry[0], tag="grad_to_host")
