"""The estimate of one placement: peak bytes per tier and per rank, whether it fits, and the step time.

A pure function of the per-unit plan (`ModelPlan`, the same `shard` builds from), the facts of one
training forward (`PassFacts`, or None when the planner cannot run the model), the workload and the
machine profile. Bytes follow the engine's ledger tag by tag (see memory.py), so the prediction is
checked against `zeroinf.memory_report(model)`; the process figure (`ram_bytes`) adds activations,
transients and the process baseline, and is checked against the peak RSS.

Memory, per rank, by ledger tag:
- `param_unsharded` (device): stages 0-2 every unit; stage 3 the resident units plus the largest
  set of non-resident units the prefetch plan keeps unsharded at once (runtime/prefetch.py, forward
  order and its reverse with the backward release lag).
- `param_shard`: stage 3, the non-resident units' shards on `offload.params` (NVMe: the swap file,
  and `param_staging` on the host); a resident unit's shard is a slice of its whole buffer. A shard
  that is its unit's fp32 master (`ModelPlan.masters_in_memory_shard`) counts 4 bytes per element,
  and its master is not counted again under `optimizer_state`.
- `grad_unsharded` (device): stages 0-1 every unit's buffer lives until the end of backward; stages
  2-3 a unit's buffer is freed once reduced, at most three at once (two reductions in flight and one
  filling), plus at stage 3 the resident units' and at stage 2 with accumulation every buffer an
  earlier micro-step filled.
- `grad_shard`: stages 2-3, one per unit on `offload.gradients` (NVMe: the gradient swap file); on the
  device, the shards reduced so far (at world 1 the unsharded buffer adopted as the shard). A device
  buffer a host shard is reduced into on an accelerator (`grad_reduce_out`, shard-sized, at most
  two) is not counted.
- `optimizer_state`: 12 bytes per owned element (8 with `offload.moment_dtype` bf16) on
  `offload.optimizer` for Adam's two moments, less for an optimizer keeping fewer
  (`ModelPlan.moments`: Lion 8, plain SGD 4) (NVMe: a swap file per state kept,
  `optimizer_staging` and `optimizer_assembly` on the host); split by `max_host_bytes`
  (`ModelPlan.optimizer_split`): the host part on the host, the rest as on NVMe.
- `transfer_staging` (host): NVMe gradient shards land in pool buffers, a few per shard size.
- `aio_buffers`: each NVMe kind has an I/O engine with one bounce buffer per worker.
- `activation_offload` (host): with `offload_activations`, the inputs kept by checkpointing.

Time, per step and rank (seconds): forward and backward are compute (matmuls at the measured rate
for their operand size and dtype, other operators at the measured memory bandwidth, 3x the forward,
plus the recomputed forward under activation checkpointing) and collectives, overlapped with NVMe
reads of parameter shards and writes of gradient shards; the optimizer phase is the fused AdamW
over the owned elements, overlapped with the swaps of its states and the writes of new parameters.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from zeroinf.aio.buffers import round_up
from zeroinf.config import DTYPES, Config
from zeroinf.memory import Tier
from zeroinf.optim.moments import WINDOW_TAG, window_bytes
from zeroinf.partition.shard_home import MAX_GRAD_WRITES_IN_FLIGHT
from zeroinf.planner.model_facts import PassFacts
from zeroinf.planner.profile import MachineProfile
from zeroinf.planner.unit_plan import (
    FP32_BYTES,
    OPTIMIZER_SWAP_KINDS,
    SWAP_ALIGN_BYTES,
    ModelPlan,
    OptimizerSplit,
    state_element_bytes,
    step_in_backward_mode,
)
from zeroinf.runtime.prefetch import kept_for_backward, plan_prefetch
from zeroinf.runtime.streams import STAGING_TAG
from zeroinf.tiers.shard_cache import simulate_reads

RAM_HEADROOM = 0.9  # plan to use at most this share of the available RAM
DEVICE_HEADROOM = 0.9
BF16_MOMENTS_ADAM_COST = 2.1  # AdamW time with bf16 moments over fp32 ones (optim/moments.py; CPU measured)
OP_OVERHEAD_S = 20e-6  # fixed cost of one operator launch (CPU) when the profile has none


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, per the plan's world size."""

    tokens_per_step: int
    """Tokens of one optimizer step over all ranks and micro-steps."""
    seq_len: int
    world_size: int
    grad_accum_steps: int = 1

    @property
    def micro_batch(self) -> int:
        """Sequences per micro-step per rank (at least 1)."""
        per_rank = self.tokens_per_step / (self.world_size * self.grad_accum_steps * self.seq_len)
        return max(1, round(per_rank))


