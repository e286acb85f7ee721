"""Write a sharded model's weights as a Hugging Face safetensors folder, one unit at a time.

`save_pretrained_weights(model, out_dir)` is a collective: every rank gathers each unit in turn
(stage 3: an all-gather; the unit is sharded again right after) and rank 0 writes its tensors. The
files are planned from the unit layouts before anything is gathered (a safetensors header must
precede its data), so host memory is one unit whatever the model size. Names go through `rename`
(None drops a tensor, e.g. LoRA adapters after merging), tied parameters are written once, and
the files are `model.safetensors`, or `model-0000k-of-0000n.safetensors` with an index when the
weights exceed `max_shard_bytes`, as `save_pretrained` writes them.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroinf.checkpoint.format import as_bytes, fsync_dir, write_atomic
from zeroinf.engine import Engine, engine_of
from zeroinf.partition.unit import ParamState
from zeroinf.weights.hf_conversion import hub_layout
from zeroinf.weights.safetensors_folder import DTYPES, INDEX_FILE, SINGLE_FILE

ST_NAMES = {dtype: name for name, dtype in DTYPES.items()}
Rename = Callable[[str], str | None]
Entry = tuple[str, tuple[int, ...], torch.dtype]  # name, shape, dtype of a stored tensor


def _plan(entries: list[tuple[str, tuple[int, ...], torch.dtype]], max_shard_bytes: int) -> list[list[int]]:
    files: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(i)
        size += nbytes
    return files


def save_pretrained_weights(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    rename: Rename | None = None,
    max_shard_bytes: int = 5 * 10**9,
    hub_layout_of: nn.Module | None = None,
    engine: Engine | None = None,
    write: bool | None = None,
) -> dict[str, str]:
    """Write the weights (parameters and persistent buffers) of sharded `model`; returns the
    weight map (name -> file). `dtype`: of floating tensors (default: as they are). `engine`: where
    `model` is a part of a sharded model (a peft model's merged base), that model's engine; the
    part's own tensors are written, under its own names.
    `hub_layout_of`: the transformers model inside `model`, whose checkpoint conversions are
    reverted as its `save_pretrained` reverts them (fused experts written one tensor each:
    weights/hf_conversion.py `hub_layout`), unit by unit, after `rename`. `write`: whether this rank
    writes the files (every rank gathers; default: rank 0)."""
    engine = engine or engine_of(model)
    part = engine.module is not model
    rename = rename or (lambda name: name)
    writer = engine.topo.leads if write is None else write
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters():
        first_name.setdefault(id(p), name)
    # The tensors by group, in the order they are gathered: one group per unit (name -> slot index),
    # then what is outside units (name -> tensor)
    groups: list[dict[str, int | torch.Tensor]] = []
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    in_units: set[int] = set()
    for unit in engine.all_units:
        group: dict[str, int | torch.Tensor] = {}
        for si, (p, slot) in enumerate(zip(unit.params, unit.layout.slots, strict=True)):
            in_units.add(id(p))
            if part and id(p) not in first_name:
                continue  # outside the part
            new = rename(first_name.get(id(p), slot.name))
            if new is not None:
                group[new] = si
                shapes[new] = (tuple(slot.shape), dtype or unit.param_flat.dtype)
        groups.append(group)
    outside = [(n, p) for n, p in model.named_parameters() if id(p) not in in_units]
    buffers = [
        (f"{m}.{b}" if m else b, t) for m, mod in model.named_modules() for b, t in mod._buffers.items()
        if t is not None and b not in mod._non_persistent_buffers_set
    ]
    group = {}
    for name, t in outside + buffers:
        new = rename(name)
        if new is not None:
            group[new] = t.detach()
            shapes[new] = (tuple(t.shape), dtype if dtype is not None and t.is_floating_point() else t.dtype)
    groups.append(group)
    metas = [{n: torch.empty(shapes[n][0], dtype=shapes[n][1], device="meta") for n in g} for g in groups]
    revert = hub_layout(hub_layout_of, metas) if hub_layout_of is not None else None
    entries: list[Entry] = []  # (name, shape, dtype) as written
    sources: list[tuple[int, str]] = []  # (group, name)
    for gi, meta in enumerate(metas):
        for name, t in (revert(meta) if revert is not None else meta).items():
            entries.append((name, tuple(t.shape), t.dtype))
            sources.append((gi, name))
    current: dict[str, Any] = {}  # the group gathered now: its index, whether to reshard, its tensors

    def values(i: int) -> torch.Tensor:
        gi, name = sources[i]
        if current.get("group") != gi:
            release()
            current["group"] = gi
            tensors = {}
            for new, source in groups[gi].items():
                if isinstance(source, int):
                    unit = engine.all_units[gi]
                    if "reshard" not in current:
                        current["reshard"] = unit.state is not ParamState.UNSHARDED
                        unit.wait_unshard()
                    source = unit.params[source].detach()
                tensors[new] = source
            current["tensors"] = revert(tensors) if revert is not None else tensors
        return current["tensors"][name]

    def release() -> None:
        if current.pop("reshard", False):
            engine.all_units[current["group"]].reshard()
        current.clear()

    try:  # copies we own: writing a view would export the flat buffer's storage, which then can no
        # longer be resized (freed) when its unit is sharded again
        return write_safetensors_files(
            out_dir, entries, lambda i: values(i).to("cpu", dtype=entries[i][2], copy=True),
            max_shard_bytes=max_shard_bytes, write=writer,
        )
    finally:
        release()


def write_safetensors_files(
    out_dir: str | os.PathLike[str],
    entries: list[Entry],
    produce: Callable[[int], torch.Tensor],
    *,
    max_shard_bytes: int = 5 * 10**9,
    write: bool = True,
) -> dict[str, str]:
    """Write `entries` (name, shape, dtype) as safetensors files in Hugging Face's layout, asking
    `produce(i)` for tensor i (a CPU tensor of that dtype) in order, one at a time; returns the
    weight map. With `write=False` the tensors are still produced (a collective's other ranks) but
    nothing is written. Files appear under their final names only when complete."""
    files = _plan(entries, max_shard_bytes)
    names = [SINGLE_FILE] if len(files) == 1 else [
        f"model-{k + 1:05d}-of-{len(files):05d}.safetensors" for k in range(len(files))
    ]
    out = os.fspath(out_dir)
    if write:
        os.makedirs(out, exist_ok=True)
    weight_map = {entries[i][0]: names[k] for k, members in enumerate(files) for i in members}
    for k, members in enumerate(files):
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for i in members:
            name, shape, dt = entries[i]
            nbytes = int(torch.Size(shape).numel()) * dt.itemsize
            header[name] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = os.path.join(out, names[k])
        f = open(f"{path}.tmp", "wb", buffering=2**20) if write else None
        try:
            if f is not None:
                f.write(struct.pack("<Q", len(raw)))
                f.write(raw)
            for i in members:
                t = produce(i).contiguous()
                if f is not None:
                    f.write(as_bytes(t.reshape(-1)))
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
        finally:
            if f is not None:
                f.close()
        if write:
            os.replace(f"{path}.tmp", path)
    if write:
        if len(files) > 1:
            total = sum(int(torch.Size(s).numel()) * d.itemsize for _, s, d in entries)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_atomic(os.path.join(out, INDEX_FILE), json.dumps(index, indent=2).encode())
        remove_stale_weights(out, set(names) | ({INDEX_FILE} if len(files) > 1 else set()))
        fsync_dir(out)
    return weight_map


STALE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?")


def remove_stale_weights(out: str, written: set[str]) -> None:
    """Weights files of an earlier save into `out` that this one did not write: a `model.safetensors`
    left beside new shards is what transformers (and zeroinf) would load, and shards of another
    count beside a new index would be taken for this model's."""
    for name in os.listdir(out):
        if STALE.fullmatch(name) and name not in written:
            os.remove(os.path.join(out, name))
