"""Regression: a resealed trace whose ``running_kept`` holds 200,000 values was
refused with a single line of about 600 KB (every value printed); the line now
shows the first four and the count."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main
from tests.test_tamper import edited


def _rows_of_step_1(rows):
    return next(i for i, r in enumerate(rows) if r["kind"] == "schedule_begin" and r["step"] == 1)


def test_regression_a_huge_kept_list_is_refused_in_a_short_line(tmp_path: Path) -> None:
    def edit(rows):
        rows[_rows_of_step_1(rows)]["running_kept"] = [0, 1] * 100_000

    trace = edited(tmp_path, "kept-many", edit)
    result = CliRunner().invoke(main, ["check", str(trace)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: {trace}: bad row: step 1 event 0: running_kept [0, 1, 0, 1, ... "
                                     f"(200000 values)] is not a slice of the previous running (1 ids)")
