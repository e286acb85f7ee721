"""The per-unit plan: what `shard` will build for each unit, computed before any memory is touched.

A pure function of plain data: the units' parameter shapes (`UnitShape`, from unit discovery or a
model built on the meta device), the `Config` and the world size. For each unit it fixes the flat
layout, whether the unit stays unsharded (resident), where its parameter shard lives, and the bytes
of every shard, swap slot and staging buffer the engine allocates for it. The engine builds from
this plan (`Engine.unit_plan`: residency, swap files, staging pools, optimizer sub-groups) and the
estimator (planner/estimate.py) reads the same plan, so the prediction cannot drift from the engine.

Sizes are per rank: every rank's shard of a unit has the same size (the flat buffer is padded to
`world_size` equal shards), so the plan does not depend on the rank.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from zeroinf.aio.buffers import round_up
from zeroinf.aio.config import AioConfig
from zeroinf.config import AUTO, DTYPES, Config, OffloadConfig
from zeroinf.memory import Tier
from zeroinf.optim.pipeline import SubGroup, plan_sub_groups
from zeroinf.partition.flat_buffer import FlatLayout
from zeroinf.partition.shard_home import GRAD_KIND as GRAD_SWAP_KIND
from zeroinf.partition.shard_home import PARAM_KIND as PARAM_SWAP_KIND
from zeroinf.partition.wrap import unit_key

SWAP_ALIGN_BYTES = 4096  # offsets of shards in the swap files, and staging buffer sizes
# Staging buffers beyond read-ahead: a unit gathered on demand (its buffer returns once gathered, so the
# unit running holds none) and the updated shard being written behind (a unit's step takes longer than
# writing its shard, so a second write buffer would sit idle; `NvmeParamFiles.reserve` waits the oldest).
# Without the write buffer where every update is written straight from a resident fp32 master
# (`ModelPlan.param_writes_from_master`).
PARAM_STAGING_EXTRA = 2
OPTIMIZER_SWAP_KINDS = ("optimizer_master", "optimizer_exp_avg", "optimizer_exp_avg_sq")  # swap kinds = NVME tags
FP32_BYTES = 4


def state_itemsizes(offload: OffloadConfig) -> tuple[int, int, int]:
    """Bytes per element of the master, exp_avg and exp_avg_sq (`offload.moment_dtype`)."""
    moment = DTYPES[offload.moment_dtype].itemsize
    return FP32_BYTES, moment, moment


def state_element_bytes(offload: OffloadConfig, moments: int = 2) -> int:
    """Optimizer-state bytes per owned element: the fp32 master and `moments` state tensors (Adam's
    2: 12 bytes with fp32 moments, 8 with bf16 ones; Lion's 1: 8 or 6; plain SGD's 0: 4)."""
    return sum(state_itemsizes(offload)[: 1 + moments])


# State tensors an optimizer keeps beside each fp32 master (`zeroinf.plan(..., optimizer=...)`): the
# torch.optim classes zeroinf.ShardedOptimizer takes with their default settings, and zeroinf's own.
OPTIMIZER_MOMENTS = {
    "adamw": 2, "adam": 2, "radam": 2, "adamax": 2, "adadelta": 2, "rmsprop": 1, "adagrad": 1, "rprop": 2,
    "lion": 1, "sgd_momentum": 1, "sgd": 0,
}


def optimizer_moments(optimizer: str | int) -> int:
    """State tensors beside the master for `optimizer`: a name in OPTIMIZER_MOMENTS (torch's default
    settings: "sgd" without momentum, "sgd_momentum" with) or the count itself."""
    if isinstance(optimizer, bool) or not isinstance(optimizer, (int, str)):
        raise ValueError(f"optimizer = {optimizer!r}: give a name ({', '.join(OPTIMIZER_MOMENTS)}) or 0, 1 or 2")
    if isinstance(optimizer, int):
        if optimizer not in (0, 1, 2):
            raise ValueError(
                f"optimizer = {optimizer}: zeroinf keeps 0, 1 or 2 state tensors beside each fp32 master (Adam's 2)"
            )
        return optimizer
    moments = OPTIMIZER_MOMENTS.get(optimizer.lower().replace("-", "_"))
    if moments is None:
        raise ValueError(
            f"optimizer = {optimizer!r} is not one the planner knows: use one of {', '.join(OPTIMIZER_MOMENTS)}, "
            "or the number of state tensors it keeps per parameter beside the fp32 master (0, 1 or 2)"
        )
    return moments
MAX_REDUCTIONS_IN_FLIGHT = 2  # gradient collectives in flight in backward before the oldest is finished


@dataclass(frozen=True)
class UnitShape:
    """A unit before it is built, as plain data: its name ("" for the root) and its parameters' shapes."""

    name: str
    params: tuple[tuple[str, tuple[int, ...]], ...]
    frozen: bool = False
    """A unit of frozen parameters (stage 3, e.g. a LoRA base): gathered like the rest, no gradient or
    optimizer state."""
    split: bool = False
    """A large layer outside the blocks made a unit of its own (partition/wrap.py); the planner's
    facts hold every such layer, and `ModelFacts.units_for` merges back those a config does not split."""
    order: float = field(default=0, compare=False)  # an ordering hint, not part of the unit's identity
    """Where the unit's module comes in the model's module order (`UnitSpec.order`): the order units
    run in. Blocks a short model's facts add (`expand_blocks`) fall between their neighbours."""
    fp32: bool = False
    """Parameters the model keeps in fp32 under a narrower compute dtype (precision.py [Note: parameters
    the model keeps in fp32]): laid out, gathered and reduced in fp32."""

    @property
    def key(self) -> str:
        """The unit's name among units, as `UnitSpec.key`: a frozen or fp32 unit is told from its twin."""
        return unit_key(self.name, self.frozen, self.fp32)

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)

    @classmethod
    def of(cls, spec: object) -> UnitShape:
        """From a `partition.wrap.UnitSpec` (its parameters may live on any device, meta included)."""
        params = tuple((n, tuple(p.shape)) for n, p in spec.params)  # type: ignore[attr-defined]
        frozen, split = bool(getattr(spec, "frozen", False)), bool(getattr(spec, "split", False))
        fp32 = bool(getattr(spec, "fp32", False))
        return cls(spec.name, params, frozen, split, getattr(spec, "order", 0), fp32)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class UnitPlan:
    """One unit as the engine builds it, on every rank."""

    name: str
    layout: FlatLayout
    resident: bool
    """Stays unsharded for the whole run (stages 0-2: every unit; stage 3: the root and small units)."""
    param_tier: Tier
    """Where the compute-dtype parameter shard lives between uses (stage 3); DEVICE otherwise."""
    param_itemsize: int
    reduce_itemsize: int
    owned_numel: int
    """Elements this rank's optimizer steps: the whole flat buffer at stage 0, one shard from stage 1;
    0 for a frozen unit."""
    frozen: bool = False
    grad_buffer_itemsize: int = 0
    """Bytes per element of the unsharded gradient buffer (`gradient_buffer_dtype`); 0: `reduce_itemsize`."""
    order: float = field(default=0, compare=False)  # an ordering hint, not part of the unit's identity
    """`UnitShape.order`: where the unit runs in module order."""
    fp32: bool = False
    """`UnitShape.fp32`: parameters kept in fp32 (`param_itemsize` 4)."""

    @property
    def key(self) -> str:
        """The unit's name among units (`UnitSpec.key`, `ShardedUnit.name`)."""
        return unit_key(self.name, self.frozen, self.fp32)

    @property
    def swap_key(self) -> str:
        """The unit's name in the swap layouts."""
        return self.key or "<root>"

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def unsharded_bytes(self) -> int:
        return self.layout.padded_numel * self.param_itemsize

    @property
    def shard_bytes(self) -> int:
        """This rank's compute-dtype parameter shard (stage 3)."""
        return self.layout.shard_numel * self.param_itemsize

    @property
    def grad_unsharded_bytes(self) -> int:
        return self.layout.padded_numel * (self.grad_buffer_itemsize or self.reduce_itemsize)

    @property
    def grad_shard_bytes(self) -> int:
        """The reduced gradient shard in memory (reduce dtype); on NVMe it is stored as fp32."""
        return self.layout.shard_numel * self.reduce_itemsize


