"""Regression (new-user trial): `harness golden check --hybrid --candidate vllm@0.33.0` printed
"0 ok, 2 skipped, 0 failed ... nothing was compared" and exited 1 (issue 17: no verdict is not a
pass), while `--help` said "Exit 0 all ok, 1 any failure". The help names the case."""

from __future__ import annotations

from click.testing import CliRunner

from harness.cli import main


def test_regression_golden_check_help_hid_exit_1_when_nothing_compared() -> None:
    r = CliRunner().invoke(main, ["golden", "check", "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert "1 any failure or nothing compared (the candidate refused every golden" in " ".join(r.output.split())
