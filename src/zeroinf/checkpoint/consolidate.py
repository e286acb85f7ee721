"""Consolidate a sharded checkpoint into full model weights as safetensors, with no process group.

`consolidate(ckpt, out_dir, dtype="bf16")` writes `model-0000k-of-0000n.safetensors` files of at
most `max_shard_bytes` each (a tensor larger than that gets a file of its own) and an HF-style
`model.safetensors.index.json` (with `config.json` and the Hub's tensor layout for a checkpoint of a
transformers model: hub_folder.py). The safetensors header is known from the manifest before any data
is read, so each file is written header first and then tensor by tensor, each tensor streamed in
checkpoint chunks (at most 8 MiB of fp32 at a time): the peak memory does not grow with the model
or even with its largest tensor. Only the fp32 masters are read; their checksums are verified.
Tied parameters are written once, under the first name; the index lists the others under
`metadata.tied`. Files are written under temporary names and renamed, the index last.

CLI: `zeroinf consolidate CKPT --out DIR [--dtype bf16|fp32|fp16] [--max-shard-size 5GB]`
(`add_arguments` + `run`, or `main(argv)`).
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from typing import Any

import torch
from torch import nn

from zeroinf.checkpoint.format import (
    CHUNK_NUMEL,
    DTYPES,
    CheckpointError,
    DataFiles,
    as_bytes,
    fsync_dir,
    read_manifest,
    refuse_files_elsewhere,
    resolve,
    write_atomic,
)
from zeroinf.checkpoint.hub_folder import Revert, meta_model, write_configs, written_by_group
from zeroinf.checkpoint.reader import ChunkReader
from zeroinf.memory import parse_bytes
from zeroinf.telemetry import get_logger
from zeroinf.weights.export import remove_stale_weights
from zeroinf.weights.hf_conversion import hub_layout, key_by_model
from zeroinf.weights.safetensors_folder import SafetensorsFolder, WeightsError

OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def _written_dtype(body: dict[str, Any], meta: dict[str, Any], out_dtype: torch.dtype) -> torch.dtype:
    """The dtype a floating tensor is written in: `out_dtype`, except one the run kept in fp32 under a
    narrower compute dtype (precision.py [Note: parameters the model keeps in fp32]), which stays fp32
    as transformers' `save_pretrained` of a bf16-loaded model writes it."""
    kept = meta.get("dtype") == "float32" and body.get("param_dtype", "fp32") != "fp32"
    return torch.float32 if kept and out_dtype.itemsize < 4 else out_dtype
ST_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
INDEX = "model.safetensors.index.json"


