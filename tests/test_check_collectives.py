"""`Config.check_collectives` (comm.py [Note: checking that the ranks call the same collectives]).

At world 2, stage 3, in one spawned group each: a layer skipped on one rank only (LayerDrop drawn
per rank), which gloo answered by aborting the process from C++, and an evaluation run on rank 0
alone, which waited for the collective timeout, now stop at once on every rank with a
CollectiveError naming what each rank was calling; the same with ZEROINF_CHECK_COLLECTIVES=1 in
the environment and the config left alone. With the check on, training that calls the same
collectives everywhere is bitwise what it is without (stages 0-3, parameters and states on NVMe, a
layer skipped on one rank at stages 0-2, where that is allowed).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import zeroinf
from tests._harness import run_ranks

# per rank and step, which of the 4 blocks run: on step 1 the ranks skip different blocks
SKIPS = {0: [[1, 1, 1, 1], [1, 0, 1, 1], [1, 1, 1, 1]], 1: [[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 1]]}
SAME = {0: [[1, 1, 1, 1]] * 3, 1: [[1, 1, 1, 1]] * 3}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class Skipping(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
        x = self.inp(x)
        for run, block in zip(keep, self.blocks, strict=True):
            if run:
                x = block(x)
        return self.out(x)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    return x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4]


def _train(rank: int, world: int, stage: int, check: bool, plans: dict, folder: str, eval_on_rank_0: bool) -> Any:
    torch.manual_seed(0)
    offload: dict[str, Any] = {"optimizer": "nvme", "nvme_dir": f"{folder}/{stage}-{check}-r{rank}"}
    if stage == 3:
        offload["params"] = "nvme"
    cfg = zeroinf.Config(
        stage=stage, persist_threshold_bytes=0, unit_classes=("Block",), offload=offload,
        check_collectives=check, collective_timeout_s=60,
    )
    model = zeroinf.shard(Skipping(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    losses: list[float] = []
    start = time.monotonic()
    try:
        for step in range(3):
            x, y = _batch(step, rank)
            if eval_on_rank_0 and step == 1 and rank == 0:
                with torch.no_grad():
                    model(x, plans[rank][step])
            loss = (model(x, plans[rank][step]) - y).pow(2).mean()
            opt.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    except zeroinf.CollectiveError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}
    finally:
        zeroinf.engine_of(model).close()
    return {"losses": losses}


def _cases(rank: int, world: int, folder: str) -> dict[str, Any]:
    out = {}
    for stage in (0, 1, 2, 3):
        for check in (False, True):
            out[f"same {stage} {check}"] = _train(rank, world, stage, check, SAME, folder, False)
        if stage < 3:  # a layer skipped on one rank is allowed at stages 0-2
            for check in (False, True):
                out[f"skips {stage} {check}"] = _train(rank, world, stage, check, SKIPS, folder, False)
    out["skips 3 True"] = _train(rank, world, 3, True, SKIPS, folder, False)
    out["eval 3 True"] = _train(rank, world, 3, True, SAME, folder, True)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_cases, 2, str(tmp_path_factory.mktemp("check")), timeout_s=300)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_check_changes_nothing_where_the_ranks_agree(results: list[dict[str, Any]], stage: int) -> None:
    for rank in range(2):
        assert results[rank][f"same {stage} True"] == results[rank][f"same {stage} False"]
        assert "losses" in results[rank][f"same {stage} True"]
        if stage < 3:
            assert results[rank][f"skips {stage} True"] == results[rank][f"skips {stage} False"]
            assert "losses" in results[rank][f"skips {stage} True"]


def test_a_layer_skipped_on_one_rank_at_stage_3_is_named_on_every_rank(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got = results[rank]["skips 3 True"]
        assert "error" in got, got
        assert "the ranks called different collectives" in got["error"]
        assert "rank 0: " in got["error"] and "rank 1: " in got["error"] and "unit blocks." in got["error"]
        assert "not a whole layer on some ranks" in got["error"]
    assert results[0]["skips 3 True"]["error"] == results[1]["skips 3 True"]["error"]


def test_an_evaluation_on_one_rank_is_named_before_the_timeout(results: list[dict[str, Any]]) -> None:
    for rank in range(2):
        got = results[rank]["eval 3 True"]
        assert "error" in got and "run evaluations on every rank" in got["error"], got
        assert got["seconds"] < 30  # the collective timeout is 60 s


def _skip_named_by_the_environment(rank: int, world: int, folder: str) -> Any:
    return _train(rank, world, 3, False, SKIPS, folder, False)


def test_the_environment_turns_it_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ZEROINF_CHECK_COLLECTIVES=1 (the ranks inherit the environment) with the config's default."""
    monkeypatch.setenv("ZEROINF_CHECK_COLLECTIVES", "1")
    got = run_ranks(_skip_named_by_the_environment, 2, str(tmp_path), timeout_s=120)
    assert all("the ranks called different collectives" in r.get("error", "") for r in got), got


def test_the_setting_is_validated(tmp_path: Path) -> None:
    with pytest.raises(zeroinf.ConfigError, match="check_collectives"):
        zeroinf.Config(check_collectives="yes")  # type: ignore[arg-type]
    model = zeroinf.shard(Skipping(), zeroinf.Config(check_collectives=True))  # world 1: nothing to check
    assert not zeroinf.engine_of(model).topo.check_collectives
