"""The docs describe the code as it is: generated where they can be, short where they are read
first, and every page they name exists."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dflash.config.doc import render

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 12_000
"""Characters: a guide a newcomer reads top to bottom; the details live in docs/."""


def tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    return [ROOT / line for line in out.splitlines() if (ROOT / line).is_file()]


def test_configuration_page_is_generated_from_the_params():
    page = ROOT / "docs/configuration.md"
    assert page.read_text() == render(), (
        "docs/configuration.md is stale: python -m dflash.config.doc docs/configuration.md"
    )


def test_every_param_says_what_it_does():
    from dflash.config.schema import Config

    missing = [
        f"{section}.{name}"
        for section, field in Config.model_fields.items()
        for name, info in field.annotation.model_fields.items()
        if not (info.description or "").strip()
    ]
    assert not missing, f"params without a docstring in dflash/config/schema.py: {missing}"


def test_readme_is_a_short_guide():
    assert len((ROOT / "README.md").read_text()) <= README_LIMIT


def test_every_markdown_file_named_exists():
    named = re.compile(r"(?<![\w/.-])((?:docs/)?[A-Za-z0-9_-]+\.md)\b")
    missing = set()
    for path in tracked("*.py", "*.md", "*.yaml", "Makefile", "*.toml"):
        for name in named.findall(path.read_text(errors="replace")):
            if name == "README.md":
                continue  # every directory has its own, and exports write one
            if not ((ROOT / name).is_file() or (path.parent / name).is_file()):
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)


def test_no_development_history_in_the_tree():
    words = re.compile(r"\bstop \d+\b|\bstops \d+|seed-?like|\bthe seed[s]\b", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in tracked("*.py", "*.md", "*.yaml", "*.sh", "Makefile")
        if path.name != "CHANGELOG.md" and path != Path(__file__).resolve()
        for m in words.finditer(path.read_text(errors="replace"))
    ]
    assert not found, found
