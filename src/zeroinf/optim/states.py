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
- `NvmeStateStore` (optim/nvme_states.py): the states live in three per-rank swap files, staged
  sub-group by sub-group through a fixed pool of host buffers.
- `SplitStateStore`: some units' states on the host, the others on NVMe (`offload.max_host_bytes`).

[Note: masters in the memory shard]
What optim/nvme_states.py [Note: masters in the parameter file] does on disk holds in memory. At
stage 3 a unit's shard and its fp32 master are the same numbers in fp32, and in bf16/fp16 the
shard is the master's rounding. Where both would live in one memory
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
Stages 0-2 in fp32 share too (the unit has no home there): the owned range of the whole buffer is
the master, so the step updates the parameters in place and uploads nothing (`master_in_params`).
Writes that do not come from the step go to the master: `zeroinf.gathered(..., modify=True)`
changes only the elements written (the others keep their unrounded masters), `load_weights` writes
the fp32 values, and a checkpoint's masters are loaded into the shard itself.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import torch

from zeroinf.aio import AioHandle
from zeroinf.config import DTYPES, OffloadConfig
from zeroinf.memory import Ledger, Tier
from zeroinf.optim.pipeline import Pending, Staged, StateViews, SubGroup, plan_sub_groups
from zeroinf.planner.unit_plan import OPTIMIZER_SWAP_KINDS, OptimizerSplit
from zeroinf.telemetry import get_logger
from zeroinf.tiers.host import check_host_cap, host_zeros, release_host
from zeroinf.tiers.nvme_tier import NvmeTier

