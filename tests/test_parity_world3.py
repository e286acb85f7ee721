"""Parity with plain single-process PyTorch at world 3: shards that do not divide evenly.

Every other parity test runs at world 1, 2 or 4, where the tiny model's flat buffers mostly split
into equal shards. At world 3 the shard boundaries fall inside parameters, the last shard carries
the padding, and each rank's optimizer sub-groups, gradient landings and NVMe slots have sizes of
their own. One spawned group of 3 ranks runs every case on a global batch of 12 (divisible by 3 ranks
and by 2 micro-steps), against the reference with the tolerances of tests/test_parity.py:
- stages 0-3 in fp32 with everything on the device;
- stage 3 with the tiers spread over host and NVMe, clipping that undoes the step made inside
  backward, accumulation, activation checkpointing, resident units, bf16 compute and bf16 moments.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests._harness import run_ranks
from tests._parity import Case, run_cases, train_reference
from tests.test_parity import assert_matches_reference
from zeroinf import OffloadConfig

WORLD, BATCH = 3, 12
SUB_GROUP_NUMEL = 5000  # units of 2.6k-12.6k elements: most are cut into several sub-groups
S3 = (("persist_threshold_bytes", 0),)
# name -> (stage, dtype, accum, clip, offload tiers or None, extra Config fields)
CASES: dict[str, tuple[int, str, int, float | None, dict[str, str] | None, tuple]] = {
    "s0": (0, "fp32", 1, None, None, ()),
    "s1-clip": (1, "fp32", 1, 0.05, None, ()),
    "s2-accum2": (2, "fp32", 2, None, None, ()),
    "s3": (3, "fp32", 1, None, None, S3),
    "s3-pnvme-onvme-gnvme-clip": (3, "fp32", 1, 0.05, {"params": "nvme", "optimizer": "nvme", "gradients": "nvme"}, S3),
    "s3-phost-ohost-accum2-ckpt": (
        3, "fp32", 2, None, {"params": "host", "optimizer": "host", "gradients": "host"},
        S3 + (("activation_checkpointing", True),),
    ),
    "s3-pnvme-ohost-resident-clip": (3, "fp32", 1, 1.0, {"params": "nvme", "optimizer": "host"}, ()),
    "s3-pdevice-onvme-bf16": (3, "bf16", 1, None, {"optimizer": "nvme"}, S3),
    "s3-phost-onvme-bf16-moments": (
        3, "fp32", 2, 0.05, {"params": "host", "optimizer": "nvme", "moment_dtype": "bf16"}, S3,
    ),
}


def make_cases(root: Path) -> list[Case]:
    cases = []
    for name, (stage, dtype, accum, clip, tiers, extra) in CASES.items():
        overrides = extra
        if tiers is not None:
            folder = root / name
            folder.mkdir()
            offload = OffloadConfig(**tiers, nvme_dir=str(folder), sub_group_numel=SUB_GROUP_NUMEL)  # type: ignore[arg-type]
            overrides = (("offload", offload),) + extra
        cases.append(Case(name, stage, dtype, accum=accum, clip=clip, overrides=overrides, steps=5, batch=BATCH))
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Case], list[dict[str, dict]]]:
    cases = make_cases(tmp_path_factory.mktemp("world3"))
    return {c.name: c for c in cases}, run_ranks(run_cases, WORLD, cases, timeout_s=400)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_plain_pytorch_at_world_3(results: tuple[dict[str, Case], list[dict[str, dict]]], name: str) -> None:
    cases, per_rank = results
    case = cases[name]
    ref_losses, ref_weights = train_reference(Case(name, case.stage, case.dtype, clip=case.clip, steps=5, batch=BATCH))
    # bf16 moments: the moments are rounded stochastically every step, within the bf16 tolerances
    tolerances = "bf16" if "moments" in name else case.dtype
    ours = [r[name] for r in per_rank]
    assert not any(math.isnan(x) for x in ours[0]["losses"]), (name, ours[0]["losses"])
    assert_matches_reference(name, ours, ref_losses, ref_weights, case.dtype, tolerances)
    if case.clip == 0.05 and case.stage == 3 and "nvme" in name:
        assert ours[0]["rollbacks"] >= 1, f"{name}: clipping should have undone a step made inside backward"