def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    dtype: str = "bf16",
    max_shard_bytes: int = 5 * 10**9,
    include_module_state: bool = True,
    frozen_from: str | os.PathLike[str] | None = None,
    allow_missing: bool = False,
) -> dict[str, Any]:
    """Write the full weights of a checkpoint as sharded safetensors + index; returns the index dict.
    A checkpoint of a transformers model also gets its config files and the Hub's tensor layout
    (hub_folder.py). Frozen parameters sharded at stage 3 are not in checkpoints (they never
    change): `frozen_from` is the weights folder to take them from (the one the model was loaded
    from); without it such a checkpoint is refused, naming them, unless `allow_missing` (then
    written without them, with a warning)."""
    if dtype not in OUT_DTYPES:
        raise ValueError(f"consolidate: dtype {dtype!r}; use one of {sorted(OUT_DTYPES)}")
    out_dtype = OUT_DTYPES[dtype]
    ckpt = resolve(os.fspath(ckpt_dir))
    body = read_manifest(ckpt)
    adapters = body.get("peft")
    if adapters:
        raise CheckpointError(
            f"{ckpt}: a checkpoint of a peft model (adapters {adapters}): consolidate writes whole models, and here "
            "the base is not in the checkpoint and the adapters are under peft's internal names, which neither peft "
            "nor transformers loads. For the adapter folder PeftModel.from_pretrained reads, or the merged model, "
            "build the model as it was trained (zeroinf.from_pretrained(base, cfg, prepare=...)), zeroinf.load this "
            "checkpoint into it, then zeroinf.save_pretrained(model, out) (adapters), or merged = "
            "model.merge_and_unload() and zeroinf.save_pretrained(merged, out). zeroinf.integrations.Trainer's "
            "checkpoint-N folders hold the adapters already"
        )
    refuse_files_elsewhere(ckpt, body, "consolidate")
    frozen = (body.get("frozen") or {}) if include_module_state else {}
    named = ", ".join(list(frozen)[:3]) + (", ..." if len(frozen) > 3 else "")
    if frozen and frozen_from is None and not allow_missing:
        raise CheckpointError(
            f"{ckpt}: the checkpoint holds no values for {len(frozen)} frozen parameters ({named}): zeroinf.save "
            "leaves parameters without gradients sharded at stage 3 out (they never change; a resume rebuilds them "
            "from where they came from). Consolidate with frozen_from=<the weights folder they were loaded from> "
            "(--frozen-from DIR) to take them from there, or allow_missing=True (--allow-missing) to write the rest "
            "without them"
        )
    out = os.fspath(out_dir)
    os.makedirs(out, exist_ok=True)
    hf = body.get("hf")
    if hf is not None:
        write_configs(out, hf, out_dtype)
    model = meta_model(out, hf) if hf is not None else None
    # the tensors to write by group (each unit's parameters, each frozen unit's from `frozen_from`,
    # then buffers and frozen parameters outside units): name -> (shape, dtype written, source);
    # source: ("param", name), ("folder", stored) or ("module", meta)
    groups: list[dict[str, tuple[list[int], torch.dtype, Any]]] = []
    unit = None
    for n in body["order"]:
        if body["params"][n].get("unit", "") != unit or not groups:
            groups.append({})
            unit = body["params"][n].get("unit", "")
        groups[-1][n] = (body["params"][n]["shape"], _written_dtype(body, body["params"][n], out_dtype), ("param", n))
    folder = _frozen_groups(frozen, frozen_from, model, out_dtype, groups) if frozen and frozen_from else None
    if frozen and folder is None:
        get_logger("checkpoint").warning(
            f"consolidate: writing {out} without the {len(frozen)} frozen parameters the checkpoint does not hold "
            f"({named})"
        )
    if include_module_state:
        groups.append({})
        for n, meta in body["module_state"].items():
            src = DTYPES[meta["dtype"]]
            written = _written_dtype(body, meta, out_dtype) if src.is_floating_point else src
            groups[-1][n] = (meta["shape"], written, ("module", meta))
    data = DataFiles(ckpt, body["files"])
    try:
        entries, revert = _entries(model, groups)
        shards: list[list[Entry]] = [[]]
        size = 0
        for e in entries:
            nbytes = _numel(e[1]) * e[2].itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(e)
            size += nbytes
        weight_map: dict[str, str] = {}
        total = 0
        reader = ChunkReader(body, data, kinds=1)
        values = _GroupValues(groups, reader, data, revert, folder)
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            total += _write_shard(os.path.join(out, fname), shard, reader, values)
            weight_map.update({e[0]: fname for e in shard})
    finally:
        data.close()
        if folder is not None:
            folder.close()
    tied = {n: body["params"][n]["aliases"] for n in body["order"] if body["params"][n]["aliases"]}
    index = {
        # "dtype" as torch spells it: transformers' from_pretrained reads it as getattr(torch, dtype)
        "metadata": {"total_size": total, "step": body["step"], "dtype": str(out_dtype).removeprefix("torch."),
                     "tied": tied, "source": ckpt},
        "weight_map": weight_map,
    }
    write_atomic(os.path.join(out, INDEX), json.dumps(index, indent=2).encode())
    remove_stale_weights(out, set(weight_map.values()) | {INDEX})
    return index


