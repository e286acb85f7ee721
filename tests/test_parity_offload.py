"""Parity with plain single-process PyTorch with model states offloaded, at world 1 and 2, with the
tolerances of tests/test_parity.py: stage {0,1,2} x optimizer {host, nvme} x {fp32, bf16}, and
stage 3 x params {host, nvme} x optimizer {host, nvme} x {fp32, bf16} (gradient shards on host or
nvme alternately), every block sharded.

One spawned group per world size runs every case. The nvme cases use a small `sub_group_numel`, so
every unit is split into several sub-groups (the pipeline, the staging pool and the master
assembly are all exercised), and each case gets its own swap folder under pytest's tmp path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._harness import run_ranks
from tests._parity import Case, run_cases
from tests.test_parity import assert_matches_reference, reference
from zeroinf import OffloadConfig

SUB_GROUP_NUMEL = 5000  # the tiny model's units own 2.6k-12.6k elements: most are split
OFFLOADS: dict[str, tuple[int, str, dict[str, str]]] = {
    f"s{s}-{tier}-{d}": (s, d, {"optimizer": tier})
    for s in (0, 1, 2)
    for tier in ("host", "nvme")
    for d in ("fp32", "bf16")
}
for i, (p_tier, o_tier, d) in enumerate(
    (p, o, d) for p in ("host", "nvme") for o in ("host", "nvme") for d in ("fp32", "bf16")
):
    OFFLOADS[f"s3-p{p_tier}-o{o_tier}-{d}"] = (
        3,
        d,
        {"params": p_tier, "optimizer": o_tier, "gradients": ("host", "nvme")[i % 2]},
    )
NAMES = list(OFFLOADS)


def make_cases(root: Path) -> list[Case]:
    cases = []
    for name, (stage, dtype, tiers) in OFFLOADS.items():
        folder = root / name
        folder.mkdir()
        offload = OffloadConfig(**tiers, nvme_dir=str(folder), sub_group_numel=SUB_GROUP_NUMEL)
        extra = (("persist_threshold_bytes", 0),) if stage == 3 else ()
        cases.append(Case(name, stage, dtype, overrides=(("offload", offload),) + extra))
    return cases


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"world{w}")
def world_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[int, dict[str, Case], dict[str, list[dict]], Path]:
    world = request.param
    root = tmp_path_factory.mktemp(f"swap-world{world}")
    cases = make_cases(root)
    per_rank = run_ranks(run_cases, world, cases, tuple(NAMES), timeout_s=300)  # and plain data parallel
    return world, {c.name: c for c in cases}, {c.name: [r[c.name] for r in per_rank] for c in cases}, root


@pytest.mark.parametrize("name", NAMES)
def test_matches_plain_pytorch(world_results: tuple, name: str) -> None:
    world, cases, results, _ = world_results
    case = cases[name]
    ref_losses, ref_weights, _ = reference(Case(f"s{case.stage}-{case.dtype}", case.stage, case.dtype))
    assert_matches_reference(f"{name} world {world}", results[name], ref_losses, ref_weights, case.dtype)


def test_every_placement_is_bitwise_plain_data_parallelism(world_results: tuple) -> None:
    """Every placement gives bitwise the losses and weights of plain data parallelism in the same
    group: in fp32 torch's DistributedDataParallel with fused AdamW, in bf16 the same by hand with
    fp32 masters (tests/test_parity.py `test_two_ranks_are_bitwise_plain_data_parallelism` says why
    two ranks can be bitwise): where the states live changes nothing."""
    world, _, results, _ = world_results
    assert len(NAMES) == 20
    for name in NAMES:
        ours, ddp = results[name][0], results[name][0]["ddp"]
        assert ours["losses"] == ddp["losses"], f"{name} world {world}: {ours['losses']} vs DDP {ddp['losses']}"
        differing = [k for k, w in ddp["weights"].items() if not torch.equal(ours["weights"][k], w)]
        assert not differing, f"{name} world {world}: weights differ from DDP's: {differing}"


def test_states_leave_the_device_and_swap_files_are_removed(world_results: tuple) -> None:
    """No optimizer state is accounted on the device; the finished runs removed their swap files."""
    _, _, results, root = world_results
    for name in NAMES:
        assert all(r["optimizer_state_bytes"] == 0 for r in results[name]), name
    assert not list(root.rglob("*.swap"))
