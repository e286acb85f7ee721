"""A consolidated checkpoint of a Hugging Face model loads with `from_pretrained` (world 1, stage 3)
and gives the trained weights and the same logits as the model that was saved."""

from __future__ import annotations

import os

import pytest
import torch

import zeroinf
import zeroinf.checkpoint as ck
from tests._hf import GLOBAL_BATCH, SEQ, VOCAB, build


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_consolidated_weights_load_with_from_pretrained(tmp_path, arch: str) -> None:
    pytest.importorskip("transformers")
    model = zeroinf.shard(build(arch), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    opt = zeroinf.AdamW(model, lr=1e-2)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        opt.backward(model(input_ids=tokens, labels=tokens).loss)
        opt.step()
        opt.zero_grad()
    ck.save(tmp_path / "ckpt", model, opt, step=2)
    out = str(tmp_path / "hf")
    index = ck.consolidate(tmp_path / "ckpt", out, dtype="fp32", max_shard_bytes=20_000)  # several files
    assert len(set(index["weight_map"].values())) > 1
    model.config.save_pretrained(out)

    loaded = type(model).from_pretrained(out).eval()
    trained = {k: v.float() for k, v in model.state_dict().items()}  # gathered (a collective at stage 3)
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    with torch.no_grad():
        model.eval()
        # the weights are bitwise equal; the kernels may differ (from_pretrained picks its attention)
        torch.testing.assert_close(loaded(input_ids=tokens).logits, model(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    zeroinf.engine_of(model).close()