Entry = tuple[str, list[int], torch.dtype, Any]  # (name written, shape, dtype, source)


def _frozen_groups(
    frozen: dict[str, Any], path: str | os.PathLike[str], model: nn.Module | None, dtype: torch.dtype,
    groups: list[dict[str, tuple[list[int], torch.dtype, Any]]],
) -> SafetensorsFolder:
    """Append a group per frozen unit whose tensors come from the weights folder at `path` (keyed
    by the model's names through its conversions where it is a transformers model); the folder."""
    folder = SafetensorsFolder(path)
    try:
        if model is not None:
            key_by_model(folder, model)
        unit = None
        for name, meta in frozen.items():
            stored = folder[name]  # a WeightsError naming the key and the folder where it is missing
            if list(stored.shape) != list(meta["shape"]):
                raise WeightsError(
                    f"{folder.path}: {name!r} has shape {tuple(stored.shape)}, the checkpoint's "
                    f"{tuple(meta['shape'])}: not the folder this model was loaded from"
                )
            if meta.get("unit") != unit or unit is None:
                groups.append({})
                unit = meta.get("unit")
            written = dtype if stored.dtype.is_floating_point else stored.dtype
            groups[-1][name] = (list(meta["shape"]), written, ("folder", stored))
    except BaseException:
        folder.close()
        raise
    return folder


def _entries(
    model: nn.Module | None, groups: list[dict[str, tuple[list[int], torch.dtype, Any]]]
) -> tuple[list[Entry], Revert | None]:
    """The tensors to write, in order, and how to revert a group's values (None: as they are). A
    tensor a revert only renames keeps its source (streamed); one it reshapes comes from
    ("value", group, name): the group read whole and reverted (hub_folder.py)."""
    as_they_are = [(n, shape, dt, src) for g in groups for n, (shape, dt, src) in g.items()]
    metas = [{n: torch.empty(shape, dtype=dt, device="meta") for n, (shape, dt, _) in g.items()} for g in groups]
    revert = hub_layout(model, metas) if model is not None else None
    if revert is None:
        return as_they_are, None
    entries: list[Entry] = []
    for gi, (written, sources) in enumerate(written_by_group(revert, metas)):
        for new, t in written.items():
            if sources is not None:
                shape, dt, src = groups[gi][sources[new]]
                entries.append((new, shape, dt, src))
            else:
                entries.append((new, list(t.shape), t.dtype, ("value", gi, new)))
    return entries, revert


