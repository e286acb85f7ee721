"""`load`: each rank takes its owned ranges under its own layout from a checkpoint of any world size.

Each rank computes its owned range under its own (new) layout, and for each parameter piece in it
reads just the saved chunks that intersect it (verifying their checksums), writes the states into
its store, and sets the compute parameters from the masters (`ShardedUnit.start_update_params`:
the stage-3 shard home, or the owned range + all-gather). Saving is in save.py.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from zeroinf.checkpoint.common import barrier, broadcast_error, module_state_tensors, set_rng_state
from zeroinf.checkpoint.format import (
    DTYPES,
    MANIFEST,
    MODULE_STATE_FILE,
    CheckpointError,
    DataFiles,
    files_elsewhere,
    rank_filename,
    read_manifest,
    resolve,
)
from zeroinf.checkpoint.reader import ChunkReader
from zeroinf.checkpoint.saving import finish_pending_save
from zeroinf.engine import Engine, engine_of
from zeroinf.memory import Tier
from zeroinf.optim.pipeline import StateViews
from zeroinf.runtime import interrupts

__all__ = ["load"]

READ_THREADS = 4  # chunk reads (and their checksums) in flight during load


def _check_model(body: dict[str, Any], engine: Engine, ckpt: str) -> None:
    where = os.path.join(ckpt, MANIFEST)
    ours = {slot.name: slot for u in engine.units for slot in u.layout.slots}
    missing = [n for n in ours if n not in body["params"]]
    unexpected = [n for n in body["params"] if n not in ours]
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: does not fit this model: parameters missing from the checkpoint {missing[:5]}, "
            f"in the checkpoint but not the model {unexpected[:5]}"
        )
    for n, slot in ours.items():
        if list(slot.shape) != body["params"][n]["shape"]:
            raise CheckpointError(
                f"{where}: parameter {n} has shape {body['params'][n]['shape']} in the checkpoint, "
                f"{list(slot.shape)} in the model"
            )


ADAM_STATES = ["exp_avg", "exp_avg_sq"]  # what checkpoints that name no states were saved with


def _check_optimizer(body: dict[str, Any], optimizer: Any, ckpt: str) -> None:
    """The checkpoint's states are the ones this optimizer keeps, so none is read as another."""
    saved = body["optimizer"].get("states", ADAM_STATES)
    ours = list(optimizer.state_names)
    if saved != ours:
        raise CheckpointError(
            f"{os.path.join(ckpt, MANIFEST)}: saved by {body['optimizer'].get('class', 'zeroinf.AdamW')}, keeping "
            f"{saved or 'no state'} per parameter, and loaded into {optimizer.display_name}, keeping "
            f"{ours or 'no state'}: its states would be read as others. Load it with the optimizer that saved it; "
            "for the weights alone, zeroinf.consolidate(ckpt, folder) then zeroinf.load_weights(model, folder)"
        )