@dataclass(frozen=True)
class TierBytes:
    device: int
    host: int
    nvme: int
    by_tag: dict[str, dict[str, int]] = field(default_factory=dict)
    """tier -> tag -> bytes at the predicted peak (the ledger's tags)."""

    def of(self, tier: Tier | str) -> int:
        return int(getattr(self, Tier(tier).value))


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    collectives_s: float
    nvme_io_s: float
    optimizer_s: float
    step_s: float
    bound: str
    """What sets the step time: "compute", "collectives", "nvme I/O" or "optimizer"."""
    forward_backward_s: float
    optimizer_phase_s: float
    nvme_read_bytes: int
    nvme_written_bytes: int
    collective_bytes: int


@dataclass(frozen=True)
class Estimate:
    """One placement's prediction, per rank."""

    config: Config
    ledger: TierBytes
    """Peak bytes per tier as the engine's ledger will count them."""
    activation_bytes: int
    """Peak bytes of activations and transients (not on the ledger)."""
    ram_bytes: int
    """Peak RSS of a rank process (on a CPU-only machine the device tier is RAM too)."""
    device_bytes: int
    """Accelerator memory needed (0 on a CPU-only machine)."""
    fits: bool
    why_not: tuple[str, ...]
    time: StepTime
    pressure: float = 0.0
    """The largest share of a resource (RAM, device memory, NVMe folder) the placement needs; > 1: no fit."""
    optimizer_split: OptimizerSplit | None = None
    """The host/NVMe split of the optimizer states (`offload.max_host_bytes`), when there is one."""
    param_split: tuple[int, int] | None = None
    """Units whose parameter shards are on the host and on NVMe, when `max_host_bytes` splits them."""

    @property
    def placement(self) -> str:
        notes = []
        if self.param_split is not None:
            notes.append(f"parameter shards split: {self.param_split[0]} units on host, {self.param_split[1]} on nvme")
        if self.optimizer_split is not None:
            notes.append(self.optimizer_split.describe())
        return describe_placement(self.config) + (f" ({'; '.join(notes)})" if notes else "")


def describe_placement(cfg: Config) -> str:
    o = cfg.offload
    ckpt = "+ckpt" if cfg.activation_checkpointing else ""
    return f"stage {cfg.stage} params {o.params}, optimizer {o.optimizer}, grads {o.gradients}{ckpt}"


# -- memory -------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _kept_units(plan: ModelPlan) -> frozenset[int]:
    """Stage 3: the units (indices into `plan.units`) the forward keeps gathered for the backward
    (runtime/prefetch.py `kept_for_backward`): gathered, and on NVMe read, once a micro-step, not twice."""
    plans = _prefetch_plans(plan) if plan.cfg.stage == 3 else None
    if plans is None:
        return frozenset()
    units = plan.units
    staged = {i for i, u in enumerate(units) if not u.resident and u.param_tier is Tier.NVME}
    sizes = {i: u.unsharded_bytes for i, u in enumerate(units)}
    return kept_for_backward(*plans, {i for i, u in enumerate(units) if u.resident}, staged, sizes)


@functools.lru_cache(maxsize=16)
def _prefetch_plans(plan: ModelPlan) -> tuple[Any, Any] | None:
    """The engine's prefetch plans for the forward order (module order) and the backward (its reverse).
    Cached: the memory timeline and the kept units both read them (the plans are frozen)."""
    cfg = plan.cfg
    order = sorted((i for i, u in enumerate(plan.units) if not u.resident), key=lambda i: _module_order(plan.units[i]))
    if not order:
        return None
    sizes = {i: u.unsharded_bytes for i, u in enumerate(plan.units)}
    resident = {i for i, u in enumerate(plan.units) if u.resident}
    nested = _nested(tuple(u.name for u in plan.units))
    live = cfg.max_live_bytes if cfg.max_live_bytes is not None else 2**62
    args: dict[str, Any] = dict(
        sizes=sizes, resident=resident, prefetch_bytes=cfg.prefetch_bytes, max_live_bytes=live,
        nested={i: js for i, js in nested.items() if js},
    )
    return plan_prefetch(order, release_lag=0, **args), plan_prefetch(order[::-1], release_lag=1, **args)


def _module_order(unit: Any) -> tuple[Any, ...]:
    """Sort key of the order units run in: their modules' order in the model (`UnitShape.order`),
    then their module paths with numbers compared as numbers (shapes built by hand have no order),
    a frozen unit just before its trainable twin (its pre-forward hook runs first; the plan lists
    frozen units after all trainable ones)."""
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in unit.name.split(".")) if unit.name else ()
    return (unit.name == "", unit.order, parts, not unit.frozen)


@functools.lru_cache(maxsize=8)
def _nested(names: tuple[str, ...]) -> dict[int, frozenset[int]]:
    """Unit index -> the units nested inside it (their names extend its name)."""
    return {
        i: frozenset(j for j, v in enumerate(names) if u and v.startswith(f"{u}."))
        for i, u in enumerate(names)
    }


def _swap_file_bytes(slots: dict[tuple[str, str], int]) -> int:
    """Bytes of the swap files holding `slots`, each at an aligned offset (as tiers/nvme.py lays them out)."""
    return sum(round_up(max(nbytes, 1), SWAP_ALIGN_BYTES) for nbytes in slots.values())


