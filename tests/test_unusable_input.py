"""Unusable input is one line and exit 2, never a traceback (issue 17).

Each row is a finding of the issue's adversarial run: the command, and the
exact line it must now print (``{tmp}`` is the test's folder). Nothing may be
left behind: no trace, no temp file, and an existing file or device named by
``-o`` keeps its bytes.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace.schema import METADATA_KEY, SUMMARY_KEY
from harness.trace.writer import reseal

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"


def run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _key(k) -> bytes:
    return k if isinstance(k, bytes) else k.encode()


def _rewrite(src: Path, dst: Path, *, meta=None, column=None) -> None:
    """Copy trace ``src`` to ``dst`` with its metadata changed by ``meta(dict)``
    or one column's values by ``column = (name, fn(list) -> list)``, keeping the footer,
    resealed (a fresh digest: a deliberate edit, so the row checks are what refuse it)."""
    table = pq.read_table(src)
    if meta is not None:
        md = dict(table.schema.metadata)
        md[_key(METADATA_KEY)] = json.dumps(meta(json.loads(md[_key(METADATA_KEY)]))).encode()
        table = table.replace_schema_metadata(md)
    if column is not None:
        name, fn = column
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, pa.array(fn(table.column(name).to_pylist()), table.schema.field(name).type))
    footer = pq.ParquetFile(src).metadata.metadata[_key(SUMMARY_KEY)].decode()
    edited = dst.with_name(dst.name + ".edited")
    with pq.ParquetWriter(edited, table.schema) as writer:
        writer.write_table(table)
        writer.add_key_value_metadata({SUMMARY_KEY: footer})
    reseal(edited, dst)
    edited.unlink()


LONG = "a" * 300
SCENARIO = REPO / "harness/scenarios/fcfs-tight.toml"

RECORD_CASES = [
    # (id, arguments after `record`, the one line on stderr)
    ("o-under-a-file", ["synthetic:3", "-o", "{tmp}/file/x.parquet"], "error: {tmp}/file/x.parquet: {tmp}/file is not a folder"),
    ("o-empty", ["synthetic:3", "-o", ""], "error: -o: the output path is empty"),
    ("o-300-characters", ["synthetic:3", "-o", f"{{tmp}}/{LONG}.parquet"],
     f"error: {{tmp}}/{LONG}.parquet: cannot use as output: File name too long"),
    ("o-dev-full", ["synthetic:3", "-o", "/dev/full"],
     "error: /dev/full: -o names a device, not a regular file; refusing to replace it"),
    ("o-fifo", ["synthetic:3", "-o", "{tmp}/fifo"], "error: {tmp}/fifo: -o names a FIFO, not a regular file; refusing to replace it"),
    ("o-is-the-workload", [str(SCENARIO), "-o", str(SCENARIO)],
     f"error: {SCENARIO}: -o names the input file; it would be overwritten (choose another path)"),
    ("o-unwritable", ["synthetic:3", "-o", "/proc/x.parquet"],
     "error: /proc/x.parquet: cannot write the trace: No such file or directory"),
    ("set-int32", ["synthetic:3", "-o", "{tmp}/t.parquet", "--set", "max_num_batched_tokens=3000000000"],
     "error: bad config: max_num_batched_tokens 3000000000 does not fit the trace's int32 columns (at most 2147483647)"),
    ("scheduled-above-batched", ["synthetic:3", "-o", "{tmp}/t.parquet", "--set", "max_num_scheduled_tokens=9000"],
     "error: bad config: max_num_scheduled_tokens 9000 is above max_num_batched_tokens 2048 (it must be <= it)"),
    ("workload-int32", ["{tmp}/big.toml", "-o", "{tmp}/t.parquet"],
     "error: {tmp}/big.toml:5: requests[0].priority: 3000000000 is greater than the maximum of 2147483647"),
]


@pytest.mark.parametrize("args,line", [c[1:] for c in RECORD_CASES], ids=[c[0] for c in RECORD_CASES])
def test_regression_record_refuses_unusable_input_in_one_line(tmp_path, args, line) -> None:
    """Regression (issue 17): each was a traceback (exit 1), or replaced what -o named."""
    (tmp_path / "file").write_text("keep")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big.toml").write_text('format_version = 1\n[[requests]]\nrequest_id = "A"\nprompt_len = 8\n'
                                       'priority = 3000000000\n')
    before = {p.name for p in tmp_path.iterdir()}
    full = os.stat("/dev/full")
    code, out, err = run("record", *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert (code, err.splitlines()) == (2, [line.replace("{tmp}", str(tmp_path))])
    assert out == ""
    assert {p.name for p in tmp_path.iterdir()} == before and (tmp_path / "file").read_text() == "keep"
    assert os.stat("/dev/full").st_rdev == full.st_rdev and os.stat("/dev/full").st_mode == full.st_mode


def test_regression_a_failure_at_close_time_leaves_no_temp_file(tmp_path, monkeypatch) -> None:
    """Regression (issue 17): a write failing when the footer was written (a full
    file system) left the temp file behind; now one line, exit 2, nothing left."""
    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(pq.ParquetWriter, "close", full)
    code, _, err = run("record", "synthetic:3", "-o", tmp_path / "t.parquet")
    monkeypatch.undo()
    assert (code, err.splitlines()) == (2, [f"error: {tmp_path / 't.parquet'}: cannot write the trace: "
                                            f"No space left on device"])
    assert list(tmp_path.iterdir()) == []


def test_regression_empty_workload_metadata_is_one_line(tmp_path) -> None:
    """Regression (issue 17): `workload: {}` in a trace's metadata was a KeyError traceback in replay."""
    path = tmp_path / "w.parquet"
    _rewrite(GOLDEN, path, meta=lambda m: {**m, "workload": {}})
    code, _, err = run("replay", path)
    assert (code, err.splitlines()) == (2, [f"error: {path}: metadata 'workload' needs a source and a sha256 "
                                            f"(strings) and params (an object), got {{}}"])


def test_regression_replay_refuses_an_arrival_row_request_spec_refuses(tmp_path) -> None:
    """Regression (issue 17): replay rebuilt the workload from arrival rows RequestSpec refuses."""
    path = tmp_path / "a.parquet"
    _rewrite(GOLDEN, path, column=("max_tokens", lambda col: [0 if v == 11 and i == 0 else v
                                                             for i, v in enumerate(col)]))
    code, _, err = run("replay", path)
    assert (code, err.splitlines()) == (2, [f"error: {path}: bad row: step 0 event 0: arrival row is not a "
                                            f"valid request (RequestSpec r000000: max_tokens must be an int >= 1, "
                                            f"got 0)"])


def test_an_unforeseen_exception_is_one_line_exit_2(monkeypatch) -> None:
    """The last resort (harness/signals.py): any exception a command lets out."""
    import harness.cli_common

    def broken(*_a, **_k):
        raise RuntimeError("something\nunforeseen")
    monkeypatch.setattr(harness.cli_common, "check_trace", broken)
    code, _, err = run("check", GOLDEN)
    assert (code, err) == (2, "error: RuntimeError: something unforeseen\n")
