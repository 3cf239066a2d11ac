"""Regressions (adversarial trial) of ``harness vllm-tests -o DIR``:

* ``-o`` under a file ended, after the sdist was prepared, on
  ``error: NotADirectoryError: ...``; now one line naming the path, exit 2,
  before anything is fetched or run.
* A previous run's recordings were cleared by unlinking every entry of
  ``DIR/recordings``: a folder of one's own lost its files there (a
  subfolder ended the run with a traceback). Only the recorder's names go.
"""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main
from harness.vllm_tests_cli import clear_stale_recordings


def test_regression_vllm_tests_output_under_a_file_refused_up_front(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    r = CliRunner().invoke(main, ["vllm-tests", "0.33.0", "-o", str(a_file / "out")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: {a_file / 'out'}: {a_file} is not a folder"]
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "recordings").write_text("mine")
    r = CliRunner().invoke(main, ["vllm-tests", "0.33.0", "-o", str(tmp_path / "out")])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [
        f"error: {tmp_path / 'out' / 'recordings'}: -o names a file, not a folder (this command writes its "
        f"files into a folder)"]


def test_regression_stale_recordings_cleared_every_file_in_the_folder(tmp_path: Path) -> None:
    rec = tmp_path / "recordings"
    rec.mkdir()
    for name in ("00000.jsonl", "00001.dp1.jsonl", "manifest.jsonl", "notes.txt", "1.jsonl"):
        (rec / name).write_text("x")
    (rec / "sub").mkdir()
    assert clear_stale_recordings(rec) == ["00000.jsonl", "00001.dp1.jsonl", "manifest.jsonl"]
    assert sorted(p.name for p in rec.iterdir()) == ["1.jsonl", "notes.txt", "sub"]
    assert clear_stale_recordings(tmp_path / "none") == []
