"""Adam's moments in bf16 on CUDA (`pytest -m gpu`; optim/moments.py): with the states on the GPU,
the fused CUDA AdamW kernel on widened moments and the stochastic rounding run there; on the host
and on NVMe, on the CPU beside the GPU's backward. Each placement trains the tiny GPT within the fp32
tolerance of the plain loop of tests/optim/test_moment_dtype.py run on the same GPU, and the two CPU
placements give the same bits (one kernel, the same gradients)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model
from tests.gpu._loop import train_then_close
from tests.optim.test_moment_dtype import BETAS, STEPS, WEIGHT_DECAY, train_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
TIERS = {
    "device": {},
    "host": {"optimizer": "host", "gradients": "host"},
    "nvme": {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"},
}


def _train(tiers: dict[str, str], folder: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    offload = zeroinf.OffloadConfig(**tiers, nvme_dir=str(folder), moment_dtype="bf16", sub_group_numel=3000)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, offload=offload, persist_threshold_bytes=0),
                          zeroinf.Topology.single(CUDA))
    opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    return train_then_close(model, opt, STEPS, CUDA)


def test_bf16_moments_on_the_gpu_and_beside_it(tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_losses, ref_weights = train_reference(device=CUDA)
    runs = {}
    for name, tiers in TIERS.items():
        (tmp_path / name).mkdir()
        runs[name] = _train(tiers, tmp_path / name)
        losses, weights = runs[name]
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, rtol=0, atol=LR * 1e-2, msg=f"{name} {key}")
    assert runs["host"][0] == runs["nvme"][0]
    for key, t in runs["host"][1].items():
        assert torch.equal(runs["nvme"][1][key], t), key
