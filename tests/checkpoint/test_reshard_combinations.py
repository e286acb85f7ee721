"""A checkpoint saved under one configuration and world size, loaded under another, drawn at random
(a fixed seed): stage, the tiers of parameters, gradients and optimizer states, the step inside
backward and its thread, accumulation, stage 3's persistence and prefetch, activation checkpointing,
saved in the foreground or in the background (one step trained while it writes). Each pair trains 2
steps at world 2 and saves; the load runs at world 1, 2 or 3, trains 2 more steps, and the 4 steps'
losses and the final weights must match plain PyTorch to the parity suite's fp32 tolerances.

One spawned group saves every pair; one per load world loads its share. When written, 84 pairs
drawn the same way (worlds 1-3 on both sides) all matched.
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
from tests._parity import LR, Case, build_model, global_batch, step_over_micro_batches, train_reference
from tests.test_parity import TOLERANCES
from tests.test_parity_combinations import draw_offload

SEED, PAIRS, BATCH, SAVE_WORLD = 7, 9, 12, 2
LOAD_WORLDS = (1, 2, 3)


def _config(rng: random.Random, clip: float | None) -> dict[str, Any]:
    stage = rng.choice([0, 1, 2, 3, 3])
    offload = draw_offload(rng, stage)
    fields: dict[str, Any] = {"stage": stage, "grad_accum_steps": rng.choice([1, 2]), "grad_clip_norm": clip}
    if stage == 3:
        fields["persist_threshold_bytes"] = rng.choice([0, 20_000])
        fields["prefetch_bytes"] = rng.choice([0, 10**9])
    fields["activation_checkpointing"] = rng.random() < 0.3
    return {"fields": fields, "offload": offload}


def _pairs() -> list[dict[str, Any]]:
    rng = random.Random(SEED)
    pairs = []
    for i in range(PAIRS):
        clip = rng.choice([None, 0.05])
        pairs.append({
            "name": f"p{i}", "model": rng.choice(["tiny_gpt", "zoo"]), "clip": clip,
            "save": _config(rng, clip), "load": _config(rng, clip), "blocking": rng.random() < 0.6,
            "load_world": LOAD_WORLDS[i % len(LOAD_WORLDS)],
        })
    return pairs


PAIR_LIST = _pairs()


def _build(pair: dict[str, Any], side: str, rank: int, folder: str) -> tuple[torch.nn.Module, Any, int]:
    drawn = pair[side]
    offload = dict(drawn["offload"])
    if "nvme" in offload.values():
        offload["nvme_dir"] = f"{folder}/{pair['name']}-{side}-r{rank}"
        Path(offload["nvme_dir"]).mkdir(parents=True)
    cfg = zeroinf.Config(**drawn["fields"], offload=zeroinf.OffloadConfig(**offload))
    model = zeroinf.shard(build_model(pair["model"]), cfg)
    return model, zeroinf.AdamW(model, lr=LR, betas=(0.9, 0.95), weight_decay=0.1), cfg.grad_accum_steps


def _steps(model: Any, opt: Any, accum: int, rank: int, world: int, start: int, stop: int) -> list[float]:
    per = BATCH // world
    losses = []
    for step in range(start, stop):
        x, y = (t[rank * per : (rank + 1) * per] for t in global_batch(step, batch=BATCH))
        losses.append(step_over_micro_batches(opt, lambda a, b, x=x, y=y: model(x[a:b], y[a:b]), per, accum, world))
    return losses


def _save_all(rank: int, world: int, folder: str) -> dict[str, list[float]]:
    out = {}
    for pair in PAIR_LIST:
        model, opt, accum = _build(pair, "save", rank, folder)
        losses = _steps(model, opt, accum, rank, world, 0, 2)
        zeroinf.save(f"{folder}/{pair['name']}-ckpt", model, opt, step=2, blocking=pair["blocking"])
        if not pair["blocking"]:
            _steps(model, opt, accum, rank, world, 2, 3)  # trains while it writes; published at this step
        zeroinf.engine_of(model).close()
        out[pair["name"]] = losses
    return out


def _load_some(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {}
    for pair in (p for p in PAIR_LIST if p["load_world"] == world):
        model, opt, accum = _build(pair, "load", rank, folder)
        step = zeroinf.load(f"{folder}/{pair['name']}-ckpt", model, opt)["step"]
        losses = _steps(model, opt, accum, rank, world, step, 4)
        weights = model.state_dict()  # a collective at stage 3
        out[pair["name"]] = {"losses": losses, "weights": {k: v.float().clone() for k, v in weights.items()}}
        zeroinf.engine_of(model).close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("reshard"))
    saved = run_ranks(_save_all, SAVE_WORLD, folder, timeout_s=300)[0]
    loaded: dict[str, Any] = {}
    for world in LOAD_WORLDS:
        loaded.update(run_ranks(_load_some, world, folder, timeout_s=300)[0])
    return {"saved": saved, "loaded": loaded}


def test_the_draw_changes_the_configuration_across_the_save() -> None:
    changed = [p for p in PAIR_LIST if p["save"] != p["load"]]
    assert len(changed) == PAIRS
    assert {p["save"]["fields"]["stage"] for p in PAIR_LIST} | {p["load"]["fields"]["stage"] for p in PAIR_LIST} == {
        0, 1, 2, 3
    }
    assert {p["blocking"] for p in PAIR_LIST} == {True, False}
    tiers = {v for p in PAIR_LIST for side in ("save", "load") for v in p[side]["offload"].values()}
    assert {"device", "host", "nvme"} <= tiers


@pytest.mark.parametrize("pair", PAIR_LIST, ids=lambda p: p["name"])
def test_the_resumed_run_matches_plain_pytorch(results: dict[str, Any], pair: dict[str, Any]) -> None:
    reference = Case(pair["name"], 0, clip=pair["clip"], model=pair["model"], steps=4, batch=BATCH)
    ref_losses, ref_weights = train_reference(reference)
    loss_rtol, weight_atol = TOLERANCES["fp32"]
    losses = results["saved"][pair["name"]] + results["loaded"][pair["name"]]["losses"]
    where = f"{pair['name']}: {pair}"
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=loss_rtol), (where, step, losses, ref_losses)
    weights = results["loaded"][pair["name"]]["weights"]
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=loss_rtol, atol=weight_atol, msg=lambda m: f"{where}: {m}")
