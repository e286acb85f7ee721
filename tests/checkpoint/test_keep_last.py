"""`zeroinf.save(..., keep_last=N)` and `zeroinf train --keep-last N` bound the disk a run's checkpoints
take (checkpoint/saving.py [Note: keeping the last checkpoints]): world 1, stage 3 with the states on
NVMe, blocking and background saves alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import zeroinf
import zeroinf.checkpoint as ck
from tests._parity import LR, build_model, global_batch
from tests.test_train import TINY_RUN
from zeroinf.config import Config
from zeroinf.train import TrainArgs, train


def _trained(swap: Path) -> tuple[torch.nn.Module, zeroinf.AdamW]:
    torch.manual_seed(0)
    cfg = zeroinf.Config(
        stage=3, persist_threshold_bytes=0, offload={"params": "nvme", "optimizer": "nvme", "nvme_dir": str(swap)}
    )
    model = zeroinf.shard(build_model(), cfg)
    return model, zeroinf.AdamW(model, lr=LR)


def _step(model: torch.nn.Module, opt: zeroinf.AdamW, step: int) -> None:
    x, y = global_batch(step)
    opt.backward(model(x, y))
    opt.step()
    opt.zero_grad()


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def test_keep_last_leaves_the_newest_checkpoints_of_the_run(tmp_path: Path) -> None:
    model, opt = _trained(tmp_path / "swap")
    root = tmp_path / "ckpt"
    weights = {}
    for step in range(1, 6):
        _step(model, opt, step)
        weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        pending = ck.save(root, model, opt, step, blocking=step % 2 == 0, keep_last=2)
        if step % 2:  # a background save: published (and older ones removed) by wait, as by the next step
            assert isinstance(pending, ck.PendingSave)
            pending.wait()
        assert _names(root) == ["latest", *[f"step_{s:08d}" for s in range(max(1, step - 1), step + 1)]]
    info = ck.load(root, model, opt)  # `latest`, the newest
    assert info["step"] == 5
    assert all(torch.equal(v, weights[5][k]) for k, v in model.state_dict().items())
    ck.load(root / "step_00000004", model, opt)  # the one kept beside it is whole too
    assert all(torch.equal(v, weights[4][k]) for k, v in model.state_dict().items())


def test_a_resumed_run_keeps_what_it_continues_from_and_leaves_later_steps_alone(tmp_path: Path) -> None:
    model, opt = _trained(tmp_path / "swap")
    root = tmp_path / "ckpt"
    for step in (10, 20, 30):  # an earlier run, keeping everything
        ck.save(root, model, opt, step)
    (root / ".tmp-step_00000008").mkdir()  # a crashed save: never a candidate
    (root / "step_00000005").mkdir()  # no manifest: not a complete checkpoint, not ours to remove
    (root / "notes.txt").write_text("mine")
    ck.save(root, model, opt, 15, keep_last=2)  # resumed from 10, saving 15: 10 is kept, 20 and 30 left alone
    assert _names(root) == [
        ".tmp-step_00000008", "latest", "notes.txt", "step_00000005", "step_00000010", "step_00000015",
        "step_00000020", "step_00000030",
    ]
    ck.save(root, model, opt, 16, keep_last=1)
    assert _names(root) == [
        ".tmp-step_00000008", "latest", "notes.txt", "step_00000005", "step_00000016", "step_00000020",
        "step_00000030",
    ]
    assert (root / "latest").read_text().strip() == "step_00000016"


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_keep_last_is_refused_before_anything_is_written(bad: object, tmp_path: Path) -> None:
    model, opt = _trained(tmp_path / "swap")
    with pytest.raises(ValueError, match=r"keep_last = .* is invalid; use None \(keep all\) or an int >= 1"):
        ck.save(tmp_path / "ckpt", model, opt, 1, keep_last=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


def test_train_keep_last_bounds_the_save_folder(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    args = {**TINY_RUN, "eval_batches": 0, "steps": 5}
    train(TrainArgs(**args, config=Config(stage=3), save_every=1, save_dir=str(root), keep_last=2))
    assert _names(root) == ["latest", "step_00000004", "step_00000005"]
    with pytest.raises(ValueError, match=r"keep_last = -1 \(--keep-last\) is invalid"):
        TrainArgs(**args, keep_last=-1)
