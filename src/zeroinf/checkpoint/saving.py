"""`save`: every rank streams its owned states into its own file; rank 0 writes the manifest last.

Each rank streams its owned optimizer states (fp32 master, exp_avg, exp_avg_sq) unit by unit and,
for states on NVMe, sub-group by sub-group (`OptimizerStateStore.iter_segments`), into its own data
file through a `StreamWriter`, cutting them at parameter boundaries into chunks (format.py). The
fp32 master is the source of truth for the parameters: the compute parameters are its cast, so
they are not stored twice. Stage 0 owns the whole buffer on every rank, so only rank 0 writes it.
Then every rank sends its chunk list to rank 0, which writes the manifest, renames the temporary
folder into place and moves `latest` last (each step fsynced): a crash at any moment leaves the
previous checkpoint loadable and the partial one as an ignored `.tmp-` folder.

[Note: saving without stopping training]
`save(..., blocking=False)` returns as soon as the small state is captured (RNG, step counts, LR
groups, loss scale, a copy of the buffers). The states are written by a background thread while
the training loop runs its next forward and backward passes: those never change optimizer states
or master weights, so no snapshot copy is needed. Masters that live in a parameter file are read
from that file alone (a plain `pread`, their writes landed when the save started): the host
buffers and aio engine of those shards belong to training's gathers, which run meanwhile. The next
`optimizer.step()` (or `wait()`, a second `save`, `load`, `optimizer.close()`, or a
`zeroinf.gathered(..., modify=True)`, whose writes reach the masters) first waits for the
writes, then finishes the checkpoint: the collective part (chunk lists to rank 0, manifest,
rename, `latest`) runs there on every rank in the same order, never on the background thread, so it
cannot interleave with the training's own collectives.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch import nn

from zeroinf.aio import BufferPool
from zeroinf.checkpoint.common import broadcast_error, gather, module_state_tensors, node_leaders, rng_state
from zeroinf.checkpoint.format import (
    CHUNK_NUMEL,
    DTYPE_NAMES,
    FORMAT,
    LATEST,
    MANIFEST,
    MODULE_STATE_FILE,
    TMP_PREFIX,
    VERSION,
    CheckpointError,
    encode_manifest,
    fsync_dir,
    rank_filename,
    step_dirname,
    step_of_dirname,
    write_atomic,
)
from zeroinf.checkpoint.hub_folder import record
from zeroinf.checkpoint.stream import STAGING_BYTES, STAGING_COUNT, StreamWriter
from zeroinf.engine import Engine, engine_of
from zeroinf.integrations.peft_layers import adapter_configs, adapter_type
from zeroinf.optim.pipeline import StateViews
from zeroinf.partition.intact import check_params_intact
from zeroinf.runtime import interrupts

__all__ = ["PendingSave", "remove_older_checkpoints", "save"]


@interrupts.entry_point
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: Any,
    step: int,
    extra: dict[str, Any] | None = None,
    *,
    blocking: bool = True,
    keep_last: int | None = None,
    node_local: bool = False,
) -> str | PendingSave | WrittenByTheFirstGroup:
    """Save a checkpoint of `model` and its zeroinf `optimizer` as `path/step_{step:08d}`; a collective.

    `extra` (JSON-serializable, taken from rank 0) is returned by `load`: data position, LR
    scheduler state, anything the training loop needs. Returns the checkpoint folder; with
    `blocking=False`, a `PendingSave` at once, whose writes overlap the next forward and backward
    ([Note: saving without stopping training]). `keep_last=N`: once this checkpoint is published,
    remove those of `path` with a lower step but the N - 1 highest, so N remain of this run
    ([Note: keeping the last checkpoints]). `node_local=True`: `path` is each machine's own disk,
    not a folder every rank sees ([Note: node-local checkpoints]).
    """
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"zeroinf.save: keep_last = {keep_last!r} is invalid; use None (keep all) or an int >= 1")
    finish_pending_save(optimizer)
    engine = engine_of(model)
    optimizer.require_consistent_states()  # never a checkpoint of a partly stepped model
    if engine.micro_step != 0:
        raise RuntimeError(
            f"zeroinf.save after {engine.micro_step} backward passes without optimizer.step(): "
            "save between optimizer steps"
        )
    check_params_intact(engine.all_units)  # values written past the engine would not be saved
    replicas = engine.topo.replicas
    every_rng: list[Any] | None = None
    if replicas is not None:  # hybrid sharding: the first shard group writes ([Note: hybrid sharding] in comm.py)
        # every rank's random-number state by global rank (`rng` holds the first group's only): each
        # resumes its own stream, as under DDP
        every_rng = gather(engine, rng_state(engine), everyone=True)
        if node_local:
            raise ValueError(
                "zeroinf.save(node_local=True) with Config.shard_group_size: only the first shard group writes, so "
                "the other machines' disks would hold no checkpoint; save to a folder every rank sees"
            )
        if replicas.rank != 0:
            folder = os.path.join(os.fspath(path), step_dirname(int(step)))
            if blocking:  # returns once the first group published it (or raises its error)
                _agree_across_replicas(engine, None)
                return folder
            return WrittenByTheFirstGroup(folder)
    job = _SaveJob(model, engine, optimizer, os.fspath(path), int(step), extra, keep_last, node_local)
    if every_rng is not None:
        job.body["rng_of_every_process"] = every_rng
    if blocking:
        try:
            job.write()
            folder = job.finish()
        except Exception as e:
            if replicas is not None:
                _agree_across_replicas(engine, f"zeroinf.save in the first shard group: {e}")
            raise
        if replicas is not None:
            _agree_across_replicas(engine, None)
        return folder
    pending = PendingSave(job, optimizer, engine)
    optimizer.pending_save = engine.pending_save = pending
    return pending


class WrittenByTheFirstGroup:
    """What `zeroinf.save(..., blocking=False)` returns in a shard group other than the first under
    hybrid sharding: nothing to write here; the first group publishes the folder when it waits."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def done_writing(self) -> bool:
        return True

    def wait(self) -> str:
        return self.folder


