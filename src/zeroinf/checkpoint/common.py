"""What saving and loading a checkpoint share: agreement across ranks, module state, RNG state."""

from __future__ import annotations

import base64
import os
import socket
from typing import Any, TypedDict

import torch
import torch.distributed as dist
from torch import nn

from zeroinf.checkpoint.format import CheckpointError, as_bytes
from zeroinf.comm import naming_failures
from zeroinf.engine import Engine


def barrier(engine: Engine) -> None:
    if engine.topo.is_distributed:
        with naming_failures("checkpoint barrier", 0, engine.topo):
            dist.barrier(group=engine.topo.group)


def gather(engine: Engine, obj: Any, everyone: bool = False) -> list[Any]:
    """Every rank's `obj`, in rank order: of the engine's group, or with `everyone` of every rank
    (hybrid sharding: every shard group's, by global rank)."""
    topo = engine.topo.everyone if everyone else engine.topo
    if not topo.is_distributed:
        return [obj]
    out: list[Any] = [None] * topo.world_size
    with naming_failures("checkpoint all-gather of objects", topo.world_size, topo):
        dist.all_gather_object(out, obj, group=topo.group)
    return out


def node_of_this_process() -> str:
    """This process's machine, as the launcher numbers it: torchrun's GROUP_RANK, Slurm's
    SLURM_NODEID, else the host name."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(name)
        if value:
            return f"{name}={value}"
    return f"host={socket.gethostname()}"


def node_leaders(engine: Engine) -> tuple[list[str], list[int]]:
    """Per rank, its node and that node's lowest rank (a collective)."""
    nodes = [str(n) for n in gather(engine, node_of_this_process())]
    first: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return nodes, [first[node] for node in nodes]


def broadcast_error(engine: Engine, error: str | None) -> None:
    """Raise on every rank if any rank failed (so no rank waits in a collective forever)."""
    errors = [e for e in gather(engine, error) if e]
    if errors:
        raise CheckpointError(errors[0])


def module_state_tensors(model: nn.Module, engine: Engine) -> list[tuple[str, torch.Tensor]]:
    """Parameters outside units (frozen) and persistent buffers, by their state_dict names.

    Frozen parameters in sharded frozen units (stage 3) are not module state: they never change,
    and a resume rebuilds them from where they came from (the pretrained folder, the same seed).
    Those of resident frozen units (the root) are whole on every rank and are saved."""
    in_units = {id(p) for u in engine.units for p in u.params}
    in_units |= {id(p) for u in engine.frozen_units if not u.resident for p in u.params}
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in in_units and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p.detach()))
    for mod_name, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append((f"{mod_name}.{bname}" if mod_name else bname, b))
    return out


class RngState(TypedDict):
    """A rank's random number generators' states, base64 (as the manifest holds them)."""

    cpu: str
    cuda: str | None  # None where the device is not CUDA


def rng_state(engine: Engine) -> RngState:
    cuda = None
    if engine.topo.device.type == "cuda":
        cuda = base64.b64encode(as_bytes(torch.cuda.get_rng_state(engine.topo.device))).decode()
    return {"cpu": base64.b64encode(as_bytes(torch.get_rng_state())).decode(), "cuda": cuda}


def set_rng_state(engine: Engine, state: RngState) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    cuda = state.get("cuda")
    if cuda and engine.topo.device.type == "cuda":
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(cuda)), dtype=torch.uint8), engine.topo.device
        )


# -- load -------------------------------------------------------------------------------------------
