"""`model.state_dict()` entries of a sharded model own their storage (partition/state_entries.py [Note:
state_dict entries and the flat buffers]): safetensors saves and loads them at every stage (it refused
every model at stages 0-2, the entries sharing their unit's buffer), they alias the parameters as a
plain model's entries do, and a tied parameter's two names still share one storage."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, load_model, save_file

import zeroinf
from tests._hf import build

pytest.importorskip("transformers")


def _model(stage: int) -> torch.nn.Module:
    return zeroinf.shard(build("llama-tied", 0), zeroinf.Config(stage=stage, persist_threshold_bytes=0))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safetensors_saves_and_loads_a_sharded_model(tmp_path, stage: int) -> None:
    model = _model(stage)
    state = model.state_dict()
    path = os.path.join(tmp_path, "model.safetensors")
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, path)  # a tied head: one name, as HF saves
    stored = load_file(path)
    assert all(torch.equal(stored[k], state[k]) for k in stored)
    other = _model(stage)
    with torch.no_grad():
        for p in other.parameters():
            if p.numel():
                p.zero_()  # in place: refused at the next forward, unless loaded over (below)
    load_model(other, path, strict=False)
    assert all(torch.equal(v, state[k]) for k, v in other.state_dict().items()), stage


@pytest.mark.parametrize("stage", [0, 2])
def test_entries_alias_the_parameters_and_ties_share_a_storage(stage: int) -> None:
    model = _model(stage)
    state = model.state_dict()
    emb, weight = state["model.embed_tokens.weight"], model.model.embed_tokens.weight
    assert emb.data_ptr() == weight.data_ptr()  # the same memory, no copy
    assert emb.untyped_storage().nbytes() == emb.numel() * emb.element_size()  # a storage of its own
    assert state["lm_head.weight"].untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()  # tied
    with torch.no_grad():
        state["model.norm.weight"].fill_(2.0)  # a write through an entry reaches the parameter, as in PyTorch
    assert bool((model.model.norm.weight == 2.0).all())
    assert model.state_dict(keep_vars=True)["model.embed_tokens.weight"] is weight
