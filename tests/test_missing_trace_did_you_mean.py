"""Regression (adversarial trial): a missing trace in check, replay or diff
said "no such file" without the close name beside it (record's workloads
and scenarios had a did-you-mean; traces had none)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "golden" / "fcfs-tight.parquet"


@pytest.mark.parametrize("command", [["check"], ["replay"], ["diff", str(GOLDEN)]])
def test_regression_missing_trace_names_a_close_file(tmp_path: Path, command: list[str]) -> None:
    (tmp_path / "fcfs-tight.parquet").write_bytes(GOLDEN.read_bytes())
    typo = tmp_path / "fcfs-tigth.parquet"
    r = CliRunner().invoke(main, [*command, str(typo)])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: {typo}: no such file; did you mean 'fcfs-tight.parquet'?"]
    far = tmp_path / "zzz.parquet"
    r = CliRunner().invoke(main, [*command, str(far)])
    assert r.output.strip().splitlines() == [f"error: {far}: no such file"]
