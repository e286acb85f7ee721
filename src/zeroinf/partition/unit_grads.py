"""The gradient path of a unit (`ShardedUnit`'s base): accumulation into the unit's flat gradient
buffer, the collective that reduces it, and the landing of the reduced shard on its tier.

[Note: gradient accumulation buffer]
Autograd writes each parameter's gradient into `param.grad` in the compute dtype. A
post-accumulate-grad hook adds it into the unit's unsharded gradient buffer in `reduce_dtype`
(fp32 by default) and drops `param.grad`. So accumulation over micro-steps happens in fp32 even
for bf16 compute, and the unit knows exactly when all its gradients of a backward have arrived.
Where the buffer only ever holds one backward's gradients and the reduce-scatter sums them into the
fp32 shard itself (gloo between CPU ranks, comm.py), it keeps the compute dtype instead
(planner/unit_plan.py `gradient_buffer_dtype`): the same sums bit for bit, without casting every
gradient and with half the bytes on the wire. Autograd delivers a leaf's gradient once per
backward; should a slot get a second one anyway, it would be added in the compute dtype, so the
buffer is widened to `reduce_dtype` first (exact) and that reduction takes the fp32 path.

[Note: where a reduced gradient lands]
Stages 2-3 reduce-scatter a unit's gradient into its shard. The first reduced micro-step of a step
is written over the shard, later ones are added to it, so the shard is never zero-filled. On the
device tier the shard is the reduce-scatter's output (at world 1 the unsharded buffer itself is
adopted as the shard). On the host tier the shard is a persistent pinned host buffer, allocated
once: on a CPU device the collective writes straight into it; on an accelerator the reduced
shard leaves the device at once on the owner's d2h stream (runtime/streams.py), non-blocking,
overlapping the rest of backward, copied over the shard or, for a later micro-step, into a pool
buffer that the CPU adds once the copy's event completed. `owned_grad()` waits for that landing.
On NVMe the landing goes through a pool buffer to the gradient swap file.

With the optimizer stepping inside backward (`hand_off` set by the engine), a reduced shard that
has no earlier micro-step to add to is not landed: it stays where the collective left it, the
step takes it (`owned_grad()`), and then either drops it (`release_handed_off`: the gradient
never travels to its tier) or, for a speculative step that may have to be redone, lands it as
above (`land_handed_off`). Such a shard is never reduced into the persistent host shard, and a
dropped one frees its memory at once, so a step inside backward holds no gradient buffer of the
model's size on any tier, only those of the units being reduced or stepped: with the optimizer on
the host, the host holds the states' 12 bytes per parameter and buffers of a few units.

[Note: a parameter the model converts in its own forward]
Switch Transformers' and NLLB-MoE's routers run `self.classifier = self.classifier.to(float32)` in
every forward ("selective precision"): under a bf16 `param_dtype` the classifier's weight gets a
tensor of its own, upcast from the engine's bf16 view, and its gradient arrives in fp32. That
gradient used to be copied into the unit's bf16 buffer (rounded), and at stages 0-2 the weight,
still the fp32 tensor at the next forward, was refused as reassigned by the user (`p.data = t`),
which nobody had done. Now a gradient wider than the buffer widens it to `reduce_dtype` first
(exact, as for a second gradient), the weight is made a view of the buffer again, and the run says
once which parameters it saw so. What stays different from plain PyTorch: the router computes with
its master rounded to bf16 and upcast, where plain bf16 training keeps the converted fp32 tensor
(and fp32 masters by hand keep their unrounded values): in `benchmarks/hf_sweep.py --head seq2seq
--dtype bf16`, Switch Transformers' weights end 7.8e-3 from that reference after two steps; every
other type there is bitwise. `Config.keep_fp32` naming the parameter ("router.classifier") puts it
in a unit of its own in fp32 (precision.py [Note: parameters the model keeps in fp32]): it then
computes from its fp32 master from the first forward on, where plain bf16 training's first forward
still reads the rounded copy. transformers does not declare these routers fp32, so by default
nothing changes and the warning names the field.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import nn

from zeroinf.comm import Handle, all_reduce, average_over_replicas, reduce_scatter_into
from zeroinf.memory import Ledger, Tier
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.partition.grad_pool import GradBufferPool
from zeroinf.partition.shard_home import NvmeGradFiles
from zeroinf.runtime.streams import Landing, Transfers, typed_view
from zeroinf.telemetry import CollectiveCounter, get_logger, phase
from zeroinf.tiers.host import host_zeros
from zeroinf.topology import Topology

if TYPE_CHECKING:  # unit.py imports this module
    from zeroinf.partition.unit import ShardingPolicy


_CONVERTED_SEEN: set[str] = set()  # parameters whose conversion in forward was reported, by name


class GradState(Enum):
    EMPTY = "empty"  # no gradient since zero_grad
    ACCUMULATING = "accumulating"  # unsharded buffer holds local gradients
    REDUCING = "reducing"  # a collective is in flight
    REDUCED = "reduced"  # the owned range holds the global mean gradient


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class UnitGradients:
    """The gradient methods of `ShardedUnit` (partition/unit.py), which sets every attribute below."""

    # the unit's
    name: str
    params: list[nn.Parameter]
    layout: FlatLayout
    topo: Topology
    policy: ShardingPolicy
    ledger: Ledger
    transfers: Transfers
    counter: CollectiveCounter
    reduce_dtype: torch.dtype
    bucket_bytes: int
    owned_start: int
    owned_end: int
    # its gradients'
    grad_buffer_dtype: torch.dtype
    grad_pool: GradBufferPool
    grad_tier: Tier
    grad_files: NvmeGradFiles | None
    grad_flat: torch.Tensor | None
    grad_shard: torch.Tensor | None
    grad_state: GradState
    grad_sq_norm: float | None
    hand_off: bool
    reduce_at_end: bool
    param_had_grad: list[bool]
    param_flat: torch.Tensor
    param_names: list[str]
    _rs_out: torch.Tensor | None
    _handed: torch.Tensor | None
    _arrived: list[bool]
    _slot_written: list[bool]
    _grad_handles: list[Handle]
    _grad_landed: bool
    _landing: Landing | None
    _read_buffer: torch.Tensor | None

    @property
    def what(self) -> str:
        """How a checked collective names this unit (Config.check_collectives)."""
        return f"unit {self.name}"

    # -- gradients ------------------------------------------------------------------------------------
    def _ensure_grad_flat(self) -> torch.Tensor:
        if self.grad_flat is None:
            # Uninitialized: each slot's first gradient is copied in, not added to zeros (zero-filling
            # the buffer cost ~5% of a bf16 backward here); the gaps between parameters and the padding are
            # zeroed here, slots no gradient reached before the reduction.
            self.grad_flat = self.grad_pool.take(self.layout.padded_numel, self.grad_buffer_dtype)
            for start, end in self.layout.gaps:
                self.grad_flat[start:end].zero_()
            self._slot_written = [False] * len(self.params)
            self.ledger.reserve(Tier.DEVICE, _nbytes(self.grad_flat), "grad_unsharded")
        return self.grad_flat

    def _zero_unwritten_slots(self) -> None:
        assert self.grad_flat is not None
        for slot, written in zip(self.layout.slots, self._slot_written, strict=True):
            if not written:
                self.grad_flat[slot.offset : slot.end].zero_()
        self._slot_written = [True] * len(self.params)

    def accumulate_grad(self, index: int) -> bool:
        """Move param `index`'s fresh .grad into the flat buffer; True once all have arrived this backward."""
        param = self.params[index]
        if param.grad is None:  # hook fired without a gradient (should not happen for dense params)
            return all(self._arrived)
        if param.grad.dtype != self.param_flat.dtype or param.dtype != self.param_flat.dtype:
            self._retake_converted(index)  # [Note: a parameter the model converts in its own forward]
        # After a reduction (sync_every_micro_step), stages 0-1 keep adding onto the reduced buffer: its
        # content is identical on every rank, so the next mean adds exactly the new local gradients.
        slot = self.layout.slots[index]
        flat = self._ensure_grad_flat()
        wider = param.grad.dtype != flat.dtype and param.grad.dtype == self.reduce_dtype
        if flat.dtype != self.reduce_dtype and (self._slot_written[index] or wider):
            self._widen_grad_flat()  # a second or a wider gradient: kept in reduce_dtype, never rounded
        target = self._ensure_grad_flat()[slot.offset : slot.end].view(slot.shape)
        if self._slot_written[index]:
            target.add_(param.grad)
        else:
            target.copy_(param.grad)
            self._slot_written[index] = True
        param.grad = None
        self.grad_state = GradState.ACCUMULATING
        self._arrived[index] = True
        self.param_had_grad[index] = True
        return all(self._arrived)

    def _retake_converted(self, index: int) -> None:
        """Param `index` was converted to another dtype by the model's own forward: a view of the
        unit's buffer again, said once per parameter ([Note: a parameter the model converts in its
        own forward])."""
        param, slot, name = self.params[index], self.layout.slots[index], self.param_names[index]
        if name not in _CONVERTED_SEEN:
            _CONVERTED_SEEN.add(name)
            get_logger().warning(
                "%s: the model's forward converted this parameter to %s (a router's `.to(float32)`); it computes "
                "from the engine's %s copy of its master, upcast, while its gradient is kept in %s. "
                "Config(keep_fp32=[%r]) keeps it in fp32 from the start "
                "(partition/unit_grads.py [Note: a parameter the model converts in its own forward])",
                name, param.grad.dtype if param.grad is not None else param.dtype, self.param_flat.dtype,
                self.reduce_dtype, name,
            )
        if param.dtype != self.param_flat.dtype:
            param.data = self.param_flat[slot.offset : slot.end].view(slot.shape)

    def _widen_grad_flat(self) -> None:
        """Turn a compute-dtype gradient buffer into a `reduce_dtype` one (an exact cast)."""
        assert self.grad_flat is not None
        narrow, self.grad_flat = self.grad_flat, self.grad_pool.take(self.grad_flat.numel(), self.reduce_dtype)
        self.grad_flat.copy_(narrow)
        self.ledger.release(Tier.DEVICE, _nbytes(narrow), "grad_unsharded")
        self.grad_pool.give(narrow)
        self.ledger.reserve(Tier.DEVICE, _nbytes(self.grad_flat), "grad_unsharded")

    def materialize_zero_grad(self) -> None:
        """Join a reduction with zeros: another rank has gradients for this unit, this one has none."""
        self._ensure_grad_flat()
        self._zero_unwritten_slots()
        self.grad_state = GradState.ACCUMULATING

    def arrived(self, index: int) -> bool:
        """Param `index`'s gradient already arrived in this backward."""
        return self._arrived[index]

    def expect_gradients(self, reached: list[bool], ranks_reaching: list[int], world: int) -> None:
        """At the start of a backward: `reached[i]`, whether it reaches param i on this rank;
        `ranks_reaching[i]`, on how many ranks. A parameter reached on some ranks only counts as
        arrived where it is not (zeros in the mean) and as having a gradient on every rank
        (runtime/reach.py [Note: gradients that reach some ranks only])."""
        for i, (here, ranks) in enumerate(zip(reached, ranks_reaching, strict=True)):
            if 0 < ranks < world:
                self.param_had_grad[i] = True
                if not here:
                    self._arrived[i] = True

    def end_backward(self) -> None:
        """Forget which gradients arrived (the next backward starts counting again)."""
        self._arrived = [False] * len(self.params)
        self.reduce_at_end = False

    @phase("zeroinf::reduce")
    def start_reduce_grads(self) -> None:
        """Launch the gradient collective (all-reduce or reduce-scatter) asynchronously."""
        if self.grad_state is not GradState.ACCUMULATING:
            return  # no gradient this step (frozen/unused unit), or already reducing
        assert self.grad_flat is not None
        self._zero_unwritten_slots()
        if self.policy.shard_grads:
            self._rs_out = self._reduce_target()
            what = f"gradients of {self.what}"
            self._grad_handles = [reduce_scatter_into(self._rs_out, self.grad_flat, self.topo, average=True, what=what)]
            self.counter.add("reduce_scatter")
        else:
            chunk = max(1, self.bucket_bytes // self.grad_flat.element_size())
            self._grad_handles = [
                all_reduce(piece, self.topo, average=True, what=f"gradients of {self.what}")
                for piece in torch.split(self.grad_flat, chunk)
            ]
            self.counter.add("all_reduce", len(self._grad_handles))
        self.grad_state = GradState.REDUCING

    def _reduce_target(self) -> torch.Tensor:
        """Where this micro-step's reduced shard is written (see [Note: where a reduced gradient
        lands]): the shard itself when it is empty and lives where the collective runs, else a
        device buffer (at world 1 the unsharded buffer, which is the shard) it is copied or added from."""
        assert self.grad_flat is not None
        numel, device = self.layout.shard_numel, self.topo.device
        if self.grad_files is None and not self._grad_landed:
            if self.grad_tier is Tier.DEVICE:
                if not self.topo.is_distributed:  # adopt the unsharded buffer: no copy, no second buffer
                    self.grad_shard = self.grad_flat
                    self.ledger.release(Tier.DEVICE, _nbytes(self.grad_flat), "grad_unsharded")
                else:
                    self.grad_shard = self.grad_pool.take(numel, self.reduce_dtype)
                self.ledger.reserve(Tier.DEVICE, _nbytes(self.grad_shard), "grad_shard")
                return self.grad_shard
            if not self.hand_off:  # a handed-off shard may never land: no persistent host shard for it
                host_shard = self._host_grad_shard()
                if host_shard.device == device:  # a CPU device: the host shard is where gloo reduces
                    return host_shard
        if not self.topo.is_distributed:
            return self.grad_flat
        out = self.grad_pool.take(numel, self.reduce_dtype)
        self.ledger.reserve(Tier.DEVICE, _nbytes(out), "grad_reduce_out")
        return out

    def _host_grad_shard(self) -> torch.Tensor:
        """The persistent fp32 gradient shard on the host (pinned with CUDA): allocated on first use,
        kept for the engine's lifetime, never zero-filled again (the first micro-step overwrites it)."""
        if self.grad_shard is None:
            self.grad_shard = host_zeros(self.layout.shard_numel, self.reduce_dtype, self.ledger, "grad_shard")
        return self.grad_shard

    @phase("zeroinf::reduce")
    def wait_reduce_grads(self) -> None:
        """Finish the collective; a reduced shard starts its way to its tier (see [Note: where a
        reduced gradient lands])."""
        if self.grad_state is not GradState.REDUCING:
            return
        for handle in self._grad_handles:
            handle.wait()
        self._grad_handles = []
        if self.topo.replicas is not None:  # comm.py [Note: hybrid sharding]
            reduced = self._rs_out if self.policy.shard_grads else self.grad_flat
            assert reduced is not None
            average_over_replicas(reduced, self.topo, f"gradients of {self.what}")
            self.counter.add("all_reduce")
        if self.policy.shard_grads:
            out, self._rs_out = self._rs_out, None
            assert out is not None
            if self.hand_off and not self._grad_landed:
                self._handed = out  # landed or dropped once the optimizer stepped it
            else:
                self._land(out)
        self.grad_state = GradState.REDUCED

    def _land(self, out: torch.Tensor) -> None:
        accumulate = self._grad_landed
        if self.grad_files is not None:
            self._land_on_disk(out, accumulate)
        elif out is not self.grad_shard:
            if self.grad_tier is Tier.HOST:
                self._landing = self.transfers.land(out, self._host_grad_shard(), accumulate=accumulate)
            else:
                assert self.grad_shard is not None
                self.grad_shard.add_(out)
        self._grad_landed = True
        self._drop_reduce_buffers(out)

    @property
    def grad_in_memory(self) -> bool:
        """The reduced gradient can be stepped now without a tier: handed off, or never sharded."""
        return self.grad_state is GradState.REDUCED and (self._handed is not None or not self.policy.shard_grads)

    def land_handed_off(self) -> None:
        """Put a handed-off shard on its tier after all (a speculative step may need it again)."""
        if self._handed is not None:
            out, self._handed = self._handed, None
            self._land(out)

    def release_handed_off(self) -> None:
        """The optimizer is done with the handed-off shard: free it without landing it (a device
        shard too: nothing reads it before `zero_grad`)."""
        if self._handed is not None:
            out, self._handed = self._handed, None
            self._drop_reduce_buffers(out)
            if out is self.grad_shard and self.grad_tier is Tier.DEVICE:
                self.ledger.release(Tier.DEVICE, _nbytes(out), "grad_shard")
                self.grad_shard = None
                self.grad_pool.give(out)

    def _land_on_disk(self, out: torch.Tensor, accumulate: bool) -> None:
        """The reduced shard goes to the gradient swap file through a staging buffer of the pool:
        once it has arrived, an earlier micro-step's shard is read and added, the squared norm kept,
        and the write started; the buffer returns to the pool when the write is done."""
        files = self.grad_files
        assert files is not None
        if out.dtype != torch.float32:
            out = out.float()
        numel = out.numel()
        raw = self.transfers.pool.acquire(numel * 4)
        shard = typed_view(raw, out)

        def arrived() -> None:
            if accumulate:
                earlier = self.transfers.pool.acquire(numel * 4)
                shard.add_(files.read(self.name, numel, out=typed_view(earlier, out)))
                self.transfers.pool.release(earlier)
            self.grad_sq_norm = float(torch.linalg.vector_norm(shard, dtype=torch.float32) ** 2)  # as optim/clip.py
            files.write(self.name, shard, on_written=lambda: self.transfers.pool.release(raw))

        self._landing = self.transfers.land(out, shard, accumulate=False, then=arrived)

    def _drop_reduce_buffers(self, out: torch.Tensor) -> None:
        """The unsharded buffer is dead once reduced: free it, and the device buffer the shard was
        reduced into (on an accelerator the allocator keeps its memory until the copy read it)."""
        assert self.grad_flat is not None
        if self.grad_flat is not self.grad_shard:
            self.ledger.release(Tier.DEVICE, _nbytes(self.grad_flat), "grad_unsharded")
            self.grad_pool.give(self.grad_flat)
        if out is not self.grad_flat and out is not self.grad_shard and out.device == self.topo.device:
            self.ledger.release(Tier.DEVICE, _nbytes(out), "grad_reduce_out")
            self.grad_pool.give(out)
        self.grad_flat = None

    def _finish_landing(self) -> None:
        if self._landing is not None:
            self.transfers.retire(self._landing)
            self._landing = None

    def owned_grad(self) -> torch.Tensor | None:
        """The reduced gradient of the owned range (a view; reduce dtype), or None if no gradient.

        On the host, it is there once this returns (the CPU waits for its copy if still running).
        Shards on NVMe are read into a pool buffer lent until `release_owned_grad()`."""
        if self.grad_state is GradState.EMPTY:
            return None
        if self.grad_state is not GradState.REDUCED:
            raise RuntimeError(f"unit {self.name}: gradients are {self.grad_state.value}, not reduced")
        if self._handed is not None:
            return self._handed
        self._finish_landing()
        if self.grad_files is not None:
            numel = self.layout.shard_numel
            if self._read_buffer is None:
                self._read_buffer = self.transfers.pool.acquire(numel * 4)
            return self.grad_files.read(self.name, numel, out=self._read_buffer.view(torch.float32))
        if self.policy.shard_grads:
            return self.grad_shard
        assert self.grad_flat is not None
        return self.grad_flat[self.owned_start : self.owned_end]

    def release_owned_grad(self) -> None:
        """Give back the buffer `owned_grad()` read an NVMe shard into."""
        if self._read_buffer is not None:
            self.transfers.pool.release(self._read_buffer)
            self._read_buffer = None

    def zero_grad(self) -> None:
        """Forget this step's gradients. Device buffers are freed; the host shard stays allocated and
        is not cleared (the next step's first micro-step overwrites it)."""
        for handle in self._grad_handles:
            handle.wait()
        self._grad_handles = []
        self.release_handed_off()
        self._finish_landing()  # nothing may still be added into the shard once the next step starts
        self.release_owned_grad()
        if self._rs_out is not None:  # reduced but never waited (an error mid-backward)
            if self._rs_out is not self.grad_flat and self._rs_out is not self.grad_shard:
                self.ledger.release(Tier.DEVICE, _nbytes(self._rs_out), "grad_reduce_out")
            self._rs_out = None
        if self.grad_flat is not None and self.grad_flat is not self.grad_shard:
            self.ledger.release(Tier.DEVICE, _nbytes(self.grad_flat), "grad_unsharded")
            self.grad_pool.give(self.grad_flat)
        self.grad_flat = None
        if self.grad_shard is not None and self.grad_tier is Tier.DEVICE:
            self.ledger.release(Tier.DEVICE, _nbytes(self.grad_shard), "grad_shard")
            self.grad_pool.give(self.grad_shard)
            self.grad_shard = None
        self.grad_state = GradState.EMPTY
        self._grad_landed, self.grad_sq_norm = False, None
        self.param_had_grad = [False] * len(self.params)
        self.end_backward()
