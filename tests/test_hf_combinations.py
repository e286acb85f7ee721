"""Hugging Face models (GPT-2, Llama, Llama with tied embeddings) under configurations drawn at
random with a fixed seed: built eagerly or under `zeroinf.init`, stage 0-3, the tiers of parameters,
gradients and optimizer states (tests/test_parity_combinations.py `draw_offload`), persistence and
the root's split at stage 3, activation checkpointing, accumulation, clipping. Each trains 3 steps at
world 2 (one spawned group runs them all) against the plain model in one process: losses within
1e-5 relative, weights within 1e-4 (fp32; the summation order of two ranks). When written, 80 drawn
cases at worlds 1 and 2 all matched.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._hf import BETAS, GLOBAL_BATCH, WEIGHT_DECAY, build, global_batch, needs_model_type
from tests._parity import LR, step_over_micro_batches
from tests.test_parity_combinations import draw_offload

SEED, COUNT, WORLD, STEPS = 12, 12, 2, 3

pytestmark = [needs_model_type("llama"), needs_model_type("gpt2")]


def _draw(i: int, rng: random.Random) -> dict[str, Any]:
    stage = rng.choice([0, 1, 2, 3, 3])
    offload = draw_offload(rng, stage)
    fields: dict[str, Any] = {
        "stage": stage, "activation_checkpointing": rng.random() < 0.3, "grad_accum_steps": rng.choice([1, 2]),
        "grad_clip_norm": rng.choice([None, 0.5]),
    }
    if stage == 3:
        fields["persist_threshold_bytes"] = rng.choice([0, 10**9])
        fields["split_root_min_bytes"] = rng.choice([0, None])
    return {
        "name": f"h{i}", "arch": rng.choice(["gpt2", "llama", "llama-tied"]), "fields": fields,
        "offload": offload, "init": rng.random() < 0.5,
    }


CASES = [_draw(i, rng) for rng in [random.Random(SEED)] for i in range(COUNT)]


def _plain(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(case["arch"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    losses = []
    for step in range(STEPS):
        x = global_batch(step)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if case["fields"]["grad_clip_norm"] is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), case["fields"]["grad_clip_norm"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded(case: dict[str, Any], rank: int, world: int, folder: str) -> dict[str, Any]:
    offload = dict(case["offload"])
    if "nvme" in offload.values():
        offload["nvme_dir"] = f"{folder}/{case['name']}-r{rank}"
        Path(offload["nvme_dir"]).mkdir(parents=True)
    cfg = zeroinf.Config(**case["fields"], offload=zeroinf.OffloadConfig(**offload))
    if case["init"]:
        with zeroinf.init(cfg):
            model = build(case["arch"])
    else:
        model = build(case["arch"])
    model = zeroinf.shard(model, cfg)
    opt = zeroinf.AdamW(model, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    accum, per = cfg.grad_accum_steps, GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        x = global_batch(step)[rank * per : (rank + 1) * per]
        lm_loss = lambda a, b, x=x: model(input_ids=x[a:b], labels=x[a:b]).loss  # noqa: E731
        losses.append(step_over_micro_batches(opt, lm_loss, per, accum, world))
    full = model.state_dict()  # a collective at stage 3
    names = {n for n, _ in model.named_parameters()}
    zeroinf.engine_of(model).close()
    return {"losses": losses, "weights": {n: t.float().clone() for n, t in full.items() if n in names}}


def _all(rank: int, world: int, folder: str) -> dict[str, Any]:
    return {case["name"]: _sharded(case, rank, world, folder) for case in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_ranks(_all, WORLD, str(tmp_path_factory.mktemp("hf")), timeout_s=600)[0]


def test_the_draw_covers_init_stages_and_tiers() -> None:
    assert {c["init"] for c in CASES} == {True, False}
    assert {c["fields"]["stage"] for c in CASES} == {0, 1, 2, 3}
    assert {c["arch"] for c in CASES} == {"gpt2", "llama", "llama-tied"}
    assert {"host", "nvme"} <= {v for c in CASES for v in c["offload"].values()}
    fields = [c["fields"] for c in CASES]
    assert any(f["activation_checkpointing"] for f in fields) and any(f["grad_clip_norm"] for f in fields)
    assert any(f["grad_accum_steps"] == 2 for f in fields)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["name"])
def test_matches_the_plain_model(results: dict[str, Any], case: dict[str, Any]) -> None:
    losses, weights = _plain(case)
    got = results[case["name"]]
    for step, (a, b) in enumerate(zip(got["losses"], losses, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), (case, step, got["losses"], losses)
    for name, ref in weights.items():
        torch.testing.assert_close(got["weights"][name], ref, rtol=1e-5, atol=1e-4, msg=lambda m: f"{case}: {m}")
