"""Where the optimizer states live: fp32 master weights and Adam moments on `device`, `host` or `nvme`.

An `OptimizerStateStore` holds, for every unit, the three states of the unit's owned range (the
fp32 master, and two moments in `offload.moment_dtype`: fp32, or bf16 as optim/moments.py
explains), and hands them to the step one sub-group at a time: `start_swap_in(k)` gives a `Pending`
whose `wait()` returns the sub-group's `Staged` views, and `start_swap_out(staged)` puts them back.
The step never knows the tier; the pipeline (optim/pipeline.py) drives both calls. Everything else
(`read_unit`, `write_unit`, `iter_segments`, `segment_for_write`: state dicts, checkpoints, user
writes) sees fp32 states whatever the moments' dtype, so checkpoints load across that setting.

- `ResidentStateStore` (`device`, `host`): the states stay in memory for the whole run, one tensor
  per unit and state; a sub-group is a whole unit and its swaps are views that complete at once.
- `NvmeStateStore`: the states live in three per-rank swap files (tiers/nvme.py, one per state
  kind). A sub-group is a piece of one unit of at most `offload.sub_group_numel` elements; swapping
  it in reserves one staging buffer of a fixed `BufferPool` (`offload.buffer_count` buffers, each
  holding a sub-group's master, exp_avg and exp_avg_sq at aligned offsets, so every transfer is
  direct O_DIRECT I/O with no copy), and swapping it out releases that buffer once the writes
  finish. Host memory is therefore bounded by the pool whatever the model size.

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

[Note: masters in the memory shard]
The same holds in memory. At stage 3 a unit's shard and its fp32 master are the same numbers in
fp32, and in bf16/fp16 the shard is the master's rounding. Where both would live in one memory
(`ModelPlan.masters_in_memory_shard`: the shard on the device and the states on the device, or any
memory placement on a CPU device; no host/NVMe split), the unit's `MemoryHome` holds the fp32
master as its shard (`ShardedUnit.share_master`) and `ResidentStateStore` allocates only the two
moments for it. The step updates the shard in place, so writing the new parameters is nothing, and
each gather casts the fp32 shard to the compute dtype on the way (at world 1 the copy into the
unsharded buffer casts; NCCL gathers a cast copy of the shard, as FSDP2 does). The cast rounds as
the copy into a compute-dtype shard did, so training is bitwise the same; the ledger counts the
master once, under `param_shard`: 12 bytes per parameter live (4 + 8 of moments), as torch.optim's
AdamW on fp32 parameters and FSDP2 hold, where two tensors took 16 (fp32) or 14 (bf16). Resident
units share only in fp32 (their master is their slice of the whole buffer); in bf16 the whole
buffer stays in the compute dtype. A host shard on an accelerator keeps its own compute-dtype copy:
its copies to the device would cross in fp32 and read the master while a step may write it.
Writes that do not come from the step go to the master: `zeroinf.gathered(..., modify=True)`
changes only the elements written (the others keep their unrounded masters), `load_weights` writes
the fp32 values, and a checkpoint's masters are loaded into the shard itself.

[Note: fresh swap files read as zeros]
The swap files are preallocated with posix_fallocate, after which reads of the allocated range
return zeros, so only the master weights are written at start; the moments start at zero for free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch

from zeroinf.aio import AioConfig, AioHandle, BufferPool, PoolBuffer
from zeroinf.aio.errors import AioError
from zeroinf.config import DTYPES, OffloadConfig
from zeroinf.memory import Ledger, Tier
from zeroinf.optim.pipeline import Pending, Staged, StateViews, SubGroup, plan_sub_groups
from zeroinf.planner.unit_plan import (
    OPTIMIZER_SWAP_KINDS,
    OptimizerSplit,
    plan_optimizer_staging,
    shadow_key,
)
from zeroinf.telemetry import get_logger, phase
from zeroinf.tiers.host import check_host_cap, host_zeros, release_host
from zeroinf.tiers.nvme import NvmeSwap
from zeroinf.tiers.nvme_tier import NvmeTier

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
SWAP_KINDS = OPTIMIZER_SWAP_KINDS  # swap file kinds and NVME ledger tags: optimizer_<state kind>
_FP32_BYTES = 4


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy of a state (a moment may be held in bf16)."""
    return t.clone() if t.dtype == torch.float32 else t.float()


