"""Elastic sharded checkpoints (see docs/checkpoint.md).

    zeroinf.checkpoint.save(root, model, opt, step=step, extra={"data_position": i})
    info = zeroinf.checkpoint.load(root, model, opt)   # any world size, stage, offload placement
    zeroinf.checkpoint.consolidate(root, "hf_out", dtype="bf16")   # no process group needed
"""

from zeroinf.checkpoint.consolidate import consolidate
from zeroinf.checkpoint.format import CheckpointError, read_manifest, resolve
from zeroinf.checkpoint.loading import load
from zeroinf.checkpoint.saving import PendingSave, save
from zeroinf.checkpoint.verify import verify

__all__ = ["CheckpointError", "PendingSave", "consolidate", "load", "read_manifest", "resolve", "save", "verify"]
