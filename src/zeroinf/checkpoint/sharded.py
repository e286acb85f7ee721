"""Elastic sharded checkpoints: `save` writes every rank's owned ranges, `load` reshards to any world.

Save: each rank streams its owned optimizer states (fp32 master, exp_avg, exp_avg_sq) unit by unit
and, for states on NVMe, sub-group by sub-group through one staging buffer of the store, into its
own data file, cutting them at parameter boundaries into chunks (format.py). The fp32 master is
the source of truth for the parameters: the compute parameters are its cast, so they are not
stored twice. Stage 0 owns the whole buffer on every rank, so only rank 0 writes it. Rank 0
gathers every rank's chunk list and writes the manifest, then renames the temporary folder into
place and moves `latest` last (each step fsynced), so a crash at any moment leaves the previous
checkpoint loadable and the partial one as an ignored `.tmp-` folder.

Load: each rank computes its owned range under its own (new) layout, and for each parameter piece
in it reads just the saved chunks that intersect it (verifying their checksums), writes the
states into its store, and sets the compute parameters from the masters
(`ShardedUnit.start_update_params`: the stage-3 shard home, or the owned range + all-gather).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zeroinf.aio import AioConfig, AioEngine, BufferPool
from zeroinf.checkpoint.format import (
    CHUNK_NUMEL,
    DTYPE_NAMES,
    DTYPES,
    FORMAT,
    LATEST,
    MANIFEST,
    MODULE_STATE_FILE,
    TMP_PREFIX,
    VERSION,
    CheckpointError,
    DataFiles,
    encode_manifest,
    fsync_dir,
    rank_filename,
    read_manifest,
    resolve,
    step_dirname,
    write_atomic,
)
from zeroinf.checkpoint.reader import ChunkReader
from zeroinf.checkpoint.stream import STAGING_BYTES, STAGING_COUNT, StreamWriter
from zeroinf.engine import Engine, engine_of
from zeroinf.memory import Tier
from zeroinf.optim.pipeline import StateViews

__all__ = ["save", "load"]

READ_THREADS = 4  # chunk reads (and their checksums) in flight during load


# -- helpers ----------------------------------------------------------------------------------------
def _barrier(engine: Engine) -> None:
    if engine.topo.is_distributed:
        dist.barrier(group=engine.topo.group)


def _gather(engine: Engine, obj: Any) -> list[Any]:
    if not engine.topo.is_distributed:
        return [obj]
    out: list[Any] = [None] * engine.topo.world_size
    dist.all_gather_object(out, obj, group=engine.topo.group)
    return out


def _broadcast_error(engine: Engine, error: str | None) -> None:
    """Raise on every rank if any rank failed (so no rank waits in a collective forever)."""
    errors = [e for e in _gather(engine, error) if e]
    if errors:
        raise CheckpointError(errors[0])


def _module_state(model: nn.Module, engine: Engine) -> list[tuple[str, torch.Tensor]]:
    """Parameters outside units (frozen) and persistent buffers, by their state_dict names."""
    in_units = {id(p) for u in engine.units for p in u.params}
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


def _rng_state(engine: Engine) -> dict[str, str | None]:
    cuda = None
    if engine.topo.device.type == "cuda":
        cuda = base64.b64encode(torch.cuda.get_rng_state(engine.topo.device).numpy().tobytes()).decode()
    return {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(), "cuda": cuda}


def _set_rng_state(engine: Engine, state: dict[str, str | None]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(state["cpu"])), dtype=torch.uint8))
    if state.get("cuda") and engine.topo.device.type == "cuda":
        torch.cuda.set_rng_state(
            torch.frombuffer(bytearray(base64.b64decode(state["cuda"])), dtype=torch.uint8), engine.topo.device
        )


# -- save -------------------------------------------------------------------------------------------
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any,
    step: int,
    extra: dict[str, Any] | None = None,
) -> str:
    """Save a checkpoint of `model` and its zeroinf `optimizer` as `path/step_{step:08d}`; a collective.

    `extra` (JSON-serializable, taken from rank 0) is returned by `load`: data position, LR
    scheduler state, anything the training loop needs. Returns the checkpoint folder.
    """
    engine = engine_of(model)
    rank = engine.topo.rank
    if engine.micro_step != 0:
        raise RuntimeError(
            f"zeroinf.save after {engine.micro_step} backward passes without optimizer.step(): "
            "save between optimizer steps"
        )
    root = os.fspath(path)
    name = step_dirname(int(step))
    tmp = os.path.join(root, TMP_PREFIX + name)
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier attempt at this step
            os.makedirs(tmp)
            if extra is not None:
                import json

                json.dumps(extra)  # fail early (before any data is written) if not serializable
        except (OSError, TypeError, ValueError) as e:
            error = f"zeroinf.save: cannot prepare {tmp}: {e}"
    _broadcast_error(engine, error)

    store = optimizer.states
    chunks: dict[str, list[dict[str, Any]]] = {}
    files: dict[str, dict[str, Any]] = {}
    module_state: dict[str, Any] = {}
    error = None
    try:
        with _stream_writers(engine) as open_writer:
            if engine.policy.shard_optimizer or rank == 0:  # stage 0: every rank holds the same states
                fname = rank_filename(rank)
                state_bytes = 3 * 4 * sum(unit.owned_numel for unit in engine.units)
                writer = open_writer(os.path.join(tmp, fname), state_bytes)
                for ui, unit in enumerate(engine.units):
                    for s, e, views in store.iter_segments(ui):
                        _append_segment(writer, fname, unit, s, e, views, chunks)
                files[fname] = {"size": writer.close()}
            if rank == 0:
                writer = open_writer(os.path.join(tmp, MODULE_STATE_FILE))
                for sname, t in _module_state(model, engine):
                    at, h = writer.append(t)
                    module_state[sname] = {"shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype],
                                           "f": MODULE_STATE_FILE, "b": at,
                                           "nbytes": t.numel() * t.element_size(), "h": h}
                files[MODULE_STATE_FILE] = {"size": writer.close()}
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = f"zeroinf.save: rank {rank} failed writing {tmp}: {type(e).__name__}: {e}"
    gathered = _gather(engine, (error, chunks, files, _rng_state(engine)))
    errors = [g[0] for g in gathered if g[0]]
    if errors:
        if rank == 0:  # every rank has stopped writing: free the space the partial save took
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{errors[0]} (the partial checkpoint was removed; the previous one is intact)")

    error = None
    if rank == 0:
        try:
            all_chunks: dict[str, list[dict[str, Any]]] = {}
            all_files: dict[str, dict[str, Any]] = {}
            for _, c, f, _ in gathered:
                for pname, lst in c.items():
                    all_chunks.setdefault(pname, []).extend(lst)
                all_files.update(f)
            for lst in all_chunks.values():
                lst.sort(key=lambda ch: ch["o"])
            body = _manifest_body(model, engine, optimizer, int(step), extra, all_chunks, all_files,
                                  module_state, [g[3] for g in gathered])
            write_atomic(os.path.join(tmp, MANIFEST), encode_manifest(body))
            fsync_dir(tmp)
            final = os.path.join(root, name)
            trash = None
            if os.path.exists(final):  # re-saving a step: move the old one aside, then replace it
                trash = os.path.join(root, f"{TMP_PREFIX}old-{name}")
                shutil.rmtree(trash, ignore_errors=True)
                os.replace(final, trash)
            os.replace(tmp, final)
            fsync_dir(root)
            write_atomic(os.path.join(root, LATEST), (name + "\n").encode())
            if trash is not None:
                shutil.rmtree(trash, ignore_errors=True)
        except Exception as e:  # noqa: BLE001
            error = f"zeroinf.save: rank 0 failed finishing {tmp}: {type(e).__name__}: {e}"
    _broadcast_error(engine, error)
    return os.path.join(root, name)


@contextlib.contextmanager
def _stream_writers(engine: Engine) -> Iterator[Callable[..., StreamWriter]]:
    """Opens StreamWriters sharing one aio engine and staging pool, all closed (or aborted) on exit."""
    writers: list[StreamWriter] = []
    with AioEngine(AioConfig(), ledger=engine.ledger) as aio, BufferPool(
        STAGING_COUNT, STAGING_BYTES, ledger=engine.ledger, tag="checkpoint_staging"
    ) as pool, ThreadPoolExecutor(1, thread_name_prefix="zeroinf-ckpt-hash") as hasher:

        def open_writer(path: str, size_hint: int = 0) -> StreamWriter:
            writers.append(StreamWriter(path, aio, pool, hasher, size_hint))
            return writers[-1]

        try:
            yield open_writer
        finally:
            for w in writers:
                w.abort()  # a no-op for a closed writer; after an error, waits for writes in flight


def _append_segment(
    writer: StreamWriter, fname: str, unit: Any, s: int, e: int, views: StateViews,
    chunks: dict[str, list[dict[str, Any]]],
) -> None:
    """Append owned-local elements [s, e) of `unit`'s states, cut into per-parameter chunks."""
    base = unit.owned_start + s
    for piece in unit.layout.pieces(base, unit.owned_start + e):
        slot = unit.layout.slots[piece.slot_index]
        local = piece.start - base
        for c in range(0, piece.numel, CHUNK_NUMEL):
            n = min(CHUNK_NUMEL, piece.numel - c)
            written = [writer.append(t[local + c : local + c + n]) for t in views]
            chunks.setdefault(slot.name, []).append(
                {"o": piece.param_offset + c, "n": n, "f": fname, "b": written[0][0], "h": [h for _, h in written]}
            )


