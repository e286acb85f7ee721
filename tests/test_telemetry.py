"""Logging like a library: nothing configured at import, the application's config applies, and the
`zeroinf` command's own handler shows INFO from rank 0 only unless asked (ZEROINF_LOG_ALL_RANKS)."""

from __future__ import annotations

import io
import logging
import subprocess
import sys

import pytest

from tests._launch import rank_env
from zeroinf.telemetry import ALL_RANKS_ENV, configure_cli_logging, get_logger


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter: pytest's own logging setup would hide what an import does."""
    return subprocess.run(
        [sys.executable, "-c", code], env=rank_env(env), capture_output=True, text=True, timeout=120, check=True
    )


def test_import_configures_nothing() -> None:
    out = run_python(
        "import logging\n"
        "import zeroinf\n"
        "log = logging.getLogger('zeroinf')\n"
        "print([type(h).__name__ for h in log.handlers], log.propagate, log.level, logging.getLogger().handlers)\n"
    )
    assert out.stdout.strip() == "['NullHandler'] True 0 []"


def test_the_applications_logging_config_applies() -> None:
    out = run_python(
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='APP %(name)s %(levelname)s %(message)s')\n"
        "import zeroinf\n"
        "from zeroinf.telemetry import get_logger\n"
        "get_logger().info('hello')\n"
        "get_logger('tiers').warning('careful')\n"
    )
    assert out.stdout.splitlines() == ["APP zeroinf INFO hello", "APP zeroinf.tiers WARNING careful"]
    assert out.stderr == ""  # no second copy through a handler of our own


def cli_lines(monkeypatch: pytest.MonkeyPatch, rank: int, all_ranks: str | None) -> list[str]:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    if all_ranks is None:
        monkeypatch.delenv(ALL_RANKS_ENV, raising=False)
    else:
        monkeypatch.setenv(ALL_RANKS_ENV, all_ranks)
    stream = io.StringIO()
    logger = get_logger()
    level = logger.level
    handler = configure_cli_logging(stream=stream)
    try:
        get_logger().info("a notice")
        get_logger("aio").warning("a warning")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return stream.getvalue().splitlines()


def test_cli_shows_info_from_rank_0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_lines(monkeypatch, 0, None) == [
        "[zeroinf rank 0] INFO a notice",
        "[zeroinf rank 0] WARNING a warning",
    ]
    assert cli_lines(monkeypatch, 1, None) == ["[zeroinf rank 1] WARNING a warning"]
    assert cli_lines(monkeypatch, 1, "0") == ["[zeroinf rank 1] WARNING a warning"]


def test_cli_shows_info_from_every_rank_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_lines(monkeypatch, 1, "1") == [
        "[zeroinf rank 1] INFO a notice",
        "[zeroinf rank 1] WARNING a warning",
    ]


def test_cli_configures_one_handler_however_often_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("zeroinf")
    before = list(logger.handlers)
    level = logger.level
    try:
        first = configure_cli_logging(stream=io.StringIO())
        second = configure_cli_logging(stream=io.StringIO())
        assert first not in logger.handlers and logger.handlers.count(second) == 1
    finally:
        logger.removeHandler(second)
        logger.setLevel(level)
    assert logger.handlers == before
