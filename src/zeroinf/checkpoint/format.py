"""The on-disk format of a zeroinf checkpoint: manifest, data files, checksums, atomic writes.

A checkpoint root holds one folder per saved step and a `latest` pointer:

    ROOT/latest                  text: the folder name of the newest complete checkpoint
    ROOT/step_00000010/          one complete checkpoint
        manifest.json            every parameter: name, shape, dtype, and where its pieces lie
        rank00000.bin ...        raw fp32 states, written by each rank for its owned ranges
        module_state.bin         buffers and parameters outside units (rank 0)
    ROOT/.tmp-step_00000012/     a save in progress (or a crashed one): never read

Data files are raw little-endian bytes with no header. A *chunk* is at most `CHUNK_NUMEL`
consecutive elements of one parameter as the saving rank owned them; it is stored as its fp32
master, exp_avg and exp_avg_sq one after the other, each with its own xxh3-64 checksum, so a
reader can take just the chunks that intersect its own owned range and verify exactly what it
read (and consolidation can read only the masters). Every file's size is in the manifest, and its
recorded pieces tile it exactly, so `verify()` checks every byte of it against a checksum.

The manifest is `{"body": {...}, "xxh3": hex}` where the hash is over the canonical JSON of the
body (sorted keys, no spaces), so a flipped byte inside it is caught too.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
from typing import Any

import torch
import xxhash

from zeroinf.aio.engine import AioEngine
from zeroinf.aio.errors import AioError

FORMAT = "zeroinf-checkpoint"
VERSION = 2  # 2: pieces written by StreamWriter, files described by their pieces (no whole-file hash)
MANIFEST = "manifest.json"
LATEST = "latest"
MODULE_STATE_FILE = "module_state.bin"
TMP_PREFIX = ".tmp-"
CHUNK_NUMEL = 2 * 1024 * 1024  # 8 MiB per fp32 state: bounds the memory of one read
STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, truncated, corrupted or does not fit the model.

    The message names the file and what is wrong with it."""


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


_STEP_DIRNAME = re.compile(r"step_(\d{8,})")


def step_of_dirname(name: str) -> int | None:
    """The step of a checkpoint folder named by `step_dirname`; None for any other name."""
    match = _STEP_DIRNAME.fullmatch(name)
    return int(match.group(1)) if match else None


