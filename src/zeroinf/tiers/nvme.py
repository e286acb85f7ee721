"""The nvme tier: per-rank swap files, one per kind of state, with shards at aligned offsets.

`plan_swap_layout` is a pure function from shard sizes to a `SwapLayout` that maps (unit, state kind)
to (file, offset, bytes). `NvmeSwap` makes the layout real: it replaces leftovers of a crashed run
(and refuses files of a live one), preallocates every file (so a full disk fails now, not mid-step),
moves shards with the aio engine (`swap_out` / `swap_in`) and removes its files on `close()`.

[Note: leftover swap files]
A clean shutdown removes the files, so one that exists at start-up was left by a run that crashed
(a rank killed, a node lost), or belongs to a run still going. Each live file holds an exclusive
flock for its lifetime, and the kernel drops the lock when its process dies however it dies, so
the lock tells the two apart: a locked file is refused (two runs must not share a folder); an
unlocked one is removed with a warning and created afresh, so the next run after a crash starts
in the same folder. Their contents are never read: they match no current layout.

[Note: several sharded models in one process]
A policy and its frozen reference model (DPO), a student and its teacher: each has its own engine,
NVMe tier and construction park, often with the same `nvme_dir`. Each claims the lowest model index
that no live owner of its role ("tier", "park") in this process holds for that folder and rank, and
its files carry it (`swap_file_name`; index 0 keeps the plain name). Claimed lowest-first, so the
next run's second model takes the same index and replaces what a crashed run's second model left.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from zeroinf.aio.buffers import as_bytes, round_up
from zeroinf.aio.config import AioConfig
from zeroinf.aio.engine import AioEngine, AioHandle
from zeroinf.aio.errors import AioError
from zeroinf.memory import Ledger, Tier, format_bytes
from zeroinf.telemetry import get_logger

_KIND_PATTERN = re.compile(r"^[A-Za-z0-9_]+$")


def open_engine(aio: AioConfig | None = None, ledger: Ledger | None = None) -> AioEngine:
    """An I/O engine outside a training engine's tier (tiers/nvme_tier.py): the park while
    `zeroinf.init` builds, reads of pretrained weights."""
    return AioEngine(aio or AioConfig(), ledger=ledger)


def swap_file_name(rank: int, kind: str, model: int = 0) -> str:
    """`model`: which of this process's sharded models owns the file (tiers/nvme_tier.py); the first
    keeps the plain name."""
    return f"zeroinf-rank{rank}-{f'model{model}-' if model else ''}{kind}.swap"


# Reentrant: the garbage collector may run a dead engine's finalizer (NvmeTier.close -> release) on
# this thread at any allocation, also inside a claim below; a plain lock then waited for itself, and
# the process hung for good (seen once in the suite: a split-states test building its next model).
_model_indices_lock = threading.RLock()
_model_indices_taken: dict[tuple[str, int, str], set[int]] = {}  # (folder, rank, role) -> live indices


class ModelIndex:
    """A model index claimed for one owner of swap files: [Note: several sharded models in one process]."""

    def __init__(self, folder: str, rank: int, role: str) -> None:
        self.key = (os.path.abspath(folder), rank, role)
        with _model_indices_lock:
            taken = _model_indices_taken.setdefault(self.key, set())
            self.index = next(i for i in range(len(taken) + 1) if i not in taken)
            taken.add(self.index)
        self._released = False

    def release(self) -> None:
        """Give the index back (idempotent: a second call must not free an index claimed since)."""
        with _model_indices_lock:
            if not self._released:
                self._released = True
                _model_indices_taken[self.key].discard(self.index)


class SwapFolderError(OSError):
    """The swap folder is missing (and cannot be created), not writable or too small; the message names it."""


def ensure_swap_folder(folder: str) -> None:
    """Create the swap folder if it is missing (as DeepSpeed does); its parent must exist.

    Several ranks may race here: the loser's "already exists" is success.
    """
    if os.path.isdir(folder):
        return
    parent = os.path.dirname(os.path.abspath(folder))
    if not os.path.isdir(parent):
        raise SwapFolderError(
            f"offload.nvme_dir {folder!r} does not exist and cannot be created: its parent {parent!r} does "
            "not exist either; create the parent or choose another folder"
        )
    try:
        os.mkdir(folder)
    except FileExistsError:  # another rank created it between the check and here
        pass
    except OSError as exc:
        raise SwapFolderError(f"offload.nvme_dir {folder!r} does not exist and cannot be created: {exc}") from exc
    if not os.path.isdir(folder):
        raise SwapFolderError(f"offload.nvme_dir {folder!r} exists but is not a folder: choose another path")


class SwapLeftoverError(RuntimeError):
    """A swap file of this rank already exists: see [Note: leftover swap files]."""


@dataclass(frozen=True)
class SwapSlot:
    """Where one shard lives: `nbytes` at `offset_bytes` of `path` (the offset is aligned)."""

    path: str
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class SwapLayout:
    """(unit, state kind) -> SwapSlot, and the size of each kind's file. Plain data."""

    folder: str
    rank: int
    slots: Mapping[tuple[str, str], SwapSlot]
    file_bytes: Mapping[str, int]  # kind -> preallocated file size
    model: int = 0  # which of this process's sharded models owns the files (swap_file_name)

    def slot(self, unit: str, kind: str) -> SwapSlot:
        try:
            return self.slots[(unit, kind)]
        except KeyError:
            raise KeyError(
                f"swap layout of rank {self.rank} has no slot for unit {unit!r}, state kind {kind!r}; "
                f"kinds: {sorted(self.file_bytes)}"
            ) from None

    def path(self, kind: str) -> str:
        return os.path.join(self.folder, swap_file_name(self.rank, kind, self.model))


