"""Regression: ``harness export DIR/steps.parquet --tables DIR`` overwrote the
input trace with the ``steps`` table (exit 0), and a FIFO named like a table
in DIR was replaced: the table paths were never checked."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "fcfs-tight.parquet"


def test_regression_export_tables_refuses_to_overwrite_the_input(tmp_path: Path) -> None:
    trace = tmp_path / "steps.parquet"
    shutil.copy(GOLDEN, trace)
    result = CliRunner().invoke(main, ["export", str(trace), "--tables", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {trace}: the output names the input trace {trace}; it would be overwritten"
    assert trace.read_bytes() == GOLDEN.read_bytes()
    assert not (tmp_path / "scheduled.parquet").exists()


def test_regression_export_tables_refuses_a_fifo(tmp_path: Path) -> None:
    fifo = tmp_path / "requests.parquet"
    os.mkfifo(fifo)
    result = CliRunner().invoke(main, ["export", str(GOLDEN), "--tables", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {fifo}: --tables names a FIFO, not a regular file; refusing to replace it"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert not (tmp_path / "steps.parquet").exists()