def _manifest_body(
    model: nn.Module, engine: Engine, optimizer: Any, step: int, extra: Any,
    chunks: dict[str, list[dict[str, Any]]], files: dict[str, dict[str, Any]],
    module_state: dict[str, Any], rng: list[dict[str, Any]],
) -> dict[str, Any]:
    aliases: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(pname)
    dtype = DTYPE_NAMES[engine.cfg.param_torch_dtype]
    params: dict[str, Any] = {}
    order: list[str] = []
    for ui, unit in enumerate(engine.units):
        for si, (slot, p) in enumerate(zip(unit.layout.slots, unit.params, strict=True)):
            order.append(slot.name)
            params[slot.name] = {
                "shape": list(slot.shape), "dtype": dtype, "numel": slot.numel,
                "param_steps": int(optimizer.param_steps[ui][si]),
                "aliases": [a for a in aliases.get(id(p), []) if a != slot.name],
                "unit": unit.name,
            }
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]
    return {
        "format": FORMAT, "version": VERSION, "step": step, "extra": extra,
        "world_size": engine.topo.world_size, "stage": engine.cfg.stage, "param_dtype": engine.cfg.param_dtype,
        "order": order, "params": params, "chunks": chunks, "module_state": module_state,
        "optimizer": {
            "step_count": int(optimizer.step_count),
            "param_groups": groups,
            "scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
        },
        "rng": rng, "files": files,
    }