def _gathered_bytes(prefetch: Any, units: tuple[Any, ...], kept: frozenset[int] = frozenset()) -> list[int]:
    """Unsharded bytes alive while each step's unit runs. A prefetched shard on NVMe is read during
    the step and gathered at the next event (runtime/schedule.py), so its unsharded buffer does not
    exist yet, unless the forward kept it gathered for the backward (`kept`); one in memory is
    gathered at once."""
    return [
        live - sum(
            units[u].unsharded_bytes for u in step.prefetch if units[u].param_tier is Tier.NVME and u not in kept
        )
        for step, live in zip(prefetch.steps, prefetch.live_bytes, strict=True)
    ]


def _kept_so_far(forward: Any, units: tuple[Any, ...], kept: frozenset[int]) -> list[int]:
    """Per forward step, the unsharded bytes of the units the forward already ran and keeps for the
    backward (runtime/prefetch.py `kept_for_backward`), which its plan counts as released."""
    last = {step.unit: i for i, step in enumerate(forward.steps)}
    return [
        sum(units[u].unsharded_bytes for u in kept if last[u] < i and forward.steps[last[u]].release_after)
        for i in range(len(forward.steps))
    ]


def _last(values: list[int], count: int) -> list[int]:
    return values[max(0, len(values) - count) :]


def _grad_moments(
    plan: ModelPlan, order: list[Any], held: bool = False, accumulated: bool = False, settled: bool = False
) -> list[dict[str, int]]:
    """Stages 2-3: the gradient bytes on the device as each unit of `order` (backward order) starts its
    reduction (partition/unit_grads.py [Note: where a reduced gradient lands]): the unsharded buffers filling or in
    flight (at most `reductions_in_flight` + 1), those of units not yet reduced when an earlier
    micro-step kept them all (`held`), and the device shards reduced so far, or all of them when an
    earlier micro-step reduced into them (`accumulated`). At world 1 the first micro-step's device
    shard is the unsharded buffer itself, adopted when its reduction starts. A shard the optimizer
    steps inside backward and frees (`_released`) lives only while its reduction is in flight;
    `settled`: the moment just after, once the reductions beyond the limit were finished and stepped
    (what a frozen unit's backward, which reduces nothing, finds)."""
    device_shards = plan.cfg.offload.gradients == "device"
    adopt = device_shards and plan.world_size == 1 and not accumulated
    all_shards = sum(u.grad_shard_bytes for u in order) if device_shards else 0
    released = _released(plan) and not accumulated
    in_flight = plan.reductions_in_flight + (0 if settled and released else 1)
    flats: list[int] = []
    window: list[int] = []
    shards = 0
    moments = []
    for i, unit in enumerate(order):
        if not adopt:
            flats = _last(flats + [unit.grad_unsharded_bytes], in_flight)
        if released:
            window = _last(window + [unit.grad_shard_bytes if device_shards else 0], in_flight)
            shards = sum(window)
        else:
            shards += unit.grad_shard_bytes if device_shards else 0
        waiting = sum(u.grad_unsharded_bytes for u in order[i + 1 :]) if held else 0
        moments.append({"grad_unsharded": sum(flats) + waiting, "grad_shard": all_shards if accumulated else shards})
    return moments


def _backward_moments(
    plan: ModelPlan, order: list[Any], last: list[Any], held: bool = False, accumulated: bool = False,
    settled: bool = False,
) -> list[dict[str, int]]:
    """The gradient moments of one backward: the units of `order` reduce in turn while the buffers of
    `last` (the root: its embedding's gradient comes last, its head's first) fill all along; they
    reduce at the end."""
    base = sum(u.grad_unsharded_bytes for u in last)
    during = _grad_moments(plan, order, held, accumulated, settled)
    moments = [{**m, "grad_unsharded": base + m["grad_unsharded"]} for m in during]
    end = _grad_moments(plan, order + last, held, accumulated, settled)
    return moments + end[-1:]


def _backward_order(plan: ModelPlan, units: list[Any]) -> tuple[list[Any], list[Any]]:
    """(the trainable units other than the root in the order backward reduces them, the root)."""
    trainable = [u for u in units if not u.frozen]
    blocks = sorted((u for u in trainable if u.name), key=_module_order, reverse=True)
    return blocks, [u for u in trainable if not u.name]


def _micro_steps(plan: ModelPlan) -> list[tuple[bool, bool]]:
    """(held, accumulated) for the kinds of backward one step runs: without a sync per micro-step,
    stage 2 reduces only in the last one, after the earlier ones kept every unsharded buffer."""
    cfg = plan.cfg
    if cfg.grad_accum_steps == 1:
        return [(False, False)]
    if cfg.stage == 2 and not cfg.sync_every_micro_step:
        return [(True, False)]
    return [(False, False), (False, True)]


