"""`zeroinf.AdamW(track_grad_norm=True)`: the global gradient norm every step, without clipping.

Without clipping or fp16 the step runs inside backward and frees each gradient before `step()`
(optim/adamw.py [Note: the norm without clipping]), so the norm is assembled from squares taken
then. Oracle: the norm the same run computes when clipping is on but never triggers (a huge
`grad_clip_norm`, every gradient kept until `step()`): bitwise equal, at stages 1-3, with states
in memory, on the host and on NVMe, gradients on NVMe, worlds 1 and 2; and torch's
`clip_grad_norm_` on the plain model within 1e-5 (another summation order). Tracking changes no
weight: the run ends bitwise where the untracked run ends.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
import torch

import zeroinf
from tests._harness import run_ranks
from tests._parity import LR, build_model, global_batch, plain_grad_norms

CASES = [  # (stage, params tier, optimizer tier, gradients tier)
    (1, "device", "device", "device"),
    (2, "device", "host", "host"),
    (3, "device", "device", "device"),
    (3, "nvme", "host", "host"),
    (3, "nvme", "nvme", "nvme"),
]
STEPS = 3


def _run(rank: int, world: int, case: tuple, clip: float | None, track: bool, swap: str) -> dict[str, Any]:
    stage, params, optimizer, gradients = case
    folder = os.path.join(swap, f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    offload = zeroinf.OffloadConfig(
        params=params, optimizer=optimizer, gradients=gradients,
        nvme_dir=folder if "nvme" in case[1:] else None,
    )
    cfg = zeroinf.Config(stage=stage, offload=offload, grad_clip_norm=clip, persist_threshold_bytes=0)
    torch.manual_seed(0)
    model = zeroinf.shard(build_model(), cfg)
    opt = zeroinf.AdamW(model, lr=LR, track_grad_norm=track)
    norms, stepped = [], []
    per = 8 // world
    for step in range(STEPS):
        x, y = global_batch(step)
        opt.backward(model(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]))
        opt.step()
        opt.zero_grad()
        norms.append(opt.last_grad_norm)
        stepped.append(opt.units_stepped_in_backward)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    zeroinf.engine_of(model).close()
    return {"norms": norms, "stepped": stepped, "weights": weights}


def _runs(rank: int, world: int) -> list[dict[str, dict[str, Any]]]:
    out = []
    for case in CASES:
        with tempfile.TemporaryDirectory() as swap:
            out.append({
                "tracked": _run(rank, world, case, None, True, swap),
                "clipping": _run(rank, world, case, 1e9, False, swap),
                "untracked": _run(rank, world, case, None, False, swap),
            })
    return out


@pytest.fixture(scope="module", params=[1, 2])
def results(request: pytest.FixtureRequest) -> tuple[int, list[list[dict[str, dict[str, Any]]]]]:
    world = request.param
    return world, run_ranks(_runs, world, timeout_s=300)


def _reference_norms() -> list[float]:
    return plain_grad_norms(STEPS, float("inf"))


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{c[0]}-{'/'.join(c[1:])}" for c in CASES])
def test_tracked_norm_is_the_clipping_norm_bitwise(results, index: int) -> None:
    world, per_rank = results
    reference = _reference_norms()
    for rank, runs in enumerate(per_rank):
        run = runs[index]
        tracked, clipping, untracked = run["tracked"], run["clipping"], run["untracked"]
        where = f"world {world} rank {rank} {CASES[index]}"
        assert tracked["norms"] == clipping["norms"], where
        assert untracked["norms"] == [None] * STEPS, where  # nothing computed unless asked
        assert tracked["norms"] == pytest.approx(reference, rel=1e-5), where
        assert all(n > 0 for n in tracked["stepped"]), f"{where}: the step ran inside backward"
        for name, value in untracked["weights"].items():
            assert torch.equal(tracked["weights"][name], value), f"{where}: tracking changed {name}"