def _agree_across_replicas(engine: Engine, error: str | None) -> None:
    """Every rank of a hybrid-sharded training learns whether the first shard group's save failed."""
    found = [e for e in gather(engine, error, everyone=True) if e]
    if found and error is None:
        raise CheckpointError(found[0])


def finish_pending_save(optimizer: Any) -> str | None:
    """Finish the optimizer's background save, if any (a collective); returns its folder."""
    pending = getattr(optimizer, "pending_save", None)
    return pending.wait() if pending is not None else None


class PendingSave:
    """A checkpoint being written in the background; `wait()` (a collective) finishes it."""

    def __init__(self, job: _SaveJob, optimizer: Any, engine: Any) -> None:
        self._job, self._optimizer, self._engine = job, optimizer, engine
        self._thread = threading.Thread(target=job.write, name="zeroinf-ckpt-save", daemon=True)
        self._thread.start()
        self._result: str | None = None
        # A process that exits (or drops the model and optimizer) with the save unfinished: let the
        # writes end before the state store's own finalizer (created earlier, so run later) closes
        # the swap files they read. The checkpoint stays an unpublished `.tmp-` folder (publishing
        # it is a collective), and a warning says so: never a checkpoint lost without a word.
        self._waited = [False]
        weakref.finalize(self, _end_unwaited, self._thread, self._waited, job.tmp, job.name)

    def done_writing(self) -> bool:
        """Whether this rank's background writes are over (the checkpoint still needs `wait()`)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Wait for this rank's writes, then finish the checkpoint on every rank; returns its folder."""
        if self._result is None:
            self._waited[0] = True  # finished here, or its error raised here
            self._thread.join()
            for owner in (self._optimizer, self._engine):
                if getattr(owner, "pending_save", None) is self:
                    owner.pending_save = None
            self._result = self._job.finish()
        return self._result


def _end_unwaited(thread: threading.Thread, waited: list[bool], tmp: str, name: str) -> None:
    """A `PendingSave` going away: its writes end; if it was never waited for, a warning."""
    thread.join()
    if not waited[0]:
        warnings.warn(
            f"zeroinf.save(..., blocking=False) of {name} was never finished: its data stays in the "
            f"unpublished folder {tmp}, which no load reads. PendingSave.wait() publishes it (so do the "
            "next optimizer.step(), zeroinf.save and zeroinf.load): call it before the end of training",
            RuntimeWarning, stacklevel=1,
        )


