"""Regression (adversarial trial): ``-o x.parquet/`` (a trailing slash, a
folder's name) was accepted where a file is meant (pathlib drops the slash).
Refused with one line, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.paths import OutputPathError, check_output_file

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "golden" / "fcfs-tight.parquet"


@pytest.mark.parametrize("suffix", ["/", "/.", "/.."])
def test_regression_output_with_trailing_slash_is_refused(tmp_path: Path, suffix: str) -> None:
    out = f"{tmp_path / 'x.parquet'}{suffix}"
    with pytest.raises(OutputPathError) as info:
        check_output_file(out)
    assert str(info.value) == (f"{out}: -o names a folder (the path ends in '/'), not a file; "
                               f"drop the '/' or name a file in it")


@pytest.mark.parametrize("command", [
    ["record", "synthetic:3"],
    ["scenario", "extract", str(TRACE), "--steps", "0:5"],
    ["export", str(TRACE), "--perfetto"],
    ["report", str(TRACE)],
])
def test_regression_commands_refuse_a_trailing_slash_output(tmp_path: Path, command: list[str]) -> None:
    out = f"{tmp_path / 'x.parquet'}/"
    r = CliRunner().invoke(main, [*command, "-o", out])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        f"error: {out}: -o names a folder (the path ends in '/'), not a file; drop the '/' or name a file in it"]
    assert list(tmp_path.iterdir()) == []
