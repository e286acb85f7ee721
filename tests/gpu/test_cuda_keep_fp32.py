"""What a model keeps in fp32 under bf16 (Config.keep_fp32), on CUDA (`pytest -m gpu`).

tests/test_keep_fp32.py on cuda:0, one process: the router model trained at stage 2 and at stage 3
with its shards on the GPU, the host (pinned, through the transfer owner) and NVMe, against fp32
masters by hand on the same GPU keeping the gate weights and score biases fp32, bitwise; and
tests/weights/test_pretrained.py's DeepSeek-V3 loaded in bf16 by `zeroinf.from_pretrained` on the
GPU, bitwise Hugging Face's bf16 load there, dtypes included, the same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import sharded_on_rows
from tests.test_keep_fp32 import LR, STEPS, Net, _by_hand, _kept
from tests.weights.test_pretrained import KEPT_BY_DEEPSEEK, kept_fp32_load

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("placement", ["stage2", "device", "host", "nvme"])
def test_kept_fp32_parameters_match_that_semantics_by_hand_on_the_gpu(placement: str, tmp_path: Path) -> None:
    tier = "device" if placement == "stage2" else placement
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(
        stage=2 if placement == "stage2" else 3, param_dtype="bf16", persist_threshold_bytes=0,
        offload=offload if placement != "stage2" else zeroinf.OffloadConfig(),
    )
    torch.manual_seed(0)
    model = zeroinf.shard(Net().to(CUDA), cfg, zeroinf.Topology.single(CUDA))
    opt = zeroinf.AdamW(model, lr=LR, weight_decay=0.0)
    losses = sharded_on_rows(model, opt, 0, 1, STEPS, CUDA)
    state = model.state_dict()
    opt.close()
    zeroinf.engine_of(model).close()
    ref_losses, ref_state = _by_hand(0, 1, keep=True, device=CUDA)
    assert losses == ref_losses, (placement, losses, ref_losses)
    for key, tensor in ref_state.items():
        assert state[key].dtype == (torch.float32 if _kept(key) else torch.bfloat16), (placement, key)
        assert torch.equal(state[key].float(), tensor), (placement, key)


def test_a_bf16_load_keeps_what_the_model_keeps_in_fp32_on_the_gpu(tmp_path: Path) -> None:
    runs = kept_fp32_load(tmp_path / "ds", CUDA)
    kept, differs, diff = runs["auto"]
    assert kept == KEPT_BY_DEEPSEEK and differs == [] and diff == 0.0, (kept, differs, diff)
