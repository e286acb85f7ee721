"""Split layers (`Config.split_root`) and weights read outside their forward, on CUDA (`pytest -m gpu`).

tests/runtime/test_external_reads.py on cuda:0, one process: DETR's query embedding read as a
weight, the demo GPT's tied head reading the split embedding, an untied Hugging Face Llama with its
embedding and head split, each at stage 3 with the parameter shards on the GPU, the host (pinned,
through the transfer owner) or NVMe, trained side by side with a plain PyTorch copy on the same GPU
in fp32 (TF32 off). The read outside the forward gathers the unit once a step on the device too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import zeroinf
from tests.runtime.test_external_reads import STEPS, _batch, _build, _count_gathers, _loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
READ_OUTSIDE = {"queries": "query", "gpt-tied": "tok_emb", "llama": None}


@pytest.fixture(autouse=True)
def exact_fp32() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.parametrize("params", ["device", "host", "nvme"])
@pytest.mark.parametrize("case", list(READ_OUTSIDE))
def test_split_layers_match_plain_pytorch_on_the_gpu(case: str, params: str, tmp_path: Path) -> None:
    model = _build(case).to(CUDA)
    plain = copy.deepcopy(model)
    offload = zeroinf.OffloadConfig(params=params, optimizer="host", nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, split_root_min_bytes=0, offload=offload)
    model = zeroinf.shard(model, cfg, zeroinf.Topology.single(CUDA))
    engine = zeroinf.engine_of(model)
    opt = zeroinf.AdamW(model, lr=1e-2, weight_decay=0.0)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.0)
    counter = _count_gathers(engine, READ_OUTSIDE[case])
    gathers = []
    try:
        for step in range(STEPS):
            batch = _batch(case, step).to(CUDA)
            before = counter[0]
            loss = _loss(model, case, batch)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            gathers.append(counter[0] - before)
            plain_loss = _loss(plain, case, batch)
            plain_loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()
            assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-5, abs=1e-6), (case, params, step)
            resting = [u.name for u in engine.all_units if not u.resident and u.state.value != "sharded"]
            assert resting == [], (case, params, step, resting)  # every split layer sharded between steps
        state = model.state_dict()
        for name, ref in plain.state_dict().items():
            # attention's qkv bias: its key part gets only rounding noise for gradients (softmax ignores a
            # shift), which Adam scales up to lr a step whatever the layout (as in the CPU test)
            atol = 2 * 1e-2 * STEPS if name.endswith("qkv.bias") else 1e-5
            torch.testing.assert_close(
                state[name].to(CUDA), ref, rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}"
            )
        units = {u.name: u.resident for u in engine.all_units}
        if case == "queries":
            assert units["query"] is False and gathers == [1] * STEPS, (units, gathers)
        if case == "gpt-tied":
            assert gathers == [2, 1, 1], gathers  # its own forward, then the head's read, once known: kept
        if case == "llama":
            assert units["model.embed_tokens"] is False and units["lm_head"] is False, units
    finally:
        engine.close()
        opt.states.close()