def _stage2_moments(plan: ModelPlan) -> list[dict[str, int]]:
    """Stage 2: every parameter unsharded; gradients reduced unit by unit in backward."""
    params = sum(u.unsharded_bytes for u in plan.units)
    order, root = _backward_order(plan, list(plan.units))
    moments = []
    for held, accumulated in _micro_steps(plan):
        moments += [{"param_unsharded": params, **m} for m in _backward_moments(plan, order, root, held, accumulated)]
    return moments


def _stage3_moments(plan: ModelPlan) -> list[dict[str, int]]:
    """Stage 3: the moving device bytes (unsharded params and gradients, gradient shards) at the moments
    that can be peaks: the forward's fullest step, and each unit's reduction in backward (the
    unit gathered, the prefetched ones, the gradient buffers in flight, the shards reduced so far)."""
    return [moment for _, moment in _stage3_timeline(plan)]


_FORWARD, _END = -1, -2  # `_stage3_timeline` markers: the forward's fullest step, the end of backward


@functools.lru_cache(maxsize=16)
def _stage3_timeline(plan: ModelPlan) -> tuple[tuple[int, dict[str, int]], ...]:
    """`_stage3_moments`, each with where it falls: _FORWARD, the unit whose backward step it is, or _END.

    Cached (a plan is frozen): the ledger's peak and the peak with activations both read it, and the
    prefetch planning behind it is most of an estimate's time. Read-only."""
    units = plan.units
    resident_params = sum(u.unsharded_bytes for u in units if u.resident)
    plans = _prefetch_plans(plan)
    if plans is None:
        return ((_FORWARD, {"param_unsharded": resident_params}),)
    forward, backward = plans
    kept = _kept_units(plan)
    during = zip(_gathered_bytes(forward, units), _kept_so_far(forward, units, kept), strict=True)
    gathered = resident_params + max((now + held for now, held in during), default=0)
    live = dict(zip((step.unit for step in backward.steps), _gathered_bytes(backward, units, kept), strict=True))
    order = [units[step.unit] for step in backward.steps if not units[step.unit].frozen]
    resident = [u for u in units if u.resident and not u.frozen]
    moments: list[tuple[int, dict[str, int]]] = []
    for _, accumulated in _micro_steps(plan):
        grads = _backward_moments(plan, order, resident, accumulated=accumulated)
        after = _backward_moments(plan, order, resident, accumulated=accumulated, settled=True)
        shards_before = grads[0]["grad_shard"] if accumulated else 0
        carried = {"grad_unsharded": sum(u.grad_unsharded_bytes for u in resident), "grad_shard": shards_before}
        moments.append((_FORWARD, {"param_unsharded": gathered, "grad_shard": shards_before}))
        pending = iter(zip(grads[:-1], after[:-1], strict=True))
        for step in backward.steps:  # a frozen unit's step finds the gradients as the last reduction left them
            if units[step.unit].frozen:
                current = carried
            else:
                current, carried = next(pending)
            moments.append((step.unit, {"param_unsharded": resident_params + live[step.unit], **current}))
        moments.append((_END, {"param_unsharded": resident_params, **grads[-1]}))  # the resident units reduce
    return tuple(moments)


def device_peak_with_activations(plan: ModelPlan, facts: PassFacts | None, ledger: TierBytes) -> int:
    """Peak device bytes with the activations alive at the same moment (on a CPU both are RAM).

    Backward frees a block's saved activations as it goes while gradient shards pile up, so the
    two peaks do not coincide: at stage 3 without activation checkpointing each moment of
    `_stage3_timeline` gets the activations alive then (`activations_alive`). Otherwise (or when
    the units do not line up with the pass's blocks) both peaks are added.
    """
    activations, _ = activation_peak(facts, plan.cfg)
    alive = activations_alive(plan, facts)
    if facts is None or alive is None:
        return ledger.device + activations
    transient = activations - facts.saved_bytes
    timeline = _stage3_timeline(plan)
    fixed = ledger.device - max(sum(m.values()) for _, m in timeline)  # shards, states: always there
    return max(fixed + sum(moment.values()) + a + transient for (_, moment), a in zip(timeline, alive, strict=True))


def activations_alive(plan: ModelPlan, facts: PassFacts | None) -> list[int] | None:
    """Saved activation bytes alive at each moment of `_stage3_timeline`: all of them at the forward's
    fullest step; at a unit's backward step the root's and those of the blocks up to the one holding
    the unit (by module path: a nested unit, or a frozen twin of the same name); the root's at the
    end. None where the pass's blocks cannot be matched to units: not stage 3, activation
    checkpointing (recomputation changes what is alive), or a different count of blocks."""
    if facts is None or plan.cfg.stage != 3 or plan.cfg.activation_checkpointing:
        return None
    inner = set().union(*_nested(tuple(u.name for u in plan.units)).values())
    outer = sorted(
        (i for i, u in enumerate(plan.units) if u.name and not u.frozen and i not in inner),
        key=lambda i: _module_order(plan.units[i]),
    )
    if len(outer) != len(facts.unit_saved_bytes):
        return None
    block_of_name = {plan.units[i].name: k for k, i in enumerate(outer)}

    def at(where: int) -> int:
        if where == _FORWARD:
            return facts.saved_bytes
        name = "" if where == _END else plan.units[where].name
        while name and name not in block_of_name:
            name = name.rpartition(".")[0]
        blocks = block_of_name[name] + 1 if name else 0
        return facts.root_saved_bytes + sum(facts.unit_saved_bytes[:blocks])

    return [at(where) for where, _ in _stage3_timeline(plan)]


