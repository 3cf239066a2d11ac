"""Regression (trial): docs/tutorials/write-a-scenario.md showed
``wrote out/a.toml: 1 requests, 1 warning(s)`` where the tool prints
``1 request, 1 warning``. The tutorial's extract session is run here, in its
own folder, and its output lines must be the tool's, exactly."""

from __future__ import annotations

import shlex
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "tutorials" / "write-a-scenario.md"


def _session() -> list[str]:
    """The fenced block holding ``harness scenario extract``: its lines."""
    blocks = DOC.read_text().split("```")
    (block,) = [b for b in blocks[1::2] if "$ harness scenario extract" in b]
    return block.strip("\n").splitlines()


def test_regression_docs_extract_said_1_requests(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "traces").symlink_to(ROOT / "traces")
    shown: list[str] = []
    printed: list[str] = []
    for line in _session():
        if line.startswith("$ harness "):
            r = CliRunner().invoke(main, shlex.split(line[len("$ harness "):]))
            assert r.exit_code == 0, r.output
            if not line.startswith("$ harness record "):  # the tutorial leaves record's line out
                printed += r.stderr.splitlines() + r.stdout.splitlines()
        else:
            shown.append(line)
    assert shown == printed
    assert shown[-1] == "wrote out/a.toml: 1 request, 1 warning"