@interrupts.entry_point
def load(
    path: str | os.PathLike[str], model: nn.Module, optimizer: Any, *, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint (a root with `latest`, or one checkpoint folder) into `model` and `optimizer`.

    Works at any world size, stage and offload placement; a collective. Returns
    {"step", "extra", "path", "world_size"} (world_size: the saving run's). Raises CheckpointError
    naming the file for a missing, truncated, corrupted or incomplete checkpoint.
    """
    finish_pending_save(optimizer)  # a background save of this optimizer reads the states being replaced
    engine = engine_of(model)
    engine.transfers.wait_uploads()  # the last step's parameter uploads may still read masters replaced here
    rank = engine.topo.rank
    body, data, error = None, None, None
    try:
        ckpt = resolve(os.fspath(path))
        body = read_manifest(ckpt)
        _check_model(body, engine, ckpt)
        _check_optimizer(body, optimizer, ckpt)
        data = DataFiles(ckpt, body["files"])
        if body.get("node_local"):
            _check_own_files_here(body, engine, data, ckpt)
        else:
            data.check_all_present()
    except CheckpointError as e:
        error = str(e)
    broadcast_error(engine, error)
    assert body is not None and data is not None
    store = optimizer.states
    executor = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="zeroinf-ckpt-read")
    reader = ChunkReader(body, data, executor=executor)
    try:
        with optimizer.replacing_states():  # every state is rewritten (a step that stopped midway is undone)
            for ui, unit in enumerate(engine.units):
                error, master = None, None
                try:
                    master = _load_unit(reader, store, ui, unit)
                except CheckpointError as e:
                    error = str(e)
                # Agree before the unit's collective, so a rank that failed never leaves others waiting.
                broadcast_error(engine, error)
                assert master is not None  # this rank's failure raised above
                # The compute parameters are the master's cast: stage 3 writes the shard home, stages
                # 1-2 the owned range and an all-gather; every rank issues the same collectives.
                with torch.no_grad():
                    unit.start_update_params(master).wait()
                del master
    finally:
        reader.drain(raise_errors=False)
        executor.shutdown()
        data.close()
    _load_small_state(body, model, engine, optimizer, ckpt_dir=data.dir)
    if load_rng and rank < len(body["rng"]):
        set_rng_state(engine, body["rng"][rank])
    barrier(engine)
    return {"step": body["step"], "extra": body["extra"], "path": data.dir, "world_size": body["world_size"]}


def _check_own_files_here(body: dict[str, Any], engine: Engine, data: DataFiles, ckpt: str) -> None:
    """A node-local checkpoint (saving.py [Note: node-local checkpoints]): the files this rank's
    layout reads must be on this machine; a missing one is named with the machine that wrote it."""
    needed = {MODULE_STATE_FILE} if body["module_state"] else set()
    for unit in engine.units:
        for piece in unit.layout.pieces(unit.owned_start, unit.owned_end):
            lo, hi = piece.param_offset, piece.param_offset + piece.numel
            for chunk in body["chunks"].get(unit.layout.slots[piece.slot_index].name, []):
                if chunk["o"] < hi and lo < chunk["o"] + chunk["n"]:
                    needed.add(chunk["f"])
    missing = sorted(needed & set(files_elsewhere(ckpt, body)))
    if missing:
        nodes = body["node_local"]
        writer = next((r for r in range(len(nodes)) if rank_filename(r) == missing[0]), None)
        whose = "another machine's" if writer is None else f"rank {writer}'s, written on {nodes[writer]}"
        raise CheckpointError(
            f"{os.path.join(ckpt, missing[0])}: missing. {ckpt} is node-local (saved with node_local=True by "
            f"{len(nodes)} ranks on {len(set(nodes))} machines): each machine holds its own ranks' states, "
            f"and this rank (rank {engine.topo.rank} of {engine.topo.world_size}) needs {whose}. Load with the "
            "same ranks on each machine, or copy every machine's step folder into one (an ordinary checkpoint "
            "then, loadable at any world size)"
        )
    data.check_present(needed)


def _load_unit(reader: ChunkReader, store: Any, ui: int, unit: Any) -> torch.Tensor:
    """Fill unit `ui`'s states (one store segment at a time) from the checkpoint; return its master.

    The chunks are read (and verified) straight into the memory the store lends for the segment:
    the resident states themselves, or an NVMe staging buffer that is then written to the swap files.
    """
    bounds = store.segment_bounds(ui)
    in_place = len(bounds) == 1 and store.tier is not Tier.NVME  # the master view outlives the segment
    whole = None if in_place else torch.zeros(unit.owned_numel, dtype=torch.float32)
    master = torch.zeros(0, dtype=torch.float32)
    with torch.no_grad():
        for s, e in bounds:
            with store.segment_for_write(ui, s, e) as states:
                base = unit.owned_start + s
                pieces = unit.layout.pieces(base, unit.owned_start + e)
                _zero_gaps(states, [(p.start - base, p.start - base + p.numel) for p in pieces], e - s)
                try:
                    for piece in pieces:
                        lo = piece.start - base
                        reader.fill(unit.layout.slots[piece.slot_index].name, piece.param_offset,
                                    piece.param_offset + piece.numel, [t[lo : lo + piece.numel] for t in states])
                except BaseException:
                    reader.drain(raise_errors=False)  # no read may still fill a buffer the store takes back
                    raise
                reader.drain()
                master = states.master
                if whole is not None:
                    whole[s:e].copy_(states.master)
    return whole if whole is not None else master


def _zero_gaps(states: StateViews, covered: list[tuple[int, int]], numel: int) -> None:
    """Zero the padding between (and after) the parameter pieces: no checkpoint bytes land there."""
    pos = 0
    for lo, hi in [*covered, (numel, numel)]:
        if lo > pos:
            for t in states:
                t[pos:lo].zero_()
        pos = max(pos, hi)


def _load_small_state(body: dict[str, Any], model: nn.Module, engine: Engine, optimizer: Any, ckpt_dir: str) -> None:
    params = body["params"]
    optimizer.param_steps = [[int(params[s.name]["param_steps"]) for s in u.layout.slots] for u in engine.units]
    opt = body["optimizer"]
    optimizer.step_count = int(opt["step_count"])
    if len(opt["param_groups"]) == len(optimizer.param_groups):
        for group, saved in zip(optimizer.param_groups, opt["param_groups"], strict=True):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    if optimizer.scaler is not None and opt["scaler"] is not None:
        optimizer.scaler.load_state_dict(opt["scaler"])
    entries = body["module_state"]
    if not entries:
        return
    current = dict(module_state_tensors(model, engine))
    data = DataFiles(ckpt_dir, body["files"])
    try:
        with torch.no_grad():
            for name, meta in entries.items():
                target = current.get(name)
                if target is None:
                    continue  # a buffer the model no longer has
                t = torch.empty(meta["shape"], dtype=DTYPES[meta["dtype"]])
                data.read_into(meta["f"], meta["b"], t, meta["h"], f"module state {name}")
                target.copy_(t)
    finally:
        data.close()
