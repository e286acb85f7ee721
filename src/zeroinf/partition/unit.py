"""ShardedUnit: one unit's flat buffers, its parameters as views, unshard/reshard and gradient reduction.

Stages are policies of this one class (see `ShardingPolicy`): the optimizer owns the whole flat
range at stage 0 and one shard from stage 1 on; gradients are all-reduced (stages 0-1) or
reduce-scattered into a shard (stages 2-3); parameters stay unsharded (stages 0-2) or live as a
shard that is all-gathered just before use and freed right after (stage 3).

[Note: freeing unsharded memory while autograd holds aliases]
Autograd saves views of the weights it needs in backward (e.g. `weight.t()` for a Linear), so
dropping our reference to the unsharded buffer would free nothing. We resize the buffer's storage
to zero instead (as FSDP2 does): every alias loses its memory at once, and the next unshard
resizes the same storage back and all-gathers into it, so saved aliases see the data again in
backward. Reading a zero-sized storage through a stale view can crash the process, so while a unit
is sharded its parameters' `.data` point at empty (0,)-shaped tensors: a stray use outside the
unit's hooks fails with a shape error instead of reading freed memory. The all-gather that refills
the storage runs under `_unsafe_preserve_version_counter`, since refilling is not a modification
autograd should see.

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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import nn

from zeroinf.comm import DoneHandle, Handle, ThenHandle, all_gather_into, all_reduce, reduce_scatter_into
from zeroinf.memory import Ledger, Tier
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.partition.grad_pool import GradBufferPool
from zeroinf.partition.park import swap_data
from zeroinf.partition.shard_home import MemoryHome, NvmeGradFiles, ShardHome
from zeroinf.runtime.streams import Landing, Transfers, typed_view
from zeroinf.telemetry import CollectiveCounter, phase
from zeroinf.tiers.host import host_zeros
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

    @property
    def shard_params(self) -> bool:
        return self.stage >= 3


class ParamState(Enum):
    SHARDED = "sharded"  # only this rank's shard exists; params point at empty placeholders
    FETCHING = "fetching"  # the shard is being read from its tier (NVMe), no collective yet
    UNSHARDING = "unsharding"  # all-gather in flight into the unsharded buffer
    UNSHARDED = "unsharded"  # params are views into the full unsharded buffer


class GradState(Enum):
    EMPTY = "empty"  # no gradient since zero_grad
    ACCUMULATING = "accumulating"  # unsharded buffer holds local gradients
    REDUCING = "reducing"  # a collective is in flight
    REDUCED = "reduced"  # the owned range holds the global mean gradient


HomeFactory = Callable[[str, torch.Tensor, bool], ShardHome]


class UnitSource(Protocol):
    """Initial values of a unit that are not in its parameters (a checkpoint's files): flat
    elements [start, end) of `layout` in `dtype`, on the CPU, padding zero."""

    def read(
        self, layout: FlatLayout, start: int, end: int, dtype: torch.dtype, scratch: bool = False
    ) -> torch.Tensor:
        """`scratch`: the result may live in a buffer the source reuses at its next such read."""
        ...


def default_home_factory(device: torch.device, ledger: Ledger, transfers: Transfers | None = None) -> HomeFactory:
    """Every shard on the device (stage 3 without parameter offload)."""
    return lambda name, initial, resident: MemoryHome(initial, Tier.DEVICE, device, ledger, transfers, alias=resident)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tell_full_size(params: list[nn.Parameter], layout: FlatLayout) -> None:
    """Give each parameter of a sharded unit its full size as `ds_numel` / `ds_shape`: between uses
    its data is an empty placeholder, and the ecosystem reads those two attributes (DeepSpeed's
    ZeRO-3 convention) for the real size: PEFT's `print_trainable_parameters` counted 0 trainable
    parameters of a stage-3 LoRA model, and its tuners size adapters by `ds_shape`."""
    for p, slot in zip(params, layout.slots, strict=True):
        p.ds_numel = slot.numel  # type: ignore[attr-defined]
        p.ds_shape = slot.shape  # type: ignore[attr-defined]


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
        keep_fp32_master: bool = True,
        resident: bool | None = None,
        home_factory: HomeFactory | None = None,
        grad_tier: Tier = Tier.DEVICE,
        grad_files: NvmeGradFiles | None = None,
        source: UnitSource | None = None,
        frozen: bool = False,
        transfers: Transfers | None = None,
        realize: Callable[[nn.Parameter, torch.Tensor], bool] | None = None,
        grad_buffer_dtype: torch.dtype | None = None,
        grad_pool: GradBufferPool | None = None,
    ) -> None:
        """`realize(p, dest)`: write a parameter parked by `zeroinf.init` straight into `dest`, its
        range of the flat buffer being built (True), or do nothing for one that holds its values
        (False): building then holds the flat buffer and no second copy of any parameter.
        `grad_buffer_dtype`: the unsharded gradient buffer's dtype, `reduce_dtype` when None (see
        [Note: gradient accumulation buffer]). `grad_pool`: where gradient buffers come from and go
        back to, shared by an engine's units (partition/grad_pool.py)."""
        self.name = name or "<root>"
        self.frozen = frozen  # parameters without gradients: gathered like the rest, never stepped
        self.param_names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.topo, self.policy, self.ledger = topo, policy, ledger
        self.reduce_dtype, self.bucket_bytes, self.counter = reduce_dtype, bucket_bytes, counter
        self.grad_buffer_dtype = grad_buffer_dtype or reduce_dtype
        self.grad_pool = grad_pool or GradBufferPool(topo.device)
        self.layout = FlatLayout.build([(n, p.shape) for n, p in params], topo.world_size)
        self.owned_start, self.owned_end = (
            self.layout.shard_range(topo.rank) if policy.shard_optimizer else (0, self.layout.padded_numel)
        )
        # Stage 3 keeps the root and tiny units unsharded ("resident"); stages 0-2 keep every unit.
        self.resident = (not policy.shard_params) if resident is None else resident or not policy.shard_params
        self.transfers = transfers or Transfers(topo.device, ledger)  # every host<->device copy
        self.home_factory = home_factory or default_home_factory(topo.device, ledger, self.transfers)
        self.grad_tier = grad_tier
        self.grad_files = grad_files  # gradient shards on NVMe (grad_tier NVME)
        self._grad_landed = False  # this step's shard holds a reduced micro-step (later ones add)
        self._landing: Landing | None = None  # the last reduced shard on its way to the host or disk
        self._read_buffer: torch.Tensor | None = None  # NVMe shards: pool buffer lent by owned_grad()
        self.grad_sq_norm: float | None = None  # NVMe shards: squared L2 norm, kept at write time
        self._master_source: Callable[[], torch.Tensor] | None = None
        self._fp32_master_from_shard = False  # fp32 built in place: the master is read from the shard
        self.user_gathers = 0  # open `zeroinf.gathered` contexts holding this unit
        self.user_writer = False  # one of them gathered it for writing
        self.master_in_params = False  # stages 0-2 in fp32: the master is the owned range itself (`share_master`)
        self.versions: list[int] = []  # the parameters' version counters the engine knows (remember_versions)
        # The all-gather refreshing the unsharded copy after a step (`start_update_params`): waited
        # before the copy is read or freed ([Note: a step's refresh of a gathered unit]).
        self._refresh_handle: Handle | None = None
        if source is None:
            self._build_buffers(param_dtype, keep_fp32_master, realize)
        else:
            self._build_from_source(param_dtype, source)
        self.grad_flat: torch.Tensor | None = None  # unsharded, reduce dtype
        self.grad_shard: torch.Tensor | None = None  # stages 2-3: owned shard, reduce dtype
        self._rs_out: torch.Tensor | None = None  # where the reduce-scatter in flight writes
        self.grad_state = GradState.EMPTY
        self.hand_off = False  # keep the next reduced shard for the optimizer (module docstring)
        self._handed: torch.Tensor | None = None
        self._arrived = [False] * len(self.params)
        # This backward: some rank does not reach the unit at all, so it reduces at the end of
        # backward on every rank (runtime/reach.py [Note: gradients that reach some ranks only]).
        self.reduce_at_end = False
        # Per parameter: did any rank produce a gradient since zero_grad? (set by the engine after
        # its agreement all-reduce). Like torch.optim, the optimizer skips parameters without one.
        self.param_had_grad = [False] * len(self.params)
        self._grad_handles: list[Handle] = []
        self._gather_handle: Handle | None = None

    def _build_buffers(
        self, param_dtype: torch.dtype, keep_fp32_master: bool,
        realize: Callable[[nn.Parameter, torch.Tensor], bool] | None,
    ) -> None:
        """Lay the current parameter values into the flat buffer (same on every rank), keep the shard."""
        device = self.topo.device
        # Laid out in fp32 when the fp32 masters are taken from it, else straight in the compute dtype
        # (copy_ rounds exactly as .to() does): one unit-sized buffer fewer while building. In fp32 the
        # masters are the parameters' own values: taken from a shard in memory when an optimizer asks,
        # not held twice meanwhile (a shard on NVMe keeps a copy, see `_finish_build`).
        self._fp32_master_from_shard = keep_fp32_master and param_dtype == torch.float32
        keep_fp32_master = keep_fp32_master and param_dtype != torch.float32
        full_dtype = torch.float32 if keep_fp32_master else param_dtype
        full = torch.zeros(self.layout.padded_numel, dtype=full_dtype, device=device)
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            dest = full[slot.offset : slot.end]
            # A parked parameter is read straight into its range (in the same order on every rank).
            if realize is None or not realize(p, dest):
                dest.copy_(p.detach().reshape(-1))
                # Drop our hold on the old values now, not after the whole unit is laid out: building
                # a unit then needs its flat buffer plus one parameter, not twice the unit.
                p.data = p.data.new_empty((0,) * max(1, p.dim()))
        if self.topo.is_distributed:  # every rank starts from rank 0's weights (as DDP does)
            torch.distributed.broadcast(full, src=0, group=self.topo.group)
        # fp32 masters start from the unrounded weights, not from their compute-dtype copy, unless
        # building under zeroinf.init, where holding fp32 copies would defeat bounded construction.
        self.initial_master: torch.Tensor | None = (
            full[self.owned_start : self.owned_end].clone() if keep_fp32_master else None
        )
        self._master_taken = False
        self.param_flat = full.to(param_dtype)
        self._finish_build(param_dtype)

    def _build_from_source(self, param_dtype: torch.dtype, source: UnitSource) -> None:
        """Read only this rank's shard from `source`; all-gather it where the unit is kept whole.

        The fp32 masters are not held meanwhile: the optimizer reads them from the source when it
        takes them (`take_initial_master`), exact in fp32 whatever the compute dtype.
        """
        device = self.topo.device
        start, end = self.layout.shard_range(self.topo.rank)
        shard = source.read(self.layout, start, end, param_dtype, scratch=True)
        sharded = self.policy.shard_params and not self.resident
        self.param_flat = torch.empty(self.layout.padded_numel, dtype=param_dtype, device=device)
        if sharded:  # the shard goes from the files to its home; the unit never exists whole here
            self.param_flat.untyped_storage().resize_(0)
        else:
            all_gather_into(self.param_flat, shard.to(device), self.topo, async_op=False)
        self.initial_master = None
        self._master_taken = False
        owned = (self.owned_start, self.owned_end)
        self._master_source = lambda: source.read(self.layout, *owned, torch.float32).to(device)
        for p in self.params:
            if p.is_meta:  # a placeholder of a parameter read from files: give it a real (empty) tensor
                swap_data(p, torch.empty((0,) * max(1, p.dim()), dtype=param_dtype, device=device))
        self._finish_build(param_dtype, sharded_initial=shard if sharded else None)

    def _finish_build(self, param_dtype: torch.dtype, sharded_initial: torch.Tensor | None = None) -> None:
        """Give the shard its home and point the parameters at their storage. `sharded_initial`: a
        stage-3 unit built straight from its shard (param_flat has no storage): it starts sharded."""
        device = self.topo.device
        self.home: ShardHome | None = None  # stage 3: where the compute-dtype shard lives between uses
        # Empty, but with each parameter's number of dimensions: code that tells matrices from vectors
        # by `p.dim()` (weight-decay groups) still works at stage 3, and any read of the data fails loudly.
        self._placeholders = [
            torch.empty((0,) * max(1, len(slot.shape)), dtype=param_dtype, device=device) for slot in self.layout.slots
        ]
        self.placeholder_shapes = [t.shape for t in self._placeholders]
        if self.policy.shard_params and not self.resident:
            _tell_full_size(self.params, self.layout)
        if sharded_initial is not None:
            self.home = self.home_factory(self.name, sharded_initial, False)
            for p, placeholder in zip(self.params, self._placeholders, strict=True):
                p.data = placeholder
            self.state = ParamState.SHARDED
            self.remember_versions()
            return
        self.ledger.reserve(Tier.DEVICE, _nbytes(self.param_flat), "param_unsharded")
        if self.policy.shard_params:
            start, end = self.layout.shard_range(self.topo.rank)
            self.home = self.home_factory(self.name, self.param_flat[start:end], self.resident)
            if self._fp32_master_from_shard and not isinstance(self.home, MemoryHome):
                # Taking it from the file later would read the whole model once more.
                self.initial_master = self.param_flat[self.owned_start : self.owned_end].clone()
        self.state = ParamState.UNSHARDED
        self._point_params_at_flat()
        if self.policy.shard_params and not self.resident:  # a resident unit stays whole from the start
            self.reshard()
        self.remember_versions()

    # -- in-place writes from outside the engine -------------------------------------------------------
    def remember_versions(self) -> None:
        """Take the parameters' version counters as they are now as known to the engine
        (partition/intact.py [Note: in-place writes to a sharded model's parameters])."""
        self.versions = [p._version for p in self.params]

    @property
    def owned_numel(self) -> int:
        return self.owned_end - self.owned_start

    @property
    def unsharded_bytes(self) -> int:
        return self.layout.padded_numel * self.param_flat.element_size()

    def take_initial_master(self) -> torch.Tensor:
        """The fp32 owned range at build time (the optimizer's master weights); handed over once."""
        if self._master_taken:
            raise RuntimeError(f"unit {self.name}: the initial master weights were already taken by an optimizer")
        self._master_taken = True
        master, self.initial_master = self.initial_master, None
        if master is None and self._master_source is not None:  # read from the checkpoint, in fp32
            master, self._master_source = self._master_source(), None
        if master is None:  # built under zeroinf.init: start from the compute-dtype values
            if self.home is not None:
                master = self.home.finish_load().float().clone()
                self.home.end_load()
            else:
                master = self.param_flat[self.owned_start : self.owned_end].float().clone()
        return master

    @property
    def home_holds_master(self) -> bool:
        """The optimizer's fp32 master is this unit's shard in memory (`share_master`)."""
        return isinstance(self.home, MemoryHome) and self.home.holds_master

    def share_master(self) -> torch.Tensor:
        """Take the fp32 master, as `take_initial_master`, and make it the shard itself: one tensor
        for both, on the shard's memory (optim/states.py [Note: masters in the memory shard]). An
        fp32 shard is the master already; a compute-dtype shard is replaced by the master, which
        gathers cast from then on."""
        home = self.home
        if home is None and not self.policy.shard_params and self.param_flat.dtype == torch.float32:
            # stages 0-2 in fp32: the owned range of the whole buffer is the master, as torch.optim's
            # AdamW steps fp32 parameters themselves (one tensor, not two)
            if self._master_taken:
                raise RuntimeError(f"unit {self.name}: the initial master weights were already taken by an optimizer")
            self._master_taken = True
            self.initial_master = self._master_source = None
            self.master_in_params = True
            return self.param_flat[self.owned_start : self.owned_end]
        if not isinstance(home, MemoryHome):
            raise RuntimeError(f"unit {self.name}: a {type(home).__name__} cannot hold the master, only a MemoryHome")
        if home.shard.dtype == torch.float32:  # the same numbers: no copy, no conversion
            if self._master_taken:
                raise RuntimeError(f"unit {self.name}: the initial master weights were already taken by an optimizer")
            self._master_taken = True
            self.initial_master = self._master_source = None
            home.adopt_master(home.shard)
            return home.shard
        master = self.take_initial_master()
        home.adopt_master(master)
        return master

    # -- unshard / reshard ----------------------------------------------------------------------------
    def _point_params_at_flat(self) -> None:
        for slot, p in zip(self.layout.slots, self.params, strict=True):
            p.data = self.param_flat[slot.offset : slot.end].view(slot.shape)

    @property
    def loads_from_storage(self) -> bool:
        """True when bringing the shard in is I/O worth starting an event before the all-gather."""
        return self.home is not None and self.home.tier is Tier.NVME

    @phase("zeroinf::swap_in")
    def start_fetch(self) -> None:
        """Start bringing this rank's shard in from its tier (an NVMe read); no collective yet."""
        if self.state is ParamState.SHARDED:
            assert self.home is not None
            self.home.start_load()
            self.state = ParamState.FETCHING

    @phase("zeroinf::unshard")
    def start_unshard(self) -> None:
        """Allocate the unsharded buffer and start the all-gather of the shards (idempotent)."""
        if self.state not in (ParamState.SHARDED, ParamState.FETCHING):
            return
        assert self.home is not None
        shard = self.home.finish_load()
        self.transfers.order_uploads()  # a device shard an optimizer on the host just updated
        storage = self.param_flat.untyped_storage()
        storage.resize_(self.unsharded_bytes)
        self.ledger.reserve(Tier.DEVICE, self.unsharded_bytes, "param_unsharded")
        with torch.autograd._unsafe_preserve_version_counter(self.param_flat):
            self._gather_handle = all_gather_into(self.param_flat, shard, self.topo)
        self.counter.add("all_gather")
        self.state = ParamState.UNSHARDING

    @phase("zeroinf::unshard")
    def wait_unshard(self) -> None:
        """Finish a started unshard (or do it now) and point the parameters at the full buffer."""
        if self.state is ParamState.UNSHARDED:
            self.wait_refresh()
            return
        self.start_unshard()
        assert self._gather_handle is not None
        with torch.autograd._unsafe_preserve_version_counter(self.param_flat):
            self._gather_handle.wait()
        self._gather_handle = None
        assert self.home is not None
        self.home.end_load()
        self._point_params_at_flat()
        self.state = ParamState.UNSHARDED

    @phase("zeroinf::reshard")
    def reshard(self) -> None:
        """Free the unsharded buffer (all aliases at once) and point params at empty placeholders.
        Not while a `zeroinf.gathered` block holds the unit: a forward inside one (the engine's hooks
        release units after use) lost the block's writes, and then its commit failed."""
        if self.state is ParamState.SHARDED or self.user_gathers > 0:
            return
        if self.state is ParamState.FETCHING:  # read but never gathered: drop the staged shard
            assert self.home is not None
            self.home.finish_load()
            self.home.end_load()
            self.state = ParamState.SHARDED
            return
        if self.state is ParamState.UNSHARDING:
            self.wait_unshard()
        self.wait_refresh()  # a collective still writing into the buffer about to be freed
        for p, placeholder in zip(self.params, self._placeholders, strict=True):
            p.data = placeholder
        self.param_flat.untyped_storage().resize_(0)
        self.ledger.release(Tier.DEVICE, self.unsharded_bytes, "param_unsharded")
        self.state = ParamState.SHARDED

    # -- gradients ------------------------------------------------------------------------------------
    def _ensure_grad_flat(self) -> torch.Tensor:
        if self.grad_flat is None:
            # Uninitialized: each slot's first gradient is copied in, not added to zeros (zero-filling
            # the buffer cost ~5% of a bf16 backward here); padding and unwritten slots are zeroed later.
            self.grad_flat = self.grad_pool.take(self.layout.padded_numel, self.grad_buffer_dtype)
            self.grad_flat[self.layout.numel :].zero_()
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
        # After a reduction (sync_every_micro_step), stages 0-1 keep adding onto the reduced buffer: its
        # content is identical on every rank, so the next mean adds exactly the new local gradients.
        slot = self.layout.slots[index]
        if self.grad_flat is not None and self.grad_flat.dtype != self.reduce_dtype and self._slot_written[index]:
            self._widen_grad_flat()  # a second gradient: add it in reduce_dtype, never in the compute dtype
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
            self._grad_handles = [reduce_scatter_into(self._rs_out, self.grad_flat, self.topo, average=True)]
            self.counter.add("reduce_scatter")
        else:
            chunk = max(1, self.bucket_bytes // self.grad_flat.element_size())
            self._grad_handles = [
                all_reduce(piece, self.topo, average=True) for piece in torch.split(self.grad_flat, chunk)
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

    # -- parameters -----------------------------------------------------------------------------------
    def commit_user_writes(
        self, owned_before: torch.Tensor, states: object | None, unit_index: int,
        exact: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Make values written into the unsharded parameters (zeroinf.gathered) the unit's own:
        this rank's shard on its tier, and the fp32 master of every element that changed (those
        that did not keep their unrounded fp32 value). `exact` (mask, fp32 values) over this rank's
        owned range: elements whose masters take these values, unrounded, whether or not the
        compute-dtype value changed (`model.load_state_dict` of fp32 weights into a bf16 model)."""
        owned = self.param_flat[self.owned_start : self.owned_end]
        changed = owned != owned_before
        source = owned  # the masters' new values, where `changed`
        if exact is not None:  # a unit-sized fp32 copy, made only for a load that brings finer values
            mask, values = exact  # on the parameters' device
            changed |= mask
            source = torch.where(mask, values, owned.float())
        if self.home_holds_master:  # the shard is the master: only the changed elements, rounded ones kept
            if bool(changed.any()):
                self.transfers.wait_uploads()
                master = self.home.shard  # type: ignore[union-attr]
                master[changed] = source[changed].to(master.dtype)
            return
        if self.home is not None:
            self.home.store(owned)
        if self.frozen or not bool(changed.any()):
            return  # a frozen unit has no masters: its shard is all there is
        if not self._master_taken and self._master_source is not None:  # hold the file's masters now
            self.initial_master, self._master_source = self._master_source(), None
        if self.initial_master is not None:  # no optimizer has taken the masters yet
            self.initial_master[changed] = source[changed].float()
        elif self._master_taken and states is not None:
            self.transfers.wait_uploads()  # an upload of the last step may still read the master
            views = states.read_unit(unit_index)  # type: ignore[attr-defined]
            mask = changed.to(views.master.device)
            views.master[mask] = source[changed].float().to(views.master.device)
            states.write_unit(unit_index, views)  # type: ignore[attr-defined]

    def load_values(self, source: UnitSource, states: object | None, unit_index: int) -> None:
        """Replace the unit's values by `source`'s (zeroinf.load_weights): this rank's shard on its
        tier, the whole unit where it is kept whole, and the fp32 masters."""
        start, end = self.layout.shard_range(self.topo.rank)
        if self.home_holds_master:  # the shard is the master: its fp32 values, gathered cast
            self.transfers.wait_uploads()
            self.home.shard.copy_(source.read(self.layout, start, end, torch.float32))  # type: ignore[union-attr]
            if self.state is ParamState.UNSHARDED:
                all_gather_into(self.param_flat, self.home.finish_load(), self.topo, async_op=False)  # type: ignore[union-attr]
            return
        shard = source.read(self.layout, start, end, self.param_flat.dtype).to(self.topo.device)
        if self.home is not None:
            self.home.store(shard)
        if self.state is ParamState.UNSHARDED:
            all_gather_into(self.param_flat, shard, self.topo, async_op=False)
        if self.frozen:
            return
        owned = (self.owned_start, self.owned_end)
        if self._master_taken and states is not None:
            self.transfers.wait_uploads()  # an upload of the last step may still read the master
            views = states.read_unit(unit_index)  # type: ignore[attr-defined]
            views.master.copy_(source.read(self.layout, *owned, torch.float32))
            states.write_unit(unit_index, views)  # type: ignore[attr-defined]
        else:
            self.initial_master, self._master_source = None, None
            self._master_source = lambda: source.read(self.layout, *owned, torch.float32).to(self.topo.device)

    def start_update_params(self, master_owned: torch.Tensor, stable: bool = False) -> Handle:
        """Write the new master weights (owned range) into the compute params; all-gather where needed.
        `stable`: `master_owned` is the optimizer's own host master (see `ShardHome.store`)."""
        self.wait_refresh()  # an earlier refresh still reads the shard this store replaces
        release: Callable[[], None] | None = None
        if self.home is not None:
            self.home.store(master_owned, stable)
            if self.state is not ParamState.UNSHARDED:
                return DoneHandle()  # the next unshard gathers the new values
            # kept whole (resident, or held by `zeroinf.gathered`): refresh the copy from the values
            # just stored, then let the loaded shard go ([Note: a step's refresh of a gathered unit])
            source, release = self.home.finish_load(), self.home.end_load
        else:  # from a CPU optimizer: asynchronously, ordered before the all-gather and the next forward
            source = self.param_flat[self.owned_start : self.owned_end]
            if master_owned.data_ptr() != source.data_ptr():  # else (`master_in_params`) the step wrote them
                self.transfers.upload(master_owned, source)
            if not self.policy.shard_optimizer:
                return DoneHandle()
        self.transfers.order_uploads()  # the all-gather reads the shard just uploaded
        self.counter.add("all_gather")
        gather = all_gather_into(self.param_flat, source, self.topo)
        self._refresh_handle = gather if release is None else ThenHandle(gather, release)
        return self._refresh_handle

    def wait_refresh(self) -> None:
        """Finish the all-gather refreshing this unit's whole copy after a step, if one is in flight.

        [Note: a step's refresh of a gathered unit]
        A unit kept whole through a step (resident, or held by `zeroinf.gathered`) has its copy
        refreshed asynchronously; with the step inside backward, a block may end before `step()`
        waits for that all-gather, and its reshard freed the buffer gloo still wrote into (heap
        corruption). So whatever reads or frees the copy first waits here. Once done, the refresh
        lets go of the shard it loaded: kept, a second store in one step (a speculative step undone
        and redone) refreshed from the first one's values. docs/design.md, "Reading and writing
        sharded parameters", has the measurements."""
        if self._refresh_handle is not None:
            handle, self._refresh_handle = self._refresh_handle, None
            handle.wait()