def wait_all(handles: Sequence[AioHandle]) -> None:
    """Wait for every handle, then raise the first error (no buffer is reused while a transfer runs)."""
    for h in handles:
        h.wait_done()
    for h in handles:
        h.wait()


class StepTraffic:
    """Bytes of optimizer state read and written per tier (keys "<tier>_read_bytes",
    "<tier>_written_bytes"), for the current step, the last finished step and in total."""

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self.this_step: Counter[str] = Counter()
        self.last_step: Counter[str] = Counter()

    def add(self, tier: Tier, direction: str, nbytes: int) -> None:
        key = f"{tier.value}_{direction}_bytes"
        self.total[key] += nbytes
        self.this_step[key] += nbytes

    def end_step(self) -> None:
        self.last_step, self.this_step = self.this_step, Counter()


class OptimizerStateStore(Protocol):
    """What the step and the pipeline need from a store; see the module docstring."""

    tier: Tier
    sub_groups: list[SubGroup]
    traffic: StepTraffic

    @property  # read only: a store's class may fix it (None)
    def staging_slots(self) -> int | None: ...  # sub-groups that may be in memory at once (None: all)

    def swaps(self, index: int) -> bool: ...  # whether sub-group `index` takes a staging slot

    def start_swap_in(self, index: int) -> Pending: ...

    def start_swap_out(self, staged: Staged) -> Pending: ...

    def collect_master(self, staged: Staged) -> torch.Tensor | None: ...

    def read_unit(self, unit_index: int) -> StateViews: ...  # fresh CPU or device tensors

    def write_unit(self, unit_index: int, states: StateViews) -> None: ...

    # Checkpoints stream a unit's states piece by piece (one sub-group on NVMe), never whole units.
    def segment_bounds(self, unit_index: int) -> list[tuple[int, int]]: ...  # owned-local [start, end)

    def iter_segments(self, unit_index: int) -> Iterator[tuple[int, int, StateViews]]: ...  # CPU views

    def land_master_writes(self) -> None:
        """Masters kept in parameter files are current in the files once this returns (call it on the
        training thread before `iter_segments` runs on another)."""
        ...

    def segment_for_write(self, unit_index: int, start: int, end: int) -> AbstractContextManager[StateViews]:
        """CPU views to fill with a segment's new states; stored when the block exits without error."""
        ...

    def check(self, op: str) -> None: ...

    def require_healthy(self) -> None: ...  # raise if an earlier error left the states inconsistent

    def fail(self, error: BaseException) -> None: ...

    # The speculative step (optim/adamw.py [Note: the step inside backward]): between `speculate()`
    # and `commit()` or `rollback()` the states before each update stay recoverable.
    def speculate(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class ResidentStateStore:
    """States that stay in memory on `device` or `host`: one tensor per unit and state kind."""

    staging_slots = None

    def __init__(
        self, masters: Sequence[torch.Tensor] | MasterSource, tier: Tier, ledger: Ledger, max_host_bytes: int | None,
        moment_dtype: torch.dtype = torch.float32,
    ) -> None:
        source = masters if isinstance(masters, MasterSource) else MasterSource.of(list(masters))
        self.tier, self.ledger, self.traffic = tier, ledger, StepTraffic()
        self.sub_groups = plan_sub_groups(source.numels, None)
        self.moment_dtype = moment_dtype
        self._element_bytes = _FP32_BYTES + 2 * moment_dtype.itemsize  # the three states of one element
        # A shared master is its unit's parameter shard: counted there, not allocated here.
        self._shared = [source.is_shared(i) for i in range(len(source.numels))]
        self._nbytes = sum(
            (self._element_bytes - (_FP32_BYTES if shared else 0)) * n
            for n, shared in zip(source.numels, self._shared, strict=True)
        )
        self.states: list[StateViews] = []
        if tier is Tier.HOST:
            check_host_cap(
                self._nbytes,
                max_host_bytes,
                "optimizer states on host",
                'raise the cap, set offload.nvme_dir to keep what fits on the host and the rest on NVMe, '
                'or use offload.optimizer = "nvme"',
            )
            # One initial master at a time: copied into its states, then dropped (the states and all
            # the masters never exist together: 12, not 16 bytes per element at the peak). Only the
            # master crosses to the device (updated parameters): the moments are never pinned.
            for i, numel in enumerate(source.numels):
                moments = [
                    host_zeros(numel, moment_dtype, ledger, "optimizer_state", pin=False) for _ in STATE_KINDS[1:]
                ]
                if self._shared[i]:
                    self.states.append(StateViews(source.take(i), *moments))
                    continue
                views = StateViews(host_zeros(numel, torch.float32, ledger, "optimizer_state"), *moments)
                views.master.copy_(source.take(i))
                self.states.append(views)
        else:
            for i in range(len(source.numels)):
                master = source.take(i)
                zeros = [torch.zeros_like(master, dtype=moment_dtype) for _ in STATE_KINDS[1:]]
                self.states.append(StateViews(master, *zeros))
            ledger.reserve(Tier.DEVICE, self._nbytes, "optimizer_state")
        self._closed = False
        self._backups: dict[int, StateViews] | None = None  # while speculating: states before the update

    def swaps(self, index: int) -> bool:
        return False  # in memory: no staging slot

    def start_swap_in(self, index: int) -> Pending:
        sg = self.sub_groups[index]
        self.traffic.add(self.tier, "read", self._element_bytes * sg.numel)
        unit = self.states[sg.unit_index]
        if self._backups is not None and index not in self._backups:
            self._backups[index] = StateViews(*(t[sg.start : sg.end].clone() for t in unit))
            self.ledger.reserve(self.tier, self._element_bytes * sg.numel, "optimizer_backup")
        return Pending("swap_in", Staged(sg, StateViews(*(t[sg.start : sg.end] for t in unit))))

    def speculate(self) -> None:
        """Keep a copy of each sub-group's states when it is swapped in, until commit or rollback."""
        self._drop_backups()
        self._backups = {}

    def commit(self) -> None:
        self._drop_backups()

    def rollback(self) -> None:
        """Put back the states of every sub-group updated since `speculate()`."""
        for index, saved in (self._backups or {}).items():
            sg = self.sub_groups[index]
            for dst, src in zip(self.states[sg.unit_index], saved, strict=True):
                dst[sg.start : sg.end].copy_(src)
        self._drop_backups()

    def _drop_backups(self) -> None:
        for index in self._backups or {}:
            self.ledger.release(self.tier, self._element_bytes * self.sub_groups[index].numel, "optimizer_backup")
        self._backups = None

    def start_swap_out(self, staged: Staged) -> Pending:
        self.traffic.add(self.tier, "written", self._element_bytes * staged.sub_group.numel)
        return Pending("swap_out", staged)

    def collect_master(self, staged: Staged) -> torch.Tensor | None:
        return self.states[staged.sub_group.unit_index].master  # sub-groups are whole units

    def read_unit(self, unit_index: int) -> StateViews:
        return StateViews(*(_fp32(t) for t in self.states[unit_index]))

    def write_unit(self, unit_index: int, states: StateViews) -> None:
        for dst, src in zip(self.states[unit_index], states, strict=True):
            dst.copy_(src)

    def segment_bounds(self, unit_index: int) -> list[tuple[int, int]]:
        return [(0, self.states[unit_index].master.numel())]

    def iter_segments(self, unit_index: int) -> Iterator[tuple[int, int, StateViews]]:
        views = self.states[unit_index]
        yield 0, views.master.numel(), StateViews(*(t.detach().cpu().float() for t in views))

    def land_master_writes(self) -> None:
        return None  # the masters are here

    @contextlib.contextmanager
    def segment_for_write(self, unit_index: int, start: int, end: int) -> Iterator[StateViews]:
        views = StateViews(*(t[start:end] for t in self.states[unit_index]))
        if views.master.device.type == "cpu" and self.moment_dtype == torch.float32:
            yield views  # filled in place
            return
        staged = StateViews(*(torch.empty(end - start, dtype=torch.float32) for _ in STATE_KINDS))
        yield staged
        for dst, src in zip(views, staged, strict=True):
            dst.copy_(src)

    def check(self, op: str) -> None:
        return None

    def require_healthy(self) -> None:
        return None

    def fail(self, error: BaseException) -> None:
        return None  # in-memory states cannot be left half-written by an I/O error

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_backups()
        if self.tier is Tier.HOST:
            for views, shared in zip(self.states, self._shared, strict=True):
                for t in views[1:] if shared else views:
                    release_host(t, self.ledger, "optimizer_state")
        else:
            self.ledger.release(Tier.DEVICE, self._nbytes, "optimizer_state")
        self.states = []


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
        self._offsets, self._itemsizes = plan.state_offsets, plan.itemsizes
        self._kind_bytes = dict(zip(SWAP_KINDS, plan.itemsizes, strict=True))  # per element
        assembly_numel = plan.assembly_numel
        check_host_cap(
            plan.host_bytes + aio.workers * aio.block_bytes,
            cfg.max_host_bytes,
            f"the optimizer's nvme staging ({plan.pool.count} buffers of {plan.pool.buffer_bytes} bytes, "
            f"a {assembly_numel * _FP32_BYTES}-byte assembly buffer, {aio.workers} I/O buffers)",
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
                "optimizer", plan.swap_bytes(shadow, masters_elsewhere), aio.alignment_bytes,
                preflight="the optimizer swap files",
            )
            self._paths = [self._swap.layout.path(kind) for kind in SWAP_KINDS if kind in self._swap.layout.file_bytes]
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
                for at, size, dtype in zip(self._offsets, self._itemsizes, dtypes, strict=True)
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
        for kind, t in zip(kinds, views, strict=False):
            if home is None or kind != SWAP_KINDS[0]:
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
        own = sum(n for kind, n in self._kind_bytes.items() if home is None or kind != SWAP_KINDS[0])
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
        self.traffic.add(Tier.NVME, "written", sum(self._kind_bytes[kind] for kind in kinds) * sg.numel)
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
                staged = StateViews(views.master, *(torch.empty(sg.numel) for _ in STATE_KINDS[1:]))
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

    def require_healthy(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"the optimizer states in {self._paths[0]!r} and its sibling files are inconsistent after an "
                f"earlier error ({self.failure}); restore from a checkpoint"
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


class MasterSource:
    """The initial fp32 masters, one per unit, produced on demand (`take(i)`, once each), so that
    an NVMe store can write them out one at a time instead of holding them all."""

    def __init__(
        self, numels: list[int], take: Callable[[int], torch.Tensor], shared: Sequence[bool] = ()
    ) -> None:
        """`shared[i]`: unit i's master is its parameter shard in memory, which keeps owning it
        ([Note: masters in the memory shard]); only a resident store takes such masters."""
        self.numels, self.take, self.shared = numels, take, tuple(shared)

    def is_shared(self, index: int) -> bool:
        return index < len(self.shared) and self.shared[index]

    @classmethod
    def of(cls, masters: list[torch.Tensor]) -> MasterSource:
        return cls([m.numel() for m in masters], masters.__getitem__)

    def subset(self, indices: Sequence[int]) -> MasterSource:
        """The masters of units `indices`, renumbered 0..len-1 (a split store's part)."""
        shared = [self.is_shared(i) for i in indices]
        return MasterSource([self.numels[i] for i in indices], lambda j: self.take(indices[j]), shared)


class SplitStateStore:
    """States of some units in host RAM and of the others on NVMe (`OptimizerSplit`, chosen by the
    unit plan within `offload.max_host_bytes`): a `ResidentStateStore` and an `NvmeStateStore`, each
    over its own units, behind the one protocol. Sub-groups are numbered over the whole model, in
    unit order (each unit's from the part that holds it); a host sub-group takes no staging slot,
    so the pipeline reads NVMe sub-groups ahead while host units are updated."""

    tier = Tier.HOST  # where the update runs: the CPU, with host-resident or staged states

    def __init__(self, host: ResidentStateStore, nvme: NvmeStateStore, split: OptimizerSplit) -> None:
        self.host, self.nvme, self.split = host, nvme, split
        self.traffic = StepTraffic()
        host.traffic = nvme.traffic = self.traffic  # one account; each part adds under its own tier
        self.staging_slots = nvme.staging_slots
        self._parts: list[tuple[ResidentStateStore | NvmeStateStore, int]] = []  # per unit: (part, local unit)
        local = {id(host): 0, id(nvme): 0}
        for on_host in split.on_host:
            part = host if on_host else nvme
            self._parts.append((part, local[id(part)]))
            local[id(part)] += 1
        by_local: dict[tuple[int, int], list[SubGroup]] = {}
        for part in (host, nvme):
            for sg in part.sub_groups:
                by_local.setdefault((id(part), sg.unit_index), []).append(sg)
        self.sub_groups: list[SubGroup] = []
        self._local: list[tuple[ResidentStateStore | NvmeStateStore, SubGroup]] = []
        for ui, (part, li) in enumerate(self._parts):
            for sg in by_local.get((id(part), li), []):
                self.sub_groups.append(SubGroup(len(self.sub_groups), ui, sg.start, sg.end, sg.unit_numel))
                self._local.append((part, sg))

    def swaps(self, index: int) -> bool:
        return self._local[index][0] is self.nvme

    def start_swap_in(self, index: int) -> Pending:
        part, sg = self._local[index]
        pending = part.start_swap_in(sg.index)
        inner = pending.staged  # the same views and buffer, under the model-wide sub-group
        pending.staged = Staged(self.sub_groups[index], inner.views, inner.buffer)
        return pending

    def start_swap_out(self, staged: Staged) -> Pending:
        part, sg = self._local[staged.sub_group.index]
        local = Staged(sg, staged.views, staged.buffer)
        staged.buffer = None  # the part's swap-out owns (and returns) the buffer now
        return part.start_swap_out(local)

    def collect_master(self, staged: Staged) -> torch.Tensor | None:
        part, sg = self._local[staged.sub_group.index]
        return part.collect_master(Staged(sg, staged.views, staged.buffer))

    def read_unit(self, unit_index: int) -> StateViews:
        part, li = self._parts[unit_index]
        return part.read_unit(li)

    def write_unit(self, unit_index: int, states: StateViews) -> None:
        part, li = self._parts[unit_index]
        part.write_unit(li, states)

    def segment_bounds(self, unit_index: int) -> list[tuple[int, int]]:
        part, li = self._parts[unit_index]
        return part.segment_bounds(li)

    def iter_segments(self, unit_index: int) -> Iterator[tuple[int, int, StateViews]]:
        part, li = self._parts[unit_index]
        return part.iter_segments(li)

    def land_master_writes(self) -> None:
        self.host.land_master_writes()
        self.nvme.land_master_writes()

    def segment_for_write(self, unit_index: int, start: int, end: int) -> AbstractContextManager[StateViews]:
        part, li = self._parts[unit_index]
        return part.segment_for_write(li, start, end)

    def check(self, op: str) -> None:
        self.nvme.check(op)

    def require_healthy(self) -> None:
        self.nvme.require_healthy()

    def fail(self, error: BaseException) -> None:
        self.nvme.fail(error)

    def speculate(self) -> None:
        self.host.speculate()
        self.nvme.speculate()

    def commit(self) -> None:
        self.host.commit()
        self.nvme.commit()

    def rollback(self) -> None:
        self.host.rollback()
        self.nvme.rollback()

    def close(self) -> None:
        self.host.close()
        self.nvme.close()


def build_state_store(
    masters: MasterSource, cfg: OffloadConfig, ledger: Ledger, rank: int, shadow: bool = False,
    split: OptimizerSplit | None = None, tier: NvmeTier | None = None, master_homes: Sequence[MasterHome | None] = (),
) -> ResidentStateStore | NvmeStateStore | SplitStateStore:
    """The store for `cfg.optimizer`, taking ownership of the initial fp32 masters (one per unit);
    `shadow`: NVMe states get a second slot per sub-group for the speculative step; `split`: the
    units' states over host and NVMe (the unit plan's `optimizer_split()`); `tier`: the engine's
    NVMe tier, whose optimizer lane the swap files use (a tier of its own when None); `master_homes`:
    per unit, the parameter file holding its masters, or None ([Note: masters in the parameter file])."""
    if split is not None:
        # Each part takes its units' masters one at a time, each dropped once stored.
        nvme = NvmeStateStore(masters.subset(split.nvme_units), cfg, ledger, rank, shadow=shadow, tier=tier)
        try:
            host = ResidentStateStore(
                masters.subset(split.host_units), Tier.HOST, ledger, None, DTYPES[cfg.moment_dtype]
            )
        except BaseException:
            nvme.close()
            raise
        get_logger().info("%s", split.describe())
        return SplitStateStore(host, nvme, split)
    if cfg.optimizer == "nvme":
        return NvmeStateStore(masters, cfg, ledger, rank, shadow=shadow, tier=tier, master_homes=master_homes)
    return ResidentStateStore(masters, Tier(cfg.optimizer), ledger, cfg.max_host_bytes, DTYPES[cfg.moment_dtype])
