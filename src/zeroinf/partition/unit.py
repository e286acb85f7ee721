"""ShardedUnit: one unit's flat buffers, its parameters as views, unshard/reshard (gradients: unit_grads.py).

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

Gradients (accumulation, reduction, landing on their tier) are partition/unit_grads.py's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import nn

from zeroinf.comm import DoneHandle, Handle, ThenHandle, all_gather_into, broadcast_to_every_group
from zeroinf.memory import Ledger, Tier
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.partition.grad_pool import GradBufferPool
from zeroinf.partition.park import KeptMaster, Realize, swap_data
from zeroinf.partition.shard_home import MemoryHome, NvmeGradFiles, ShardHome
from zeroinf.partition.unit_grads import GradState, UnitGradients, _nbytes
from zeroinf.runtime.streams import Landing, Transfers
from zeroinf.telemetry import CollectiveCounter, phase
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


def _tell_full_size(params: list[nn.Parameter], layout: FlatLayout) -> None:
    """Give each parameter of a sharded unit its full size as `ds_numel` / `ds_shape`: between uses
    its data is an empty placeholder, and the ecosystem reads those two attributes (DeepSpeed's
    ZeRO-3 convention) for the real size: PEFT's `print_trainable_parameters` counted 0 trainable
    parameters of a stage-3 LoRA model, and its tuners size adapters by `ds_shape`."""
    for p, slot in zip(params, layout.slots, strict=True):
        p.ds_numel = slot.numel  # type: ignore[attr-defined]
        p.ds_shape = slot.shape  # type: ignore[attr-defined]


def _drop_kept(kept: list[tuple[int, KeptMaster]]) -> None:
    for _, values in kept:
        values.drop()
    kept.clear()


def full_numel(p: torch.Tensor) -> int:
    """A parameter's size in the model: `ds_numel` where `_tell_full_size` set it (between uses a
    stage-3 parameter is an empty placeholder), else its own."""
    return int(getattr(p, "ds_numel", p.numel()))


class ShardedUnit(UnitGradients):
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
        realize: Realize | None = None,
        grad_buffer_dtype: torch.dtype | None = None,
        grad_pool: GradBufferPool | None = None,
    ) -> None:
        """`realize(p, dest, keep)`: write a parameter parked by `zeroinf.init` straight into `dest`,
        its range of the flat buffer being built (True), or do nothing for one that holds its values
        (False): building then holds the flat buffer and no second copy of any parameter. It may
        return the fp32 values of the elements `keep` of the parameter that this rank's master holds
        (park.py [Note: exact masters under zeroinf.init]): the master starts from them.
        `grad_buffer_dtype`: the unsharded gradient buffer's dtype, `reduce_dtype` when None (see
        unit_grads.py [Note: gradient accumulation buffer]). `grad_pool`: where gradient buffers come
        from and go back to, shared by an engine's units (partition/grad_pool.py)."""
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
        # fp32 values zeroinf.init kept for the master, at their offsets in the owned range
        self._kept_masters: list[tuple[int, KeptMaster]] = []
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
        realize: Realize | None,
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
        # what this rank's master holds of each parameter, for values a park keeps unrounded
        owned_pieces = {} if self.frozen else {
            piece.slot_index: piece for piece in self.layout.pieces(self.owned_start, self.owned_end)
        }
        for i, (slot, p) in enumerate(zip(self.layout.slots, self.params, strict=True)):
            dest = full[slot.offset : slot.end]
            piece = owned_pieces.get(i)
            keep = None if piece is None else (piece.param_offset, piece.param_offset + piece.numel)
            # A parked parameter is read straight into its range (in the same order on every rank).
            realized, kept = realize(p, dest, keep) if realize is not None else (False, None)
            if kept is not None:
                assert piece is not None
                self._kept_masters.append((piece.start - self.owned_start, kept))
            if not realized:
                dest.copy_(p.detach().reshape(-1))
                # Drop our hold on the old values now, not after the whole unit is laid out: building
                # a unit then needs its flat buffer plus one parameter, not twice the unit.
                p.data = p.data.new_empty((0,) * max(1, p.dim()))
        broadcast_to_every_group(full, self.topo)  # every rank starts from rank 0's weights (as DDP does)
        # fp32 masters start from the unrounded weights, not from their compute-dtype copy, unless
        # building under zeroinf.init, where holding fp32 copies would defeat bounded construction.
        self.initial_master: torch.Tensor | None = (
            full[self.owned_start : self.owned_end].clone() if keep_fp32_master else None
        )
        self._master_taken = False
        self.param_flat = full.to(param_dtype)
        self._finish_build(param_dtype)
        if self._kept_masters:
            self._master_source = self._exact_master
            # a unit dropped before any optimizer took its master: its kept values go too
            weakref.finalize(self, _drop_kept, self._kept_masters)

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
            all_gather_into(self.param_flat, shard.to(device), self.topo, async_op=False, what=self.what)
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
            master = self._master_from_shard()
        return master

    def _master_from_shard(self) -> torch.Tensor:
        """The owned range's compute-dtype values, as a new fp32 tensor."""
        if self.home is not None:  # one new fp32 tensor (`.float().clone()` made two of a bf16 shard)
            master = self.home.finish_load().to(torch.float32, copy=True)
            self.home.end_load()
            return master
        return self.param_flat[self.owned_start : self.owned_end].to(torch.float32, copy=True)

    def _exact_master(self) -> torch.Tensor:
        """The master from the shard, with the fp32 values zeroinf.init kept for it written over
        the rounded ones (elements not kept, a parameter built in bf16, stay as they are)."""
        master = self._master_from_shard()
        for at, kept in self._kept_masters:
            kept.read_into(master[at : at + kept.numel])
        self._kept_masters.clear()
        return master

    def release_master(self) -> None:
        """The optimizer holding this unit's master was closed, its states freed: the next optimizer
        takes the master anew, from the unit's values (optim/sharded.py `close`)."""
        self._master_taken = False
        self.initial_master = self._master_source = None
        self.master_in_params = False

    def drop_kept_masters(self) -> None:
        """Let zeroinf.init's kept values go: the master comes from elsewhere (a checkpoint), or the
        engine is closed."""
        _drop_kept(self._kept_masters)

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

    def off_buffer(self) -> list[int]:
        """Indices of the parameters that are not views of the unit's buffer (gathered, each must
        be): code gave them a tensor of their own (`p.data = t`)."""
        flat = self.param_flat.untyped_storage().data_ptr()
        return [i for i, p in enumerate(self.params) if p.untyped_storage().data_ptr() != flat]

    def retake_replaced(self, keep_values: bool) -> list[str]:
        """Names of the gathered parameters that code gave storage of their own (`p.data = t`, as
        peft's IA3 and DoRA merges write), each made a view of the unit's buffer again; with
        `keep_values`, the buffer first takes its values (a `gathered(..., modify=True)` block's
        writes: partition/gathered.py). A new shape is refused: the unit's layout is fixed."""
        replaced = []
        for i in self.off_buffer():
            name, slot, p = self.param_names[i], self.layout.slots[i], self.params[i]
            if tuple(p.shape) != tuple(slot.shape):
                raise RuntimeError(
                    f"parameter {name} was given a tensor of shape {tuple(p.shape)} inside zeroinf.gathered, but the "
                    f"engine holds it as {tuple(slot.shape)}: a sharded parameter keeps its shape (write its values, "
                    "or build the model at the new size)"
                )
            view = self.param_flat[slot.offset : slot.end].view(slot.shape)
            if keep_values:
                view.copy_(p.data)
            p.data = view
            replaced.append(name)
        return replaced

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
            self._gather_handle = all_gather_into(self.param_flat, shard, self.topo, what=self.what)
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
                all_gather_into(
                    self.param_flat, self.home.finish_load(), self.topo, async_op=False, what=self.what  # type: ignore[union-attr]
                )
            return
        shard = source.read(self.layout, start, end, self.param_flat.dtype).to(self.topo.device)
        if self.home is not None:
            self.home.store(shard)
        if self.state is ParamState.UNSHARDED:
            all_gather_into(self.param_flat, shard, self.topo, async_op=False, what=self.what)
        if self.frozen:
            return
        owned = (self.owned_start, self.owned_end)
        if self._master_taken and states is not None:
            self.transfers.wait_uploads()  # an upload of the last step may still read the master
            views = states.read_unit(unit_index)  # type: ignore[attr-defined]
            views.master.copy_(source.read(self.layout, *owned, torch.float32))
            states.write_unit(unit_index, views)  # type: ignore[attr-defined]
        else:
            self.drop_kept_masters()
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
        gather = all_gather_into(self.param_flat, source, self.topo, what=self.what)
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