# -- load -------------------------------------------------------------------------------------------
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


def load(
    path: str | os.PathLike[str], model: nn.Module, optimizer: Any, *, load_rng: bool = True
) -> dict[str, Any]:
    """Load a checkpoint (a root with `latest`, or one checkpoint folder) into `model` and `optimizer`.

    Works at any world size, stage and offload placement; a collective. Returns
    {"step", "extra", "path", "world_size"} (world_size: the saving run's). Raises CheckpointError
    naming the file for a missing, truncated, corrupted or incomplete checkpoint.
    """
    engine = engine_of(model)
    rank = engine.topo.rank
    body, data, error = None, None, None
    try:
        ckpt = resolve(os.fspath(path))
        body = read_manifest(ckpt)
        _check_model(body, engine, ckpt)
        data = DataFiles(ckpt, body["files"])
        data.check_all_present()
    except CheckpointError as e:
        error = str(e)
    _broadcast_error(engine, error)
    assert body is not None and data is not None
    store = optimizer.states
    executor = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="zeroinf-ckpt-read")
    reader = ChunkReader(body, data, executor=executor)
    try:
        for ui, unit in enumerate(engine.units):
            error, master = None, None
            try:
                master = _load_unit(reader, store, ui, unit)
            except CheckpointError as e:
                error = str(e)
            # Agree before the unit's collective, so a rank that failed never leaves others waiting.
            _broadcast_error(engine, error)
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
        _set_rng_state(engine, body["rng"][rank])
    _barrier(engine)
    return {"step": body["step"], "extra": body["extra"], "path": data.dir, "world_size": body["world_size"]}


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
    current = dict(_module_state(model, engine))
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
