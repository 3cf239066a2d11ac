"""Regression (new-user trial): a bare group (``harness``, ``harness golden``)
printed its whole help flattened into one ``error: Usage: ...`` line of about
1,500 characters; it prints the help as ``--help`` does (exit 2, as click)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.cli import main


@pytest.mark.parametrize("args, first", [([], "Usage: harness [OPTIONS] COMMAND [ARGS]..."),
                                         (["golden"], "Usage: harness golden [OPTIONS] COMMAND [ARGS]...")])
def test_regression_a_bare_group_prints_its_help(args: list[str], first: str) -> None:
    result = CliRunner().invoke(main, args, prog_name="harness")
    assert result.exit_code == 2
    lines = result.stderr.splitlines()
    assert lines[0] == first
    assert "Commands:" in lines and not any(line.startswith("error:") for line in lines)
