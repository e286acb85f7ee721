"""Every error of the `zeroinf` command line that is the user's to fix is one line on stderr with exit
status 2, from a real `python -m zeroinf` process; a bug keeps its traceback."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import zeroinf
from zeroinf import cli
from zeroinf.aio import bench
from zeroinf.memory import parse_bytes

consolidate_module = importlib.import_module("zeroinf.checkpoint.consolidate")  # the package re-exports the function
SRC = str(Path(zeroinf.__file__).resolve().parents[1])

# (test id, arguments after `python -m zeroinf`, a fragment the error line must hold); {d} is a fresh folder
CASES: list[tuple[str, list[str], str]] = [
    ("deepspeed-missing", ["train", "--deepspeed", "{d}/nope.json"], "nope.json does not exist"),
    ("deepspeed-bad-stage", ["train", "--deepspeed", "{d}/bad.json"], "`zero_optimization.stage` = 7"),
    ("deepspeed-not-json", ["train", "--deepspeed", "{d}/broken.json"], "broken.json is not valid JSON"),
    ("config-not-toml", ["train", "--config", "{d}/broken.toml"], "broken.toml is not valid TOML"),
    ("config-and-deepspeed", ["train", "--config", "a.toml", "--deepspeed", "b.json"], "not allowed with"),
    ("argparse-bad-int", ["train", "--steps", "abc"], "argument --steps: invalid int value: 'abc'"),
    ("nproc-0", ["train", "--nproc", "0"], "--nproc 0 is invalid"),
    ("warmup-negative", ["train", "--warmup", "-5"], "warmup_steps = -5 (--warmup) is invalid: use 0 or a positive"),
    ("batch-0", ["train", "--batch", "0"], "global_batch = 0 (--batch) is invalid"),
    ("finetune-epochs-0", ["finetune", "--model", "{d}", "--data", "{d}/a.txt", "--epochs", "0"],
     "epochs = 0.0 (--epochs) is invalid"),
    ("offload-params-stage-2", ["train", "--offload-params", "host"], "`offload.params`"),
    ("data-missing", ["train", "--model", "tiny", "--data", "{d}/nope.txt"], "nope.txt does not exist"),
    # two ranks: the parent validates before launching, and a rank's error comes back once, without
    # torchrun's traceback and failure table (zeroinf/launch.py)
    ("nproc2-config", ["train", "--model", "tiny", "--stage", "2", "--offload-gradients", "host", "--nproc", "2"],
     "`offload.gradients` = 'host' is invalid"),
    ("nproc2-data-missing", ["train", "--model", "tiny", "--steps", "1", "--data", "{d}/nope.txt", "--nproc", "2"],
     "nope.txt does not exist"),
    ("nproc2-resume-missing", ["train", "--model", "tiny", "--steps", "1", "--resume", "{d}/none", "--nproc", "2"],
     "no such checkpoint folder"),
    ("consolidate-missing", ["consolidate", "{d}/none", "--out", "{d}/out"], "no such checkpoint folder"),
    ("consolidate-bad-size", ["consolidate", "{d}", "--out", "{d}/out", "--max-shard-size", "5XB"],
     "cannot parse --max-shard-size '5XB'"),
    ("bench-io-no-folder", ["bench-io", "--dir", "{d}/none", "--size", "1MiB"], "is not a folder"),
    ("bench-io-bad-size", ["bench-io", "--dir", "{d}", "--size", "4XB"], "cannot parse --size '4XB'"),
]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zeroinf", *argv],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": SRC},
    )


def test_user_errors_are_one_line_with_exit_status_2(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text('{"zero_optimization": {"stage": 7}}')
    (tmp_path / "broken.json").write_text('{"zero_optimization": ')
    (tmp_path / "broken.toml").write_text("stage = \n")
    argvs = [[a.format(d=tmp_path) for a in argv] for _, argv, _ in CASES]
    with ThreadPoolExecutor(4) as pool:  # the processes mostly import torch: run a few at once
        results = list(pool.map(_run, argvs))
    failures = []
    for (name, argv, fragment), proc in zip(CASES, results, strict=True):
        lines = proc.stderr.strip().splitlines()
        command = f"zeroinf {argv[0]}: error: "
        if not (proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(command) and fragment in lines[0]):
            failures.append(f"{name}: exit {proc.returncode}, stderr {proc.stderr!r}")
    assert not failures, "\n".join(failures)


def test_a_bug_keeps_its_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> int:
        raise RuntimeError("a bug, not the user's error")

    monkeypatch.setattr(cli, "run_train", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["train"])


def test_module_entry_points_report_like_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert consolidate_module.main([str(tmp_path / "none"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("zeroinf consolidate: error: ")
    assert bench.main(["--dir", str(tmp_path / "none"), "--size", "1MiB"]) == 2
    assert capsys.readouterr().err.startswith("zeroinf bench-io: error: ")


@pytest.mark.parametrize("size", ["1TB", "1.5 GiB", "500mb", "4096"])
def test_max_shard_size_parses_through_the_one_byte_parser(size: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`consolidate --max-shard-size` had a parser of its own (1TB raised KeyError); now memory.parse_bytes."""
    seen: list[int] = []

    def fake_consolidate(ckpt: str, out: str, dtype: str, max_shard_bytes: int, **_: object) -> dict:
        seen.append(max_shard_bytes)
        return {"weight_map": {}, "metadata": {"total_size": 0}}

    monkeypatch.setattr(consolidate_module, "consolidate", fake_consolidate)
    assert cli.main(["consolidate", "ckpt", "--out", "out", "--max-shard-size", size]) == 0
    assert seen == [parse_bytes(size)]