def _grad_landing_bytes(plan: ModelPlan) -> int:
    """Host pool buffers NVMe gradient shards land in (unit.py `_land_on_disk`): the pool keeps
    buffers by exact size, and per size at most the writes in flight, the shard arriving and (with
    accumulation) the earlier shard read back are lent at once."""
    at_once = MAX_GRAD_WRITES_IN_FLIGHT + 1 + (plan.cfg.grad_accum_steps > 1)
    sizes = Counter(u.layout.shard_numel * FP32_BYTES for u in plan.trainable_units)
    return sum(size * min(count, at_once) for size, count in sizes.items())


def _released(plan: ModelPlan) -> bool:
    """Whether each reduced gradient is stepped inside backward and freed at once, never landing on its
    tier (one micro-step, or the only reducing one; the "final" mode)."""
    return step_in_backward_mode(plan.cfg) == "final" and _grads_stay_in_memory(plan.cfg)


def _grads_stay_in_memory(cfg: Config) -> bool:
    """Whether no reduced gradient lands on its tier before the step: no earlier micro-step was reduced."""
    return cfg.grad_accum_steps == 1 or (cfg.resolved_stage < 3 and not cfg.sync_every_micro_step)


def ledger_bytes(plan: ModelPlan, activation_offload_bytes: int = 0) -> TierBytes:
    """Peak bytes per tier, and by tag at that peak, as the engine's ledger counts them over a step."""
    cfg = plan.cfg
    o = cfg.offload
    tags: dict[str, dict[str, int]] = {"device": {}, "host": {}, "nvme": {}}

    def add(tier: str, tag: str, nbytes: int) -> None:
        if nbytes:
            tags[tier][tag] = tags[tier].get(tag, 0) + int(nbytes)

    units = plan.units
    # Units whose fp32 master is their shard in memory ([Note: masters in the memory shard]).
    shared = [u for u, held in zip(plan.trainable_units, plan.masters_in_memory_shard, strict=True) if held]
    shared_keys = {u.key for u in shared}
    engine_bytes = o.aio.workers * o.aio.block_bytes  # each NVMe kind's engine: one bounce buffer per worker
    if cfg.resolved_stage < 2:  # every buffer lives until the end of backward
        add("device", "param_unsharded", sum(u.unsharded_bytes for u in units))
        add("device", "grad_unsharded", sum(u.grad_unsharded_bytes for u in units))
    elif cfg.stage == 2:
        for tag, nbytes in max(_stage2_moments(plan), key=lambda m: sum(m.values())).items():
            add("device", tag, nbytes)
    else:
        peak = max(_stage3_moments(plan), key=lambda m: sum(m.values()))
        for tag, nbytes in peak.items():
            add("device", tag, nbytes)
        if plan.nvme_param_units:  # none sharded: all stay on the device
            add("nvme", "param_shard", _swap_file_bytes(plan.param_swap_bytes()))
            add("host", "param_staging", plan.param_staging().total_bytes)
            add("host", "aio_buffers", engine_bytes)
            if slots := plan.param_cache_slots():
                add("host", "param_cache", slots * plan.param_cache_slot_bytes)
        for u in plan.sharded_units:  # in memory (a split's host part included); fp32 where it is the master
            if u.param_tier is not Tier.NVME:
                shard_bytes = u.layout.shard_numel * FP32_BYTES if u.key in shared_keys else u.shard_bytes
                add(u.param_tier.value, "param_shard", shard_bytes)
    mode = step_in_backward_mode(cfg)
    if cfg.resolved_stage >= 2:
        if o.gradients == "nvme":
            add("nvme", "grad_shard", _swap_file_bytes(plan.grad_swap_bytes()))
            if not (mode == "final" and _grads_stay_in_memory(cfg)):  # else stepped where reduced, never landed
                add("host", STAGING_TAG, _grad_landing_bytes(plan))
            add("host", "aio_buffers", engine_bytes)
        elif o.gradients == "host" and not _released(plan):  # device shards: counted in the moments above
            add(o.gradients, "grad_shard", sum(u.grad_shard_bytes for u in plan.trainable_units))
    element = state_element_bytes(o, plan.moments)  # Adam: 12, or 8 with bf16 moments
    state_bytes = element * plan.owned_numel - FP32_BYTES * sum(u.owned_numel for u in shared)
    split = plan.optimizer_split()
    if split is not None:  # the host part's states (and copies) on the host, the rest as on NVMe below
        add("host", "optimizer_state", element * split.host_numel)
        if mode == "speculative":
            add("host", "optimizer_backup", element * split.host_numel)
    if o.optimizer == "nvme" or split is not None:
        staging = plan.optimizer_staging()
        for k, kind in enumerate(OPTIMIZER_SWAP_KINDS[: 1 + plan.moments]):  # a speculative step: second slots
            elsewhere = plan.masters_in_param_file if k == 0 else ()
            add("nvme", kind, staging.file_bytes(mode == "speculative", elsewhere, state=k))
        add("host", "optimizer_staging", staging.pool.total_bytes)
        add("host", "optimizer_assembly", staging.assembly_numel * FP32_BYTES)
        add("host", "aio_buffers", engine_bytes)
    else:
        add(o.optimizer, "optimizer_state", state_bytes)
        if mode == "speculative":  # the states before the step, kept until step() validates it
            add(o.optimizer, "optimizer_backup", state_bytes)
    if o.moment_dtype == "bf16" and plan.owned_numel:  # the update's fp32 windows, where it runs
        add("device" if o.optimizer == "device" else "host", WINDOW_TAG, window_bytes(_largest_sub_group(plan)))
    add("host", "activation_offload", activation_offload_bytes)
    device, host, nvme = (sum(tags[t].values()) for t in ("device", "host", "nvme"))
    return TierBytes(device, host, nvme, by_tag=tags)