if TYPE_CHECKING:
    from zeroinf.optim.nvme_states import MasterHome, NvmeStateStore

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")
SWAP_KINDS = OPTIMIZER_SWAP_KINDS  # swap file kinds and NVME ledger tags: optimizer_<state kind>
_FP32_BYTES = 4


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy of a state (a moment may be held in bf16)."""
    return t.clone() if t.dtype == torch.float32 else t.float()


def absent_slot(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A state slot the optimizer does not use (SGD keeps one tensor, Adam two): reads as `numel`
    zeros and holds no memory (one element seen through stride 0). Never written: stores skip it."""
    return torch.zeros((), dtype=dtype, device=device).expand(numel)


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

    def keep_moments(self, moments: int) -> None: ...  # the slots beside the master that hold memory

    def check_room_for(self, moments: int) -> None: ...  # raises where `keep_moments(moments)` would not fit

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

    def fail(self, error: BaseException) -> None: ...  # a step (or a load) stopped midway

    def forget_failure(self) -> None: ...  # every state is about to be rewritten (a checkpoint load)

    # The speculative step (optim/backward_step.py [Note: the step inside backward]): between `speculate()`
    # and `commit()` or `rollback()` the states before each update stay recoverable.
    def speculate(self) -> None: ...

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class ResidentStateStore:
    """States that stay in memory on `device` or `host`: one tensor per unit and state kind. Only the
    first `moments` of the two slots beside the master hold memory (the optimizer's `state_names`);
    the others are `absent_slot`s."""

    staging_slots = None

    def __init__(
        self, masters: Sequence[torch.Tensor] | MasterSource, tier: Tier, ledger: Ledger, max_host_bytes: int | None,
        moment_dtype: torch.dtype = torch.float32, moments: int = 2,
    ) -> None:
        source = masters if isinstance(masters, MasterSource) else MasterSource.of(list(masters))
        self.tier, self.ledger, self.traffic = tier, ledger, StepTraffic()
        self.sub_groups = plan_sub_groups(source.numels, None)
        self.moment_dtype = moment_dtype
        self.moments = moments
        self.max_host_bytes = max_host_bytes  # what host states may take (a successor keeping more moments too)
        self._element_bytes = _FP32_BYTES + moments * moment_dtype.itemsize  # the states of one element
        # A shared master is its unit's parameter shard: counted there, not allocated here.
        self._shared = [source.is_shared(i) for i in range(len(source.numels))]
        self._nbytes = sum(
            (self._element_bytes - (_FP32_BYTES if shared else 0)) * n
            for n, shared in zip(source.numels, self._shared, strict=True)
        )
        self.states: list[StateViews] = []
        self.failure: BaseException | None = None  # see `fail`
        if tier is Tier.HOST:
            check_host_cap(
                self._nbytes,
                max_host_bytes,
                "optimizer states on host",
                'raise the cap, set offload.nvme_dir to keep what fits on the host and the rest on NVMe, '
                'or use offload.optimizer = "nvme"',
            )
            # One initial master at a time: copied into its states, then dropped (the states and all
            # the masters never exist together: 12, not 16 bytes per element at the peak).
            for i, numel in enumerate(source.numels):
                slots = [self._new_slot(k, numel, torch.device("cpu")) for k in range(len(STATE_KINDS) - 1)]
                if self._shared[i]:
                    self.states.append(StateViews(source.take(i), *slots))
                    continue
                views = StateViews(host_zeros(numel, torch.float32, ledger, "optimizer_state"), *slots)
                views.master.copy_(source.take(i))
                self.states.append(views)
        else:
            for i in range(len(source.numels)):
                master = source.take(i)
                slots = [self._new_slot(k, master.numel(), master.device) for k in range(len(STATE_KINDS) - 1)]
                self.states.append(StateViews(master, *slots))
            ledger.reserve(Tier.DEVICE, self._nbytes, "optimizer_state")
        self._closed = False
        self._backups: dict[int, StateViews] | None = None  # while speculating: states before the update

    def _new_slot(self, k: int, numel: int, device: torch.device) -> torch.Tensor:
        """Zeros for state slot `k` (0: exp_avg's, 1: exp_avg_sq's), or an absent slot past `moments`."""
        return absent_slot(numel, self.moment_dtype, device) if k >= self.moments else self._zeros(numel, device)

    def _zeros(self, numel: int, device: torch.device) -> torch.Tensor:
        if self.tier is Tier.HOST:  # only the master crosses to the device: the moments are never pinned
            return host_zeros(numel, self.moment_dtype, self.ledger, "optimizer_state", pin=False)
        return torch.zeros(numel, dtype=self.moment_dtype, device=device)

    def _held(self, views: StateViews) -> tuple[torch.Tensor, ...]:
        """The tensors of a unit's states that hold memory: the master and the first `moments` slots."""
        return tuple(views[: 1 + self.moments])

    def check_room_for(self, moments: int) -> None:
        """Refuse, before anything changes, `moments` slots that would take the host states past
        `max_host_bytes` (the plan sized them for the first optimizer's: Lion's one, then AdamW's two)."""
        if self.tier is not Tier.HOST or moments <= self.moments:
            return
        grown = self._nbytes + (moments - self.moments) * self.moment_dtype.itemsize * sum(
            v.master.numel() for v in self.states
        )
        check_host_cap(
            grown, self.max_host_bytes,
            f"optimizer states on host for an optimizer keeping {moments} state tensors beside each master "
            f"(the states were planned for the first optimizer's {self.moments})",
            "build the optimizer that keeps more states first (the plan then sizes them for it), raise "
            "offload.max_host_bytes, or use offload.optimizer = \"nvme\"",
        )

    def keep_moments(self, moments: int) -> None:
        """Hold `moments` slots beside each master from here on (a new optimizer of the model keeps
        another number, optim/succession.py): slots added start at zero, slots dropped are freed."""
        if moments == self.moments:
            return
        self.check_room_for(moments)
        before = self._nbytes
        for i, views in enumerate(self.states):
            numel, device = views.master.numel(), views.master.device
            slots = list(views[1:])
            for k in range(len(slots)):
                if self.moments <= k < moments:
                    slots[k] = self._zeros(numel, device)
                elif moments <= k < self.moments:
                    if self.tier is Tier.HOST:
                        release_host(slots[k], self.ledger, "optimizer_state")
                    slots[k] = absent_slot(numel, self.moment_dtype, device)
            self.states[i] = StateViews(views.master, *slots)
        moment_bytes = (moments - self.moments) * self.moment_dtype.itemsize
        self.moments = moments
        self._element_bytes += moment_bytes
        self._nbytes += moment_bytes * sum(v.master.numel() for v in self.states)
        if self.tier is not Tier.HOST:
            if self._nbytes > before:
                self.ledger.reserve(Tier.DEVICE, self._nbytes - before, "optimizer_state")
            else:
                self.ledger.release(Tier.DEVICE, before - self._nbytes, "optimizer_state")

    def swaps(self, index: int) -> bool:
        return False  # in memory: no staging slot

    def start_swap_in(self, index: int) -> Pending:
        sg = self.sub_groups[index]
        self.traffic.add(self.tier, "read", self._element_bytes * sg.numel)
        unit = self.states[sg.unit_index]
        if self._backups is not None and index not in self._backups:
            held = len(self._held(unit))
            self._backups[index] = StateViews(
                *(t[sg.start : sg.end].clone() if k < held else t[sg.start : sg.end] for k, t in enumerate(unit))
            )
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
            for dst, src in zip(self._held(self.states[sg.unit_index]), saved, strict=False):
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
        for dst, src in zip(self._held(self.states[unit_index]), states, strict=False):  # absent slots stay zero
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
        if views.master.device.type == "cpu" and self.moment_dtype == torch.float32 and self.moments == 2:
            yield views  # filled in place
            return
        staged = StateViews(*(torch.empty(end - start, dtype=torch.float32) for _ in STATE_KINDS))
        yield staged
        for dst, src in zip(self._held(views), staged, strict=False):
            dst.copy_(src)

    def check(self, op: str) -> None:
        return None

    def require_healthy(self) -> None:
        if self.failure is not None:
            raise RuntimeError(
                f"the optimizer states on {self.tier.value} are inconsistent: a step stopped midway "
                f"({self.failure!r}), some sub-groups updated and others not; restore from a checkpoint "
                "(zeroinf.load, or optimizer.load_state_dict) before the next step"
            ) from self.failure

    def fail(self, error: BaseException) -> None:
        """A step stopped midway (an interrupt, an error in an update): in memory as on NVMe, some
        sub-groups hold the new states and the others the old ones. It used to be ignored here, and the
        next step stepped the updated sub-groups twice."""
        self.failure = self.failure or error

    def forget_failure(self) -> None:
        self.failure = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._drop_backups()
        if self.tier is Tier.HOST:
            for views, shared in zip(self.states, self._shared, strict=True):
                held = self._held(views)
                for t in held[1:] if shared else held:
                    release_host(t, self.ledger, "optimizer_state")
        else:
            self.ledger.release(Tier.DEVICE, self._nbytes, "optimizer_state")
        self.states = []


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

    def keep_moments(self, moments: int) -> None:
        self.host.keep_moments(moments)  # first: it refuses what the host part cannot hold, before any file is made
        self.nvme.keep_moments(moments)

    def check_room_for(self, moments: int) -> None:
        self.host.check_room_for(moments)

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

    def forget_failure(self) -> None:
        self.nvme.forget_failure()

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
    moments: int = 2,
) -> ResidentStateStore | NvmeStateStore | SplitStateStore:
    """The store for `cfg.optimizer`, taking ownership of the initial fp32 masters (one per unit);
    `shadow`: NVMe states get a second slot per sub-group for the speculative step; `split`: the
    units' states over host and NVMe (the unit plan's `optimizer_split()`); `tier`: the engine's
    NVMe tier, whose optimizer lane the swap files use (a tier of its own when None); `master_homes`:
    per unit, the parameter file holding its masters, or None ([Note: masters in the parameter file]);
    `moments`: how many of the two state slots beside the master the optimizer uses; states in
    memory hold only those, NVMe swap files move only those (optim/nvme_states.py [Note: state slots
    an optimizer does not use, on NVMe])."""
    from zeroinf.optim.nvme_states import NvmeStateStore  # it builds on this module's pieces
    if split is not None:
        # Each part takes its units' masters one at a time, each dropped once stored.
        nvme = NvmeStateStore(
            masters.subset(split.nvme_units), cfg, ledger, rank, shadow=shadow, tier=tier, moments=moments
        )
        try:
            host = ResidentStateStore(  # within the part of the cap the split left the states
                masters.subset(split.host_units), Tier.HOST, ledger, split.budget_bytes, DTYPES[cfg.moment_dtype],
                moments,
            )
        except BaseException:
            nvme.close()
            raise
        get_logger().info("%s", split.describe())
        return SplitStateStore(host, nvme, split)
    if cfg.optimizer == "nvme":
        return NvmeStateStore(
            masters, cfg, ledger, rank, shadow=shadow, tier=tier, master_homes=master_homes, moments=moments
        )
    return ResidentStateStore(
        masters, Tier(cfg.optimizer), ledger, cfg.max_host_bytes, DTYPES[cfg.moment_dtype], moments
    )
