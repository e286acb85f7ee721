"""accelerate's `save_state` / `load_state` of a sharded model on CUDA (`pytest -m gpu`;
integrations/accelerate_loop.py [Note: accelerate's save_state of sharded states]): a Hugging Face
Llama at stage 3 in bf16 on cuda:0, its optimizer states on the GPU, the host and NVMe. Two steps,
`accelerator.save_state`, two more; a fresh model and optimizer `load_state` the folder and take the
same two steps: the same losses, bit for bit (the file carries the fp32 masters, finer than the bf16
weights beside them). One process: accelerate's single-GPU path. "nvme-sharded": the same through
`zeroinf.integrations.sharded_save_state` (zeroinf.save / zeroinf.load under accelerate's hooks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA path needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
TIERS = {
    "device": {},
    "host": {"params": "host", "optimizer": "host"},
    "nvme": {"params": "nvme", "optimizer": "nvme"},
    "nvme-sharded": {"params": "nvme", "optimizer": "nvme"},
}


def _run(tiers: dict[str, str], folder: Path, load: bool, sharded: bool) -> list[float]:
    from accelerate import Accelerator

    from tests._hf import build

    accelerator = Accelerator(cpu=CUDA.type == "cpu")
    offload = zeroinf.OffloadConfig(**tiers, nvme_dir=str(folder / ("nvme-load" if load else "nvme-save")))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, param_dtype="bf16", offload=offload)
    model = zeroinf.shard(build("llama", 0), cfg, zeroinf.Topology.single(CUDA))
    opt = zeroinf.AdamW(model, lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    if sharded:
        from zeroinf.integrations import sharded_save_state

        sharded_save_state(accelerator)
    rows = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(CUDA)
    losses = []

    def step() -> None:
        loss = model(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())

    if load:
        accelerator.load_state(str(folder / "state"))
    else:
        step()
        step()
        accelerator.save_state(str(folder / "state"))
        losses.clear()
    step()
    step()
    opt.close()
    zeroinf.engine_of(model).close()
    return losses


@pytest.mark.parametrize("tier", TIERS)
def test_accelerate_save_state_resumes_bitwise_on_the_gpu(tier: str, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    saved = _run(TIERS[tier], tmp_path, load=False, sharded=tier.endswith("-sharded"))
    loaded = _run(TIERS[tier], tmp_path, load=True, sharded=tier.endswith("-sharded"))
    assert loaded == saved, (tier, saved, loaded)
