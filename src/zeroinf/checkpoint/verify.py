"""`verify(path)`: check a whole checkpoint without a model: the manifest, that the chunks of every
parameter cover it exactly once, and that the recorded pieces tile every data file exactly (no
unaccounted byte), each piece read back and checked against its xxh3-64. A node-local checkpoint's
files on other machines are listed (`elsewhere`), the ones here checked."""

from __future__ import annotations

import os
from typing import Any

import torch

from zeroinf.checkpoint.format import (
    MANIFEST,
    STATE_KINDS,
    CheckpointError,
    DataFiles,
    chunk_what,
    files_elsewhere,
    read_manifest,
    resolve,
)

Piece = tuple[int, int, str, str]  # (byte offset, byte count, xxh3, what it holds)


def file_pieces(body: dict[str, Any]) -> dict[str, list[Piece]]:
    """Every checksummed piece of every data file, sorted by offset."""
    pieces: dict[str, list[Piece]] = {name: [] for name in body["files"]}
    for pname, lst in body["chunks"].items():
        for c in lst:
            n = c["n"]
            for k in range(len(STATE_KINDS)):
                pieces.setdefault(c["f"], []).append((c["b"] + 4 * n * k, 4 * n, c["h"][k], chunk_what(k, pname, c)))
    for sname, meta in body["module_state"].items():
        pieces.setdefault(meta["f"], []).append((meta["b"], meta["nbytes"], meta["h"], f"module state {sname}"))
    for lst in pieces.values():
        lst.sort()
    return pieces


def verify(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Raise CheckpointError (naming the file) if anything is wrong; return a small summary."""
    ckpt = resolve(os.fspath(path))
    body = read_manifest(ckpt)
    for name in body["order"]:
        pos = 0
        for c in body["chunks"].get(name, []):
            if c["o"] != pos:
                raise CheckpointError(f"{ckpt}/{MANIFEST}: parameter {name}: chunks do not cover element {pos}")
            pos += c["n"]
        if pos != body["params"][name]["numel"]:
            raise CheckpointError(f"{ckpt}/{MANIFEST}: parameter {name}: chunks cover {pos} of "
                                  f"{body['params'][name]['numel']} elements")
    elsewhere = files_elsewhere(ckpt, body)
    data = DataFiles(ckpt, body["files"])
    try:
        data.check_present([name for name in body["files"] if name not in elsewhere])
        buf = torch.empty(0, dtype=torch.uint8)
        for fname, pieces in file_pieces(body).items():
            if fname in elsewhere:
                continue
            if fname not in body["files"]:
                raise CheckpointError(f"{ckpt}/{MANIFEST}: {pieces[0][3]} lies in {fname}, which is not listed")
            pos = 0
            for offset, nbytes, digest, what in pieces:
                if offset != pos:
                    raise CheckpointError(
                        f"{os.path.join(ckpt, fname)}: bytes [{min(pos, offset)}, {max(pos, offset)}) are "
                        f"{'not described by' if offset > pos else 'claimed twice in'} the manifest (at {what})"
                    )
                if buf.numel() < nbytes:
                    buf = torch.empty(nbytes, dtype=torch.uint8)
                data.read_into(fname, offset, buf[:nbytes], digest, what)
                pos = offset + nbytes
            if pos != body["files"][fname]["size"]:
                raise CheckpointError(
                    f"{os.path.join(ckpt, fname)}: the manifest describes {pos} of its "
                    f"{body['files'][fname]['size']} bytes"
                )
    finally:
        data.close()
    return {"path": ckpt, "step": body["step"], "files": len(body["files"]) - len(elsewhere),
            "bytes": sum(f["size"] for name, f in body["files"].items() if name not in elsewhere),
            "elsewhere": elsewhere}
