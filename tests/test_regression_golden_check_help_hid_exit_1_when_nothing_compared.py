"""Regression (new-user trial): `harness golden check --hybrid --candidate vllm@0.33.0` printed
"0 ok, 2 skipped, 0 failed ... nothing was compared" and exited 1 (issue 17: no verdict is not a
pass), while `--help` said "Exit 0 all ok, 1 any failure". The help names the case."""

from __future__ import annotations

from click.testing import CliRunner

from harness.cli import main


def test_regression_golden_check_help_hid_exit_1_when_nothing_compared() -> None:
    r = CliRunner().invoke(main, ["golden", "check", "--help"], terminal_width=200)
    assert r.exit_code == 0
    assert ("Exit 0 all ok, 1 any failure or nothing compared (the candidate refused every golden's config: "
            "each one skipped), 2 unusable folder or manifest, or an unknown --semantics.") in " ".join(r.output.split())


def test_regression_golden_check_help_example_was_wrong() -> None:
    """A trial: the help's example "--hybrid on a vllm@ candidate" refuses every
    golden, yet `golden check --hybrid --candidate vllm@0.33.0` gives 3 ok (the
    vLLM candidates drive hybrid configs now): the help names no such example."""
    r = CliRunner().invoke(main, ["golden", "check", "--help"], terminal_width=200)
    assert "--hybrid on a" not in " ".join(r.output.split())
