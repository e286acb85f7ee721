"""`zeroinf.plan(...)`: every candidate placement of a model on this machine, estimated before the run.

    plan = zeroinf.plan("125m", world_size=2, tokens_per_step=16384)     # a demo preset
    plan = zeroinf.plan("path/to/hf-folder")                               # a Hugging Face config, no weights
    plan = zeroinf.plan(model, zeroinf.Config(stage="auto", offload=...))  # a module (e.g. under zeroinf.init)
    print(plan.table()); plan.best.config                                  # the fastest that fits

`resolve_config` is what `auto` does at `zeroinf.shard` and `zeroinf train`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zeroinf.config import AUTO, Config, OffloadConfig
from zeroinf.planner import choose as choose_mod
from zeroinf.planner.estimate import Capacity, Estimate, Workload, describe_placement, estimate
from zeroinf.planner.model_facts import ExampleInputs, ModelFacts, PassFacts, from_hf, from_module, from_preset
from zeroinf.planner.profile import MachineProfile, available_ram_bytes, load_profile
from zeroinf.planner.unit_plan import optimizer_moments, plan_units, state_element_bytes
from zeroinf.topology import cuda_in_use

DEFAULT_SEQ_LEN = 2048


def default_seq_len(facts: ModelFacts) -> int:
    """The sequence length planned when none is given: the model's context, at most DEFAULT_SEQ_LEN."""
    return min(facts.seq_len or DEFAULT_SEQ_LEN, DEFAULT_SEQ_LEN)
"""Tokens per sequence when none is given: the model's context, at most this."""

ALL_AUTO = Config(
    stage=AUTO, activation_checkpointing=AUTO, offload=OffloadConfig(params=AUTO, optimizer=AUTO, gradients=AUTO)
)
"""Every placement field left to the planner (the dtype stays the Config's default)."""


@dataclass
class Plan:
    """What `zeroinf.plan` found: one `Estimate` per candidate placement, fitting and fastest first."""

    model: str
    param_count: int
    workload: Workload
    profile: MachineProfile
    capacity: Capacity
    estimates: list[Estimate]
    best: Estimate | None
    pass_facts: PassFacts | None
    nvme_dir: str | None
    notes: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)  # why combinations of the fixed fields were left out

    @property
    def config(self) -> Config:
        """The chosen placement's Config (the fastest predicted that fits); ValueError when none fits."""
        if self.best is None:
            if not self.estimates:  # the fields given rule out every placement: say which refusal
                raise ValueError(
                    f"no placement of {self.model} is possible with the fields you set "
                    f"({'; '.join(self.refused) or 'none could be estimated'}): change them, or leave them to auto"
                )
            reason = "; ".join(self.estimates[0].why_not)
            raise ValueError(
                f"no placement of {self.model} fits this machine ({reason}): add ranks, free memory or disk, "
                "or set the offload tiers yourself"
            )
        return self.best.config

    def table(self, limit: int | None = 12) -> str:
        from zeroinf.planner.report import format_plan

        return format_plan(self, limit)

    def to_json(self) -> dict[str, Any]:
        from zeroinf.planner.report import plan_json

        return plan_json(self)


def load_model_facts(
    model: str | Path | nn.Module | ModelFacts, example_inputs: ExampleInputs | None = None,
    unit_classes: tuple[str, ...] = (),
) -> ModelFacts:
    """A demo preset name, a Hugging Face folder or config.json, a module, or facts already read."""
    if isinstance(model, ModelFacts):
        return model
    if isinstance(model, nn.Module):
        from zeroinf.models.gpt import GPT
        from zeroinf.planner.model_facts import gpt_inputs

        default_inputs = gpt_inputs if isinstance(model, GPT) else None
        return from_module(model, example_inputs or default_inputs, unit_classes)
    from zeroinf.models.gpt import PRESETS

    if isinstance(model, str) and model in PRESETS:
        return from_preset(model, unit_classes)
    if Path(model).exists():
        return from_hf(model, unit_classes)
    raise ValueError(
        f"model {str(model)!r} is neither a demo preset ({sorted(PRESETS)}) nor a Hugging Face folder or config.json"
    )