@dataclass(frozen=True)
class StagingPlan:
    """A fixed pool of aligned host buffers."""

    count: int
    buffer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.count * self.buffer_bytes


def _size_classes(units: tuple[UnitPlan, ...]) -> list[tuple[int, list[UnitPlan]]]:
    """NVMe units grouped by shard size for staging, largest first: a unit joins the class of the
    next larger size while its aligned shard is at least half that size (a buffer at most twice what
    it holds), else starts a class of its own size.

    [Note: staging by size class]
    Every staging buffer was the size of the largest shard, and the count came from the smallest units
    (those the prefetcher can read ahead together). A LoRA model has both: 19 adapter units of 630 KB
    and frozen base layers of 103 MB (a 1.1B Llama in bf16, parameters on NVMe): 21 units fit the
    prefetch budget, so 23 buffers of the 131 MB head, 3.0 GB of host memory for a 2.2 GB model,
    all touched by the second step (TRL SFT measured 2.3 GB peak RSS above the start against 2.8 GB
    for plain TRL holding the whole model). Pools by size class hold each shard in a buffer near its
    size, each class counted as before."""
    classes: list[tuple[int, list[UnitPlan]]] = []
    for unit in sorted(units, key=lambda u: u.shard_bytes, reverse=True):
        size = round_up(max(1, unit.shard_bytes), SWAP_ALIGN_BYTES)
        if classes and 2 * size >= classes[-1][0]:
            classes[-1][1].append(unit)
        else:
            classes.append((size, [unit]))
    return classes


