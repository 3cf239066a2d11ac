"""Regression (adversarial trial, finding 5): ``golden check`` reported a
candidate raising in the middle of a golden (``tests/forks/raise_mid_run.py``,
step 29) as ``candidate diverges at step 29, event #1 (crash), field
exception: expected 'schedule r000006', got 'candidate raised ...'`` under the
hint to try ``--semantics fork``; ``replay`` said "crashed". Only a crash after
the golden's last row was read as one. Any crash is now a crash, under every
``--semantics``, with no fork hint."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("semantics", ["auto", "fork"])
def test_regression_a_mid_run_crash_is_a_crash_without_a_fork_hint(monkeypatch, semantics: str) -> None:
    from forks import put_on_path

    put_on_path(monkeypatch)
    out = CliRunner().invoke(main, ["golden", "check", "--dir", str(GOLDEN), "--candidate",
                                    "forks.raise_mid_run:make", "--semantics", semantics]).output
    lines = out.splitlines()
    assert lines[0] == ("FAIL fcfs-tight            the candidate raised ValueError in schedule() at step 29: boom "
                        "(at forks/raise_mid_run.py:20) (the golden run did not: schedule r000003 at event #1)"), out
    assert sum(line.startswith("FAIL ") and "the candidate raised ValueError in schedule() at step 29" in line
               for line in lines) == 20, out
    assert not any("diverges" in line or line.startswith("hint:") for line in lines), out
    assert lines[-1] == (f"0 ok, 20 failed ({GOLDEN}, candidate forks.raise_mid_run:make"
                         + (", profile fork)" if semantics == "fork" else ")"))
