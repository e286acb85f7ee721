"""zeroinf.ShardedOptimizer on CUDA (`pytest -m gpu`; optim/torch_optimizer.py): torch's SGD with
momentum and torch's fused AdamW over the shards of a model on the GPU, the states on the GPU (torch's
CUDA kernels over views of the shard: foreach for SGD, fused for AdamW, whose `step` tensors then live
on the GPU), on the host and on NVMe (torch's CPU kernels beside the GPU's backward). Each placement
trains the tiny GPT as the same torch optimizer on the whole model on the same GPU, within the fp32
tolerances of tests/gpu/test_cuda_moments.py (the CPU kernels may round differently from the GPU's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, global_batch
from tests.gpu._loop import train_then_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
STEPS = 4
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
    "fused-adamw": (torch.optim.AdamW, {"lr": LR, "weight_decay": 0.1, "fused": True}),
}
TIERS = {
    "device": {},
    "host": {"optimizer": "host", "gradients": "host"},
    "nvme": {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"},
}


def _plain(cls: type[torch.optim.Optimizer], settings: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build_model().to(CUDA)
    opt = cls(model.parameters(), **settings)
    losses = []
    for step in range(STEPS):
        loss = model(*(t.to(CUDA) for t in global_batch(step)))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: t.detach().float().cpu() for n, t in model.state_dict().items()}


def _sharded(cls: type[torch.optim.Optimizer], settings: dict[str, Any], tiers: dict[str, str],
             folder: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    offload = zeroinf.OffloadConfig(**tiers, nvme_dir=str(folder), sub_group_numel=3000)
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, offload=offload, persist_threshold_bytes=0),
                          zeroinf.Topology.single(CUDA))
    opt = zeroinf.ShardedOptimizer(cls, model.parameters(), **settings)
    return train_then_close(model, opt, STEPS, CUDA)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_torch_optimizers_over_shards_on_the_gpu_and_beside_it(optimizer: str, tmp_path: Path) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    cls, settings = OPTIMIZERS[optimizer]
    ref_losses, ref_weights = _plain(cls, settings)
    for name, tiers in TIERS.items():
        (tmp_path / name).mkdir()
        losses, weights = _sharded(cls, settings, tiers, tmp_path / name)
        assert losses == pytest.approx(ref_losses, rel=1e-5), (optimizer, name)
        for key, ref in ref_weights.items():
            torch.testing.assert_close(weights[key], ref, rtol=0, atol=LR * 1e-2, msg=f"{optimizer} {name} {key}")
