"""`model.state_dict()` of a sharded model: entries with storages of their own.

[Note: state_dict entries and the flat buffers]
A unit's parameters are views into its flat buffer, so a plain `state_dict()` handed out tensors
that all shared the buffer's storage. safetensors (`save_file`, `save_model`, `load_model`, and
with them accelerate's `save_state`/`load_state`) reads tensors sharing a storage as tied weights
and refused every such model at stages 0-2 ("no suitable name to keep ... None is covering the
entire storage"). So each entry that is a view of an engine buffer is handed out as a tensor with a
storage of its own over the same memory (DLPack: no copy, and the buffer stays alive as long as
the entry): it still aliases its parameter, as a plain model's entries do, and the two names of
one tied parameter still share a storage. Entries that are parameters (`keep_vars=True`) are left
as they are, and stage 3's gathered copies own their storage already.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zeroinf.partition.unit import ShardedUnit


def own_storages(units: list[ShardedUnit]) -> Callable[[nn.Module, dict[str, Any], str, Any], None]:
    """A state_dict hook giving each entry that views one of `units`' buffers a storage of its own."""

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        buffers = {
            u.param_flat.untyped_storage().data_ptr() for u in units if u.param_flat.untyped_storage().nbytes()
        }
        for name, value in state_dict.items():
            if (
                name.startswith(prefix) and isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
                and value.numel() and value.untyped_storage().data_ptr() in buffers
            ):
                state_dict[name] = torch.from_dlpack(value.detach())

    return hook