class _SaveJob:
    """One checkpoint: prepared at once (collective), written (any thread), finished (collective)."""

    def __init__(
        self, model: nn.Module, engine: Engine, optimizer: Any, root: str, step: int, extra: Any,
        keep_last: int | None = None, node_local: bool = False,
    ) -> None:
        self.engine, self.store, self.root, self.keep_last = engine, optimizer.states, root, keep_last
        self.rank = engine.topo.rank
        self.name = step_dirname(step)
        self.tmp = os.path.join(root, TMP_PREFIX + self.name)
        # Who writes the folder, the shared files and the manifest: rank 0, or with `node_local` the
        # first rank of each machine, on that machine's disk ([Note: node-local checkpoints]).
        self.nodes: list[str] | None = None
        self.publisher = self.rank == 0
        if node_local:
            self.nodes, leaders = node_leaders(engine)
            self.publisher = leaders[self.rank] == self.rank
        error = None
        if self.publisher:
            try:
                os.makedirs(root, exist_ok=True)
                shutil.rmtree(self.tmp, ignore_errors=True)  # a crashed earlier attempt at this step
                # node-local: another machine preparing the same folder is what `_refuse_a_shared_folder`
                # reports; its `makedirs` must not end the save first with a bare FileExistsError
                os.makedirs(self.tmp, exist_ok=node_local)
                json.dumps(extra)  # fail early (before any data is written) if not serializable
            except (OSError, TypeError, ValueError) as e:
                error = f"zeroinf.save: cannot prepare {self.tmp}: {e}"
        broadcast_error(engine, error)
        if node_local:
            self._refuse_a_shared_folder()
        # Masters kept in parameter files: their last writes land now, on this thread; the writer
        # then reads those files alone while training gathers from them (optim/states.py).
        self.store.land_master_writes()
        # The small state, captured now: the training loop may move on before the data is written.
        self.body = json.loads(json.dumps(_manifest_head(model, engine, optimizer, step, extra)))
        self.rng = rng_state(engine)
        self.buffers = (
            [(n, t.detach().clone()) for n, t in module_state_tensors(model, engine)] if self.publisher else []
        )
        self.chunks: dict[str, list[dict[str, Any]]] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.module_state: dict[str, Any] = {}
        self.error: str | None = None

    def _refuse_a_shared_folder(self) -> None:
        """node_local=True where machines share the folder (a shared file system): their first ranks
        would write one manifest over another's, each listing its own machine's files. Each one marks
        the folder it prepared, and a mark of another machine's means the folder is shared."""
        mark = os.path.join(self.tmp, f".publisher-{self.rank}")
        shared = (
            f"zeroinf.save(node_local=True): {self.root} is one folder for several machines ({{}}): node_local is "
            "for a disk each machine has alone; on a file system the machines share, save with node_local=False "
            "(the Trainer's and accelerate's save_on_each_node=False)"
        )
        error = None
        if self.publisher:
            try:
                open(mark, "w").close()
            except OSError:  # its folder went: another machine's save removed it to prepare its own
                error = shared.format(f"{self.tmp} was removed while rank {self.rank} prepared it")
        gather(self.engine, None)  # every publisher has marked (a mark is made after its maker's removal)
        if self.publisher and error is None:
            mine = os.path.basename(mark)
            try:
                others = sorted(f for f in os.listdir(self.tmp) if f.startswith(".publisher-") and f != mine)
            except OSError:
                others = ["?"]
            if others:
                ranks = ", ".join(f.removeprefix(".publisher-") for f in others)
                error = shared.format(f"ranks {ranks} of other machines prepared it too")
        broadcast_error(self.engine, error)  # every publisher has looked
        if self.publisher:
            os.remove(mark)

    def write(self) -> None:
        """This rank's data files; no collective, so it may run on a background thread."""
        engine, rank, tmp = self.engine, self.rank, self.tmp
        try:
            with _stream_writers(engine) as open_writer:
                # stage 0: every rank holds the same states, written once (once per machine, node-local)
                if engine.policy.shard_optimizer or self.publisher:
                    fname = rank_filename(rank if engine.policy.shard_optimizer else 0)
                    state_bytes = 3 * 4 * sum(unit.owned_numel for unit in engine.units)
                    writer = open_writer(os.path.join(tmp, fname), state_bytes)
                    # another machine's copy of rank 0's file: the same pieces, listed once (rank 0's)
                    chunks = self.chunks if engine.policy.shard_optimizer or rank == 0 else {}
                    for ui, unit in enumerate(engine.units):
                        for s, e, views in self.store.iter_segments(ui):
                            _append_segment(writer, fname, unit, s, e, views, chunks)
                    self.files[fname] = {"size": writer.close()}
                if self.publisher:
                    writer = open_writer(os.path.join(tmp, MODULE_STATE_FILE))
                    for sname, t in self.buffers:
                        at, h = writer.append(t)
                        self.module_state[sname] = {
                            "shape": list(t.shape), "dtype": DTYPE_NAMES[t.dtype], "f": MODULE_STATE_FILE,
                            "b": at, "nbytes": t.numel() * t.element_size(), "h": h,
                        }
                    self.files[MODULE_STATE_FILE] = {"size": writer.close()}
        except Exception as e:  # noqa: BLE001 - reported on every rank by finish()
            self.error = f"zeroinf.save: rank {rank} failed writing {tmp}: {type(e).__name__}: {e}"

    def finish(self) -> str:
        """Gather the chunk lists, write the manifest, publish the folder and `latest` (a collective)."""
        engine, rank, tmp = self.engine, self.rank, self.tmp
        gathered = gather(engine, (self.error, self.chunks, self.files, self.rng))
        errors = [g[0] for g in gathered if g[0]]
        if errors:
            if self.publisher:  # every rank has stopped writing: free the space the partial save took
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"{errors[0]} (the partial checkpoint was removed; the previous one is intact)")
        error = None
        if self.publisher:
            try:
                self._publish(gathered)
            except Exception as e:  # noqa: BLE001
                error = f"zeroinf.save: rank {rank} failed finishing {tmp}: {type(e).__name__}: {e}"
        broadcast_error(engine, error)
        return os.path.join(self.root, self.name)

    def _publish(self, gathered: list[Any]) -> None:
        all_chunks: dict[str, list[dict[str, Any]]] = {}
        all_files: dict[str, dict[str, Any]] = {}
        for _, chunks, files, _ in gathered:
            for pname, lst in chunks.items():
                all_chunks.setdefault(pname, []).extend(lst)
            all_files.update(files)
        for lst in all_chunks.values():
            lst.sort(key=lambda ch: ch["o"])
        body = {**self.body, "chunks": all_chunks, "files": all_files, "module_state": self.module_state,
                "rng": [g[3] for g in gathered]}
        if self.nodes is not None:  # the machine of each rank's file: loading checks its own are here
            body["node_local"] = self.nodes
        write_atomic(os.path.join(self.tmp, MANIFEST), encode_manifest(body))
        fsync_dir(self.tmp)
        root, name = self.root, self.name
        final = os.path.join(root, name)
        trash = None
        if os.path.exists(final):  # re-saving a step: move the old one aside, then replace it
            trash = os.path.join(root, f"{TMP_PREFIX}old-{name}")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
        os.replace(self.tmp, final)
        fsync_dir(root)
        write_atomic(os.path.join(root, LATEST), (name + "\n").encode())
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        if self.keep_last is not None:
            remove_older_checkpoints(root, self.keep_last, name)