def _largest_sub_group(plan: ModelPlan) -> int:
    """The most elements the optimizer updates at once: a whole unit's owned range in memory, at most
    `offload.sub_group_numel` of it on NVMe (optim/states.py, optim/nvme_states.py)."""
    o = plan.cfg.offload
    split = plan.optimizer_split()
    in_memory = [u.owned_numel for u in plan.trainable_units] if o.optimizer != "nvme" else []
    if split is not None:
        in_memory = [split.owned_numels[i] for i in split.host_units]
    on_nvme = [sg.numel for sg in plan.optimizer_staging().sub_groups] if o.optimizer == "nvme" or split else []
    return max([*in_memory, *on_nvme, 1])


def activation_peak(facts: PassFacts | None, cfg: Config) -> tuple[int, int]:
    """(bytes of activations and transients at the peak, bytes of them on the host tier)."""
    if facts is None:
        return 0, 0
    transient = 2 * facts.largest_tensor_bytes  # the loss's logits and their gradient, one layer's grads
    if not cfg.activation_checkpointing:
        return facts.saved_bytes + transient, 0
    every = cfg.checkpoint_every
    kept = [b for i, b in enumerate(facts.unit_input_bytes) if i % every == 0]
    plain = [b for i, b in enumerate(facts.unit_saved_bytes) if i % every != 0]
    recompute = max((b for i, b in enumerate(facts.unit_saved_bytes) if i % every == 0), default=0)
    offloaded = sum(kept) if cfg.offload_activations else 0
    return facts.root_saved_bytes + sum(plain) + sum(kept) - offloaded + recompute + transient, offloaded


# -- time ----------------------------------------------------------------------------------------------------
def pass_seconds(facts: PassFacts | None, dtype: str, profile: MachineProfile, units_only: bool = False) -> float:
    """Seconds of one forward: matmuls at the rate of their size, other operators at memory bandwidth."""
    if facts is None:
        return 0.0
    flops = facts.unit_matmul_flops if units_only else facts.root_matmul_flops + facts.unit_matmul_flops
    seconds = sum(f / profile.matmul_rate(dtype, size) for size, f in flops)
    other = facts.unit_other_bytes if units_only else facts.other_bytes
    return seconds + other / profile.memory_bps


def _read_once(plan: ModelPlan) -> tuple[Any, ...]:
    """The kept units whose NVMe shard is read once a micro-step, not twice. Where the parameter
    file holds a kept unit's masters, its step reads them from there instead of taking them from the
    backward's staged shard: the same load, through the same cache, moved to the step; unless the
    shard is still in a buffer kept for masters."""
    in_file = {u.key for u, held in zip(plan.trainable_units, plan.masters_in_param_file, strict=True) if held}
    # The shards the forward loaded last stay in the buffers kept for masters (partition/shard_home.py
    # [Note: a shard kept for its masters]); backward steps those units first, from there: read once.
    keep = plan.param_buffers_kept_for_masters
    on_nvme = {u.key for u in plan.nvme_param_units}
    loaded = sorted((i for i, u in enumerate(plan.units) if u.key in on_nvme), key=lambda i: _module_order(
        plan.units[i]))
    still_kept = set(loaded[-keep:]) if keep else set()
    kept = sorted(_kept_units(plan))
    return tuple(plan.units[i] for i in kept if plan.units[i].key not in in_file or i in still_kept)


