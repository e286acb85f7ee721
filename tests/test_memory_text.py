"""`zeroinf.memory_report(model)` prints as a short table and stays the dict programs read
(memory_text.py)."""

from __future__ import annotations

import json
from pathlib import Path

import zeroinf
from tests._parity import LR, build_model, train_step


def test_the_report_prints_as_a_table_and_stays_a_dict(tmp_path: Path) -> None:
    offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(tmp_path)}
    model = zeroinf.shard(build_model(), zeroinf.Config(stage=3, persist_threshold_bytes=0, offload=offload))
    opt = zeroinf.AdamW(model, lr=LR)
    for step in range(2):
        train_step(model, opt, step)
    report = zeroinf.memory_report(model)
    assert isinstance(report, dict) and json.loads(json.dumps(report)) == json.loads(json.dumps(dict(report)))
    text = str(report)
    lines = text.splitlines()
    assert lines[0].split() == ["zeroinf", "memory", "(this", "rank)", "live", "peak", "peak", "B/param"]
    nvme = next(line for line in lines if line.strip().startswith("nvme"))
    assert f"{report['nvme']['peak_bytes_per_param']:.2f}" in nvme
    assert any("optimizer_exp_avg" in line and "param_shard" in line for line in lines)  # the tier's tags
    assert any(line.strip().startswith("last step") and "B/param" in line for line in lines)
    counts = report["collectives_last_step"]
    assert f"all_gather {counts['all_gather']}" in text
    assert len(lines) <= 12 and all(len(line) <= 130 for line in lines)
