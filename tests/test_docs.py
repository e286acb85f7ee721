"""Generated docs stay in sync with the code they are generated from."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from zeroinf.config import Config, LossScaleConfig, OffloadConfig, config_markdown, field_docs

DOCS = Path(__file__).resolve().parents[1] / "docs"
REGENERATE = "regenerate it with: PYTHONPATH=src python -m zeroinf.config --markdown > docs/config.md"


def test_config_md_is_up_to_date() -> None:
    path = DOCS / "config.md"
    assert path.is_file(), f"{path} is missing; {REGENERATE}"
    # `print` adds one newline after the generated text; trailing newlines are not content.
    text = path.read_text()
    assert text.rstrip("\n") == config_markdown().rstrip("\n"), f"docs/config.md is stale; {REGENERATE}"


@pytest.mark.parametrize("cls", [Config, LossScaleConfig, OffloadConfig], ids=lambda c: c.__name__)
def test_every_config_field_has_a_docstring(cls: type) -> None:
    docs = field_docs(cls)
    undocumented = [f.name for f in fields(cls) if not docs.get(f.name, "").strip()]
    assert not undocumented, f"{cls.__name__} fields without a docstring under them: {undocumented}"


def test_every_config_field_appears_in_the_markdown() -> None:
    text = config_markdown()
    for cls in (Config, LossScaleConfig, OffloadConfig):
        for f in fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name} missing from the reference"
