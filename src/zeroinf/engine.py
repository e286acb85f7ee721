"""`zeroinf.shard`: turn an ordinary module into a sharded one, and the engine state behind it.

The module keeps its class, its parameter objects, names and `state_dict` keys; its parameters
become views into the flat buffers of units. The engine object is the one attribute we attach
(`module._zeroinf_engine`), found again with `engine_of(module)`.

Gradient flow of one backward: each parameter's gradient lands in its unit's flat buffer
(runtime/hooks.py); on the micro-step that synchronizes, a unit whose gradients have all arrived
starts its collective at once, overlapping the rest of backward; at the end of backward the engine
agrees with the other ranks on which units got gradients at all (one small all-reduce, so unused
branches on one rank never desynchronize the collectives), reduces the stragglers in unit order,
and waits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zeroinf.comm import all_reduce
from zeroinf.config import Config
from zeroinf.memory import Ledger
from zeroinf.partition.unit import GradState, ShardedUnit, ShardingPolicy
from zeroinf.partition.wrap import discover_units
from zeroinf.runtime.hooks import queue_end_of_backward, register_grad_ready_hooks
from zeroinf.telemetry import CollectiveCounter
from zeroinf.topology import Topology

_ATTR = "_zeroinf_engine"


class Engine:
    def __init__(self, module: nn.Module, cfg: Config, topo: Topology, ledger: Ledger | None = None) -> None:
        self.module, self.cfg, self.topo = module, cfg, topo
        self.ledger = ledger or Ledger()
        self.counter = CollectiveCounter()
        self.policy = ShardingPolicy(cfg.stage)
        param_dtype = cfg.param_torch_dtype
        for p in module.parameters():
            if not p.is_floating_point():
                raise TypeError(f"zeroinf shards floating-point parameters only; got {p.dtype}")
        specs = discover_units(module, cfg.unit_classes)
        if not specs:
            raise ValueError("zeroinf.shard: the model has no trainable parameters")
        self.units = [
            ShardedUnit(
                spec.name, list(spec.params), topo, self.policy, param_dtype, cfg.reduce_torch_dtype,
                self.ledger, cfg.bucket_bytes, self.counter,
            )
            for spec in specs
        ]
        for p in module.parameters():  # frozen parameters: cast in place, not sharded
            if p.dtype != param_dtype:
                p.data = p.data.to(param_dtype)
        for unit in self.units:
            unit.broadcast_from_rank0()
        self.micro_step = 0  # backward passes since the last optimizer step
        self._in_backward = False
        self._sync_this_backward = False
        self._hook_handles = [
            h
            for ui, unit in enumerate(self.units)
            for h in register_grad_ready_hooks(unit.params, lambda pi, ui=ui: self._on_grad_ready(ui, pi))
        ]

    # -- backward -------------------------------------------------------------------------------------
    def _on_grad_ready(self, unit_index: int, param_index: int) -> None:
        if not self._in_backward:
            self._begin_backward()
        unit = self.units[unit_index]
        if unit.accumulate_grad(param_index) and self._sync_this_backward:
            unit.start_reduce_grads()

    def _begin_backward(self) -> None:
        if self.micro_step >= self.cfg.grad_accum_steps:
            raise RuntimeError(
                f"backward pass {self.micro_step + 1} since the last optimizer step, but grad_accum_steps is "
                f"{self.cfg.grad_accum_steps}: call optimizer.step() (and zero_grad()) every "
                f"{self.cfg.grad_accum_steps} backward passes, or change grad_accum_steps"
            )
        self._in_backward = True
        last = self.micro_step + 1 == self.cfg.grad_accum_steps
        self._sync_this_backward = last or self.cfg.sync_every_micro_step
        queue_end_of_backward(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False
        self.micro_step += 1
        for unit in self.units:
            unit.end_backward()
        if self._sync_this_backward:
            self._reduce_all()

    def _reduce_all(self) -> None:
        has_grad = torch.tensor(
            [u.grad_state is not GradState.EMPTY for u in self.units], dtype=torch.int32, device=self.topo.device
        )
        if self.topo.is_distributed:
            all_reduce(has_grad, self.topo, async_op=False)
            self.counter.add("all_reduce")
        for unit, anyone in zip(self.units, has_grad.tolist(), strict=True):
            if anyone and unit.grad_state is GradState.EMPTY:
                unit.materialize_zero_grad()  # this rank had no gradient, others did: contribute zeros
            unit.start_reduce_grads()
        for unit in self.units:
            unit.wait_reduce_grads()

    # -- step boundary ----------------------------------------------------------------------------------
    def require_step_boundary(self) -> None:
        if self.micro_step != self.cfg.grad_accum_steps:
            raise RuntimeError(
                f"optimizer.step() after {self.micro_step} backward passes, but grad_accum_steps is "
                f"{self.cfg.grad_accum_steps}: step once every {self.cfg.grad_accum_steps} backward passes"
            )

    def end_step(self) -> None:
        self.micro_step = 0
        self.counter.end_step()

    def zero_grad(self) -> None:
        for unit in self.units:
            unit.zero_grad()
        for p in self.module.parameters():
            p.grad = None

    def memory_report(self) -> dict[str, Any]:
        report: dict[str, Any] = self.ledger.snapshot()
        report["collectives_last_step"] = dict(self.counter.last_step)
        report["collectives_total"] = dict(self.counter.total)
        report["units"] = len(self.units)
        return report


def shard(module: nn.Module, cfg: Config | None = None, topology: Topology | None = None) -> nn.Module:
    """Shard `module` in place according to `cfg` (default: `Config()`) and return it.

    `topology` defaults to the initialized default process group (or a single process).
    """
    if hasattr(module, _ATTR):
        raise RuntimeError("zeroinf.shard: this module is already sharded")
    cfg = cfg or Config()
    topo = topology or Topology.current()
    module.to(topo.device)
    engine = Engine(module, cfg, topo)
    setattr(module, _ATTR, engine)
    return module


def engine_of(module: nn.Module) -> Engine:
    engine = getattr(module, _ATTR, None)
    if engine is None:
        raise TypeError("this module is not sharded: call `model = zeroinf.shard(model, cfg)` first")
    return engine


def memory_report(module: nn.Module) -> dict[str, Any]:
    """Live and peak bytes per tier (by tag) and collectives per step, from the engine's own accounting."""
    return engine_of(module).memory_report()
