"""Regression (trial): a cold `harness replay/golden check/sweep/bisect` against a
vllm@ candidate, piped (a CI log), printed nothing for minutes while vLLM
imported. The first driver start of each target in a process now says so on
stderr, once, when stderr is no terminal (harness/candidates/vllm/candidate.py
``announce_start``); stdout (--json) stays clean."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness.candidates.vllm.candidate as candidate
from harness.candidates.vllm.spec import release_target

ROOT = Path(__file__).resolve().parents[1]


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.fixture
def notice_on(monkeypatch):
    monkeypatch.setenv("HARNESS_VLLM_START_NOTICE", "1")
    monkeypatch.setattr(candidate, "_ANNOUNCED", set())


def test_regression_piped_vllm_run_said_nothing_for_minutes(notice_on, monkeypatch) -> None:
    piped = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", piped)
    target = release_target("0.33.0")
    candidate.announce_start(target)
    candidate.announce_start(target)  # the second driver (a pool of 2, a data-parallel rank): silent
    candidate.announce_start(release_target("0.29.0"))  # another release: its own line
    assert piped.getvalue() == ("starting vLLM 0.33.0 drivers (about a minute cold)\n"
                                "starting vLLM 0.29.0 drivers (about a minute cold)\n")


def test_no_start_notice_on_a_terminal_or_when_silenced(notice_on, monkeypatch) -> None:
    terminal = _Stream(tty=True)  # the progress bar says it there
    monkeypatch.setattr(sys, "stderr", terminal)
    candidate.announce_start(release_target("0.33.0"))
    assert terminal.getvalue() == ""
    piped = _Stream(tty=False)
    monkeypatch.setattr(sys, "stderr", piped)
    monkeypatch.setattr(candidate, "_ANNOUNCED", set())
    monkeypatch.setenv("HARNESS_VLLM_START_NOTICE", "0")
    candidate.announce_start(release_target("0.33.0"))
    assert piped.getvalue() == ""


@pytest.mark.vllm
def test_piped_vllm_replay_json_says_it_starts_on_stderr_only(tmp_path: Path) -> None:
    """The real command, piped: one notice line on stderr, the JSON alone on stdout."""
    env = {**os.environ, "HARNESS_VLLM_START_NOTICE": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(ROOT / "golden" / "eos-stop-abort.parquet"),
                        "--candidate", "vllm@0.33.0", "--json"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["divergence"] is None
    assert r.stderr.splitlines().count("starting vLLM 0.33.0 drivers (about a minute cold)") == 1
