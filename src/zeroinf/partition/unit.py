"""ShardedUnit: one unit's flat buffers, its parameters as views, and its gradient reduction.

Stages are policies of this one class (see `ShardingPolicy`): the parameters stay unsharded for
stages 0-2; the optimizer owns the whole flat range at stage 0 and one shard from stage 1 on;
gradients are all-reduced (stages 0-1) or reduce-scattered into a shard (stage 2).

[Note: gradient accumulation buffer]
Autograd writes each parameter's gradient into `param.grad` in the compute dtype. A
post-accumulate-grad hook adds it into the unit's unsharded gradient buffer in `reduce_dtype`
(fp32 by default) and drops `param.grad`. So accumulation over micro-steps happens in fp32 even
for bf16 compute, and the unit knows exactly when all its gradients of a backward have arrived.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from zeroinf.comm import DoneHandle, Handle, all_gather_into, all_reduce, reduce_scatter_into
from zeroinf.memory import Ledger, Tier
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.telemetry import CollectiveCounter
from zeroinf.topology import Topology


@dataclass(frozen=True)
class ShardingPolicy:
    """What a ZeRO stage shards; every other difference between stages follows from these flags."""

    stage: int

    @property
    def shard_optimizer(self) -> bool:
        return self.stage >= 1

    @property
    def shard_grads(self) -> bool:
        return self.stage >= 2


class GradState(Enum):
    EMPTY = "empty"  # no gradient since zero_grad
    ACCUMULATING = "accumulating"  # unsharded buffer holds local gradients
    REDUCING = "reducing"  # a collective is in flight
    REDUCED = "reduced"  # the owned range holds the global mean gradient


class ShardedUnit:
    def __init__(
        self,
        name: str,
        params: list[tuple[str, nn.Parameter]],
        topo: Topology,
        policy: ShardingPolicy,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        ledger: Ledger,
        bucket_bytes: int,
        counter: CollectiveCounter,
    ) -> None:
        self.name = name or "<root>"
        self.params = [p for _, p in params]
        self.topo, self.policy, self.ledger = topo, policy, ledger
        self.reduce_dtype, self.bucket_bytes, self.counter = reduce_dtype, bucket_bytes, counter
        self.layout = FlatLayout.build([(n, p.shape) for n, p in params], topo.world_size)
        self.owned_start, self.owned_end = (
            self.layout.shard_range(topo.rank) if policy.shard_optimizer else (0, self.layout.padded_numel)
        )
        device = topo.device
        self.param_flat = torch.zeros(self.layout.padded_numel, dtype=param_dtype, device=device)
        ledger.reserve(Tier.DEVICE, self._nbytes(self.param_flat), "param_unsharded")
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            view = self.param_flat[slot.offset : slot.end].view(slot.shape)
            view.copy_(p.detach())
            p.data = view
        self.grad_flat: torch.Tensor | None = None  # unsharded, reduce dtype
        self.grad_shard: torch.Tensor | None = None  # stage 2: owned shard, reduce dtype
        self.grad_state = GradState.EMPTY
        self._arrived = [False] * len(self.params)
        self._handles: list[Handle] = []

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    @property
    def owned_numel(self) -> int:
        return self.owned_end - self.owned_start

    def fp32_params_owned(self) -> torch.Tensor:
        """A new fp32 copy of the owned range of the parameters (the initial master weights)."""
        return self.param_flat[self.owned_start : self.owned_end].float().clone()

    # -- initial state --------------------------------------------------------------------------------
    def broadcast_from_rank0(self) -> None:
        """Make every rank start from rank 0's weights (as DDP does)."""
        if self.topo.is_distributed:
            torch.distributed.broadcast(self.param_flat, src=0, group=self.topo.group)

    # -- gradients ------------------------------------------------------------------------------------
    def accumulate_grad(self, index: int) -> bool:
        """Move param `index`'s fresh .grad into the flat buffer; True once all have arrived this backward."""
        param = self.params[index]
        grad = param.grad
        if grad is None:  # hook fired without a gradient (should not happen for dense params)
            return all(self._arrived)
        self._ensure_grad_flat()
        # After a reduction (sync_every_micro_step), stages 0-1 keep adding onto the reduced buffer: its
        # content is identical on every rank, so the next mean adds exactly the new local gradients.
        slot = self.layout.slots[index]
        self.grad_flat[slot.offset : slot.end].view(slot.shape).add_(grad)
        param.grad = None
        self.grad_state = GradState.ACCUMULATING
        self._arrived[index] = True
        return all(self._arrived)

    def _ensure_grad_flat(self) -> None:
        if self.grad_flat is None:
            self.grad_flat = torch.zeros(self.layout.padded_numel, dtype=self.reduce_dtype, device=self.topo.device)
            self.ledger.reserve(Tier.DEVICE, self._nbytes(self.grad_flat), "grad_unsharded")

    def materialize_zero_grad(self) -> None:
        """Join a reduction with zeros: another rank has gradients for this unit, this one has none."""
        self._ensure_grad_flat()
        self.grad_state = GradState.ACCUMULATING

    def end_backward(self) -> None:
        """Forget which gradients arrived (the next backward starts counting again)."""
        self._arrived = [False] * len(self.params)

    def start_reduce_grads(self) -> None:
        """Launch the gradient collective (all-reduce or reduce-scatter) asynchronously."""
        if self.grad_state is not GradState.ACCUMULATING:
            return  # no gradient this step (frozen/unused unit), or already reducing
        assert self.grad_flat is not None
        if self.policy.shard_grads:
            shard_numel = self.layout.shard_numel
            if self.grad_shard is None:
                self.grad_shard = torch.zeros(shard_numel, dtype=self.reduce_dtype, device=self.topo.device)
                self.ledger.reserve(Tier.DEVICE, self._nbytes(self.grad_shard), "grad_shard")
                self._rs_out = self.grad_shard
            else:  # accumulate onto an earlier micro-step's reduced shard
                self._rs_out = torch.empty_like(self.grad_shard)
            self._handles = [reduce_scatter_into(self._rs_out, self.grad_flat, self.topo, average=True)]
            self.counter.add("reduce_scatter")
        else:
            chunk = max(1, self.bucket_bytes // self.grad_flat.element_size())
            self._handles = [
                all_reduce(piece, self.topo, average=True) for piece in torch.split(self.grad_flat, chunk)
            ]
            self.counter.add("all_reduce", len(self._handles))
        self.grad_state = GradState.REDUCING

    def wait_reduce_grads(self) -> None:
        if self.grad_state is not GradState.REDUCING:
            return
        for handle in self._handles:
            handle.wait()
        self._handles = []
        if self.policy.shard_grads:
            assert self.grad_shard is not None and self.grad_flat is not None
            if self._rs_out is not self.grad_shard:
                self.grad_shard.add_(self._rs_out)
            self._rs_out = None
            # The unsharded buffer is dead once scattered: free it (stage 2 keeps only the shard).
            self.ledger.release(Tier.DEVICE, self._nbytes(self.grad_flat), "grad_unsharded")
            self.grad_flat = None
            self.grad_state = GradState.REDUCED
        else:
            self.grad_state = GradState.REDUCED

    def owned_grad(self) -> torch.Tensor | None:
        """The reduced gradient of the owned range (a view; reduce dtype), or None if no gradient."""
        if self.grad_state is GradState.EMPTY:
            return None
        if self.grad_state is not GradState.REDUCED:
            raise RuntimeError(f"unit {self.name}: gradients are {self.grad_state.value}, not reduced")
        if self.policy.shard_grads:
            return self.grad_shard
        assert self.grad_flat is not None
        return self.grad_flat[self.owned_start : self.owned_end]

    def zero_grad(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles = []
        if self.grad_flat is not None:
            self.ledger.release(Tier.DEVICE, self._nbytes(self.grad_flat), "grad_unsharded")
            self.grad_flat = None
        if self.grad_shard is not None:
            self.ledger.release(Tier.DEVICE, self._nbytes(self.grad_shard), "grad_shard")
            self.grad_shard = None
        self.grad_state = GradState.EMPTY
        self.end_backward()

    # -- parameters -----------------------------------------------------------------------------------
    def start_update_params(self, master_owned: torch.Tensor) -> Handle:
        """Write the new master weights (owned range) into the compute params and all-gather them."""
        self.param_flat[self.owned_start : self.owned_end].copy_(master_owned)
        if not self.policy.shard_optimizer:
            return DoneHandle()
        shard = self.param_flat[self.owned_start : self.owned_end]
        self.counter.add("all_gather")
        return all_gather_into(self.param_flat, shard, self.topo)