def plan_swap_layout(
    shard_bytes: Mapping[tuple[str, str], int],
    folder: str | os.PathLike[str],
    rank: int,
    alignment_bytes: int = 4096,
    model: int = 0,
) -> SwapLayout:
    """Lay shards end to end, in the mapping's order, one file per kind, each at an aligned offset."""
    folder = os.path.abspath(os.fspath(folder))
    slots: dict[tuple[str, str], SwapSlot] = {}
    file_bytes: dict[str, int] = {}
    for (unit, kind), nbytes in shard_bytes.items():
        if not _KIND_PATTERN.match(kind):
            raise ValueError(f"swap layout: state kind {kind!r} must be letters, digits and '_' only")
        if nbytes < 0:
            raise ValueError(f"swap layout: shard ({unit!r}, {kind!r}) has negative size {nbytes}")
        offset_bytes = file_bytes.get(kind, 0)
        path = os.path.join(folder, swap_file_name(rank, kind, model))
        slots[(unit, kind)] = SwapSlot(path, offset_bytes, nbytes)
        file_bytes[kind] = offset_bytes + round_up(max(nbytes, 1), alignment_bytes)
    return SwapLayout(folder, rank, slots, file_bytes, model)


class NvmeSwap:
    """The swap files of one rank: created and preallocated at construction, removed by `close()`.

    Each file's bytes are reserved on the ledger's NVME tier under its state kind as tag.
    """

    def __init__(self, layout: SwapLayout, engine: AioEngine, *, ledger: Ledger | None = None) -> None:
        self.layout = layout
        # Slots and file sizes as they grow (`add_slot`); the layout holds what was planned up front.
        self._slots: dict[tuple[str, str], SwapSlot] = dict(layout.slots)
        self._file_bytes: dict[str, int] = dict(layout.file_bytes)
        self.engine = engine
        self.ledger = ledger if ledger is not None else engine.ledger
        self._lock_fds: dict[str, int] = {}  # kind -> fd holding the file's flock
        self._reserved_kinds: set[str] = set()
        self._in_flight: list[AioHandle] = []
        self._closed = False
        self._check_folder()
        self._check_leftovers()
        try:
            for kind, nbytes in layout.file_bytes.items():
                self._create(kind, nbytes)
        except BaseException:
            self.close()
            raise

    def _check_folder(self) -> None:
        folder = self.layout.folder
        first = next(iter(self.layout.file_bytes.items()), None)
        path, nbytes = (self.layout.path(first[0]), first[1]) if first else (folder, 0)
        try:
            ensure_swap_folder(folder)
        except SwapFolderError as exc:
            raise AioError("create", path, 0, nbytes, str(exc)) from exc
        # Root passes access() on any folder that is not on a read-only filesystem; creating the
        # files below then reports the error with its errno.
        if not os.access(folder, os.W_OK | os.X_OK):
            raise AioError("create", path, 0, nbytes, f"the swap folder {folder!r} is not writable")

    def _check_leftovers(self, paths: list[str] | None = None) -> None:
        # Only this layout's kinds: the parameter and optimizer swaps of one run share a folder.
        if paths is None:
            paths = [self.layout.path(kind) for kind in self.layout.file_bytes]
        found = sorted(p for p in paths if os.path.exists(p))
        if not found:
            return
        in_use = [p for p in found if _locked_by_another(p)]
        if in_use:
            raise SwapLeftoverError(
                f"swap files of rank {self.layout.rank} are in use by a running process: {in_use}; "
                "give each run its own swap folder"
            )
        get_logger("tiers").warning(
            "removing swap files of rank %d left by a run that did not shut down cleanly: %s",
            self.layout.rank, found,
        )
        for path in found:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def add_slot(self, unit: str, kind: str, nbytes: int, alignment_bytes: int = 4096) -> SwapSlot:
        """Append a slot for a shard not in the planned layout (the file grows, preallocated)."""
        self._require_open(unit, kind)
        if (unit, kind) in self._slots:
            raise ValueError(f"swap of rank {self.layout.rank} already has a slot for ({unit!r}, {kind!r})")
        if not _KIND_PATTERN.match(kind):
            raise ValueError(f"swap layout: state kind {kind!r} must be letters, digits and '_' only")
        offset = self._file_bytes.get(kind, 0)
        end = offset + round_up(max(nbytes, 1), alignment_bytes)
        path = self.layout.path(kind)
        if kind not in self._lock_fds:
            self._check_leftovers([path])
            self._file_bytes[kind] = end
            self._create(kind, end)
        else:
            try:
                os.posix_fallocate(self._lock_fds[kind], offset, end - offset)
            except OSError as exc:
                raise AioError.from_os_error("fallocate", path, offset, end - offset, exc) from exc
            self._file_bytes[kind] = end
            self.ledger.reserve(Tier.NVME, end - offset, kind)
        slot = SwapSlot(path, offset, nbytes)
        self._slots[(unit, kind)] = slot
        return slot

    def _create(self, kind: str, nbytes: int) -> None:
        path = self.layout.path(kind)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AioError.from_os_error("create", path, 0, nbytes, exc) from exc
        self._lock_fds[kind] = fd
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # a full disk fails here, not in the middle of a step
        except OSError as exc:
            raise AioError.from_os_error("fallocate", path, 0, nbytes, exc) from exc
        self.engine.open_file(path)
        self.ledger.reserve(Tier.NVME, nbytes, kind)
        self._reserved_kinds.add(kind)

    def slot_of(self, unit: str, kind: str) -> SwapSlot:
        """Where the shard of `unit` and `kind` lives now (a grown file may have moved it)."""
        return self._slots.get((unit, kind)) or self.layout.slot(unit, kind)  # the layout's error names it

    def _require_open(self, unit: str, kind: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"the NVMe swap files of rank {self.layout.rank} in {self.layout.folder} were closed and removed "
                f"(the {kind} shard of {unit!r} was asked for): the engine or optimizer that owned them was closed "
                "(engine_of(model).close(), optimizer.close(), or the process exiting). Shard the model again, or "
                "make a new optimizer, to go on"
            )

    def _slot_for(self, unit: str, kind: str, tensor: torch.Tensor, op: str, at_bytes: int | None) -> SwapSlot:
        self._require_open(unit, kind)
        slot = self.slot_of(unit, kind)
        nbytes = as_bytes(tensor, f"the {kind} shard of {unit!r}").numel()
        start = at_bytes or 0
        if (nbytes != slot.nbytes if at_bytes is None else not 0 <= start <= start + nbytes <= slot.nbytes):
            raise ValueError(
                f"{op} of unit {unit!r} {kind}: the tensor has {nbytes} bytes at byte {start}, the slot at "
                f"offset {slot.offset_bytes} of {slot.path!r} holds {slot.nbytes}"
            )
        return slot

    def swap_out(self, unit: str, kind: str, tensor: torch.Tensor, at_bytes: int | None = None) -> AioHandle:
        """Start writing a shard to its slot (or, with `at_bytes`, a piece of it at that byte); keep
        `tensor` unchanged until the handle is waited on."""
        slot = self._slot_for(unit, kind, tensor, "swap_out", at_bytes)
        return self._track(self.engine.write(tensor, slot.path, slot.offset_bytes + (at_bytes or 0)))

    def swap_in(self, unit: str, kind: str, tensor: torch.Tensor, at_bytes: int | None = None) -> AioHandle:
        """Start reading a shard from its slot (or a piece of it, at `at_bytes`) into `tensor`."""
        slot = self._slot_for(unit, kind, tensor, "swap_in", at_bytes)
        return self._track(self.engine.read(tensor, slot.path, slot.offset_bytes + (at_bytes or 0)))

    def _track(self, handle: AioHandle) -> AioHandle:
        self._in_flight = [h for h in self._in_flight if not h.done()]
        self._in_flight.append(handle)
        return handle

    def close(self) -> None:
        """Remove the swap files and release their bytes. Wait for swaps in flight first. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._in_flight:  # errors belong to whoever waits on the handle
            handle.wait_done()
        self._in_flight.clear()
        for kind, fd in self._lock_fds.items():
            path = self.layout.path(kind)
            self.engine.close_file(path)
            with contextlib.suppress(FileNotFoundError):  # someone else removed it: nothing to clean
                os.remove(path)
            os.close(fd)  # the lock goes last: no moment where the file exists unlocked
            if kind in self._reserved_kinds:
                self.ledger.release(Tier.NVME, self._file_bytes[kind], kind)
        self._lock_fds.clear()
        self._reserved_kinds.clear()

    def describe(self) -> str:
        sizes = ", ".join(f"{k}: {format_bytes(n)}" for k, n in self._file_bytes.items())
        return f"NvmeSwap(rank {self.layout.rank}, {self.layout.folder}: {sizes})"

    def __enter__(self) -> NvmeSwap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _locked_by_another(path: str) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
