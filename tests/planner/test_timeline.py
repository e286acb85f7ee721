"""Looking at a step: phase labels in profiler traces, the recorder, and `--report`'s timeline files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zeroinf
from zeroinf.models.gpt import GPT, GPTConfig
from zeroinf.planner.timeline import category, exclusive_seconds, measured_split
from zeroinf.telemetry import PhaseEvent, phase_scope, record_phases

GPT_CFG = GPTConfig(seq_len=32, n_layer=3, n_head=2, d_model=128)
PHASES = {"zeroinf::unshard", "zeroinf::reshard", "zeroinf::reduce", "zeroinf::swap_in", "zeroinf::swap_out",
          "zeroinf::optimizer", "zeroinf::backward"}


def offloaded(tmp_path: Path) -> tuple[torch.nn.Module, zeroinf.AdamW]:
    offload = zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(stage=3, offload=offload)
    torch.manual_seed(0)
    with zeroinf.init(cfg):
        model = GPT(GPT_CFG)
    zeroinf.shard(model, cfg)
    return model, zeroinf.AdamW(model, lr=1e-3)


def step(model: torch.nn.Module, opt: zeroinf.AdamW) -> None:
    idx = torch.randint(0, 256, (2, GPT_CFG.seq_len))
    with phase_scope("zeroinf::forward"):
        loss = model(idx, idx)
    opt.backward(loss)
    opt.step()
    opt.zero_grad()


def test_profiler_traces_show_our_phases(tmp_path: Path) -> None:
    model, opt = offloaded(tmp_path)
    step(model, opt)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step(model, opt)
    names = {e.key for e in prof.key_averages()}
    assert PHASES | {"zeroinf::forward"} <= names
    opt.close()
    zeroinf.engine_of(model).close()


def test_recorder_keeps_nested_phases_of_one_step(tmp_path: Path) -> None:
    model, opt = offloaded(tmp_path)
    step(model, opt)
    with record_phases() as rec:
        step(model, opt)
    assert PHASES <= {e.name for e in rec.events}
    assert rec.end_s is not None
    split = measured_split(rec.events, rec.start_s, rec.end_s, "MainThread")
    assert split["compute"] > 0 and split["optimizer"] > 0 and split["nvme I/O"] > 0
    assert sum(split[c] for c in ("compute", "collectives", "nvme I/O", "optimizer", "other")) == pytest.approx(
        split["step"], rel=1e-6
    )
    with record_phases():  # nothing is recorded outside the block, and one recorder at a time
        with pytest.raises(RuntimeError, match="already active"):
            with record_phases():
                pass
    opt.close()
    zeroinf.engine_of(model).close()


def test_exclusive_time_subtracts_nested_phases() -> None:
    events = [
        PhaseEvent("zeroinf::forward", "T", 0.0, 1.0, 0),
        PhaseEvent("zeroinf::unshard", "T", 0.1, 0.3, 1),
        PhaseEvent("zeroinf::swap_in", "T", 0.15, 0.2, 2),
        PhaseEvent("zeroinf::optimizer", "T", 1.0, 1.5, 0),
        PhaseEvent("zeroinf::wait_io.optimizer", "T", 1.1, 1.2, 1),
        PhaseEvent("zeroinf::optimizer", "other", 0.0, 5.0, 0),
    ]
    got = exclusive_seconds(events, "T")
    assert got == pytest.approx({"compute": 0.8, "collectives": 0.15, "nvme I/O": 0.15, "optimizer": 0.4})
    assert category("zeroinf::wait_io.params") == "nvme I/O" and category("zeroinf::reduce") == "collectives"


def test_train_report_writes_the_timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zeroinf.train import TrainArgs, train

    monkeypatch.setenv("ZEROINF_CACHE_DIR", str(tmp_path / "cache"))
    cfg = zeroinf.Config(
        stage=3, offload=zeroinf.OffloadConfig(params="nvme", optimizer="nvme", nvme_dir=str(tmp_path / "swap"))
    )
    report = tmp_path / "run.json"
    train(TrainArgs(
        model="tiny", seq_len=32, global_batch=4, steps=4, eval_batches=0, max_corpus_bytes=2**18, config=cfg,
        progress=False, report_path=str(report),
    ))
    data = json.loads(report.read_text())
    step_report = data["step_report"]
    page = Path(step_report["timeline_html"]).read_text()
    assert step_report["timeline_html"] == str(tmp_path / "run.timeline.html")
    assert "<svg" in page and "optimizer" in page and "predicted" in page
    trace = json.loads(Path(step_report["trace_json"]).read_text())
    assert {e["name"] for e in trace["traceEvents"]} >= {"zeroinf::forward", "zeroinf::backward", "zeroinf::optimizer"}
    assert step_report["predicted"]["peak_bytes"]["nvme"] > 0
    assert step_report["measured_s"]["step"] > 0