class _GroupValues:
    """The reverted tensors of one group at a time, read whole in the output dtype; and single
    tensors read whole (module state, frozen parameters from a weights folder)."""

    def __init__(self, groups: list[dict[str, tuple[list[int], torch.dtype, Any]]], reader: ChunkReader,
                 data: DataFiles, revert: Revert | None, folder: SafetensorsFolder | None) -> None:
        self.groups, self.reader, self.data, self.revert, self.folder = groups, reader, data, revert, folder
        self.index: int | None = None
        self.values: dict[str, torch.Tensor] = {}

    def get(self, gi: int, name: str) -> torch.Tensor:
        if self.index != gi:
            assert self.revert is not None
            self.values = {}  # the last group's tensors go before this one's are read
            tensors = {n: self.whole(n, shape, dt, src) for n, (shape, dt, src) in self.groups[gi].items()}
            self.values, self.index = self.revert(tensors), gi
        return self.values[name].contiguous()

    def whole(self, name: str, shape: list[int], dtype: torch.dtype, source: Any) -> torch.Tensor:
        """One tensor to write, whole, in `dtype` (contiguous)."""
        kind, src = source
        if kind == "param":  # in checkpoint chunks through one fp32 buffer: no fp32 copy of the tensor
            t = torch.empty(_numel(shape), dtype=dtype)
            scratch = torch.empty(min(CHUNK_NUMEL, t.numel()), dtype=torch.float32)
            for a in range(0, t.numel(), CHUNK_NUMEL):
                b = min(t.numel(), a + CHUNK_NUMEL)
                self.reader.fill(src, a, b, [scratch[: b - a]])
                t[a:b].copy_(scratch[: b - a])
            return t.view(shape)
        if kind == "folder":
            assert self.folder is not None
            t = self.folder.read(src)
        else:
            t = torch.empty(src["shape"], dtype=DTYPES[src["dtype"]])
            self.data.read_into(src["f"], src["b"], t, src["h"], f"module state {name}")
        return t.to(dtype).view(shape)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _write_shard(path: str, shard: list[Entry], reader: ChunkReader, values: _GroupValues) -> int:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dt, _ in shard:
        nbytes = _numel(shape) * dt.itemsize
        header[name] = {"dtype": ST_NAMES[dt], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb", buffering=1024 * 1024) as f:  # chunks are written whole; a small buffer
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        # Two reused buffers (fp32 read, cast) instead of one allocation per chunk: the allocator
        # would otherwise keep freed chunks around and the peak would grow with the tensor count.
        scratch = torch.empty(CHUNK_NUMEL, dtype=torch.float32)
        cast = torch.empty(CHUNK_NUMEL, dtype=torch.float32 if not shard else shard[0][2])
        for name, shape, dt, source in shard:
            kind, src = source[0], source[1]
            if kind == "value":  # reverted with its group (hub_folder.py)
                f.write(as_bytes(values.get(source[1], source[2])))
            elif kind == "param":
                numel = _numel(shape)
                if cast.dtype != dt:
                    cast = torch.empty(CHUNK_NUMEL, dtype=dt)
                for a in range(0, numel, CHUNK_NUMEL):
                    b = min(numel, a + CHUNK_NUMEL)
                    buf = scratch[: b - a]
                    reader.fill(src, a, b, [buf])
                    if dt != torch.float32:
                        buf = cast[: b - a].copy_(buf)
                    f.write(as_bytes(buf))
            else:  # module state, or a frozen parameter from the weights folder it was loaded from
                f.write(as_bytes(values.whole(name, shape, dt, source)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    return offset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint folder, or a root holding a `latest` pointer")
    parser.add_argument("--out", required=True, help="output folder for the safetensors files and index")
    parser.add_argument("--dtype", choices=sorted(OUT_DTYPES), default="bf16", help="weights dtype (default bf16)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB; e.g. 500MB)")
    parser.add_argument("--no-buffers", action="store_true", help="weights only: leave out buffers and frozen params")
    parser.add_argument("--frozen-from", metavar="DIR", default=None,
                        help="the weights folder the model was loaded from: its frozen parameters, which stage-3 "
                             "checkpoints do not hold, are taken from there")
    parser.add_argument("--allow-missing", action="store_true",
                        help="write a checkpoint's weights without the frozen parameters it does not hold")


def run(args: argparse.Namespace) -> int:
    """Consolidate as `args` say; a bad size or checkpoint raises (`zeroinf.cli.main` prints it)."""
    max_shard_bytes = parse_bytes(args.max_shard_size, "--max-shard-size")
    if max_shard_bytes < 1:
        raise ValueError(f"--max-shard-size {args.max_shard_size!r}: use a positive size, e.g. 5GB")
    index = consolidate(
        args.checkpoint, args.out, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
        include_module_state=not args.no_buffers, frozen_from=args.frozen_from, allow_missing=args.allow_missing,
    )
    files = sorted(set(index["weight_map"].values()))
    print(f"wrote {len(index['weight_map'])} tensors, {index['metadata']['total_size']} bytes, "
          f"in {len(files)} files to {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m zeroinf.checkpoint.consolidate ...`: the same as `zeroinf consolidate ...`, errors included."""
    from zeroinf.cli import main as cli_main

    return cli_main(["consolidate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
