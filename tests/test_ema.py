"""`zeroinf.ema_update`: the EMA of a sharded model's weights in a second, frozen sharded model.

World 2 (one spawned group), a tiny Hugging Face Llama trained 3 steps in fp32, the EMA updated
after each step (decay 0.9, so every step moves it visibly), against plain PyTorch: the plain model
on the whole batch and a plain copy updated with `lerp_`. The EMA's gathered weights match the plain
EMA within 1e-6 where the model is at stage 3 on NVMe, on the host or on the device and the EMA
(fp32) alike, and where both are at stage 0 (the EMA's frozen parameters are whole there, updated
without a gather). At stage 3 the units' shards are averaged shard to shard (ema.py [Note: an EMA
averaged shard to shard]): no all-gather in `ema_update`, and the same values as the gathered path
(forced by holding the model gathered) to the last bit. In process: names that do not match and a
decay outside [0, 1] are refused.
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

import zeroinf
from tests._harness import run_ranks

CASES = [(3, "nvme"), (3, "host"), (3, "device"), (0, "device")]


def _case(rank: int, world: int, stage: int, tier: str, folder: str) -> dict[str, float]:
    from tests._hf import build

    plain = build("llama", 0)
    plain_ema = copy.deepcopy(plain).requires_grad_(False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)

    def cfg() -> zeroinf.Config:
        offload = zeroinf.OffloadConfig(params=tier, optimizer=tier, nvme_dir=folder) if stage == 3 else None
        return zeroinf.Config(stage=stage, persist_threshold_bytes=0, offload=offload or zeroinf.OffloadConfig())

    model = zeroinf.shard(copy.deepcopy(plain), cfg())
    ema = zeroinf.shard(build("llama", 1).requires_grad_(False), cfg())  # other weights: the load must win
    ema.load_state_dict(model.state_dict())
    gathered_ema = zeroinf.shard(build("llama", 1).requires_grad_(False), cfg())  # the gathered path's
    gathered_ema.load_state_dict(model.state_dict())
    counters = [zeroinf.engine_of(m).counter for m in (model, ema)]
    gathers = 0
    opt = zeroinf.AdamW(model, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randint(0, 128, (4, 16), generator=g)
        rows = x[rank * 4 // world : (rank + 1) * 4 // world]
        model(input_ids=rows, labels=rows).loss.backward()
        opt.step()
        opt.zero_grad()
        before = sum(c.total["all_gather"] for c in counters)
        zeroinf.ema_update(ema, model, decay=0.9)
        gathers += sum(c.total["all_gather"] for c in counters) - before
        with zeroinf.gathered(list(model.parameters())):  # every model unit whole: the gathered path
            zeroinf.ema_update(gathered_ema, model, decay=0.9)
        plain(input_ids=x, labels=x).loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
        with torch.no_grad():
            for e, p in zip(plain_ema.parameters(), plain.parameters(), strict=True):
                e.lerp_(p, 0.1)
    state, other = ema.state_dict(), gathered_ema.state_dict()
    diff = max((state[k] - v).abs().max().item() for k, v in plain_ema.state_dict().items())
    paths = max((state[k] - v).abs().max().item() for k, v in other.items())
    moved = max((v - plain.state_dict()[k]).abs().max().item() for k, v in plain_ema.state_dict().items())
    assert moved > 1e-3, "the EMA should differ from the model after 3 steps at decay 0.9"
    opt.close()
    for m in (model, ema, gathered_ema):
        zeroinf.engine_of(m).close()
    return {"diff": diff, "paths": paths, "gathers": gathers}


def run(rank: int, world: int, root: str) -> dict[str, dict[str, float]]:
    out = {}
    for stage, tier in CASES:
        folder = os.path.join(root, f"{stage}-{tier}")
        os.makedirs(folder, exist_ok=True)
        out[f"{stage} {tier}"] = _case(rank, world, stage, tier, folder)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, float]]]:
    with tempfile.TemporaryDirectory(prefix="zeroinf-ema-") as root:
        return run_ranks(run, 2, root, timeout_s=240)


@pytest.mark.parametrize(("stage", "tier"), CASES)
def test_ema_of_a_sharded_model_matches_plain_pytorch(
    results: list[dict[str, dict[str, float]]], stage: int, tier: str
) -> None:
    for rank, r in enumerate(results):
        assert r[f"{stage} {tier}"]["diff"] <= 1e-6, (rank, r)


@pytest.mark.parametrize("tier", ["nvme", "host", "device"])
def test_stage_3_averages_shard_to_shard_without_a_gather(
    results: list[dict[str, dict[str, float]]], tier: str
) -> None:
    for rank, r in enumerate(results):
        case = r[f"3 {tier}"]
        assert case["gathers"] == 0, (rank, case)  # the root (kept whole) needs none either
        assert case["paths"] == 0.0, (rank, case)  # the gathered path's values, bit for bit


def test_bad_input_is_refused() -> None:
    from tests._hf import build

    model = zeroinf.shard(build("llama", 0), zeroinf.Config(stage=3, persist_threshold_bytes=0))
    other = zeroinf.shard(build("gpt2", 0).requires_grad_(False), zeroinf.Config(stage=3))
    with pytest.raises(ValueError, match="do not match the model's.*same class and config"):
        zeroinf.ema_update(other, model, decay=0.9)
    with pytest.raises(ValueError, match="decay = 1.5"):
        zeroinf.ema_update(model, model, decay=1.5)
    for m in (model, other):
        zeroinf.engine_of(m).close()


def test_a_plain_model_needs_no_gather() -> None:
    torch.manual_seed(0)
    model, ema = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    expected = [e.detach().lerp(p.detach(), 0.5) for e, p in zip(ema.parameters(), model.parameters(), strict=True)]
    zeroinf.ema_update(ema, model, decay=0.5)
    assert all(torch.equal(e, x) for e, x in zip(ema.parameters(), expected, strict=True))
