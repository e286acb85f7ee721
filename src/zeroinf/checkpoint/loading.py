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
            f"{ours or 'no state'}: its states would be read as others. Load it with the optimizer that saved "
            "it, or with load_optimizer_states=False: the weights (the fp32 masters) and this optimizer's states "
            "fresh, as a new optimizer's"
        )


@interrupts.entry_point
def load(
    path: str | os.PathLike[str], model: nn.Module, optimizer: Any = None, *, load_rng: bool = True,
    load_optimizer_states: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint (a root with `latest`, or one checkpoint folder) into `model` and `optimizer`.

    Works at any world size, stage and offload placement; a collective. Returns
    {"step", "extra", "path", "world_size"} (world_size: the saving run's). Raises CheckpointError
    naming the file for a missing, truncated, corrupted or incomplete checkpoint.

    `load_optimizer_states=False`: the fp32 masters (the exact weights) and the run's state, with the
    optimizer's own states left fresh, as a new optimizer's (zero, step counts 0) and its
    hyperparameters its own: to go on with another optimizer than the one that saved, or to reset
    its states ([Note: loading less than the whole checkpoint]). `optimizer=None`: the weights
    alone, for a model that has no optimizer (evaluation, generation); an optimizer made afterwards
    starts from the checkpoint's fp32 masters, read from it then.
    """
    engine = engine_of(model)
    if optimizer is None:
        return _load_weights_only(path, model, engine, load_rng)
    finish_pending_save(optimizer)  # a background save of this optimizer reads the states being replaced
    engine.transfers.wait_uploads()  # the last step's parameter uploads may still read masters replaced here
    body, data = _open(path, engine, optimizer if load_optimizer_states else None)
    store = optimizer.states
    executor = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="zeroinf-ckpt-read")
    reader = ChunkReader(body, data, kinds=3 if load_optimizer_states else 1, executor=executor)
    try:
        with optimizer.replacing_states():  # every state is rewritten (a step that stopped midway is undone)
            for ui, unit in enumerate(engine.units):
                error, master = None, None
                try:
                    master = _load_unit(reader, store, ui, unit, load_optimizer_states)
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
    _load_optimizer_state(body, engine, optimizer, load_optimizer_states)
    return _finish(body, model, engine, data.dir, load_rng)


def _open(path: str | os.PathLike[str], engine: Engine, optimizer: Any) -> tuple[dict[str, Any], DataFiles]:
    """The checkpoint's manifest and data files, checked against the model (and the optimizer's
    states, unless None) and checked present; the ranks agree on any error before going on."""
    body, data, error = None, None, None
    try:
        ckpt = resolve(os.fspath(path))
        body = read_manifest(ckpt)
        _check_model(body, engine, ckpt)
        if optimizer is not None:
            _check_optimizer(body, optimizer, ckpt)
        data = DataFiles(ckpt, body["files"], **_direct_reads(engine))
        try:
            if body.get("node_local"):
                _check_own_files_here(body, engine, data, ckpt)
            else:
                data.check_all_present()
        except BaseException:
            data.close()
            raise
    except CheckpointError as e:
        error = str(e)
    broadcast_error(engine, error)
    assert body is not None and data is not None
    return body, data


def _direct_reads(engine: Engine) -> dict[str, Any]:
    """DataFiles' arguments for reads through the checkpoint lane's aio engine ([Note: checkpoint
    reads bypass the page cache])."""
    return {"aio": engine.nvme_tier.engine("checkpoint"), "timeout_s": engine.cfg.offload.io_timeout_s}


def _finish(body: dict[str, Any], model: nn.Module, engine: Engine, ckpt_dir: str, load_rng: bool) -> dict[str, Any]:
    """Buffers and RNG, then every rank done: what `load` returns."""
    _load_module_state(body, model, engine, ckpt_dir=ckpt_dir)
    every = body.get("rng_of_every_process")  # hybrid sharding: by global rank
    everyone = engine.topo.everyone
    if load_rng and engine.topo.replicas is not None and every is not None and len(every) == everyone.world_size:
        set_rng_state(engine, every[everyone.rank])
    elif load_rng and engine.topo.rank < len(body["rng"]):
        set_rng_state(engine, body["rng"][engine.topo.rank])
    barrier(engine)
    return {"step": body["step"], "extra": body["extra"], "path": ckpt_dir, "world_size": body["world_size"]}


# [Note: loading less than the whole checkpoint]
# DeepSpeed's `load_checkpoint` takes `load_optimizer_states=False` and `load_module_only=True`;
# users reach for them to switch optimizers mid-run, to reset states after a divergence, or to
# evaluate a training checkpoint without the optimizer's memory. Both are here, without DeepSpeed's
# loss: its module-only load gives the optimizer masters cast up from the 16-bit weights.
# - `load_optimizer_states=False` reads only state 0 of each saved chunk (the fp32 master: chunks
#   hold master, then the states, checkpoint/reader.py) into the store's master, zeroes its other
#   slots and sets every parameter's step count to 0, which is what a new optimizer holds: the next
#   step is that optimizer's first (a torch optimizer's first step makes its own initial states,
#   optim/torch_optimizer.py). The checkpoint's hyperparameters are not applied (the optimizer's
#   own are the point); its step count (the loss scaler's clock) and loss scale are.
# - `optimizer=None` goes through `ShardedUnit.load_values`, as `zeroinf.load_weights` does: each
#   rank's shard is read now (cast to the compute dtype), and the unit's master source becomes a
#   read of the checkpoint's fp32 masters, made when an optimizer takes them, so training from there
#   starts from the exact masters and no fp32 copy is held meanwhile (the checkpoint must still be
#   there then; its checksums are verified on that read too). A model whose optimizer already exists
#   is refused: that optimizer's masters would keep the old weights and overwrite the loaded ones at
#   its next step.
def _load_weights_only(
    path: str | os.PathLike[str], model: nn.Module, engine: Engine, load_rng: bool
) -> dict[str, Any]:
    """`load(path, model)`: the weights and buffers alone ([Note: loading less than the whole checkpoint])."""
    live = engine.optimizer_ref() if engine.optimizer_ref is not None else None
    if live is not None:
        raise ValueError(
            f"zeroinf.load: this model has an optimizer ({live.display_name}): pass it, zeroinf.load(path, model, "
            "optimizer), or its fp32 master weights would keep the old values and overwrite the loaded ones at its "
            "next step (load_optimizer_states=False loads the weights into it and leaves its states fresh)"
        )
    engine.transfers.wait_uploads()
    engine.release_gathered()
    body, data = _open(path, engine, None)
    data.close()
    for ui, unit in enumerate(engine.units):
        source = SavedMasters(body, data.dir, _direct_reads(engine))
        error = None
        try:  # this rank's shard, read before the unit's collective so a failure stops every rank
            source.prefetch(unit.layout, *unit.layout.shard_range(engine.topo.rank))
        except CheckpointError as e:
            error = str(e)
        broadcast_error(engine, error)
        with torch.no_grad():
            unit.load_values(source, None, ui)
    return _finish(body, model, engine, data.dir, load_rng)


class SavedMasters:
    """A unit's values from a checkpoint's fp32 masters, any range under any layout, read when asked
    (partition/unit.py `UnitSource`); the range `prefetch` read is handed over once without a read."""

    def __init__(self, body: dict[str, Any], ckpt_dir: str, reads: dict[str, Any]) -> None:
        self.body, self.dir, self.reads = body, ckpt_dir, reads
        self._fetched: tuple[int, int, torch.Tensor] | None = None

    def prefetch(self, layout: Any, start: int, end: int) -> None:
        self._fetched = (start, end, self._read_fp32(layout, start, end))

    def read(self, layout: Any, start: int, end: int, dtype: torch.dtype, scratch: bool = False) -> torch.Tensor:
        fetched, self._fetched = self._fetched, None
        if fetched is not None and fetched[:2] == (start, end):
            values = fetched[2]
        else:
            values = self._read_fp32(layout, start, end)
        return values if dtype == torch.float32 else values.to(dtype)

    def _read_fp32(self, layout: Any, start: int, end: int) -> torch.Tensor:
        out = torch.zeros(end - start, dtype=torch.float32)  # padding stays zero
        data = DataFiles(self.dir, self.body["files"], **self.reads)
        reader = ChunkReader(self.body, data, kinds=1)
        try:
            for piece in layout.pieces(start, end):
                lo = piece.start - start
                reader.fill(layout.slots[piece.slot_index].name, piece.param_offset,
                            piece.param_offset + piece.numel, [out[lo : lo + piece.numel]])
            reader.drain()
        finally:
            data.close()
        return out


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


def _load_unit(reader: ChunkReader, store: Any, ui: int, unit: Any, with_states: bool = True) -> torch.Tensor:
    """Fill unit `ui`'s states (one store segment at a time) from the checkpoint; return its master.
    Without `with_states`, only the masters: the other states are zeroed, as a new optimizer's.

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
                targets = states if with_states else states[:1]
                for fresh in states[len(targets):]:
                    fresh.zero_()
                try:
                    for piece in pieces:
                        lo = piece.start - base
                        reader.fill(unit.layout.slots[piece.slot_index].name, piece.param_offset,
                                    piece.param_offset + piece.numel, [t[lo : lo + piece.numel] for t in targets])
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


def _load_optimizer_state(body: dict[str, Any], engine: Engine, optimizer: Any, with_states: bool) -> None:
    """Step counts, hyperparameters and loss scale; without `with_states`, the per-parameter step
    counts are a new optimizer's and the hyperparameters stay the optimizer's own."""
    params = body["params"]
    optimizer.param_steps = [
        [int(params[s.name]["param_steps"]) if with_states else 0 for s in u.layout.slots] for u in engine.units
    ]
    opt = body["optimizer"]
    optimizer.step_count = int(opt["step_count"])
    if with_states and len(opt["param_groups"]) == len(optimizer.param_groups):
        for group, saved in zip(optimizer.param_groups, opt["param_groups"], strict=True):
            group.update({k: (tuple(v) if k == "betas" else v) for k, v in saved.items()})
    if optimizer.scaler is not None and opt["scaler"] is not None:
        optimizer.scaler.load_state_dict(opt["scaler"])


def _load_module_state(body: dict[str, Any], model: nn.Module, engine: Engine, ckpt_dir: str) -> None:
    """Buffers and the parameters outside units, whole on every rank."""
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
