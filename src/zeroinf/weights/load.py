"""`zeroinf.load_weights(model, path)`: stream a safetensors folder into an already sharded model.

For any module sharded by `zeroinf.shard` whose `state_dict` names match the stored keys (or do
through `key_map`, or, for a transformers model, through its checkpoint conversions: a Hub folder
of an MoE model whose experts the model fuses, weights/hf_conversion.py): every key is checked
first (missing, unexpected, shape, dtype: errors name the key and the file), then each unit, one
at a time, reads only this rank's shard range from the files and writes it to the shard's tier
(NVMe included), the whole unit where it is kept whole, and the fp32 masters (into the optimizer's
store if one exists, else for the optimizer to read from the files when it is built). Parameters
outside units and persistent buffers are read whole. A collective: every rank calls it.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from zeroinf.engine import engine_of
from zeroinf.partition.park import swap_data
from zeroinf.weights.hf_conversion import key_by_model
from zeroinf.weights.safetensors_folder import SafetensorsFolder
from zeroinf.weights.source import CheckpointWeights, KeyMap, UnitWeights


def load_weights(model: nn.Module, path: str | os.PathLike[str], key_map: KeyMap | None = None) -> None:
    """Load the safetensors weights at `path` (a folder or one file) into sharded `model`."""
    engine = engine_of(model)
    folder = SafetensorsFolder(path)
    shapes = {
        id(p): tuple(slot.shape) for u in engine.all_units for p, slot in zip(u.params, u.layout.slots, strict=True)
    }
    try:
        if key_map is None:  # transformers' renamings and fused experts (weights/hf_conversion.py)
            key_by_model(folder, model, shapes)  # a split's sizes: the full shapes, not the placeholders
        weights = CheckpointWeights(folder, model, shapes=shapes, key_map=key_map)
        states = engine.optimizer_states
        in_units: set[int] = set()
        for ui, unit in enumerate(engine.all_units):
            in_units.update(id(p) for p in unit.params)
            if weights.covers(unit.params):
                unit.load_values(UnitWeights(weights, list(unit.params)), states, ui)
        with torch.no_grad():
            for p in model.parameters():
                stored = weights.stored(p)
                if stored is not None and id(p) not in in_units:
                    swap_data(p, folder.read(stored).to(device=p.device, dtype=p.dtype))
        weights.load_buffers()
    finally:
        folder.close()
