"""Regression: ``harness report -o``, ``harness export --perfetto -o`` and
``--report FILE`` of check/replay/diff did not use the trace writers' output
check: a FIFO (or, as root, ``/dev/full``) was replaced by a regular file and
``check T.parquet --report T.parquet`` overwrote the trace with HTML, exit 0."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize("args", [
    ("report", str(GOLDEN), "-o"),
    ("export", str(GOLDEN), "--perfetto", "-o"),
    ("check", str(GOLDEN), "--report"),
    ("replay", str(GOLDEN), "--report"),
    ("diff", str(GOLDEN), str(GOLDEN), "--report"),
])
def test_regression_report_output_refuses_a_fifo(tmp_path: Path, args) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out = run(*args, str(fifo))
    assert code == 2, out
    # The option that named it (was always "-o", trial finding).
    assert out.strip().splitlines() == [f"error: {fifo}: {args[-1]} names a FIFO, not a regular file; refusing to "
                                        f"replace it"]
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.parametrize("command", [("check",), ("replay",)])
def test_regression_report_flag_refuses_the_input_trace(tmp_path: Path, command) -> None:
    trace = tmp_path / "t.parquet"
    shutil.copy(GOLDEN, trace)
    before = trace.read_bytes()
    code, out = run(*command, str(trace), "--report", str(trace))
    assert code == 2, out
    assert out.strip() == f"error: {trace}: the output names the input trace {trace}; it would be overwritten"
    assert trace.read_bytes() == before


def test_regression_diff_report_refuses_the_second_trace(tmp_path: Path) -> None:
    trace = tmp_path / "t.parquet"
    shutil.copy(GOLDEN, trace)
    code, out = run("diff", str(GOLDEN), str(trace), "--report", str(trace))
    assert code == 2, out
    assert trace.read_bytes() == GOLDEN.read_bytes()
