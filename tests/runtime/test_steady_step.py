"""A steady step through the transfer owner: after the first step nothing on the host is allocated
again. The pool allocates no staging buffer (`staging_allocations` of step 3 is zero), the reduced
gradients land in the same persistent host shards every step (no per-step allocation, no
zero-fill) or, when the only reduction of a step is stepped inside backward, in none at all, and
the engine's host memory by tag is the same after step 2 and step 3.

World 1 on the CPU device (the accelerator branches run in tests/gpu/); every placement that puts
gradients or optimizer states on the host or NVMe, with two micro-steps, so both the first landing
(copied over the shard) and the later ones (added) run each step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, global_batch
from zeroinf import OffloadConfig, Topology
from zeroinf.engine import engine_of

PLACEMENTS: dict[str, tuple[int, dict[str, str]]] = {
    "s1-ohost": (1, {"optimizer": "host"}),
    "s2-ghost-ohost": (2, {"gradients": "host", "optimizer": "host"}),
    "s2-gnvme-onvme": (2, {"gradients": "nvme", "optimizer": "nvme"}),
    "s3-phost-ghost-ohost": (3, {"params": "host", "gradients": "host", "optimizer": "host"}),
    "s3-pnvme-gnvme-onvme": (3, {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}),
}
STEPS, ACCUM = 3, 2


def _train(stage: int, tiers: dict[str, str], nvme_dir: Path) -> dict:
    offload = OffloadConfig(**tiers, nvme_dir=str(nvme_dir), sub_group_numel=5000)
    cfg = zeroinf.Config(
        stage=stage, grad_accum_steps=ACCUM, offload=offload,
        **({"persist_threshold_bytes": 0} if stage == 3 else {}),
    )
    model = zeroinf.shard(build_model(), cfg, Topology.single(torch.device("cpu")))
    opt = zeroinf.AdamW(model, lr=LR)
    engine = engine_of(model)
    seen: dict[str, list] = {"staging": [], "host_by_tag": [], "host_peak": [], "grad_shards": []}
    for step in range(STEPS):
        x, y = global_batch(step)
        for m in range(ACCUM):
            half = slice(m * len(x) // ACCUM, (m + 1) * len(x) // ACCUM)
            (model(x[half], y[half]) / ACCUM).backward()
        seen["grad_shards"].append([u.grad_shard for u in engine.units])  # held: no address reuse
        opt.step()
        opt.zero_grad()
        report = zeroinf.memory_report(model)
        seen["staging"].append(report["transfers"]["last_step"]["staging_allocations"])
        seen["host_by_tag"].append(dict(report["host"]["by_tag"]))
        seen["host_peak"].append(report["last_step"]["host"]["peak_bytes"])
        seen["transfers"] = report["transfers"]
    opt.close()
    engine.close()
    return seen


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_a_steady_step_allocates_nothing_on_the_host(name: str, tmp_path: Path) -> None:
    stage, tiers = PLACEMENTS[name]
    seen = _train(stage, tiers, tmp_path)
    assert seen["staging"][-1] == 0, f"{name}: step {STEPS} allocated {seen['staging'][-1]} staging buffers"
    assert seen["host_by_tag"][1] == seen["host_by_tag"][2], f"{name}: host memory changed in a steady step"
    assert seen["host_peak"][1] == seen["host_peak"][2], f"{name}: the host peak grew in a steady step"
    if tiers.get("gradients") == "host" and stage == 3:  # the same persistent shards every step
        first, *later = seen["grad_shards"]
        assert all(t is not None for t in first)
        assert all(a is b for shards in later for a, b in zip(first, shards, strict=True))
    elif tiers.get("gradients") == "host":  # one reduction, stepped inside backward: no host shard at all
        assert all(t is None for shards in seen["grad_shards"] for t in shards)
        assert "grad_shard" not in seen["host_by_tag"][-1]
    if tiers.get("gradients") == "nvme":
        if stage == 3:  # every micro-step reduces: the first shards reach the swap file through the pool
            assert seen["staging"][0] > 0
        else:  # one reduction, stepped inside backward where it was reduced: nothing lands at all
            assert seen["staging"][0] == 0
    # A CPU device: nothing crosses between host and accelerator memory, so no copy is counted.
    total = seen["transfers"]["total"]
    assert total["h2d_copies"] == total["d2h_copies"] == total["pageable_copies"] == 0
