"""Crash salvage (issue 17): a `harness record` killed with SIGKILL leaves its
temporary folder of complete segments; `harness salvage` makes a trace of
them that check and replay accept (with a note), cut at its last step.

Regression: a killed record left a temp file with no footer that no reader
could open (0 of 10 readable).
"""

from __future__ import annotations

from reference.words import plural

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

from harness.cli import main
from harness.trace import SUMMARY_KEY, open_trace
from harness.trace.salvage import salvage


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def _killed_record(tmp_path: Path, segments: int = 2) -> tuple[Path, Path]:
    """Start `harness record synthetic:4000` and SIGKILL it once its temp
    folder holds ``segments`` complete segments; (folder, -o path)."""
    out = tmp_path / "killed.parquet"
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "record", "synthetic:4000", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            folders = list(tmp_path.glob(".killed.parquet.*.tmp"))
            if folders and len(list(folders[0].glob("seg-*.parquet"))) >= segments:
                break
            assert proc.poll() is None, "record ended before it could be killed"
            time.sleep(0.05)
        else:
            raise AssertionError("no segments written in time")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    return folders[0], out


def test_a_sigkilled_record_is_salvaged_whole_row_groups_and_checks(tmp_path: Path) -> None:
    folder, out = _killed_record(tmp_path)
    assert not out.exists()  # the final path is never partial
    code, output = run("check", folder)
    assert code == 2 and f"a killed recording's segments: `harness salvage {folder} -o TRACE.parquet`" in output
    kept = sorted(folder.glob("seg-*.parquet"))
    rows = sum(pq.ParquetFile(p).metadata.num_rows for p in kept)
    steps = len({s for p in kept for s in pq.read_table(p, columns=["step"]).column("step").to_pylist()})
    salvaged = tmp_path / "salvaged.parquet"
    code, output = run("salvage", folder, "-o", salvaged)
    assert code == 0, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(f"salvaged {salvaged}: {steps} steps, {rows} events from {len(kept)} row group{'s' * (len(kept) != 1)}")
    trace = open_trace(salvaged)  # schema 7, digest verified
    assert trace.summary["steps"] == steps and trace.num_rows == rows
    assert trace.summary["salvaged"].startswith(f"salvaged from a run cut off after step {steps - 1}:")
    assert pq.ParquetFile(salvaged).metadata.num_row_groups == len(kept)
    code, output = run("check", "--json", salvaged)
    report = json.loads(output)
    # Issue 26: half a run never passes as a whole one: exit 3, its own verdict.
    assert code == 3 and not report["ok"] and report["steps"] == steps, output
    assert report["incomplete"] == trace.summary["salvaged"] and report["sealed"]
    assert any("LIVENESS and the end-of-trace checks not run" in n for n in report["notes"])
    code, output = run("replay", salvaged)
    assert code == 3 and output.strip().splitlines()[-1] == \
        (f"incomplete run (exit 3): no violation in the {steps} steps it has (profile 0.33.0): "
         f"{trace.summary['salvaged']}; {plural(steps, 'step')} replayed, identical decisions"), output
    code, output = run("replay", salvaged, "--allow-incomplete")
    assert code == 0, output


def test_salvage_refuses_what_is_not_a_writers_folder(tmp_path: Path) -> None:
    code, output = run("salvage", tmp_path, "-o", tmp_path / "x.parquet")
    assert code == 2 and "no complete segment to salvage" in output and len(output.strip().splitlines()) == 1
    code, output = run("salvage", tmp_path / "nope", "-o", tmp_path / "x.parquet")
    assert code == 2 and "not a folder" in output
    assert not (tmp_path / "x.parquet").exists()


def test_segments_are_complete_files_while_recording(tmp_path: Path) -> None:
    """The writer's segments are footed Parquet files of whole steps: the
    salvage of a folder in which only the first was written keeps exactly
    its steps."""
    from harness.trace.writer import TraceWriter
    writer = TraceWriter(tmp_path / "t.parquet", {"engine": "x"}, rows_per_group=2)
    rows = [{"step": 0, "event_index": 0, "kind": "update_end", "rank": 0},
            {"step": 0, "event_index": 1, "kind": "update_end", "rank": 0}]
    writer.add_step(rows)
    segments = sorted(writer.temp_dir.glob("seg-*.parquet"))
    assert [p.name for p in segments] == ["seg-000000.parquet"]
    assert pq.ParquetFile(segments[0]).metadata.num_rows == 2
    result = salvage(writer.temp_dir, tmp_path / "s.parquet")
    assert (result.steps, result.events, result.segments, result.last_step) == (1, 2, 1, 0)
    summary = json.loads(pq.ParquetFile(tmp_path / "s.parquet").metadata.metadata[SUMMARY_KEY])
    assert (summary["steps"], summary["events"]) == (1, 2)
    writer.abort()
    assert not writer.temp_dir.exists()


def _left_folder(parent: Path, steps: int = 20) -> Path:
    """The temporary folder a killed ``harness record -o parent/rec.parquet``
    leaves (as the writer names it), holding the first ``steps`` steps of an
    example trace as two-step segments."""
    import shutil

    from harness.trace import METADATA_KEY
    from harness.trace.writer import TraceWriter

    source = Path(__file__).resolve().parents[1] / "traces" / "preemption-heavy.parquet"
    meta = json.loads(pq.ParquetFile(source).metadata.metadata[METADATA_KEY])
    writer = TraceWriter(parent / "scratch.parquet", meta, rows_per_group=1)
    for step, rows in open_trace(source).iter_steps():  # decoded rows, as the recorder hands them
        if step == steps:
            break
        writer.add_step(rows)
    folder = parent / ".rec.parquet.0123456789abcdef.tmp"
    shutil.copytree(writer.temp_dir, folder)
    writer.abort()
    return folder


def test_regression_salvaged_temp_folder_made_folder_check_exit_2(tmp_path: Path) -> None:
    """Trial finding: after `harness salvage`, the killed recording's temporary
    folder stayed, so `harness check` of the folder above it kept reporting it
    (exit 2). Salvage removes it once the trace is in place; the folder check
    then sees the salvaged trace alone (exit 3: an incomplete run)."""
    folder = _left_folder(tmp_path)
    code, output = run("check", tmp_path)
    assert code == 2 and f"harness salvage {folder} -o TRACE.parquet" in output, output
    code, output = run("salvage", folder, "-o", tmp_path / "rec.parquet")
    assert code == 0 and output.strip().splitlines()[-1] == (
        f"salvaged {tmp_path / 'rec.parquet'}: 20 steps, 176 events from 20 row groups, up to step 19; "
        f"removed {folder}"), output
    assert not folder.exists() and [p.name for p in tmp_path.iterdir()] == ["rec.parquet"]
    code, output = run("check", tmp_path)
    assert code == 3, output
    assert output.strip().splitlines()[-1].startswith("incomplete run (exit 3): no violation in the 20 steps"), output


def test_salvage_keeps_a_folder_holding_anything_else(tmp_path: Path) -> None:
    """Nothing of anyone else's is removed: a foreign file keeps the folder, named in a warning."""
    folder = _left_folder(tmp_path, steps=4)
    (folder / "notes.txt").write_text("mine")
    code, output = run("salvage", folder, "-o", tmp_path / "rec.parquet")
    assert code == 0 and (folder / "notes.txt").exists() and len(list(folder.glob("seg-*.parquet"))) == 4
    assert f"warning: kept {folder}: it holds 'notes.txt', not the recording's; remove it when done " \
           "(`harness check` of a folder above it reports it)" in " ".join(output.split()), output