def _param_read_bytes(plan: ModelPlan) -> int:
    """Bytes of NVMe parameter shards read in a steady step's loads (forward, and backward but for
    the kept units): all of them without a cache; with `param_cache_bytes`, what
    tiers/shard_cache.py's policy misses."""
    units = plan.nvme_param_units
    once = {u.key for u in _read_once(plan)}
    names = [u.key for u in units]
    order = names + [n for n in names[::-1] if n not in once]
    sizes = {u.key: u.shard_bytes for u in units}
    slots = plan.param_cache_slots()
    if not slots:
        return sum(sizes[n] for n in order)
    return simulate_reads(order, slots, steps=2, sizes=sizes)[-1]


def step_time(
    plan: ModelPlan, facts: PassFacts | None, work: Workload, profile: MachineProfile, param_count: int
) -> StepTime:
    cfg = plan.cfg
    o = cfg.offload
    w = plan.world_size
    accum = cfg.grad_accum_steps
    # Forward + backward = 3 forwards (+1 recomputed under checkpointing), per micro-step.
    forward_s = pass_seconds(facts, cfg.param_dtype, profile)
    if facts is None:  # a module the planner cannot call: 6 FLOPs per parameter and token at a mid-size rate
        forward_s = 2.0 * param_count * work.micro_batch * work.seq_len / profile.matmul_rate(cfg.param_dtype, 1024)
    recompute_s = pass_seconds(facts, cfg.param_dtype, profile, units_only=True) if cfg.activation_checkpointing else 0
    compute_s = accum * (3 * forward_s + recompute_s) * profile.efficiency(cfg.param_dtype)
    # Collectives (world 1: the same bytes as local copies).
    ring = (w - 1) / w if w > 1 else 1.0
    rate = profile.collective_rate(w) if w > 1 else profile.copy_bps
    params_b = sum(u.unsharded_bytes for u in plan.units)
    grads_b = sum(u.grad_unsharded_bytes for u in plan.trainable_units)
    sharded_b = sum(u.unsharded_bytes for u in plan.sharded_units)
    kept = [plan.units[i] for i in _kept_units(plan)]  # gathered (and read) for forward only
    if cfg.stage == 3:
        # gather forward and backward but for the kept units, reduce-scatter every micro-step
        per_micro = 2 * sharded_b - sum(u.unsharded_bytes for u in kept) + grads_b
        coll_b = accum * per_micro + (params_b - sharded_b)  # resident units refreshed after the step
        gathers = 2 * len(plan.sharded_units) - len(kept)
        calls = accum * (gathers + len(plan.trainable_units)) + len(plan.units) - len(plan.sharded_units)
    else:
        syncs = accum if cfg.sync_every_micro_step else 1
        grad_factor = 2 if cfg.resolved_stage < 2 else 1  # all-reduce moves twice a reduce-scatter's bytes
        coll_b = syncs * grad_factor * grads_b + (params_b if cfg.resolved_stage >= 1 else 0)
        calls = syncs * len(plan.units) + (len(plan.units) if cfg.resolved_stage >= 1 else 0)
    collective_bytes = int(coll_b * ring)
    latency = profile.collective_latency_s if w > 1 else 0.0
    collectives_s = collective_bytes / rate + calls * latency
    # NVMe traffic of a step.
    shard_b = sum(u.shard_bytes for u in plan.nvme_param_units)
    owned = plan.owned_numel
    fb_read = fb_write = opt_read = opt_write = 0
    if cfg.stage == 3 and shard_b:
        fb_read += accum * _param_read_bytes(plan)
        opt_write += shard_b
    mode = step_in_backward_mode(cfg)
    if cfg.resolved_stage >= 2 and o.gradients == "nvme":
        landed = accum if mode != "final" or not _grads_stay_in_memory(cfg) else 0
        fb_write += landed * FP32_BYTES * owned
        fb_read += max(0, landed - 1) * FP32_BYTES * owned
        if mode is None or not _grads_stay_in_memory(cfg):  # else stepped from memory inside backward
            opt_read += FP32_BYTES * owned
    split = plan.optimizer_split()
    on_nvme = owned if o.optimizer == "nvme" else split.nvme_numel if split is not None else 0
    # Masters in the parameter file are written with the parameters (counted above), and read only
    # when no host buffer holds the shard at the step: a whole cache, or the shard kept from backward
    # (for a unit kept gathered from forward, the load that read is counted above, see `_read_once`).
    held = zip(plan.trainable_units, plan.masters_in_param_file, strict=True)
    in_params = sum(u.owned_numel for u, in_file in held if in_file)
    in_memory = plan.param_cache_slots() >= len(plan.nvme_param_units) or plan.param_buffers_kept_for_masters
    element = state_element_bytes(o, plan.moments)
    opt_read += element * on_nvme - (FP32_BYTES * in_params if in_memory else 0)
    opt_write += element * on_nvme - FP32_BYTES * in_params
    rd, wr = profile.disk_read_bps, profile.disk_write_bps
    fb_io_s = fb_read / rd + fb_write / wr
    opt_io_s = opt_read / rd + opt_write / wr
    # The optimizer: fused AdamW where the states are, then the new compute-dtype values.
    adam_rate = profile.device_adam_params_per_s if o.optimizer == "device" else profile.adam_params_per_s
    itemsize = DTYPES[cfg.param_dtype].itemsize
    if o.moment_dtype == "bf16":  # widened, updated, rounded back (optim/moments.py [Note: bf16 moments])
        adam_rate /= BF16_MOMENTS_ADAM_COST
    optimizer_s = owned / adam_rate + owned * (FP32_BYTES + itemsize) / profile.copy_bps
    if on_nvme:  # the pipeline waits for the first sub-group's read and the last one's write
        staging = plan.optimizer_staging()
        first = sum(staging.state_bytes)
        optimizer_s += first / rd + first / wr
    fb_s = max(compute_s + collectives_s, fb_io_s)
    opt_s = max(optimizer_s, opt_io_s)
    if mode is not None and _grads_stay_in_memory(cfg):
        # Stepped inside backward: the state swaps share backward's window with its I/O; a CPU update
        # overlaps an accelerator's compute, and takes the same cores as a CPU device's; states on the
        # device are updated by the device itself, between its backward kernels.
        serial = profile.device == "cpu" or cfg.offload.optimizer == "device"
        cpu_bound = compute_s + collectives_s + (optimizer_s if serial else 0.0)
        fb_s = max(cpu_bound, optimizer_s, fb_io_s + opt_io_s)
        opt_s = 0.0
    parts = {
        "compute": compute_s, "collectives": collectives_s, "nvme I/O": fb_io_s + opt_io_s, "optimizer": optimizer_s,
    }
    if fb_io_s > compute_s + collectives_s:
        parts["nvme I/O"] = max(parts["nvme I/O"], fb_s + max(0.0, opt_io_s - optimizer_s))
    bound = max(parts, key=lambda k: parts[k])
    return StepTime(
        compute_s=compute_s, collectives_s=collectives_s, nvme_io_s=fb_io_s + opt_io_s, optimizer_s=optimizer_s,
        step_s=fb_s + opt_s, bound=bound, forward_backward_s=fb_s, optimizer_phase_s=opt_s,
        nvme_read_bytes=int(fb_read + opt_read), nvme_written_bytes=int(fb_write + opt_write),
        collective_bytes=collective_bytes,
    )


