"""A folder of safetensors weights in the Hugging Face layout, read by element ranges.

`model.safetensors`, or `model-0000k-of-0000n.safetensors` files listed by
`model.safetensors.index.json`. Only the headers are parsed up front (8 bytes of little-endian
header length, then a JSON header giving each tensor's dtype, shape and byte range); the data is
read later, a range of elements at a time, through the aio engine (O_DIRECT where the filesystem
allows it, so loading a model larger than RAM leaves no page cache behind, and many requests in
flight). A tensor's elements are stored row-major, so any range of its flattened elements is one
contiguous byte range: each rank reads exactly the bytes of its own shards.

Every structural problem is found before any data is read and named with its file: a missing
shard file, an index that names a file that is not there, a header that does not parse, a tensor
whose bytes run past the end of its file (a truncated download), a dtype we cannot convert, a
malformed entry or two tensors sharing bytes (a damaged header).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import json
import math
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from zeroinf.aio import AioEngine, AioHandle
from zeroinf.telemetry import get_logger
from zeroinf.tiers.nvme import open_engine

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 2**20


class WeightsError(ValueError):
    """A weights folder or file that cannot be loaded; the message names the file and the key."""


@dataclass(frozen=True)
class StoredTensor:
    key: str
    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int  # absolute offset of the first element in `path`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def ranges(self, start: int, numel: int) -> list[Segment]:
        """Elements [start, start + numel) as ranges of stored tensors: itself."""
        return [Segment(self, start, numel)]


@dataclass(frozen=True)
class Segment:
    """Elements [start, start + numel) of a stored tensor (one contiguous byte range of its file)."""

    stored: StoredTensor
    start: int
    numel: int


@dataclass(frozen=True)
class ComposedTensor:
    """A tensor the files hold in pieces, or a piece of a stored tensor: its flattened elements are
    `segments`, in order (the experts of a layer stacked, two stacks concatenated, a fused qkv split:
    weights/hf_conversion.py). A range of it is a few ranges of stored tensors, so a shard is still
    read as contiguous byte ranges."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    segments: tuple[Segment, ...]

    def __post_init__(self) -> None:
        if sum(s.numel for s in self.segments) != self.numel:
            raise ValueError(f"{self.key}: segments of {sum(s.numel for s in self.segments)} elements for {self.shape}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def path(self) -> str:
        """The file of its first piece (messages name it)."""
        return self.segments[0].stored.path if self.segments else "(no elements)"

    def ranges(self, start: int, numel: int) -> list[Segment]:
        """Elements [start, start + numel) as ranges of stored tensors."""
        offsets = self._offsets
        out, end = [], start + numel
        i = bisect.bisect_right(offsets, start) - 1
        while start < end:
            seg, seg_start = self.segments[i], offsets[i]
            take = min(end, seg_start + seg.numel) - start
            out.append(Segment(seg.stored, seg.start + start - seg_start, take))
            start += take
            i += 1
        return out

    @functools.cached_property
    def _offsets(self) -> list[int]:
        """Where each segment starts in the flattened tensor."""
        return list(itertools.accumulate((seg.numel for seg in self.segments[:-1]), initial=0))


Ranged = StoredTensor | ComposedTensor  # any range of its elements is ranges of the files


@dataclass(frozen=True)
class TransposedTensor:
    """`base.transpose(dim0, dim1)`, contiguous (transformers' Transpose: Qwen3-VL-MoE's experts
    are stored (experts, hidden, 2 x intermediate), the model holds (experts, 2 x intermediate,
    hidden)). Its elements are not ranges of the files: a range is read as the whole blocks of
    `base` it falls in (a block: the dims from `dim0` on, one expert's matrix there), transposed in
    memory, so a rank reads at most two blocks beyond its shard, never the whole tensor for 3-D."""

    key: str
    base: Ranged
    dim0: int  # dim0 < dim1, both >= 0
    dim1: int

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.base.shape)
        shape[self.dim0], shape[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    @property
    def numel(self) -> int:
        return self.base.numel

    @property
    def path(self) -> str:
        return self.base.path

    @property
    def block(self) -> int:
        """Elements per block: what one index of the dims before `dim0` holds."""
        return math.prod(self.base.shape[self.dim0 :])


Stored = StoredTensor | ComposedTensor | TransposedTensor


def transpose(key: str, base: Ranged, dim0: int, dim1: int) -> TransposedTensor:
    """`base.transpose(dim0, dim1).contiguous()`, read by blocks."""
    dims = sorted((dim0 % len(base.shape), dim1 % len(base.shape)))
    return TransposedTensor(key, base, dims[0], dims[1])


def stack(key: str, parts: Sequence[Ranged]) -> ComposedTensor:
    """`torch.stack(parts)` (along dim 0): the parts one after the other."""
    _check_alike(key, parts, dim=None)
    segments = tuple(seg for part in parts for seg in part.ranges(0, part.numel))
    return ComposedTensor(key, (len(parts), *parts[0].shape), parts[0].dtype, _merged(segments))


def concatenate(key: str, parts: Sequence[Ranged], dim: int) -> ComposedTensor:
    """`torch.cat(parts, dim)`: for each index of the dimensions before `dim`, each part's block of
    prod(shape[dim:]) elements in turn."""
    _check_alike(key, parts, dim)
    dim = dim % len(parts[0].shape)
    outer = math.prod(parts[0].shape[:dim])
    inner = [math.prod(part.shape[dim:]) for part in parts]
    segments = tuple(
        seg for o in range(outer) for part, n in zip(parts, inner, strict=True) for seg in part.ranges(o * n, n)
    )
    shape = list(parts[0].shape)
    shape[dim] = sum(part.shape[dim] for part in parts)
    return ComposedTensor(key, tuple(shape), parts[0].dtype, _merged(segments))


def split(keys: Sequence[str], part: Ranged, dim: int, sizes: Sequence[int]) -> list[ComposedTensor]:
    """`torch.split(part, sizes, dim)`, piece i named `keys[i]`: for each index of the dimensions
    before `dim`, its block of sizes[i] * prod(shape[dim + 1:]) elements (one range for dim 0)."""
    dim = dim % len(part.shape)
    if len(keys) != len(sizes) or sum(sizes) != part.shape[dim] or min(sizes, default=0) < 0:
        raise WeightsError(
            f"{part.path}: {part.key!r} {tuple(part.shape)} cannot be split along dim {dim} into {list(keys)} of "
            f"sizes {list(sizes)}"
        )
    outer, row = math.prod(part.shape[:dim]), math.prod(part.shape[dim + 1 :])
    out, at = [], 0
    for key, size in zip(keys, sizes, strict=True):
        segments = tuple(seg for o in range(outer) for seg in part.ranges((o * part.shape[dim] + at) * row, size * row))
        shape = (*part.shape[:dim], size, *part.shape[dim + 1 :])
        out.append(ComposedTensor(key, shape, part.dtype, _merged(segments)))
        at += size
    return out


def permute_rows(key: str, part: Ranged, order: Sequence[int]) -> ComposedTensor:
    """`part[order]`: its rows (along dim 0) in the order given, each a range of `part`."""
    row = math.prod(part.shape[1:])
    if sorted(order) != list(range(part.shape[0])):
        raise WeightsError(f"{part.path}: {part.key!r} {tuple(part.shape)}: {len(order)} rows do not permute its rows")
    segments = tuple(seg for r in order for seg in part.ranges(r * row, row))
    return ComposedTensor(key, tuple(part.shape), part.dtype, _merged(segments))


def chunk_sizes(length: int, chunks: int) -> list[int]:
    """The sizes `torch.chunk` cuts `length` into for `chunks` (fewer pieces where it does not divide)."""
    size = -(-length // chunks) if length else 0
    return [min(size, length - start) for start in range(0, length, size)] if size else [0] * chunks


def _check_alike(key: str, parts: Sequence[Ranged], dim: int | None) -> None:
    """Parts of one dtype and of one shape (but along `dim`), or a WeightsError naming them."""
    first = parts[0]
    for part in parts[1:]:
        shapes = (first.shape, part.shape)
        if dim is not None and len(first.shape) == len(part.shape):
            shapes = tuple(s[: dim % len(s)] + s[dim % len(s) + 1 :] for s in shapes)  # type: ignore[assignment]
        if part.dtype != first.dtype or shapes[0] != shapes[1]:
            raise WeightsError(
                f"{part.path}: {key!r} is built from {first.key!r} ({first.dtype}, {first.shape}) and {part.key!r} "
                f"({part.dtype}, {part.shape}), which do not fit together"
            )


def _merged(segments: tuple[Segment, ...]) -> tuple[Segment, ...]:
    """Adjacent ranges of one stored tensor as one range (fewer, larger reads)."""
    out: list[Segment] = []
    for seg in segments:
        last = out[-1] if out else None
        if last is not None and last.stored is seg.stored and last.start + last.numel == seg.start:
            out[-1] = Segment(seg.stored, last.start, last.numel + seg.numel)
        else:
            out.append(seg)
    return tuple(out)


class Reads:
    """The reads of one range of a tensor: several where it spans stored tensors; `then` runs once
    they are done (a transposed tensor's blocks are transposed into place)."""

    def __init__(self, handles: list[AioHandle], then: Callable[[], None] | None = None) -> None:
        self.handles = handles
        self.then = then

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        if self.then is not None:
            then, self.then = self.then, None
            then()


def _read_header(path: str) -> dict[str, StoredTensor]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{path}: not a safetensors file ({size} bytes, shorter than its header length)")
            (header_bytes,) = struct.unpack("<Q", head)
            if header_bytes > min(MAX_HEADER_BYTES, size - 8):
                raise WeightsError(
                    f"{path}: not a safetensors file (header length {header_bytes} for a {size}-byte file)"
                )
            header = json.loads(f.read(header_bytes))
    except FileNotFoundError:
        raise WeightsError(f"{path}: the weights file is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WeightsError(f"{path}: its safetensors header does not parse ({exc})") from None
    data_start = 8 + header_bytes
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: its safetensors header is not a JSON object (the file is corrupted)")
    out = {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        shape, (begin, end) = _entry(path, key, meta)  # meta is a dict from here on
        dtype = DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise WeightsError(f"{path}: tensor {key!r} has dtype {meta.get('dtype')!r}, which zeroinf cannot load")
        stored = StoredTensor(key, path, dtype, shape, data_start + begin)
        if end - begin != stored.numel * dtype.itemsize:
            raise WeightsError(f"{path}: tensor {key!r} spans {end - begin} bytes for shape {stored.shape} {dtype}")
        if data_start + end > size:
            raise WeightsError(
                f"{path}: tensor {key!r} ends at byte {data_start + end} but the file has {size} bytes: "
                "the file is truncated (an interrupted download or copy?)"
            )
        out[key] = stored
    _check_disjoint(path, out)
    return out


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(path: str, key: str, meta: object) -> tuple[tuple[int, ...], tuple[int, int]]:
    """A header entry's shape and byte range, or a WeightsError: a damaged header must not reach
    the readers as a KeyError, nor as a negative offset that reads the header as data."""
    offsets = meta.get("data_offsets") if isinstance(meta, dict) else None
    shape = meta.get("shape") if isinstance(meta, dict) else None
    if (
        not isinstance(shape, list) or not all(_is_count(d) for d in shape)
        or not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise WeightsError(
            f"{path}: tensor {key!r} has a malformed header entry {meta!r} (needs dtype, shape and two "
            "ascending data_offsets): the file is corrupted"
        )
    return tuple(shape), (offsets[0], offsets[1])


def _check_disjoint(path: str, tensors: dict[str, StoredTensor]) -> None:
    """Two tensors sharing bytes is a damaged header (safetensors writes each tensor once)."""
    spans = sorted((t.offset_bytes, t.offset_bytes + t.numel * t.dtype.itemsize, t.key) for t in tensors.values())
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise WeightsError(f"{path}: tensors {first!r} and {second!r} overlap in the file: the file is corrupted")


class SafetensorsFolder:
    """The tensors of a Hugging Face weights folder (or of one .safetensors file), by key."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        path = os.fspath(path)
        self.path = path
        if os.path.isfile(path) and path.endswith(".safetensors"):
            files = [path]
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):  # before the index, as transformers looks
            files = [os.path.join(path, SINGLE_FILE)]
            if os.path.isfile(os.path.join(path, INDEX_FILE)):
                get_logger("weights").warning(
                    f"{path} holds both {SINGLE_FILE} and {INDEX_FILE} (an earlier save left one behind?): "
                    f"loading {SINGLE_FILE}, as transformers does; delete the stale one"
                )
        elif os.path.isfile(os.path.join(path, INDEX_FILE)):
            files = self._files_from_index(path)
        elif os.path.isdir(path):
            raise WeightsError(
                f"{path}: no {SINGLE_FILE} and no {INDEX_FILE}: not a Hugging Face weights folder (zeroinf loads "
                "safetensors; convert .bin weights with `save_pretrained(..., safe_serialization=True)`)"
            )
        else:
            raise WeightsError(f"{path}: no such folder or .safetensors file")
        # by key; `from_pretrained` re-keys them by the model's names (weights/hf_conversion.py)
        self.tensors: dict[str, Stored] = {}
        for file in files:
            for key, stored in _read_header(file).items():
                if key in self.tensors:
                    raise WeightsError(f"tensor {key!r} is in both {self.tensors[key].path} and {file}")
                self.tensors[key] = stored
        self._engine: AioEngine | None = None

    @staticmethod
    def _files_from_index(folder: str) -> list[str]:
        index_path = os.path.join(folder, INDEX_FILE)
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise WeightsError(f"{index_path}: not a safetensors index ({exc!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightsError(f"{index_path}: not a safetensors index (weight_map is not a table of file names)")
        files = sorted(set(weight_map.values()))
        missing = [name for name in files if not os.path.isfile(os.path.join(folder, name))]
        if missing:
            raise WeightsError(f"{index_path} lists {missing[:3]}, which are missing from {folder}")
        return [os.path.join(folder, name) for name in files]

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __getitem__(self, key: str) -> Stored:
        try:
            return self.tensors[key]
        except KeyError:
            raise WeightsError(f"{self.path}: no tensor named {key!r}") from None

    # -- reading --------------------------------------------------------------------------------------
    @property
    def engine(self) -> AioEngine:
        if self._engine is None:
            self._engine = open_engine()
        return self._engine

    def start_read(self, stored: Stored, start: int, out: torch.Tensor) -> Reads:
        """Start reading elements [start, start + out.numel()) of `stored` into `out` (its dtype, CPU)."""
        if out.dtype != stored.dtype or start < 0 or start + out.numel() > stored.numel:
            raise ValueError(f"read of {stored.key!r}: elements [{start}, {start + out.numel()}) {out.dtype}")
        if isinstance(stored, TransposedTensor):
            return self._start_transposed_read(stored, start, out)
        handles, at = [], 0
        for seg in stored.ranges(start, out.numel()):
            piece, at = out[at : at + seg.numel], at + seg.numel
            handles.append(self.engine.read(piece, seg.stored.path, seg.stored.offset_bytes + seg.start * out.itemsize))
        return Reads(handles)

    def _start_transposed_read(self, stored: TransposedTensor, start: int, out: torch.Tensor) -> Reads:
        """The blocks of `stored.base` the range falls in, into a staging tensor; transposed into
        `out` when the reads are done."""
        block = stored.block
        first, end = start // block, -(-(start + out.numel()) // block)
        staging = torch.empty((end - first) * block, dtype=stored.dtype)
        reads = self.start_read(stored.base, first * block, staging)

        def place() -> None:
            blocks = staging.view(end - first, *stored.base.shape[stored.dim0 :])
            moved = blocks.transpose(1, stored.dim1 - stored.dim0 + 1).reshape(-1)  # a copy
            out.copy_(moved[start - first * block : start - first * block + out.numel()])

        return Reads(reads.handles, then=place)

    def read(self, tensor: str | Stored) -> torch.Tensor:
        """A whole tensor (by key, or as looked up), in its stored dtype and shape (small ones: buffers)."""
        stored = self[tensor] if isinstance(tensor, str) else tensor
        out = torch.empty(stored.numel, dtype=stored.dtype)
        self.start_read(stored, 0, out).wait()
        return out.view(stored.shape)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
