"""A checkpoint saved with the embedding and head in the root resumes with them split
(`Config.split_root`), and the other way: checkpoints are keyed by parameter, not by unit, so the
resumed step equals the uninterrupted one exactly (world 2, stage 3, Hugging Face Llama)."""

from __future__ import annotations

import os
import tempfile

import torch

import zeroinf
from tests._harness import run_ranks


def _cfg(split: bool) -> zeroinf.Config:
    return zeroinf.Config(stage=3, persist_threshold_bytes=0, split_root=split, split_root_min_bytes=0)


def _step(model: torch.nn.Module, opt: zeroinf.AdamW, ids: torch.Tensor) -> None:
    opt.backward(model(input_ids=ids, labels=ids).loss)
    opt.step()
    opt.zero_grad()


def _resume_across(rank: int, world: int, root: str) -> list[tuple[bool, float, float, list[str]]]:
    from tests import _hf

    out = []
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(rank))
    for saved_split in (False, True):
        folder = os.path.join(root, f"split-{saved_split}")
        torch.manual_seed(0)
        model = zeroinf.shard(_hf.build("llama"), _cfg(saved_split))
        opt = zeroinf.AdamW(model, lr=1e-2)
        for _ in range(2):
            _step(model, opt, ids)
        zeroinf.save(folder, model, opt, step=2)
        _step(model, opt, ids)
        expected = model(input_ids=ids, labels=ids).loss.item()
        torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
        resumed = zeroinf.shard(_hf.build("llama"), _cfg(not saved_split))
        resumed_opt = zeroinf.AdamW(resumed, lr=1e-2)
        zeroinf.load(folder, resumed, resumed_opt)
        _step(resumed, resumed_opt, ids)
        got = resumed(input_ids=ids, labels=ids).loss.item()
        out.append((saved_split, expected, got, [u.name for u in zeroinf.engine_of(resumed).units]))
        for m in (model, resumed):
            zeroinf.engine_of(m).close()
    return out


def test_a_checkpoint_resumes_exactly_with_the_other_split() -> None:
    with tempfile.TemporaryDirectory(prefix="zeroinf-split-ckpt-") as root:
        results = run_ranks(_resume_across, 2, root)
    for rank, per_rank in enumerate(results):
        for saved_split, expected, got, units in per_rank:
            assert got == expected, (rank, saved_split, expected, got)
            assert ("lm_head" in units) == (not saved_split), units
