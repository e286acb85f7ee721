"""A sharded model under `torch.inference_mode()` (Hugging Face pipelines run their forward in it).

Every tensor made in inference mode, views of existing storage included, is an inference tensor:
never to be updated in place outside inference mode, and inference mode is per thread. Stage 3
with parameters on NVMe used to fail in its first inference-mode forward (the I/O threads landing a
read into a view made there). Now the engine's hooks run with inference mode off (runtime/hooks.py
[Note: the engine outside inference mode]). World 1, in process, a tiny Hugging Face Llama at
stage 3 on every parameter tier, against a plain copy: inference-mode forwards, `generate`,
`state_dict()` and `zeroinf.gathered` between training steps give the plain model's values, and
training goes on with the plain model's losses; a frozen model evaluated only in inference mode too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import zeroinf
from tests._hf import build


def _cfg(tier: str, folder: Path) -> zeroinf.Config:
    offload = zeroinf.OffloadConfig(params=tier, optimizer="nvme" if tier == "nvme" else tier, nvme_dir=str(folder))
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload)


@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_inference_mode_between_training_steps(tmp_path: Path, tier: str) -> None:
    plain = build("llama", 0)
    model = zeroinf.shard(copy.deepcopy(plain), _cfg(tier, tmp_path))
    opt = zeroinf.AdamW(model, lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    weight = model.model.layers[0].mlp.up_proj.weight
    for _ in range(2):
        model.eval()
        plain.eval()
        with torch.inference_mode():  # first, before any training step: the engine's first forward
            assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
            generated = model.generate(x[:, :4], max_new_tokens=4, do_sample=False)
            state = model.state_dict()
            with zeroinf.gathered(weight) as (gathered,):
                assert torch.equal(gathered, plain.model.layers[0].mlp.up_proj.weight)
        assert torch.equal(generated, plain.generate(x[:, :4], max_new_tokens=4, do_sample=False))
        assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
        model.train()
        plain.train()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        plain_loss = plain(input_ids=x, labels=x).loss
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        assert loss.item() == plain_loss.item()
    opt.close()
    zeroinf.engine_of(model).close()


def test_a_frozen_model_evaluated_in_inference_mode(tmp_path: Path) -> None:
    plain = build("llama", 1).requires_grad_(False)
    model = zeroinf.shard(copy.deepcopy(plain), _cfg("nvme", tmp_path))
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # the first pass records the order, the next ones prefetch along it
        with torch.inference_mode():
            assert torch.equal(model(input_ids=x).logits, plain(input_ids=x).logits)
    zeroinf.engine_of(model).close()
