"""Regression (adversarial trial): a trace whose file name is not valid UTF-8
(``bad\\xffname.parquet``) was refused as "unreadable trace (UnicodeEncodeError
...)" by check, replay and diff: pyarrow encodes a path as UTF-8. Such a file
is now read like any other (``harness.paths.arrow_source``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "fcfs-tight.parquet"


def test_regression_a_non_utf8_file_name_checks_and_replays(tmp_path: Path) -> None:
    bad = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/bad\xffname.parquet"))
    shutil.copy(GOLDEN, bad)
    check = CliRunner().invoke(main, ["check", str(bad)])
    assert check.exit_code == 0, check.output
    assert check.output.splitlines()[-1] == "conformant (profile 0.33.0)"
    replay = CliRunner().invoke(main, ["replay", str(bad)])
    assert replay.exit_code == 0, replay.output
    assert replay.output.splitlines()[-1] == "conformant (profile 0.33.0): 392 steps replayed, identical decisions"
    diff = CliRunner().invoke(main, ["diff", str(bad), str(GOLDEN)])
    assert diff.exit_code == 0, diff.output


def test_regression_a_non_utf8_output_name_is_refused_before_any_work(tmp_path: Path) -> None:
    """``record -o out\\xff/x.parquet`` ended after its work with a bare
    UnicodeEncodeError and left the folder behind; it is one line, exit 2,
    nothing made."""
    out = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/out\xff/x.parquet"))
    scenario = Path(__file__).resolve().parents[1] / "traces" / "scenarios" / "stop-token.toml"
    result = CliRunner().invoke(main, ["record", str(scenario), "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [
        f"error: {tmp_path}/out\\xff/x.parquet: -o names a path that is not valid UTF-8; choose a UTF-8 name "
        "(such a file can be read, not written)"]
    assert list(tmp_path.iterdir()) == []
