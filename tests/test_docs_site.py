"""The documentation stays usable: the site builds strictly, the README stays a
front door, and no relative link is broken.

- ``mkdocs build --strict`` (mkdocs.yml at the root; the reference pages are
  generated from the code by docs/gen_reference.py at every build) into a
  temporary folder: a broken link, a missing page, a page left out of the nav
  or a bad anchor fails. Skipped, saying so, where mkdocs is not installed
  (``pip install -e '.[docs]'``; the ``test`` extra pulls it in).
- README.md: at most 250 lines, no machine paths or machine details, and it
  names the command CI runs (``make test``, called by .ci/run).
- Every relative link in README.md and docs/ resolves to a file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) and ![alt](target); the target up to a space or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def _relative_links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file, code blocks and inline code left out."""
    text = _FENCE.sub("", path.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = [t for t in _LINK.findall(text)]
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", t)]


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' "
                                         "(the test extra pulls it in)")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material prints a notice about its successor
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                             "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout[-2000:]
    # The generated reference pages are in the site, rendered from the code.
    from harness.check.invariants import INVARIANTS
    from harness.trace.schema import COLUMNS

    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "harness record" in cli and "--step-timeout" in cli
    catalogue = (site / "reference" / "invariants" / "index.html").read_text()
    assert all(inv_id in catalogue for inv_id in INVARIANTS)
    schema = (site / "reference" / "trace-schema" / "index.html").read_text()
    assert all(f"<code>{c}</code>" in schema for c in COLUMNS)
    assert "arrival_step" in (site / "reference" / "scenario-schema" / "index.html").read_text()


def test_the_generated_pages_come_from_the_code(tmp_path: Path) -> None:
    """The generator run as a script (no mkdocs needed) writes the four pages."""
    result = subprocess.run([sys.executable, str(DOCS / "gen_reference.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    from harness.check.invariants import INVARIANTS
    from harness.check.result import LAYERS

    catalogue = (tmp_path / "reference" / "invariants.md").read_text()
    assert [line[4:] for line in catalogue.splitlines() if line.startswith("### ")] == [
        i for layer in LAYERS for i, inv in INVARIANTS.items() if inv.layer == layer]
    for layer in LAYERS:
        assert f"## {layer.capitalize()} layer" in catalogue
    cli = (tmp_path / "reference" / "cli.md").read_text()
    assert "## `harness golden check`" in cli and "## `harness scenario extract`" in cli
    assert "## `harness convert`" in cli  # a vLLM recording into a trace (harness/convert_cli.py)
    # Nothing generated is committed under docs/: the build always renders the code's pages.
    for uri in ("cli.md", "invariants.md", "trace-schema.md", "scenario-schema.md"):
        assert not (DOCS / "reference" / uri).exists(), f"docs/reference/{uri} is generated; do not commit it"


def test_the_readme_is_a_front_door() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250: the rest lives in docs/)"
    for needle in ("/work/", "/home/", "/root/", "/tmp/"):
        assert needle not in text, f"README.md names a machine path ({needle})"
    assert "load average" not in text.lower(), "README.md gives machine details (load average)"
    assert "make test" in text, "README.md must say the test command CI runs (make test, via .ci/run)"
    for heading in ("## Quick start", "## Check your scheduler"):
        assert heading in text, heading
    # Check your scheduler comes right after Quick start.
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[headings.index("## Quick start") + 1] == "## Check your scheduler"


def _generated() -> set[Path]:
    """The pages docs/gen_reference.py renders at build time (no file under docs/)."""
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {(DOCS / uri).resolve() for uri in module.PAGES}


def test_no_machine_paths_or_machine_details_in_the_docs() -> None:
    """The pages describe the project, not the machine a figure was taken on."""
    found = []
    for path in _markdown_files():
        text = path.read_text()
        for needle in ("/work/", "/home/", "/root/", "load average", "2-core machine"):
            if needle in text.lower():
                found.append(f"{path.relative_to(ROOT)}: {needle}")
    assert found == []


def test_every_relative_link_resolves() -> None:
    generated, broken = _generated(), []
    for path in _markdown_files():
        for target in _relative_links(path):
            file = target.split("#", 1)[0]
            if path == README and (path.parent / file).resolve() in generated:
                broken.append(f"README.md: {target} is generated at build time: not a file on GitHub")
            elif file and not (path.parent / file).exists() and (path.parent / file).resolve() not in generated:
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


def test_the_link_scan_finds_links(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("see [a](a.md), [b](sub/b.md#x), ![img](p.png), [web](https://x.org), [top](#t)\n"
                   "```\n[not](code.md)\n```\n`[nor](inline.md)`\n")
    assert _relative_links(doc) == ["a.md", "sub/b.md#x", "p.png"]
