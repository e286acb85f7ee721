"""`zeroinf env` (env_report.py): the facts it reports are this machine's, the NVMe folder check finds
what offload.nvme_dir would meet, and the warnings name what to do."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from zeroinf import env_report
from zeroinf.cli import main


def test_the_json_report_holds_this_machines_facts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "swap"
    assert main(["env", "--json", "--nvme-dir", str(folder)]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["torch"]["version"] == torch.__version__
    assert found["cpu"]["cores"] == len(os.sched_getaffinity(0))
    assert set(found["cpu"]["features"]) == set(env_report.CPU_FEATURES)
    assert 0 < found["memory"]["available_bytes"] <= found["memory"]["total_bytes"]
    assert "gloo" in found["distributed"]["backends"]
    assert found["libraries"]["safetensors"] is not None  # a dependency of zeroinf
    nvme = found["nvme_dir"]
    assert nvme["problem"] is None and folder.is_dir() and list(folder.iterdir()) == []  # the probe file is gone
    assert nvme["o_direct"] is True and nvme["filesystem"]  # a real disk here
    assert 0 < nvme["free_bytes"] <= nvme["total_bytes"]


def test_the_text_report_names_each_fact_and_the_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    text = capsys.readouterr().out
    for label in ("zeroinf", "torch", "cpu features", "memory", "distributed"):
        assert any(line.startswith(label) for line in text.splitlines()), label
    assert "warnings        none" in text or "warning: " in text


def test_a_folder_that_cannot_be_made_fails_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--nvme-dir", "/proc/zeroinf-env-test"]) == 1
    assert "nvme_dir '/proc/zeroinf-env-test' cannot be created" in capsys.readouterr().out


def _found(**changes: Any) -> dict[str, Any]:
    found = env_report.report()
    for path, value in changes.items():
        section, key = path.split("__")
        found[section][key] = value
    return found


def test_warnings_name_the_fix() -> None:
    gpu = [{"index": 0, "name": "GPU", "memory_bytes": 80 * 2**30, "capability": "9.0", "bf16": True}]
    found = _found(memory__locked_limit_bytes=64 * 2**10, memory__shm_bytes=64 * 2**20)
    found["accelerators"] = gpu
    said = " | ".join(env_report.warnings(found))
    assert "ulimit -l unlimited" in said and "--shm-size" in said
    found = _found(cpu__native_bf16=False)
    found["accelerators"] = []
    assert any("param_dtype='fp32'" in w for w in env_report.warnings(found))
    found = _found(distributed__backends=["gloo"])
    found["accelerators"] = gpu
    assert any("no NCCL" in w for w in env_report.warnings(found))
    found["nvme_dir"] = {"path": "/mnt/x", "problem": None, "o_direct": False, "filesystem": "nfs"}
    assert any("does not take O_DIRECT" in w and "(nfs)" in w for w in env_report.warnings(found))