@dataclass(frozen=True)
class SizedStagingPlan:
    """Pools of aligned host buffers of a few sizes: (buffer_bytes, count), smallest first."""

    classes: tuple[tuple[int, int], ...]

    @property
    def count(self) -> int:
        return sum(count for _, count in self.classes)

    @property
    def total_bytes(self) -> int:
        return sum(size * count for size, count in self.classes)


@dataclass(frozen=True)
class OptimizerStaging:
    """How NVMe optimizer states stream: sub-groups, staging buffers, and the master assembly buffer."""

    sub_groups: tuple[SubGroup, ...]
    state_bytes: tuple[int, int, int]
    """Bytes of each state (master, exp_avg, exp_avg_sq) of the largest sub-group, aligned; a staging
    buffer holds the three one after the other."""
    pool: StagingPlan
    assembly_numel: int
    """fp32 elements of the buffer that assembles a unit split into several sub-groups (0: none)."""
    itemsizes: tuple[int, int, int] = (FP32_BYTES, FP32_BYTES, FP32_BYTES)
    """Bytes per element of each state (`state_itemsizes`)."""

    @property
    def state_offsets(self) -> tuple[int, int, int]:
        """Where each state starts in a staging buffer (aligned)."""
        master, exp_avg, _ = self.state_bytes
        return 0, master, master + exp_avg

    @property
    def host_bytes(self) -> int:
        return self.pool.total_bytes + self.assembly_numel * FP32_BYTES

    def swap_bytes(
        self, shadow: bool = False, masters_elsewhere: Sequence[bool] = (), moments: int = 2
    ) -> dict[tuple[str, str], int]:
        """Swap slots per (sub-group key, kind); `shadow` adds a second slot per sub-group (the
        speculative step inside backward writes there, see optim/states.py). Units marked in
        `masters_elsewhere` have no master slot: their parameter file holds it (`masters_in_param_file`).
        Only the first `moments` state slots beside the master (the optimizer's: SGD with momentum one)."""
        keys = [sg.key for sg in self.sub_groups] + ([shadow_key(sg.key) for sg in self.sub_groups] if shadow else [])
        by_key = {sg.key: sg for sg in self.sub_groups}
        slots = {}
        kept = zip(OPTIMIZER_SWAP_KINDS[: 1 + moments], self.itemsizes, strict=False)
        for kind, itemsize in kept:
            for key in keys:
                sg = by_key[key.removesuffix(SHADOW_SUFFIX)]
                if kind == OPTIMIZER_SWAP_KINDS[0] and _marked(masters_elsewhere, sg.unit_index):
                    continue
                slots[(key, kind)] = sg.numel * itemsize
        return slots

    @cached_property
    def _slot_bytes(self) -> dict[int, int]:  # a plan weighs many placements of the same sub-groups: summed once
        return {
            size: sum(round_up(max(sg.numel * size, 1), SWAP_ALIGN_BYTES) for sg in self.sub_groups)
            for size in set(self.itemsizes)
        }

    def file_bytes(self, shadow: bool = False, masters_elsewhere: Sequence[bool] = (), state: int = 1) -> int:
        """Bytes of the swap file of `state` (0 master, 1 exp_avg, 2 exp_avg_sq), as tiers/nvme.py lays
        it out; with `masters_elsewhere`, the master file holds only the units not marked."""
        itemsize = self.itemsizes[state]
        if masters_elsewhere and state == 0:
            nbytes = sum(
                round_up(max(sg.numel * itemsize, 1), SWAP_ALIGN_BYTES)
                for sg in self.sub_groups
                if not _marked(masters_elsewhere, sg.unit_index)
            )
        else:
            nbytes = self._slot_bytes[itemsize]
        return 2 * nbytes if shadow else nbytes


def _marked(flags: Sequence[bool], index: int) -> bool:
    """`flags[index]`, False past the end (units not listed are not marked)."""
    return index < len(flags) and flags[index]


SHADOW_SUFFIX = "~"


def shadow_key(key: str) -> str:
    """The swap key of a sub-group's second slot."""
    return key + SHADOW_SUFFIX