# [Note: node-local checkpoints]
# On machines without a file system they all see, `save(..., node_local=True)` writes each rank's
# states to its own machine's disk (`path`, the same name on every machine), and the first rank of
# each machine (by torchrun's GROUP_RANK, Slurm's SLURM_NODEID, else the host name) writes there
# what rank 0 writes otherwise: the folder, the buffers, the manifest (listing every rank's file and
# its machine) and `latest`, and removes that machine's old checkpoints (`keep_last`). At stage 0,
# where every rank holds the same states, each machine keeps a copy of rank 0's file. As
# DeepSpeed's `use_node_local_storage`, such a checkpoint loads with the same ranks on each machine:
# each rank then finds its own pieces at home; `load` checks that every file this rank's layout
# needs is there and otherwise names the missing file and its machine. Copied together into one
# folder (every machine's step folder merged), it is an ordinary checkpoint again, loadable at any
# world size, and `zeroinf.consolidate` reads it. On a file system the machines share, their first
# ranks would write one manifest over another's: each marks the folder it prepares, and a mark of
# another machine's refuses the save on every rank (`_refuse_a_shared_folder`).

# [Note: keeping the last checkpoints]
# `save(..., keep_last=N)` bounds the disk a run's checkpoints take (a 7B model's fp32 master and
# moments are 84 GB a checkpoint): once the new checkpoint of step s and `latest` are published and
# fsynced, rank 0 removes the complete checkpoints of the root numbered below s but the N - 1
# highest of them. Checkpoints numbered above s are left alone: they were saved by a run this one
# resumed before (resumed from step 100 of a root holding 100-300, the save of step 110 with
# keep_last=2 keeps 110 and 100, and leaves 200 and 300 to the user; by write time it would keep 300
# and drop the checkpoint this run continues from, and by number alone it would drop 110 itself).
# Only folders named like a step that hold a manifest are candidates: `.tmp-` folders, folders without
# a manifest and anything else in the root are never touched.
def remove_older_checkpoints(root: str, keep_last: int, newest: str) -> list[str]:
    """Remove the complete step folders of `root` numbered below `newest` (the one just published, named
    by `latest`) but the `keep_last - 1` highest of them; returns the names removed."""
    limit = step_of_dirname(newest)
    older = []
    for entry in os.scandir(root):
        step = step_of_dirname(entry.name)
        if step is None or limit is None or step >= limit or not entry.is_dir(follow_symlinks=False):
            continue
        if os.path.exists(os.path.join(entry.path, MANIFEST)):  # else not a complete checkpoint: not ours
            older.append((step, entry.name))
    older.sort(reverse=True)
    removed = [name for _, name in older[keep_last - 1 :]]
    for name in removed:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return removed


