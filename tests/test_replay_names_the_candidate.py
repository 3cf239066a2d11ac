"""Regression (a new user's trial): `harness replay --candidate SPEC` printed
the trace's engine (what recorded it) but never the candidate it re-drove;
only --json had it."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fcfs-tight.parquet"


def test_regression_replay_report_names_the_candidate() -> None:
    result = CliRunner().invoke(main, ["replay", str(GOLDEN), "--candidate", "mutant:budget-overrun"])
    lines = [line.split(None, 1) for line in result.stdout.splitlines()[:3]]  # (a hint goes to stderr)
    assert [parts[0] for parts in lines] == ["trace", "engine", "candidate"]
    assert lines[1][1].strip() == "reference" and lines[2][1].strip() == "mutant:budget-overrun"