def gradient_buffer_dtype(cfg: Config, world_size: int, device_type: str) -> str:
    """The dtype of a unit's unsharded gradient buffer (pure; unit_grads.py [Note: gradient accumulation
    buffer]): `reduce_dtype`, or the compute dtype where that is exact and moves half the bytes.

    A reduce-scatter over gloo between CPU ranks runs as messages (comm.py), which send the compute
    dtype's bytes and sum them into the `reduce_dtype` shard, exactly as casting first would (the cast
    of a bf16 or fp16 value to fp32 is exact, and the sums run in fp32 in the same order). That holds
    while the buffer only ever holds one backward's gradients, copied in: a buffer that accumulates
    micro-steps before reducing (stages 0-2 without `sync_every_micro_step`) would add in the compute
    dtype and round, so it keeps `reduce_dtype`; all-reduces (stages 0-1) and collectives of other
    backends, which want one dtype, keep it too. 98M GPT, 2 ranks x 1 thread, bf16: 0.81 -> 0.73
    s/step (no fp32 cast of every gradient, half the bytes on the wire and in the buffer)."""
    lower = DTYPES[cfg.param_dtype].itemsize < DTYPES[cfg.reduce_dtype].itemsize
    reduced_every_backward = cfg.stage == 3 or cfg.grad_accum_steps == 1 or cfg.sync_every_micro_step
    as_messages = device_type == "cpu" and world_size > 1
    if cfg.resolved_stage >= 2 and lower and reduced_every_backward and as_messages:
        return cfg.param_dtype
    return cfg.reduce_dtype


def step_in_backward_mode(cfg: Config) -> str | None:
    """How the optimizer steps (pure; optim/backward_step.py [Note: the step inside backward]): None after
    backward; "final" inside backward, exact as it goes (no decision needs every gradient);
    "speculative" inside backward, checked against the global norm in `step()` and undone when
    clipping triggers or fp16 overflows."""
    offload = cfg.offload
    if offload.step_in_backward is False:
        return None
    if cfg.grad_clip_norm is None and cfg.param_dtype != "fp16":
        return "final"
    # Undoing needs the old states: on nvme a second swap slot (disk only), on host or the device a
    # copy in memory (12 bytes per stepped element), made only when asked.
    return "speculative" if offload.optimizer == "nvme" or offload.step_in_backward is True else None


def plan_optimizer_staging(owned_numels: Sequence[int], offload: OffloadConfig, aio: AioConfig) -> OptimizerStaging:
    """Sub-groups of at most `offload.sub_group_numel` and the pool that stages them (pure)."""
    count = offload.buffer_count
    if count == AUTO:
        count = 0 if offload.max_host_bytes is None else AUTO_STAGING_UNDER_CAP
    return _optimizer_staging(
        tuple(owned_numels), offload.sub_group_numel, int(count), aio.alignment_bytes, state_itemsizes(offload)
    )


AUTO_STAGING_BYTES = 2**30
"""At most this much staging when `offload.buffer_count` is "auto" (and no `max_host_bytes`)."""
AUTO_STAGING_UNDER_CAP = 3
"""`offload.buffer_count` "auto" under `max_host_bytes`: the fewest that overlap reads and writes."""