def machine_capacity(profile: MachineProfile, nvme_dir: str | None, ranks_per_machine: int) -> Capacity:
    ranks = max(1, ranks_per_machine)
    nvme_free = None
    if nvme_dir is not None:
        folder = nvme_dir
        while folder and not os.path.isdir(folder):  # a folder the run will create: its nearest existing parent
            folder = os.path.dirname(folder.rstrip("/")) or "/"
        nvme_free = shutil.disk_usage(folder).free // ranks
    device = profile.device_memory_bytes
    return Capacity(available_ram_bytes() // ranks, device, nvme_free)


def plan(
    model: str | Path | nn.Module | ModelFacts,
    config: Config | Mapping[str, Any] | None = None,
    *,
    world_size: int = 1,
    tokens_per_step: int | None = None,
    seq_len: int | None = None,
    profile: MachineProfile | None = None,
    nvme_dir: str | None = None,
    ranks_per_machine: int | None = None,
    example_inputs: ExampleInputs | None = None,
    capacity: Capacity | None = None,
    threads: int | None = None,
    assume_nvme_dir: bool = True,
    optimizer: str | int = "adamw",
) -> Plan:
    """Estimate every candidate placement of `model` (see the module docstring); nothing is allocated.

    `config` fields that are "auto" span the candidates (default: every placement field); the others
    stay. `tokens_per_step` counts all ranks and micro-steps (default: one sequence per rank).
    `profile` defaults to this machine's cached measurement (`zeroinf plan --measure`) or defaults.
    `threads`: CPU threads of each rank (default: the cores shared by the ranks on this machine, as
    `zeroinf train` sets them). Without an NVMe folder (`nvme_dir`, `offload.nvme_dir`) NVMe
    placements are estimated in the temporary folder, or left out with `assume_nvme_dir=False`.
    `optimizer`: what its states take beside the fp32 masters, by name ("adamw", "lion", "sgd",
    "sgd_momentum", ...: `unit_plan.OPTIMIZER_MOMENTS`) or by the number of state tensors it keeps per
    parameter (Adam's 2, Lion's 1, plain SGD's 0).
    """
    if world_size < 1:
        raise ValueError(f"world_size = {world_size} is invalid: use a positive number of ranks")
    moments = optimizer_moments(optimizer)
    base = Config.of(config, "zeroinf.plan") if config is not None else ALL_AUTO
    facts = load_model_facts(model, example_inputs, base.unit_classes)
    profile = profile or load_profile()
    notes = []
    if not profile.measured:
        notes.append("machine profile: conservative defaults; run `zeroinf plan --measure` for this machine's figures")
    if moments != 2:
        notes.append(
            f"optimizer {optimizer}: {moments} state tensor(s) beside each fp32 master, "
            f"{state_element_bytes(base.offload, moments)} bytes per parameter of optimizer states "
            f"(Adam's: {state_element_bytes(base.offload)})"
        )
    folder = nvme_dir or base.offload.nvme_dir
    if folder is None and assume_nvme_dir:
        folder = tempfile.gettempdir()
        notes.append(f"NVMe folder assumed: {folder} (set --nvme-dir / offload.nvme_dir)")
    elif folder is None:
        notes.append("no NVMe folder: NVMe placements left out (set offload.nvme_dir)")
    seq = seq_len or default_seq_len(facts)
    tokens = tokens_per_step or seq * world_size * base.grad_accum_steps
    work = Workload(tokens, seq, world_size, base.grad_accum_steps)
    device = torch.device("cuda") if cuda_in_use() else torch.device("cpu")
    pass_facts = facts.pass_facts(work.micro_batch, seq, base.param_dtype, device)
    if pass_facts is None and facts.pass_error is not None:
        notes.append(
            "activations not measured: the forward does not run on meta tensors, which have shapes but no "
            f"values ({facts.pass_error})"
        )
    elif pass_facts is None:
        notes.append("activations not measured (the planner cannot call this module: pass example_inputs)")
    ranks_here = ranks_per_machine or world_size
    capacity = capacity or machine_capacity(profile, folder, ranks_here)
    rank_profile = profile.for_rank(threads or max(1, profile.cores // max(1, ranks_here)), ranks_here)
    estimates = []
    refused: list[str] = []
    for cfg in choose_mod.candidates(base, folder, refused):
        try:
            # hybrid sharding: the states are sharded over a group, not the world (comm.py [Note: hybrid sharding])
            sharded_over = min(cfg.shard_group_size or world_size, world_size)
            unit_plan = plan_units(facts.units_for(cfg), cfg, sharded_over, device.type, moments)
            estimates.append(estimate(unit_plan, pass_facts, work, rank_profile, capacity, facts.param_count))
        except ValueError:
            continue  # e.g. parameters on NVMe while every unit is resident
    estimates = choose_mod.ordered(estimates)
    return Plan(
        facts.name, facts.param_count, work, profile, capacity, estimates, choose_mod.choose(estimates),
        pass_facts, folder, notes, refused,
    )


def resolve_config(
    cfg: Config,
    model: str | Path | nn.Module | ModelFacts,
    world_size: int,
    tokens_per_step: int | None = None,
    seq_len: int | None = None,
    **kwargs: Any,
) -> tuple[Config, Plan]:
    """`cfg` with its "auto" placement fields set to the fastest predicted placement that fits.

    NVMe placements are candidates only when `cfg.offload.nvme_dir` (or `nvme_dir=`) names a folder.
    """
    kwargs.setdefault("assume_nvme_dir", False)
    result = plan(model, cfg, world_size=world_size, tokens_per_step=tokens_per_step, seq_len=seq_len, **kwargs)
    if not cfg.is_auto:
        return cfg, result
    chosen = result.config
    if cfg.offload.nvme_dir is None and "nvme" not in (
        chosen.offload.params, chosen.offload.optimizer, chosen.offload.gradients
    ):
        chosen = dataclasses.replace(chosen, offload=dataclasses.replace(chosen.offload, nvme_dir=None))
    return chosen, result


def resolve_for_ranks(
    cfg: Config, model: str | Path | nn.Module | ModelFacts, topo: Any, **kwargs: Any
) -> tuple[Config, Plan | None]:
    """`resolve_config` on rank 0, the chosen Config broadcast to every rank (each rank's own view of
    free memory could differ, and all ranks must build the same placement). The Plan is rank 0's."""
    import torch.distributed as dist

    result: Plan | None = None
    chosen: Config | None = None
    error: str | None = None
    if topo.rank == 0:
        try:
            chosen, result = resolve_config(cfg, model, topo.world_size, **kwargs)
        except ValueError as exc:
            error = str(exc)
    if topo.is_distributed:
        box: list[Any] = [(chosen, error)]
        dist.broadcast_object_list(box, group_src=0, group=topo.group)
        if topo.replicas is not None:  # hybrid sharding: every group builds the first group's placement
            dist.broadcast_object_list(box, group_src=0, group=topo.replicas.group)
        chosen, error = box[0]
    if error is not None:
        raise ValueError(error)
    assert chosen is not None
    return chosen, result


def predict(
    model: str | Path | nn.Module | ModelFacts, cfg: Config, world_size: int = 1, **kwargs: Any
) -> Estimate:
    """The estimate of one concrete placement (`cfg` without "auto" fields)."""
    if cfg.is_auto:
        raise ValueError("predict needs a concrete Config; use zeroinf.plan for 'auto' fields")
    result = plan(model, cfg, world_size=world_size, **kwargs)
    if not result.estimates:
        raise ValueError(f"{describe_placement(cfg)} is not a placement the engine builds")
    return result.estimates[0]


def predict_built(
    engine: Any,
    facts: ModelFacts | None,
    tokens_per_step: int,
    seq_len: int,
    profile: MachineProfile | None = None,
) -> Estimate:
    """The estimate of a model already sharded: from the unit plan its engine built from
    (`Engine.unit_plan`, frozen units included), with the pass facts of `facts` (None: no activations,
    time from the parameter count). What `zeroinf train --report` and `finetune --report` compare with."""
    unit_plan = engine.unit_plan
    cfg, world = unit_plan.cfg, unit_plan.world_size
    profile = profile or load_profile()
    work = Workload(tokens_per_step, seq_len, world, cfg.grad_accum_steps)
    device = torch.device("cuda") if cuda_in_use() else torch.device("cpu")
    pass_facts = facts.pass_facts(work.micro_batch, seq_len, cfg.param_dtype, device) if facts is not None else None
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    capacity = machine_capacity(profile, cfg.offload.nvme_dir, ranks_here)
    rank_profile = profile.for_rank(torch.get_num_threads(), ranks_here)
    param_count = facts.param_count if facts is not None else unit_plan.numel
    return estimate(unit_plan, pass_facts, work, rank_profile, capacity, param_count)
