"""Optimizer states on NVMe: `NvmeStateStore`, three per-rank swap files (master, exp_avg,
exp_avg_sq; tiers/nvme.py) staged through a fixed pool of host buffers.

A sub-group is a piece of one unit of at most `offload.sub_group_numel` elements; swapping it in
reserves one staging buffer of a fixed `BufferPool` (`offload.buffer_count` buffers, each holding a
sub-group's master, exp_avg and exp_avg_sq at aligned offsets, so every transfer is direct O_DIRECT
I/O with no copy), and swapping it out releases that buffer once the writes finish. Host memory is
therefore bounded by the pool whatever the model size. The protocol it implements, and the other
stores, are in optim/states.py.

[Note: master weights of a unit split into several sub-groups]
`ShardedUnit.start_update_params` takes the whole owned master of a unit. When a unit is split,
the updated pieces are copied into one unit-sized fp32 assembly buffer (host, reused by every
unit, tag "optimizer_assembly") and the unit's parameters are written once its last piece is
updated. That adds 4 bytes per element of the largest split unit to the host bound; a slice API
on the unit would remove it.

[Note: masters in the parameter file]
With fp32 parameters on NVMe, a unit's parameter shard and its fp32 master are the same numbers:
every update writes the new master into the parameter file (`start_update_params`). Keeping a
second copy in an optimizer master file costs 4 bytes per parameter of disk and, every step, 4
bytes written and 4 read. So where the plan says so (`ModelPlan.masters_in_param_file`: fp32, the
states on NVMe, the unit's shard on NVMe, no speculative step), the store has no master slot for
the unit; `_swap_all` reads the master range from the unit's `NvmeHome` (a copy from memory when a
cache slot or the buffer kept after the unit's backward gather holds the shard, else a read of the
parameter file) and writes it there. The step's update writes it once, with the parameters. A fully
offloaded fp32 step then moves 28 bytes per parameter instead of 36: the shard read for forward and
for backward (8), the moments in and out (16), the new shard (4); 32 when stepped after backward
(the masters are read again); with a cache holding every shard, 20. A speculative
step (clipping, fp16) keeps the masters before the step in a second slot, which the parameter file
does not have: those runs keep the master file.

[Note: state slots an optimizer does not use, on NVMe]
A sub-group's staging buffer has room for the master and two slots, Adam's moments; a torch
optimizer through zeroinf.ShardedOptimizer may keep fewer (SGD with momentum one, plain SGD none:
`moments`). The slots it does not keep are neither read nor written: on swap-in their views are
zeroed in the buffer (a memset, against 4 bytes per element each way on disk), so state dicts and
checkpoints read zeros there as the stores in memory give them. Each state kind has its own swap
file, and only the kinds kept get one (SGD with momentum: 8 bytes per parameter on disk, not 12).
A later optimizer keeping more (optim/succession.py) first sets `moments`, which makes the missing
files (preallocated, so a full disk fails there, not midway through a step), then writes every slot
it keeps, so no stale bytes of an earlier one are read. One keeping fewer leaves the files as they
are.

[Note: fresh swap files read as zeros]
The swap files are preallocated with posix_fallocate, after which reads of the allocated range
return zeros, so only the master weights are written at start; the moments start at zero for free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from zeroinf.aio import AioConfig, AioHandle, BufferPool, PoolBuffer
from zeroinf.aio.errors import AioError
from zeroinf.config import DTYPES, OffloadConfig
from zeroinf.memory import Ledger, Tier
from zeroinf.optim.pipeline import Pending, Staged, StateViews, SubGroup
from zeroinf.optim.states import STATE_KINDS, SWAP_KINDS, MasterSource, StepTraffic, wait_all
from zeroinf.planner.unit_plan import FP32_BYTES, plan_optimizer_staging, shadow_key
from zeroinf.telemetry import phase
from zeroinf.tiers.host import check_host_cap, host_zeros, release_host
from zeroinf.tiers.nvme import NvmeSwap
from zeroinf.tiers.nvme_tier import NvmeTier


class MasterHome(Protocol):
    """Where a unit's fp32 masters live when its parameter file holds them (partition/shard_home.py
    `NvmeHome`): element ranges of the owned shard, read (None: copied from memory, done) and written."""

    def read_range(self, start: int, end: int, out: torch.Tensor) -> AioHandle | None: ...

    def write_range(self, start: int, end: int, values: torch.Tensor) -> None: ...

    def land_writes(self) -> None: ...  # the file holds the current values once this returns

    def read_file_range(self, start: int, end: int, out: torch.Tensor) -> None: ...  # any thread, no write in flight


class NvmeStateStore:
    """States in per-rank swap files, staged through a fixed pool of host buffers (module docstring)."""

    tier = Tier.NVME

    def __init__(
        self,
        masters: Sequence[torch.Tensor] | MasterSource,
        cfg: OffloadConfig,
        ledger: Ledger,
        rank: int,
        aio: AioConfig | None = None,
        shadow: bool = False,
        tier: NvmeTier | None = None,
        master_homes: Sequence[MasterHome | None] = (),
        moments: int = 2,
    ) -> None:
        assert cfg.nvme_dir is not None  # OffloadConfig requires it for nvme
        source = masters if isinstance(masters, MasterSource) else MasterSource.of(list(masters))
        # Per unit: the parameter file that holds its masters ([Note: masters in the parameter file]).
        self._master_homes = list(master_homes) + [None] * (len(source.numels) - len(master_homes))
        if shadow and any(h is not None for h in self._master_homes):
            raise ValueError("a speculative step keeps the masters before it: they cannot live in the parameter file")
        masters_elsewhere = [h is not None for h in self._master_homes]
        self.ledger, self.traffic = ledger, StepTraffic()
        aio = aio or cfg.aio
        plan = plan_optimizer_staging(source.numels, cfg, aio)  # the sizes zeroinf.plan predicts
        self.sub_groups = list(plan.sub_groups)
        self.staging_slots = plan.pool.count
        self.moment_dtype = DTYPES[cfg.moment_dtype]
        self._offsets = plan.state_offsets
        self._kind_bytes = dict(zip(SWAP_KINDS, plan.itemsizes, strict=True))  # per element
        self.moments = moments  # [Note: state slots an optimizer does not use, on NVMe]
        assembly_numel = plan.assembly_numel
        check_host_cap(
            plan.host_bytes + aio.workers * aio.block_bytes,
            cfg.max_host_bytes,
            f"the optimizer's nvme staging ({plan.pool.count} buffers of {plan.pool.buffer_bytes} bytes, "
            f"a {assembly_numel * FP32_BYTES}-byte assembly buffer, {aio.workers} I/O buffers)",
            "raise the cap, or lower offload.sub_group_numel or offload.buffer_count",
        )
        # With `shadow`, each sub-group has two slots; `_slot[k]` is the one holding its current states
        # and a speculative update writes the other (see `speculate`).
        self._slot = [0] * len(self.sub_groups)
        self._shadow = shadow
        self._written_aside: set[int] | None = None
        self.failure: BaseException | None = None
        self._unit_groups: dict[int, list[SubGroup]] = {}
        for sg in self.sub_groups:
            self._unit_groups.setdefault(sg.unit_index, []).append(sg)
        self._swap: NvmeSwap | None = None
        self._pool: BufferPool | None = None
        self._assembly: torch.Tensor | None = None
        # Its own tier (with its own engine) when built alone, as tests and benchmarks do.
        tier = tier or NvmeTier(dataclasses.replace(cfg, aio=aio), rank, ledger)
        self.engine = tier.engine("optimizer")
        self._finalizer = weakref.finalize(self, _close_nvme, self.__dict__)
        try:
            self._swap = tier.open_swap(
                "optimizer", plan.swap_bytes(shadow, masters_elsewhere, moments), aio.alignment_bytes,
                preflight="the optimizer swap files",
            )
            self._paths = [self._swap.layout.path(kind) for kind in SWAP_KINDS if kind in self._swap.layout.file_bytes]
            self._on_disk = SWAP_KINDS[: 1 + moments]  # kinds with slots in the files
            self._alignment = aio.alignment_bytes
            self._pool = BufferPool(
                plan.pool.count,
                plan.pool.buffer_bytes,
                alignment_bytes=aio.alignment_bytes,
                ledger=ledger,
                tag="optimizer_staging",
            )
            if assembly_numel:
                self._assembly = host_zeros(assembly_numel, torch.float32, ledger, "optimizer_assembly")
            # Only the masters are written; see [Note: fresh swap files read as zeros].
            # One unit's master in memory at a time: written, then dropped (bounded host memory).
            for ui in range(len(source.numels)):
                self._write_pieces(ui, (source.take(ui),), SWAP_KINDS[:1])
        except BaseException:
            self.close()
            raise

    # -- the step ---------------------------------------------------------------------------------------
    def _views(self, flat: torch.Tensor, numel: int) -> StateViews:
        """The three states of a `numel` sub-group inside a staging buffer, each at an aligned offset."""
        dtypes = (torch.float32, self.moment_dtype, self.moment_dtype)
        return StateViews(
            *(
                flat[at : at + numel * size].view(dtype)
                for at, size, dtype in zip(self._offsets, self._kind_bytes.values(), dtypes, strict=True)
            )
        )

    def _swap_all(
        self,
        op: str,
        sg: SubGroup,
        views: Sequence[torch.Tensor],
        kinds: Sequence[str] = SWAP_KINDS,
        slot: int | None = None,
        masters_from_file: bool = False,
    ) -> list[AioHandle]:
        """Start one transfer ("swap_in" or "swap_out") per state kind of sub-group `sg`, at its
        current slot unless told otherwise. A master held by the parameter file is read from there
        (or copied from memory), or written there before this returns. `masters_from_file`: such a
        master is read from the file alone (`read_file_range`, safe beside training's gathers)."""
        assert self._swap is not None
        transfer = self._swap.swap_in if op == "swap_in" else self._swap.swap_out
        slot = self._slot[sg.index] if slot is None else slot
        key = shadow_key(sg.key) if slot else sg.key
        home = self._master_homes[sg.unit_index]
        handles = []
        live = SWAP_KINDS[: 1 + self.moments]
        for kind, t in zip(kinds, views, strict=False):
            if kind not in live:  # [Note: state slots an optimizer does not use, on NVMe]
                if op == "swap_in":
                    t.zero_()
            elif home is None or kind != SWAP_KINDS[0]:
                handles.append(transfer(key, kind, t))
            elif op == "swap_out":
                home.write_range(sg.start, sg.end, t)
            elif masters_from_file:
                home.read_file_range(sg.start, sg.end, t)
            elif (handle := home.read_range(sg.start, sg.end, t)) is not None:
                handles.append(handle)
        return handles

    def swaps(self, index: int) -> bool:
        return True  # through a staging buffer

    @phase("zeroinf::swap_in")
    def start_swap_in(self, index: int) -> Pending:
        """Reserve a staging buffer (the pipeline guarantees one is free) and start the three reads."""
        self.require_healthy()
        assert self._pool is not None and self._swap is not None
        sg = self.sub_groups[index]
        buffer = self._pool.reserve(timeout_s=0)
        staged = Staged(sg, self._views(buffer.tensor, sg.numel), buffer)
        try:
            handles = self._swap_all("swap_in", sg, staged.views)
        except BaseException:
            staged.release()
            raise
        # This store's files only: a master read from the parameter file counts as parameter traffic.
        home = self._master_homes[sg.unit_index]
        own = sum(n for kind, n in self._live_kind_bytes().items() if home is None or kind != SWAP_KINDS[0])
        self.traffic.add(Tier.NVME, "read", own * sg.numel)
        return Pending("swap_in", staged, handles)

    @phase("zeroinf::swap_out")
    def start_swap_out(self, staged: Staged) -> Pending:
        """Start the three writes; the staging buffer returns to the pool when they finish."""
        assert self._swap is not None
        sg = staged.sub_group
        aside = self._written_aside is not None
        # A master in the parameter file goes there with the unit's new parameters (collect_master).
        moments_only = self._master_homes[sg.unit_index] is not None
        views, kinds = (staged.views[1:], SWAP_KINDS[1:]) if moments_only else (staged.views, SWAP_KINDS)
        try:  # speculating: into the other slot, so the current one keeps the states before the update
            handles = self._swap_all("swap_out", sg, views, kinds, slot=1 - self._slot[sg.index] if aside else None)
        except BaseException:
            staged.release()
            raise
        if self._written_aside is not None:
            self._written_aside.add(sg.index)
        live = self._live_kind_bytes()
        self.traffic.add(Tier.NVME, "written", sum(live.get(kind, 0) for kind in kinds) * sg.numel)
        return Pending("swap_out", staged, handles, release_when_done=True)

    # -- the speculative step: updates go to each sub-group's other slot until commit or rollback --------
    def speculate(self) -> None:
        if not self._shadow:
            raise RuntimeError("this NVMe state store has no second slots (built without shadow=True)")
        self._written_aside = set()

    def commit(self) -> None:
        """The updated slots become current (call after their writes finished)."""
        for index in self._written_aside or ():
            self._slot[index] = 1 - self._slot[index]
        self._written_aside = None

    def rollback(self) -> None:
        """Forget the updates written since `speculate()`: the current slots still hold the states before."""
        self._written_aside = None

    def collect_master(self, staged: Staged) -> torch.Tensor | None:
        """The unit's whole updated master once its last sub-group is in ([Note: master weights ...])."""
        sg = staged.sub_group
        if sg.whole_unit:
            return staged.views.master
        assert self._assembly is not None
        self._assembly[sg.start : sg.end].copy_(staged.views.master)
        return self._assembly[: sg.unit_numel] if sg.end == sg.unit_numel else None

    # -- whole units (state_dict / load_state_dict), streamed through one staging buffer ---------------
    def read_unit(self, unit_index: int) -> StateViews:
        groups = self._unit_groups.get(unit_index, [])
        numel = groups[-1].end if groups else 0
        out = StateViews(*(torch.empty(numel, dtype=torch.float32) for _ in STATE_KINDS))
        for start, end, views in self._iter_staged(unit_index):
            for dst, src in zip(out, views, strict=True):
                dst[start:end].copy_(src)
        return out

    def _live_kind_bytes(self) -> dict[str, int]:
        """Bytes per element of the state kinds the optimizer uses (the master and `moments` slots)."""
        return {kind: n for kind, n in self._kind_bytes.items() if kind in SWAP_KINDS[: 1 + self.moments]}

    def check_room_for(self, moments: int) -> None:
        """Disk room for missing swap files is checked when they are made (`keep_moments`, preallocated)."""

    def keep_moments(self, moments: int) -> None:
        """Read and write only `moments` slots beside the master from here on (a new optimizer of the
        model keeps another number; optim/succession.py then writes every slot it keeps). Slots never
        kept before get their swap file now ([Note: state slots an optimizer does not use, on NVMe])."""
        assert self._swap is not None
        for kind in SWAP_KINDS[len(self._on_disk) : 1 + moments]:
            itemsize = self._kind_bytes[kind]
            for sg in self.sub_groups:
                for key in (sg.key, shadow_key(sg.key)) if self._shadow else (sg.key,):
                    self._swap.add_slot(key, kind, sg.numel * itemsize, self._alignment)
            self._paths.append(self._swap.layout.path(kind))
            self._on_disk = (*self._on_disk, kind)
        self.moments = moments

    def write_unit(self, unit_index: int, states: StateViews) -> None:
        self.require_healthy()
        self._write_pieces(unit_index, states, SWAP_KINDS)

    def _write_pieces(self, unit_index: int, sources: Sequence[torch.Tensor], kinds: Sequence[str]) -> None:
        assert self._pool is not None and self._swap is not None
        with self._pool.reserve() as flat:
            for sg in self._unit_groups.get(unit_index, []):
                if self._written_aside is not None:  # these states replace any speculative update
                    self._written_aside.discard(sg.index)
                views = self._views(flat, sg.numel)
                for src, view in zip(sources, views, strict=False):
                    view.copy_(src[sg.start : sg.end])
                wait_all(self._swap_all("swap_out", sg, views, kinds))

    # -- sub-groups one at a time, for checkpoints ---------------------------------------------------------
    def segment_bounds(self, unit_index: int) -> list[tuple[int, int]]:
        return [(sg.start, sg.end) for sg in self._unit_groups.get(unit_index, [])]

    def land_master_writes(self) -> None:
        for home in self._master_homes:
            if home is not None:
                home.land_writes()

    def iter_segments(self, unit_index: int, ahead: int = 2) -> Iterator[tuple[int, int, StateViews]]:
        """Yield each sub-group's states in fp32, valid until the next item (in a staging buffer, or
        widened copies of bf16 moments); the reads of the next `ahead - 1` sub-groups run while the
        caller uses this one. A checkpoint may run this on a background thread while training gathers
        parameters: masters held by the parameter file are read from the file alone
        (`land_master_writes` ran first, on the training thread)."""
        for start, end, views in self._iter_staged(unit_index, ahead):
            if self.moment_dtype != torch.float32:
                views = StateViews(views.master, views.exp_avg.float(), views.exp_avg_sq.float())
            yield start, end, views

    def _iter_staged(self, unit_index: int, ahead: int = 2) -> Iterator[tuple[int, int, StateViews]]:
        """`iter_segments` with the states as stored (the moments in `moment_dtype`)."""
        self.require_healthy()
        assert self._pool is not None and self._swap is not None
        groups = self._unit_groups.get(unit_index, [])
        ahead = max(1, min(ahead, self._pool.count))
        in_flight: deque[tuple[SubGroup, PoolBuffer, StateViews, list[AioHandle]]] = deque()

        def start(sg: SubGroup) -> None:
            assert self._pool is not None and self._swap is not None
            buffer = self._pool.reserve()
            views = self._views(buffer.tensor, sg.numel)
            try:
                handles = self._swap_all("swap_in", sg, views, masters_from_file=True)
            except BaseException:
                buffer.pool.release(buffer)
                raise
            in_flight.append((sg, buffer, views, handles))

        try:
            for sg in groups[:ahead]:
                start(sg)
            following = ahead
            while in_flight:
                sg, buffer, views, handles = in_flight[0]
                wait_all(handles)
                yield sg.start, sg.end, views
                in_flight.popleft()
                buffer.pool.release(buffer)
                if following < len(groups):
                    start(groups[following])
                    following += 1
        finally:  # also when the caller stops early: no buffer is released while the disk writes into it
            for _, buffer, _, handles in in_flight:
                for h in handles:
                    h.wait_done()
                buffer.pool.release(buffer)

    @contextlib.contextmanager
    def segment_for_write(self, unit_index: int, start: int, end: int) -> Iterator[StateViews]:
        self.require_healthy()
        assert self._pool is not None and self._swap is not None
        sg = next((g for g in self._unit_groups.get(unit_index, []) if (g.start, g.end) == (start, end)), None)
        if sg is None:
            raise ValueError(f"unit {unit_index} has no sub-group [{start}, {end}): see segment_bounds()")
        with self._pool.reserve() as flat:
            views = self._views(flat, sg.numel)
            if self.moment_dtype == torch.float32:
                yield views  # filled in place
            else:  # fp32 for the caller, the moments rounded into the staging buffer after
                moments = (torch.empty(sg.numel, dtype=torch.float32) for _ in STATE_KINDS[1:])
                staged = StateViews(views.master, *moments)
                yield staged
                views.exp_avg.copy_(staged.exp_avg)
                views.exp_avg_sq.copy_(staged.exp_avg_sq)
            wait_all(self._swap_all("swap_out", sg, views))

    # -- health and lifetime ------------------------------------------------------------------------------
    def check(self, op: str) -> None:
        """Raise AioError naming the file if a swap file was removed (e.g. its folder deleted).

        Open files survive their removal, so the I/O itself keeps working on a nameless file; this
        one fstat per file per step turns that silent state into an error.
        """
        for path in self._paths:
            if os.fstat(self.engine.open_file(path)).st_nlink == 0:
                error = AioError(
                    op,
                    path,
                    0,
                    0,
                    "the swap file was removed during training (folder deleted?); "
                    "the optimizer states can no longer be trusted: restore from a checkpoint",
                )
                self.failure = self.failure or error
                raise error

    def fail(self, error: BaseException) -> None:
        """Record that a step stopped midway: the files hold a mix of old and new states."""
        self.failure = self.failure or error

    def forget_failure(self) -> None:
        """Every state is about to be rewritten (a checkpoint load; one that fails midway fails again)."""
        self.failure = None

    def require_healthy(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"the optimizer states in {self._paths[0] if self._paths else 'the parameter files'!r} and its "
                "sibling files are inconsistent after an "
                f"earlier error ({self.failure}); restore from a checkpoint (zeroinf.load, or "
                "optimizer.load_state_dict) before the next step"
            ) from self.failure

    def close(self) -> None:
        """Remove the swap files and free the buffers (also run at garbage collection and exit)."""
        self._finalizer()


def _close_nvme(state: dict) -> None:
    """Release an NvmeStateStore's resources given its attribute dict (a finalizer must not hold self)."""
    if state.get("_assembly") is not None:
        release_host(state["_assembly"], state["ledger"], "optimizer_assembly")
        state["_assembly"] = None
    if state.get("_swap") is not None:
        state["_swap"].close()
        state["_swap"] = None
    if state.get("_pool") is not None:
        pool = state["_pool"]
        if pool.free_count == pool.count:  # a buffer kept after a timed-out transfer stays out
            pool.close()
        state["_pool"] = None
    state["engine"].close()