def rank_filename(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The flat uint8 view of a tensor's bytes on the CPU (copied there, or made contiguous, only if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8)


def as_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor (any dtype, any shape) that keeps its memory alive.

    Built on ctypes rather than `Tensor.numpy()`, so the package runs without numpy installed.
    """
    flat = tensor_bytes(t)
    if not flat.numel():
        return memoryview(b"")
    raw = (ctypes.c_ubyte * flat.numel()).from_address(flat.data_ptr())
    raw._owner = flat  # type: ignore[attr-defined]  # the memoryview holds `raw`, `raw` holds the tensor
    return memoryview(raw).cast("B")


def chunk_what(kind_index: int, pname: str, chunk: dict[str, Any]) -> str:
    """How errors name one state of one saved chunk, e.g. "exp_avg of blocks.0.w[0:2097152]"."""
    return f"{STATE_KINDS[kind_index]} of {pname}[{chunk['o']}:{chunk['o'] + chunk['n']}]"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` via a temporary name, fsync, rename, fsync the folder."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def encode_manifest(body: dict[str, Any]) -> bytes:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return json.dumps({"body": body, "xxh3": xxhash.xxh3_64_hexdigest(canon.encode())}, indent=1).encode()


def read_manifest(ckpt_dir: str) -> dict[str, Any]:
    path = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint folder")
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete: a save did not finish)")
    try:
        with open(path, "rb") as f:
            outer = json.loads(f.read())
        body = outer["body"]
        expected = outer["xxh3"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid manifest (truncated or corrupted: {e})") from None
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"))
    if xxhash.xxh3_64_hexdigest(canon.encode()) != expected:
        raise CheckpointError(f"{path}: checksum mismatch (the manifest is corrupted)")
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: format {body.get('format')!r} version {body.get('version')!r}; "
            f"this zeroinf reads {FORMAT!r} version {VERSION}"
        )
    return body


def resolve(path: str) -> str:
    """A checkpoint folder from a root (through `latest`) or a checkpoint folder itself."""
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.exists(latest):
        with open(latest, "rb") as f:
            name = f.read().decode("utf-8", errors="replace").strip()  # a damaged pointer is named below
        target = os.path.join(path, name)
        if not name or "\x00" in name or not os.path.isdir(target):
            raise CheckpointError(f"{latest}: points at {name!r}, which does not exist")
        return target
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint folder")
    raise CheckpointError(
        f"{path}: neither a checkpoint (no {MANIFEST}) nor a checkpoint root (no {LATEST} pointer); "
        "an interrupted save leaves only a .tmp- folder, which is never loaded"
    )


def files_elsewhere(ckpt: str, body: dict[str, Any]) -> list[str]:
    """The data files a node-local checkpoint (saving.py [Note: node-local checkpoints]) keeps on
    other machines: listed in its manifest, absent from this machine's folder; [] for any other."""
    if not body.get("node_local"):
        return []
    return sorted(name for name in body["files"] if not os.path.exists(os.path.join(ckpt, name)))


def refuse_files_elsewhere(ckpt: str, body: dict[str, Any], what: str) -> None:
    """`what` needs every rank's states: refuse a node-local folder that lacks some, saying how to merge."""
    absent = files_elsewhere(ckpt, body)
    if absent:
        more = " and more" if len(absent) > 3 else ""
        raise CheckpointError(
            f"{ckpt}: {what} needs every rank's states, and this node-local checkpoint keeps "
            f"{', '.join(absent[:3])}{more} on other machines: copy every machine's {os.path.basename(ckpt)} "
            "folder into one first (it is then an ordinary checkpoint)"
        )


READ_AHEAD_BYTES = 64 * 1024 * 1024

# [Note: checkpoint reads bypass the page cache]
# Saves write through the aio engine with O_DIRECT (stream.py); loads used to read with `preadv`
# through the page cache, asking the kernel to read ahead. On this VM's disk (O_DIRECT 1.2-3.1 GB/s
# read) that path read 0.6-1.3 GB/s, `cat` of the same files 0.6-1.6: the page cache, not the disk,
# was the bound, and a load of a large state also pushed everything else out of it. A load now
# reads each chunk through the model's checkpoint aio engine (the save's lane) from a second,
# read-only O_DIRECT descriptor of each file: unaligned offsets and sizes are the engine's job (it
# reads the aligned blocks around them through its bounce buffers), the checksum is checked as
# before, and a filesystem that refuses O_DIRECT (tmpfs) keeps the plain reads. Side by side in one
# process, page cache emptied before each load (5.0e8 parameters, states on the host, 6.04 GB, AMD
# EPYC 2 threads, 4 rounds, `benchmarks/checkpoint_io.py` builds the model): medians 8.5 s plain
# against 3.8 s direct for the whole state, 2.36 against 1.61 s for the masters alone
# (`load_optimizer_states=False`, 4 of each 12 bytes, whose plain read-ahead also read the states
# it skipped). More reader threads (2, 4, 8) changed nothing. `consolidate` and `verify` keep the
# plain reads: an engine of its own made `consolidate` 1.3-2x faster on a 5e8-parameter checkpoint,
# but its bounce buffers and threads, made for one call, moved the process's peak RSS by 3-30 MiB
# from run to run (tests/checkpoint/test_elastic.py bounds the whole growth at a quarter of a
# 128 MiB model), where the plain reads stay at 17 MiB.


class DataFiles:
    """Read-side access to a checkpoint's data files: size checks on open, checksummed reads.

    With an `aio` engine (a load: the model's checkpoint lane) the reads go through it from a second,
    O_DIRECT descriptor of each file ([Note: checkpoint reads bypass the page cache]). Without one
    (consolidate, verify), or where the filesystem refuses O_DIRECT, they are plain `preadv`s, and
    readers walking a file mostly forward ask the kernel (posix_fadvise WILLNEED) to fetch the next
    `READ_AHEAD_BYTES` in the background while this chunk is hashed and copied.
    """

    def __init__(
        self, ckpt_dir: str, files: dict[str, dict[str, Any]], aio: AioEngine | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        self.dir, self.files, self.aio, self.timeout_s = ckpt_dir, files, aio, timeout_s
        self._fds: dict[str, int] = {}
        self._direct_fds: dict[str, int | None] = {}  # None: the filesystem refuses O_DIRECT
        self._advised: dict[str, int] = {}  # per file: the end of the range already asked for

    def _direct_fd(self, name: str) -> int | None:
        if name not in self._direct_fds:
            try:  # read-only: a checkpoint on a read-only mount loads too
                self._direct_fds[name] = os.open(os.path.join(self.dir, name), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise CheckpointError(f"{os.path.join(self.dir, name)}: cannot be opened: {exc}") from exc
                self._direct_fds[name] = None
        return self._direct_fds[name]

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        path = os.path.join(self.dir, name)
        meta = self.files.get(name)
        if meta is None:
            raise CheckpointError(f"{path}: not listed in the manifest's files")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (the manifest lists it with {meta['size']} bytes)") from None
        size = os.fstat(fd).st_size
        if size != meta["size"]:
            os.close(fd)
            what = "truncated" if size < meta["size"] else "longer than recorded"
            raise CheckpointError(f"{path}: {what}: {size} bytes, the manifest says {meta['size']}")
        self._fds[name] = fd
        return fd

    def check_all_present(self) -> None:
        self.check_present(self.files)

    def check_present(self, names: Any) -> None:
        """Open (and size-check) the data files `names`."""
        for name in names:
            self._fd(name)

    def read_into(self, name: str, offset: int, out: torch.Tensor, expected: str, what: str) -> None:
        """Fill contiguous CPU tensor `out` from `name` at `offset`; verify its xxh3."""
        buf = as_bytes(out)
        fd = self._fd(name)  # opened and size-checked
        path = os.path.join(self.dir, name)
        direct = self._direct_fd(name) if self.aio is not None and buf.nbytes else None
        if direct is not None:
            assert self.aio is not None
            try:
                n = self.aio.read(tensor_bytes(out), direct, offset).wait(self.timeout_s)
            except AioError as exc:
                raise CheckpointError(f"{path}: reading {what} failed: {exc}") from exc
            except TimeoutError as exc:
                raise CheckpointError(f"{path}: reading {what}: {exc} (is the disk responding?)") from exc
        else:
            end = offset + buf.nbytes
            if self._advised.get(name, 0) < end + READ_AHEAD_BYTES // 2:  # one syscall per half window
                self._advised[name] = end + READ_AHEAD_BYTES
                os.posix_fadvise(fd, end, READ_AHEAD_BYTES, os.POSIX_FADV_WILLNEED)
            n = os.preadv(fd, [buf], offset) if buf.nbytes else 0
        if n != buf.nbytes:
            raise CheckpointError(f"{path}: truncated: {what} needs bytes [{offset}, {offset + buf.nbytes})")
        got = xxhash.xxh3_64_hexdigest(buf)
        if got != expected:
            raise CheckpointError(
                f"{path}: checksum mismatch in {what} (bytes [{offset}, {offset + buf.nbytes})): "
                "the file is corrupted"
            )

    def close(self) -> None:
        for fd in [*self._fds.values(), *self._direct_fds.values()]:
            if fd is not None:
                os.close(fd)
        self._fds, self._direct_fds, self._advised = {}, {}, {}
