"""mypy reports no errors in src (the settings of pyproject.toml's [tool.mypy], unused
`type: ignore`s included). The test extra pins mypy's version, so a new mypy release cannot turn a
passing tree into a failing one; raise the pin and fix what it reports together.

mypy keeps its incremental cache in zeroinf's cache folder (`planner.profile.cache_dir()`, where
the machine profile lives: ~/.cache/zeroinf; one folder per mypy and Python version), not in the
checkout: a fresh clone on a machine that ran the suite before checks in about 5 s instead of 45 s
cold on 2 cores. mypy revalidates every cached module against its source's hash, so an edited file
is checked again; ZEROINF_MYPY_CACHE=off checks cold in a temporary folder. It runs in a child
process (`python -m mypy`, what `mypy.api.run` calls) rather than through `mypy.api.run` in this
one: in process, the 1.6 GB of type information it builds would stay in the test worker (raising
the peak RSS that memory tests measure), and freeing it when the worker exits takes about 25 s
more."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def mypy_cache_dir(tmp_path: Path) -> Path:
    from mypy.version import __version__

    from zeroinf.planner.profile import cache_dir

    if os.environ.get("ZEROINF_MYPY_CACHE") == "off":
        return tmp_path / "mypy_cache"
    return cache_dir() / f"mypy-{__version__}-py{platform.python_version()}"


def test_mypy_reports_no_errors_in_src(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    result = subprocess.run(
        [
            sys.executable, "-m", "mypy",
            "--config-file", str(ROOT / "pyproject.toml"),
            "--cache-dir", str(mypy_cache_dir(tmp_path)),
            str(ROOT / "src"),
        ],
        capture_output=True, text=True, timeout=600, check=False,
    )
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"mypy found errors (exit status {result.returncode}):\n{report}"