@contextlib.contextmanager
def _stream_writers(engine: Engine) -> Iterator[Callable[..., StreamWriter]]:
    """Opens StreamWriters sharing the checkpoint lane's aio engine and one staging pool, all closed
    (or aborted) on exit."""
    writers: list[StreamWriter] = []
    aio = engine.nvme_tier.engine("checkpoint")
    with BufferPool(
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


def _manifest_head(model: nn.Module, engine: Engine, optimizer: Any, step: int, extra: Any) -> dict[str, Any]:
    """The manifest without the data's locations: parameters, optimizer and run state."""
    aliases: dict[int, list[str]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(pname)
    params: dict[str, Any] = {}
    order: list[str] = []
    for ui, unit in enumerate(engine.units):
        dtype = DTYPE_NAMES[unit.param_flat.dtype]  # the compute dtype, or fp32 where the model keeps it
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
        "order": order, "params": params,
        "hf": record(model),  # a transformers model's class and config: consolidate writes a Hub folder
        # a peft model's adapters (name -> peft type): consolidate refuses it, naming zeroinf.save_pretrained
        "peft": {name: adapter_type(c) for name, c in adapter_configs(model).items()} or None,
        # frozen parameters sharded at stage 3 are not saved (common.py): named for consolidate
        "frozen": {
            slot.name: {"shape": list(slot.shape), "unit": unit.name}
            for unit in engine.frozen_units if not unit.resident for slot in unit.layout.slots
        },
        "optimizer": {
            # what the two state slots beside the master hold (optim/sharded.py `state_names`): load checks it
            "class": optimizer.display_name,
            "states": list(optimizer.state_names),
            "step_count": int(optimizer.step_count),
            "param_groups": groups,
            "scaler": optimizer.scaler.state_dict() if optimizer.scaler is not None else None,
        },
    }
