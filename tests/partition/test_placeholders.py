"""At stage 3 a parameter outside its unit's forward is an empty placeholder that keeps its number of
dimensions (so `p.dim()`-based weight-decay groups stay right) and fails loudly when read; a resident
unit (the root) is whole from the build on."""

from __future__ import annotations

import pytest
import torch

import zeroinf
from zeroinf.models.gpt import GPT, GPTConfig


def test_placeholders_keep_dims_hold_nothing_and_refuse_reads() -> None:
    torch.manual_seed(0)
    plain = GPT(GPTConfig.preset("tiny"))
    dims = {name: p.dim() for name, p in plain.named_parameters()}
    shapes = {name: p.shape for name, p in plain.named_parameters()}
    model = zeroinf.shard(plain, zeroinf.Config(stage=3, persist_threshold_bytes=0))
    engine = zeroinf.engine_of(model)
    resident = {id(p) for u in engine.all_units if u.resident for p in u.params}
    for name, p in model.named_parameters():
        if id(p) in resident:  # the root stays whole on the device from the build on
            assert p.shape == shapes[name], name
        else:
            assert p.dim() == max(1, dims[name]) and p.numel() == 0, name
    weight = model.blocks[0].attn.qkv.weight
    with pytest.raises(RuntimeError):  # raw functional access outside the unit: a shape error, not zeros
        torch.nn.functional.linear(torch.randn(2, 64), weight)
    repr(weight)  # printing a placeholder is safe
    zeroinf.engine_of(model).close()
