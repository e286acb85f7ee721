"""Opening the NVMe tier for parameters: a model whose units are all resident runs (with a notice)
instead of failing, and a missing swap folder is created."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
from tests._parity import LR, build_model, train_step
from zeroinf import OffloadConfig
from zeroinf.topology import Topology

CPU = Topology.single(torch.device("cpu"))


def train(offload: OffloadConfig, steps: int = 3) -> list[float]:
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, offload=offload), CPU)  # default threshold
    opt = zeroinf.AdamW(model, lr=LR)
    losses = []
    for step in range(steps):
        losses.append(train_step(model, opt, step))
    opt.close()
    zeroinf.engine_of(model).close()
    return losses


def test_params_on_nvme_with_every_unit_resident_run_with_a_notice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    swap = tmp_path / "swap"
    with caplog.at_level("INFO", logger="zeroinf"):
        losses = train(OffloadConfig(params="nvme", nvme_dir=str(swap)))
    notices = [r for r in caplog.records if "resident" in r.getMessage()]
    assert len(notices) == 1 and notices[0].levelname == "INFO", caplog.text
    assert "persist_threshold_bytes" in notices[0].getMessage() and "\n" not in notices[0].getMessage()
    assert losses == train(OffloadConfig())  # the same run as with parameters on the device
    assert not swap.exists() or not list(swap.iterdir())  # nothing went to NVMe


def test_every_state_on_nvme_in_a_folder_that_does_not_exist_yet(tmp_path: Path) -> None:
    swap = tmp_path / "new" / "swap"
    (tmp_path / "new").mkdir()
    offload = OffloadConfig(params="nvme", optimizer="nvme", gradients="nvme", nvme_dir=str(swap))
    model = zeroinf.shard(
        build_model(), zeroinf.Config(stage=3, offload=offload, persist_threshold_bytes=0), CPU
    )
    opt = zeroinf.AdamW(model, lr=LR)
    assert len(list(swap.glob("*.swap"))) == 5  # params, gradients, three optimizer states
    opt.close()
    zeroinf.engine_of(model).close()
    assert swap.is_dir() and not list(swap.iterdir())
