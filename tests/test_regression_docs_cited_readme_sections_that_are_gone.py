"""Regression (new-user trial): docs/trace-format.md sent readers to README sections "Safety
invariants and version semantics" and "Fidelity notes" that the short README no longer has. A
README section cited by name from docs/ or the code must be a heading of README.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITED = re.compile(r'README,? "([^"]+)"')


def test_regression_docs_cited_readme_sections_that_are_gone() -> None:
    headings = {line.lstrip("#").strip() for line in (ROOT / "README.md").read_text().splitlines()
                if line.startswith("## ")}
    missing = []
    for top in ("docs", "harness", "reference"):
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".md", ".py"):
                continue
            text = " ".join(path.read_text().split())  # a citation may wrap
            missing += [f"{path.relative_to(ROOT)}: README \"{name}\"" for name in CITED.findall(text)
                        if name not in headings]
    assert missing == []