# -- one placement ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Capacity:
    """What the placement may use on this machine, per rank."""

    ram_bytes: int
    """RAM this rank may use (available RAM / ranks on this machine)."""
    device_bytes: int | None
    """Accelerator memory of this rank; None on a CPU-only machine."""
    nvme_free_bytes: int | None
    """Free bytes in the NVMe folder for this rank; None when no folder is known."""


def estimate(
    plan: ModelPlan,
    facts: PassFacts | None,
    work: Workload,
    profile: MachineProfile,
    capacity: Capacity,
    param_count: int,
) -> Estimate:
    """The prediction of one placement (`plan.cfg`), per rank."""
    cfg = plan.cfg
    activations, offloaded = activation_peak(facts, cfg)
    ledger = ledger_bytes(plan, offloaded)
    why: list[str] = []
    shares = []
    device_need = device_peak_with_activations(plan, facts, ledger)
    if capacity.device_bytes is None:  # the CPU is the device: everything is RAM
        ram = profile.baseline_rss_bytes + device_need + ledger.host
        device_need = 0
    else:
        ram = profile.baseline_rss_bytes + ledger.host
        shares.append(fraction(device_need, DEVICE_HEADROOM * capacity.device_bytes))
        if shares[-1] > 1:
            why.append(f"device memory: needs {_gib(device_need)}, has {_gib(capacity.device_bytes)}")
    shares.append(fraction(ram, RAM_HEADROOM * capacity.ram_bytes))
    if shares[-1] > 1:
        why.append(f"RAM: needs {_gib(ram)} per rank, has {_gib(capacity.ram_bytes)} available")
    if ledger.nvme:
        if capacity.nvme_free_bytes is None:
            shares.append(math.inf)
            why.append("NVMe: no folder (set offload.nvme_dir / --nvme-dir)")
        else:
            shares.append(fraction(ledger.nvme, capacity.nvme_free_bytes))
            if shares[-1] > 1:
                why.append(
                    f"NVMe: needs {_gib(ledger.nvme)} per rank, the folder has {_gib(capacity.nvme_free_bytes)} free"
                )
    time = step_time(plan, facts, work, profile, param_count)
    nvme_units = len(plan.nvme_param_units)
    param_split = (len(plan.sharded_units) - nvme_units, nvme_units) if plan.params_split else None
    return Estimate(
        cfg, ledger, activations, ram, device_need, not why, tuple(why), time, max(shares), plan.optimizer_split(),
        param_split,
    )


def _gib(nbytes: float) -> str:
    if nbytes >= 2**40:
        return f"{nbytes / 2**40:.1f} TiB"
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def fraction(a: float, b: float) -> float:
    """a / b, or inf when b is 0 (and a is not)."""
    return a / b if b else (math.inf if a else 1.0)
