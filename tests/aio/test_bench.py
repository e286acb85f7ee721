"""`zeroinf bench-io --sweep` prints the `[offload.aio]` lines of its best setting, and they load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeroinf.aio.bench import config_lines
from zeroinf.cli import main
from zeroinf.config import AioConfig, Config


def test_sweep_prints_config_lines_that_load_into_offload_aio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "2MiB", "--sweep", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    best = out["best"]
    assert out["config_lines"] == config_lines(best)
    (tmp_path / "train.toml").write_text("\n".join(out["config_lines"]) + "\n")
    aio = Config.load(tmp_path / "train.toml").offload.aio
    assert aio == AioConfig(block_bytes=best["block_bytes"], queue_depth=best["queue_depth"],
                            workers=best["workers"], o_direct=best["o_direct"])


def test_the_text_sweep_ends_with_the_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench-io", "--dir", str(tmp_path), "--size", "1MiB", "--sweep"]) == 0
    text = capsys.readouterr().out
    lines = text.strip().splitlines()
    tail = lines[lines.index("[offload.aio]"):]
    assert tail[1].startswith("block_bytes = ") and len(tail) in (4, 5)