@functools.lru_cache(maxsize=16)  # a plan weighs many placements of the same units
def _optimizer_staging(
    owned_numels: tuple[int, ...], sub_group_numel: int, buffer_count: int, alignment: int,
    itemsizes: tuple[int, int, int] = (FP32_BYTES, FP32_BYTES, FP32_BYTES),
) -> OptimizerStaging:
    """`buffer_count` 0: "auto", room for two units' sub-groups and two more within AUTO_STAGING_BYTES
    (optim/backward_step.py [Note: states read while their unit's backward runs])."""
    sub_groups = tuple(plan_sub_groups(list(owned_numels), sub_group_numel))
    slot_numel = max((sg.numel for sg in sub_groups), default=1)
    master, exp_avg, exp_avg_sq = (round_up(slot_numel * size, alignment) for size in itemsizes)
    buffer_bytes = master + exp_avg + exp_avg_sq
    assembly_numel = max((sg.unit_numel for sg in sub_groups if not sg.whole_unit), default=0)
    if buffer_count == 0:
        per_unit = max(collections.Counter(sg.unit_index for sg in sub_groups).values(), default=1)
        buffer_count = max(3, min(2 * per_unit + 2, AUTO_STAGING_BYTES // buffer_bytes))
    return OptimizerStaging(
        sub_groups, (master, exp_avg, exp_avg_sq), StagingPlan(buffer_count, buffer_bytes), assembly_numel, itemsizes
    )


@dataclass(frozen=True)
class OptimizerSplit:
    """Optimizer states over two tiers: the units marked `on_host` keep theirs in host RAM, the
    others on NVMe (offload.optimizer = "host" with a `max_host_bytes` the states exceed, and an
    `nvme_dir` to spill to). Indices are over the trainable units."""

    on_host: tuple[bool, ...]
    owned_numels: tuple[int, ...]
    budget_bytes: int
    """Host bytes the states may take: `max_host_bytes` less the engine's other host buffers."""
    element_bytes: int = 3 * FP32_BYTES
    """State bytes per element (`state_element_bytes`)."""

    @property
    def host_units(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.on_host) if h)

    @property
    def nvme_units(self) -> tuple[int, ...]:
        return tuple(i for i, h in enumerate(self.on_host) if not h)

    @property
    def host_numel(self) -> int:
        return sum(n for n, h in zip(self.owned_numels, self.on_host, strict=True) if h)

    @property
    def nvme_numel(self) -> int:
        return sum(n for n, h in zip(self.owned_numels, self.on_host, strict=True) if not h)

    def to_json(self) -> dict[str, int]:
        return {
            "host_units": len(self.host_units), "nvme_units": len(self.nvme_units),
            "host_numel": self.host_numel, "nvme_numel": self.nvme_numel, "budget_bytes": self.budget_bytes,
        }

    def describe(self) -> str:
        host, nvme = self.host_numel, self.nvme_numel
        share = host / (host + nvme) if host + nvme else 0.0
        per = self.element_bytes
        return (
            f"optimizer states split: {len(self.host_units)} units ({100 * share:.0f}%, "
            f"{per * host / 2**30:.2f} GiB) on host, {len(self.nvme_units)} units "
            f"({per * nvme / 2**30:.2f} GiB) on nvme, interleaved along the step order"
        )


def choose_host_units(owned_numels: Sequence[int], budget_bytes: int, bytes_per_element: int) -> tuple[bool, ...]:
    """Which units keep their states on the host within `budget_bytes` (pure).

    The host units are spread evenly along the units' order (a running share, as a line is drawn on
    a grid), not packed at one end: whichever order the step visits them in (forward's, or backward's
    reverse), NVMe sub-groups alternate with host units, so their swaps run while host units are
    stepped. What the even pass leaves of the budget is then filled in order with the units that fit.
    """
    total = sum(owned_numels) * bytes_per_element
    share = min(1.0, budget_bytes / total) if total else 1.0
    on_host = [False] * len(owned_numels)
    used = seen = 0
    for i, numel in enumerate(owned_numels):
        nbytes = numel * bytes_per_element
        seen += nbytes
        if used + nbytes <= share * seen and used + nbytes <= budget_bytes:
            on_host[i], used = True, used + nbytes
    for i, numel in enumerate(owned_numels):
        if not on_host[i] and used + numel * bytes_per_element <= budget_bytes:
            on_host[i], used = True, used + numel * bytes_per_element
    return tuple(on_host)


def _check_tiers(cfg: Config) -> None:
    tiers = (cfg.stage, cfg.offload.params, cfg.offload.optimizer, cfg.offload.gradients, cfg.param_dtype)
    if "auto" in tiers or cfg.activation_checkpointing == "auto":
        raise ValueError(
            "plan_units needs a concrete Config; resolve its 'auto' fields first (zeroinf.plan(...).config)"
        )


@dataclass(frozen=True)
class ModelPlan:
    """The per-unit plan of a whole model under one Config and world size."""

    units: tuple[UnitPlan, ...]
    cfg: Config
    world_size: int
    device_type: str = "cpu"
    """The accelerator's kind ("cuda", ...) or "cpu" when the CPU computes."""
    moments: int = 2
    """State tensors the optimizer keeps beside each fp32 master (`optimizer_moments`: Adam's 2,
    Lion's 1): what the optimizer states take per element. The optimizer sets it when it is built."""

    def with_moments(self, moments: int) -> ModelPlan:
        """This plan for an optimizer keeping `moments` state tensors (the split recomputed)."""
        return self if moments == self.moments else dataclasses.replace(self, moments=moments)

    @property
    def grad_buffer_dtype(self) -> str:
        """The dtype of every unit's unsharded gradient buffer (`gradient_buffer_dtype`)."""
        return gradient_buffer_dtype(self.cfg, self.world_size, self.device_type)

    @property
    def reductions_in_flight(self) -> int:
        """Gradient reductions backward leaves running before it finishes the oldest (engine.py). One
        CPU process has nothing to overlap a reduction with (it is done when started): finishing each
        at once frees its gradient buffer, or steps it, before the next unit's fills."""
        return 0 if self.world_size == 1 and self.device_type == "cpu" else MAX_REDUCTIONS_IN_FLIGHT

    @cached_property
    def _by_name(self) -> dict[str, UnitPlan]:
        return {u.key: u for u in self.units}

    def unit(self, key: str) -> UnitPlan:
        """The unit of this key (`UnitSpec.key`: the name, with `#frozen` for a frozen unit)."""
        try:
            return self._by_name[key]
        except KeyError:
            raise KeyError(f"the unit plan has no unit {key!r}; units: {[u.key for u in self.units][:8]}") from None

    @property
    def trainable_units(self) -> tuple[UnitPlan, ...]:
        """Units with gradients and optimizer state (`Engine.units`); frozen units come after them."""
        return tuple(u for u in self.units if not u.frozen)

    @property
    def sharded_units(self) -> tuple[UnitPlan, ...]:
        """Units gathered before use and freed after (stage 3, not resident)."""
        return tuple(u for u in self.units if not u.resident)

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def owned_numel(self) -> int:
        return sum(u.owned_numel for u in self.units)

    @property
    def nvme_param_units(self) -> tuple[UnitPlan, ...]:
        """Units whose parameter shard lives on NVMe (offload.params = nvme, or the NVMe part of a split)."""
        return tuple(u for u in self.sharded_units if u.param_tier is Tier.NVME)

    @property
    def params_split(self) -> bool:
        """Parameter shards on both the host and NVMe (offload.params = host over `max_host_bytes`)."""
        tiers = {u.param_tier for u in self.sharded_units}
        return tiers == {Tier.HOST, Tier.NVME}

    # -- parameters on NVMe (partition/offload.py) -----------------------------------------------------
    def param_swap_bytes(self) -> dict[tuple[str, str], int]:
        """Slots of the parameter swap file: every non-resident unit's shard on NVMe."""
        return {(u.swap_key, PARAM_SWAP_KIND): u.shard_bytes for u in self.nvme_param_units}

    def param_staging(self) -> SizedStagingPlan:
        """Host buffers for NVMe parameter shards in flight, by size class ([Note: staging by size
        class]): per class, the units of it the prefetcher may read ahead and `PARAM_STAGING_EXTRA`,
        at most its number of units. The prefetch plan keeps the units ahead within `prefetch_bytes`
        (runtime/prefetch.py), so at most as many of them are read at once as the smallest units that
        fit it together (counting floor(prefetch_bytes / smallest unit) made a small unit, such as a
        position embedding split from the root, stand for every unit: 23 buffers of a 1.0B GPT's
        largest shard, 4.6 GB, where 2 fit)."""
        sharded = self.nvme_param_units
        if not sharded:
            raise ValueError("offload.params = 'nvme' but every unit is resident; lower persist_threshold_bytes")
        extra = PARAM_STAGING_EXTRA - self.param_writes_from_master + self.param_buffers_kept_for_masters
        classes = []
        for size, units in _size_classes(sharded):
            ahead, room = 0, self.cfg.prefetch_bytes
            for unsharded in sorted(u.unsharded_bytes for u in units):
                if unsharded > room:
                    break
                ahead, room = ahead + 1, room - unsharded
            classes.append((size, min(len(units), ahead + extra)))
        return SizedStagingPlan(tuple(sorted(classes)))

    @property
    def param_cache_slot_bytes(self) -> int:
        """A parameter cache slot (tiers/shard_cache.py): the largest NVMe shard, aligned. Staging buffers
        come by size class (`param_staging`)."""
        return round_up(max(u.shard_bytes for u in self.nvme_param_units), SWAP_ALIGN_BYTES)

    @property
    def param_buffers_kept_for_masters(self) -> int:
        """Staging buffers units keep after their backward gather for their steps inside backward to
        take the masters from (partition/shard_home.py [Note: a shard kept for its masters]), where
        the parameter file holds the masters and the step runs inside backward, else none. A unit is
        stepped once its reduction is finished, and backward leaves `reductions_in_flight` running
        before it finishes the oldest: the units gathered meanwhile keep theirs too, one each."""
        kept = any(self.masters_in_param_file) and step_in_backward_mode(self.cfg) == "final"
        if not kept or self.param_cache_slots() >= len(self.nvme_param_units):  # a whole cache holds them
            return 0
        return 1 + self.reductions_in_flight

    @property
    def param_writes_from_master(self) -> bool:
        """Updated NVMe parameter shards are written straight from the optimizer's fp32 masters, which
        stay in place on the host (partition/shard_home.py [Note: writes from the master]): fp32
        parameters, every unit's states resident in host memory (no NVMe part, no split possible)."""
        o = self.cfg.offload
        resident = o.optimizer == "host" or (o.optimizer == "device" and self.device_type == "cpu")
        split_possible = o.max_host_bytes is not None and o.nvme_dir is not None
        return self.cfg.param_dtype == "fp32" and resident and not split_possible

    @cached_property
    def masters_in_param_file(self) -> tuple[bool, ...]:
        """Per trainable unit: its fp32 masters are its NVMe parameter shard, one copy on disk, not two
        (optim/nvme_states.py [Note: masters in the parameter file]). Holds for the units whose shard is on
        NVMe when parameters are fp32 (the shard equals the master bit for bit), the optimizer states
        are all on NVMe, and no speculative step needs the masters before it (a second copy)."""
        cfg = self.cfg
        applies = (
            cfg.stage == 3 and cfg.param_dtype == "fp32" and cfg.offload.optimizer == "nvme"
            and step_in_backward_mode(cfg) != "speculative"
        )
        return tuple(
            applies and not u.resident and u.param_tier is Tier.NVME and u.owned_numel == u.layout.shard_numel
            for u in self.trainable_units
        )

    @cached_property
    def masters_in_memory_shard(self) -> tuple[bool, ...]:
        """Per trainable unit: its fp32 master is its parameter shard in memory, one tensor, not two
        (optim/states.py [Note: masters in the memory shard]). Holds at stages 0-2 in fp32 with the
        optimizer's states on the device (its owned range of the whole buffer is the master), and at
        stage 3 when the optimizer's states stay in the memory that holds the unit's shard (both on
        the device; on a CPU device host and device are one memory); never with a host/NVMe split. At
        stage 3 for sharded units in any compute
        dtype (the shard is then held in fp32 and cast as it is gathered) and for resident ones in fp32
        (the master is their slice of the whole buffer). Not for a host shard on an accelerator: its
        copies to the device would cross in fp32 and read the master while a step may write it."""
        cfg, optimizer = self.cfg, self.cfg.offload.optimizer
        if optimizer not in ("device", "host") or self.optimizer_split() is not None:
            return (False,) * len(self.trainable_units)

        def same_memory(tier: Tier) -> bool:
            return self.device_type == "cpu" or (tier is Tier.DEVICE and optimizer == "device")

        fp32 = cfg.param_dtype == "fp32"
        if cfg.stage != 3:  # the whole buffer on the device: in fp32 the owned range is the master
            return (fp32 and same_memory(Tier.DEVICE),) * len(self.trainable_units)
        return tuple(
            u.param_tier is not Tier.NVME and same_memory(u.param_tier) and (fp32 or not u.resident)
            for u in self.trainable_units
        )

    def param_cache_slots(self) -> int:
        """Whole shards `offload.param_cache_bytes` holds (tiers/shard_cache.py), at most one per NVMe unit."""
        budget, units = self.cfg.offload.param_cache_bytes, self.nvme_param_units
        if not budget or not units:
            return 0
        slot = self.param_cache_slot_bytes
        if budget < slot:
            raise ValueError(
                f"offload.param_cache_bytes = {budget} holds no parameter shard of {slot} bytes: "
                f"raise it to at least {slot} or set it to 0"
            )
        return min(len(units), budget // slot)

    # -- gradients on NVMe --------------------------------------------------------------------------------
    def grad_swap_bytes(self) -> dict[tuple[str, str], int]:
        """Slots of the gradient swap file: every trainable unit's fp32 gradient shard."""
        return {(u.swap_key, GRAD_SWAP_KIND): FP32_BYTES * u.layout.shard_numel for u in self.trainable_units}

    # -- optimizer states ---------------------------------------------------------------------------------
    def optimizer_staging(self, aio: AioConfig | None = None) -> OptimizerStaging:
        """The NVMe sub-groups and staging of the optimizer states on NVMe (with a split, of its NVMe part)."""
        owned = [u.owned_numel for u in self.trainable_units]
        split = self.optimizer_split()
        if split is not None:
            owned = [split.owned_numels[i] for i in split.nvme_units]
        return plan_optimizer_staging(owned, self.cfg.offload, aio or self.cfg.offload.aio)

    def other_host_bytes(self, optimizer_on_nvme: bool = True) -> int:
        """The engine's host buffers other than optimizer states on the host: parameter shards on the
        host, parameter staging, gradient shards on the host, one I/O engine's buffers per NVMe kind,
        and (`optimizer_on_nvme`) the NVMe optimizer staging. The part of `max_host_bytes` they leave
        is what optimizer states on the host may take."""
        o, cfg = self.cfg.offload, self.cfg
        engine_bytes = o.aio.workers * o.aio.block_bytes
        nbytes = sum(u.shard_bytes for u in self.sharded_units if u.param_tier is Tier.HOST)
        if self.nvme_param_units:
            nbytes += self.param_staging().total_bytes + engine_bytes
            nbytes += self.param_cache_slots() * self.param_cache_slot_bytes
        if cfg.resolved_stage >= 2 and o.gradients == "host":
            nbytes += sum(u.grad_shard_bytes for u in self.trainable_units)
        if cfg.resolved_stage >= 2 and o.gradients == "nvme":
            nbytes += engine_bytes
        if optimizer_on_nvme and o.optimizer in ("host", "nvme") and o.nvme_dir is not None:  # states on NVMe
            owned = [u.owned_numel for u in self.trainable_units]
            nbytes += plan_optimizer_staging(owned, o, o.aio).host_bytes + engine_bytes
        return nbytes

    @cached_property
    def _optimizer_split(self) -> OptimizerSplit | None:
        o = self.cfg.offload
        if o.optimizer != "host" or o.max_host_bytes is None or o.nvme_dir is None:
            return None
        owned = tuple(u.owned_numel for u in self.trainable_units)
        element = state_element_bytes(o, self.moments)
        per_element = element * (2 if step_in_backward_mode(self.cfg) == "speculative" else 1)
        if sum(owned) * per_element <= o.max_host_bytes - self.other_host_bytes(optimizer_on_nvme=False):
            return None  # everything fits: no split
        budget = max(0, o.max_host_bytes - self.other_host_bytes())
        return OptimizerSplit(choose_host_units(owned, budget, per_element), owned, budget, element)

    def optimizer_split(self) -> OptimizerSplit | None:
        """The host/NVMe split of the optimizer states, when `offload.optimizer` = "host", its states
        exceed `offload.max_host_bytes` and `offload.nvme_dir` is set; None otherwise."""
        return self._optimizer_split


def is_resident(unit: UnitShape, cfg: Config, world_size: int, layout: FlatLayout | None = None) -> bool:
    """Stage 3 keeps the root unit and units below `persist_threshold_bytes` unsharded; stages 0-2 all."""
    if cfg.resolved_stage < 3:
        return True
    layout = layout or FlatLayout.build(list(unit.params), world_size)
    itemsize = FP32_BYTES if unit.fp32 else DTYPES[cfg.param_dtype].itemsize
    small = layout.padded_numel * itemsize < cfg.persist_threshold_bytes
    return unit.name == "" or small


@functools.lru_cache(maxsize=4096)
def _layout(unit: UnitShape, world_size: int) -> FlatLayout:
    return FlatLayout.build([(n, torch.Size(s)) for n, s in unit.params], world_size)


def plan_units(
    units: Sequence[UnitShape], cfg: Config, world_size: int, device_type: str = "cpu", moments: int = 2
) -> ModelPlan:
    """The plan of every unit (in the order given: unit discovery's order, root last) on `world_size`
    ranks computing on `device_type`, for an optimizer keeping `moments` state tensors. Pure."""
    _check_tiers(cfg)
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} is invalid: use a positive number of ranks")
    param_itemsize = DTYPES[cfg.param_dtype].itemsize
    reduce_itemsize = DTYPES[cfg.reduce_dtype].itemsize
    grad_buffer_itemsize = DTYPES[gradient_buffer_dtype(cfg, world_size, device_type)].itemsize
    planned = []
    for unit in units:
        layout = _layout(unit, world_size)
        resident = is_resident(unit, cfg, world_size, layout)
        tier = Tier(cfg.offload.params) if cfg.stage == 3 and not resident else Tier.DEVICE
        owned = 0 if unit.frozen else layout.shard_numel if cfg.resolved_stage >= 1 else layout.padded_numel
        # a unit kept in fp32 holds and collects its gradients in reduce_dtype, never its own narrower one
        itemsizes = (FP32_BYTES, reduce_itemsize) if unit.fp32 else (param_itemsize, grad_buffer_itemsize)
        planned.append(UnitPlan(
            unit.name, layout, resident, tier, itemsizes[0], reduce_itemsize, owned, unit.frozen,
            itemsizes[1], unit.order, unit.fp32,
        ))
    plan = ModelPlan(tuple(planned), cfg, world_size, device_type, moments)
    return _split_params(plan)


def _split_params(plan: ModelPlan) -> ModelPlan:
    """Parameter shards on the host beyond what `max_host_bytes` leaves them go to NVMe (with an
    `nvme_dir`), units spread along the order as the optimizer's split does. The shards come first
    in the host budget (a shard is read twice and written once a step, so a host byte saves more
    disk traffic as a shard than as an optimizer state), then the engine's other buffers; the
    optimizer states get what remains (`optimizer_split`)."""
    o = plan.cfg.offload
    if plan.cfg.stage != 3 or o.params != "host" or o.max_host_bytes is None or o.nvme_dir is None:
        return plan
    sharded = [i for i, u in enumerate(plan.units) if not u.resident]
    if not sharded:
        return plan
    if plan.other_host_bytes() <= o.max_host_bytes:  # host shards included
        return plan  # every shard fits on the host
    # With some shards on NVMe: their staging and I/O engine come out of the budget too.
    probe = dataclasses.replace(plan, units=tuple(
        dataclasses.replace(u, param_tier=Tier.NVME) if i in sharded else u for i, u in enumerate(plan.units)
    ))
    budget = max(0, o.max_host_bytes - probe.other_host_bytes())
    on_host = choose_host_units([plan.units[i].shard_bytes for i in sharded], budget, 1)
    tiers = {i: Tier.HOST if h else Tier.NVME for i, h in zip(sharded, on_host, strict=True)}
    return dataclasses.replace(plan, units=tuple(
        dataclasses.replace(u, param_tier=tiers[i]) if i in tiers else u for i, u in enumerate(plan.units)
    ))
