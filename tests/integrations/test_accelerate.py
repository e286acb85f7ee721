"""A user's own accelerate loop around a sharded model: `accelerator.prepare(model, opt, loader)`.

`zeroinf.shard` and `zeroinf.AdamW` carry accelerate's prepared flag, so `prepare` hands them back
unchanged (integrations/trainer.py [Note: accelerate and the sharded model]). Before, accelerate
moved the model (world 2: wrapped it in DDP too) and the next forward stopped with the engine's
"converted after zeroinf.shard" error. World 2 (one spawned group), a tiny Hugging Face Llama,
`accelerator.backward` and the prepared optimizer, against plain PyTorch on the whole batch: the
same losses, weights within 1e-6, at stage 0 and at stage 3 with parameters and optimizer on the host.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist

import zeroinf

STAGES = [(0, "device"), (3, "host")]


def _loop(rank: int, world: int, stage: int, tier: str) -> dict[str, Any]:
    from accelerate import Accelerator

    from tests._hf import build

    accelerator = Accelerator(cpu=True)
    plain = build("llama", 0)
    offload = zeroinf.OffloadConfig(params=tier, optimizer=tier) if stage == 3 else zeroinf.OffloadConfig()
    model = zeroinf.shard(copy.deepcopy(plain), zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=1e-3)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    prepared_model, prepared_opt = accelerator.prepare(model, opt)
    x = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    rows = x[rank * 4 // world : (rank + 1) * 4 // world]
    losses = []
    for _ in range(3):
        loss = prepared_model(input_ids=rows, labels=rows).loss
        accelerator.backward(loss)
        prepared_opt.step()
        prepared_opt.zero_grad()
        plain_loss = plain(input_ids=x, labels=x).loss
        plain_loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append((mean.item() / world, plain_loss.item()))
    state = model.state_dict()
    out = {
        "unchanged": prepared_model is model and prepared_opt is opt, "losses": losses,
        "diff": max((state[k] - v).abs().max().item() for k, v in plain.state_dict().items()),
    }
    opt.close()
    zeroinf.engine_of(model).close()
    return out


def run(rank: int, world: int) -> dict[str, Any]:
    return {f"{stage} {tier}": _loop(rank, world, stage, tier) for stage, tier in STAGES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    pytest.importorskip("accelerate")
    from tests._harness import run_ranks

    return run_ranks(run, 2, timeout_s=240)


@pytest.mark.parametrize(("stage", "tier"), STAGES)
def test_accelerate_prepare_returns_the_sharded_model_and_it_trains(
    results: list[dict[str, Any]], stage: int, tier: str
) -> None:
    for rank, r in enumerate(results):
        case = r[f"{stage} {tier}"]
        assert case["unchanged"], rank
        assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in case["losses"]), (rank, case["losses"])
        assert case["diff"] <= 1e-6, (rank, case["diff"])
