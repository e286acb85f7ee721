"""`verify(path)`: check a whole checkpoint without a model: manifest, every file's size and checksum,
and that the chunks of every parameter cover it exactly once."""

from __future__ import annotations

import os
from typing import Any

from zeroinf.checkpoint.format import MANIFEST, CheckpointError, DataFiles, read_manifest, resolve


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
    data = DataFiles(ckpt, body["files"])
    try:
        for name in body["files"]:
            data.verify_file(name)
    finally:
        data.close()
    return {"path": ckpt, "step": body["step"], "files": len(body["files"]),
            "bytes": sum(f["size"] for f in body["files"].values())}
