"""Tamper evidence (issue 17): every altered trace is refused with one line
(exit 2) or reported with a witness (exit 1), never a traceback, never a
clean verdict.

Schema 7 writes page checksums and a digest of the whole file in the footer
(``trace_sha256``), so any changed byte is refused at open. A *resealed* edit
(``harness.trace.writer.reseal``: the digest recomputed, what a deliberate
editor does) must still meet the row validation of ``harness.trace.validate``
or the invariants: these tests doctor rows, reseal, and assert the exact
outcome. The property test at the end mutates a valid trace at random
(seeded, bounded examples).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.cli import main
from harness.trace import METADATA_KEY, SUMMARY_KEY, TraceError, open_trace
from harness.trace.writer import digest_of_file, reseal

ROOT = Path(__file__).resolve().parents[1]
# 160 steps, 40 requests, 15 preemptions: every common row kind.
SOURCE = ROOT / "traces" / "preemption-heavy.parquet"

Rows = list[dict[str, Any]]


def run(*args: Any) -> tuple[int, str, BaseException | None]:
    """(exit code, output, the exception if it was not a clean exit)."""
    result = CliRunner().invoke(main, [str(a) for a in args])
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.output, exc


def edited(tmp_path: Path, name: str, edit: Callable[[Rows], None], *, seal: bool = True,
           schema: pa.Schema | None = None) -> Path:
    """A copy of SOURCE whose rows ``edit`` changed in place, its metadata and
    footer summary kept; resealed (a fresh digest) unless ``seal`` is False."""
    table = pq.read_table(SOURCE)
    rows = table.to_pylist()
    edit(rows)
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    summary = json.loads(kv[SUMMARY_KEY])
    summary["events"] = len(rows)  # a careful editor keeps the footer's count
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / f"{name}.parquet"
    target = (schema or table.schema)
    pq.write_table(pa.Table.from_pylist(rows, schema=target).replace_schema_metadata(kv), out)
    return reseal(out, out) if seal else out


def first(rows: Rows, kind: str) -> dict[str, Any]:
    return next(r for r in rows if r["kind"] == kind)


def assert_unusable(path: Path, fragment: str, commands: tuple[str, ...] = ("check", "replay")) -> None:
    for command in commands:
        code, out, exc = run(command, path)
        assert exc is None, exc
        assert code == 2, out
        assert len(out.strip().splitlines()) == 1, out
        assert fragment in out, out


# -- the digest and the page checksums --------------------------------------------------
def test_source_trace_carries_a_verified_digest() -> None:
    trace = open_trace(SOURCE)
    assert trace.meta["schema_version"] == 8
    summary = json.loads(pq.ParquetFile(SOURCE).metadata.metadata[SUMMARY_KEY])
    assert trace.digest == summary["trace_sha256"] and len(trace.digest) == 64
    assert "trace_sha256" not in trace.summary  # the run's figures only
    at = SOURCE.read_bytes().index(trace.digest.encode())
    assert digest_of_file(SOURCE, at) == trace.digest


@pytest.mark.parametrize("where", ["data", "footer", "metadata", "last-data-byte"])
def test_a_single_byte_flip_anywhere_is_refused(tmp_path: Path, where: str) -> None:
    data = bytearray(SOURCE.read_bytes())
    footer_len = int.from_bytes(data[-8:-4], "little")
    footer_start = len(data) - 8 - footer_len
    offset = {"data": footer_start // 2, "footer": footer_start + footer_len // 3,
              "metadata": bytes(data).index(b'"seed": 0') + 8, "last-data-byte": footer_start - 1}[where]
    data[offset] ^= 0x01
    path = tmp_path / "flipped.parquet"
    path.write_bytes(bytes(data))
    for command in ("check", "replay"):
        code, out, exc = run(command, path)
        assert exc is None and code == 2 and len(out.strip().splitlines()) == 1, (command, out)


def test_page_checksum_catches_a_flip_even_under_a_matching_digest(tmp_path: Path) -> None:
    """A flip inside a data page with the digest recomputed over it: the page
    checksum (written, and verified on read) still refuses the page."""
    data = bytearray(SOURCE.read_bytes())
    trace = open_trace(SOURCE)
    at = bytes(data).index(trace.digest.encode())
    meta = pq.ParquetFile(SOURCE).metadata.row_group(0).column(0)  # step: int32, first column
    offset = meta.data_page_offset + meta.total_compressed_size - 2
    data[offset] ^= 0xFF
    path = tmp_path / "paged.parquet"
    path.write_bytes(bytes(data))
    digest = digest_of_file(path, at)
    data[at:at + 64] = digest.encode()
    path.write_bytes(bytes(data))
    trace = open_trace(path)  # the digest matches: only the page is wrong
    with pytest.raises(TraceError, match="corrupt or truncated data"):
        list(trace.iter_steps())
    code, out, _ = run("check", path)
    assert code == 2 and "corrupt or truncated data" in out and len(out.strip().splitlines()) == 1


def test_zero_row_file_with_the_original_metadata_is_refused(tmp_path: Path) -> None:
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    summary = json.loads(kv[SUMMARY_KEY])
    summary.update(steps=0, events=0)
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    path = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(SOURCE).slice(0, 0).replace_schema_metadata(kv), path)
    reseal(path, path)
    assert_unusable(path, "empty trace (no rows)")


def test_unsealed_edit_is_a_digest_mismatch(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        first(rows, "schedule")["num_scheduled_tokens"] += 1
    assert_unusable(edited(tmp_path, "unsealed", edit, seal=False), "digest")


# -- rows validated against their kind (resealed edits) ---------------------------------
def test_nan_clock_is_refused(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        first(rows, "schedule_begin")["clock_s"] = float("nan")
    assert_unusable(edited(tmp_path, "nan", edit), "step 0 event 1: clock_s nan is not a finite number >= 0")


def test_inf_arrival_time_refused_by_check_and_replay_alike(tmp_path: Path) -> None:
    """Regression: replay rebuilt the workload from arrival rows RequestSpec refuses."""
    def edit(rows: Rows) -> None:
        first(rows, "arrival")["arrival_time_s"] = float("inf")
    assert_unusable(edited(tmp_path, "inf", edit), "step 0 event 0: arrival_time_s inf is not a finite number")


def test_arrival_row_requestspec_refuses_is_unusable_for_check_and_replay(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        first(rows, "arrival")["min_tokens"] = 10_000  # > max_tokens
    assert_unusable(edited(tmp_path, "spec", edit), "step 0 event 0: arrival row is not a valid request "
                                                     "(RequestSpec r000000: min_tokens must be an int in")


@pytest.mark.parametrize("kind", ["schedule_begin", "schedule_end", "update_end"])
def test_regression_null_free_count_read_as_free_blocks(tmp_path: Path, kind: str) -> None:
    """A resealed trace with ``num_free_blocks`` nulled checked as a different
    engine: a leak mutant's 306 BLOCK-CONSERVATION witnesses became
    PROGRESS-ADMIT ones judged on the checker's own free count (leaked blocks
    counted as free). Every engine records the count on these rows."""
    def edit(rows: Rows) -> None:
        first(rows, kind)["num_free_blocks"] = None
    assert_unusable(edited(tmp_path, f"nofree-{kind}", edit), f"{kind} without num_free_blocks")


def test_step_without_its_update_end_is_refused(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        end = first(rows, "update_end")
        rows.remove(end)
    assert_unusable(edited(tmp_path, "noend", edit), "step 0: the rank's rows lack their update_end")


def test_rank_3_with_one_rank_is_refused(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        first(rows, "schedule")["rank"] = 3
    assert_unusable(edited(tmp_path, "rank", edit), "rank 3 is not in 0..0 (data_parallel_size 1)")


def test_bogus_finish_status_is_refused(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        first(rows, "finish")["status"] = "FINISHED_BOGUS"
    assert_unusable(edited(tmp_path, "status", edit), "finish status 'FINISHED_BOGUS' is not a finished")


def test_regression_negative_output_token_checked_clean(tmp_path: Path) -> None:
    """A token id below 0 in an output row checked clean (no model emits one)."""
    def edit(rows: Rows) -> None:
        out = first(rows, "output")
        out["token_ids"] = [-7, *out["token_ids"][1:]]
    assert_unusable(edited(tmp_path, "negtok", edit), "token_ids holds a negative token id (-7)")


def test_rows_out_of_the_steps_order_are_refused(tmp_path: Path) -> None:
    """A decision row moved after schedule_end, event indexes kept in order."""
    def edit(rows: Rows) -> None:
        step0 = [r for r in rows if r["step"] == 0]
        kinds = [r["kind"] for r in step0]
        i, j = kinds.index("schedule"), kinds.index("schedule_end")
        step0[i], step0[j] = step0[j], step0[i]
        for index, row in enumerate(step0):
            row["event_index"] = index
        rows[:len(step0)] = step0
    assert_unusable(edited(tmp_path, "order", edit), "step 0 event")


def test_a_steps_rows_swapped_out_of_order_are_refused_by_check_replay_and_diff(tmp_path: Path) -> None:
    def edit(rows: Rows) -> None:
        rows[1], rows[2] = rows[2], rows[1]
    path = edited(tmp_path, "swap", edit)
    assert_unusable(path, "events out of order at step 0 event 1")
    code, out, exc = run("diff", SOURCE, path)
    assert exc is None and code == 2 and "events out of order at step 0 event 1" in out, out


@pytest.mark.parametrize("column,arrow_type", [("step", pa.float64()), ("num_scheduled_tokens", pa.int64()),
                                               ("clock_s", pa.string())])
def test_wrong_column_type_is_refused(tmp_path: Path, column: str, arrow_type: pa.DataType) -> None:
    """Regression: only column names were checked. A non-integer ``step``
    (diff's key) is refused at open too."""
    table = pq.read_table(SOURCE)
    index = table.schema.get_field_index(column)
    changed = table.set_column(index, pa.field(column, arrow_type), table.column(column).cast(arrow_type))
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    path = tmp_path / "typed.parquet"
    pq.write_table(changed.replace_schema_metadata(kv), path)
    reseal(path, path)
    assert_unusable(path, f"column {column} has type {arrow_type}", ("check", "replay"))
    code, out, exc = run("diff", SOURCE, path)
    assert exc is None and code == 2 and f"column {column} has type" in out, out


@pytest.mark.parametrize("value", [-5, 0])
def test_negative_or_zero_scheduled_count_is_a_violation_with_a_witness(tmp_path: Path, value: int) -> None:
    """Regression: exit 2 "malformed (KeyError)" instead of a violation."""
    def edit(rows: Rows) -> None:
        first(rows, "schedule")["num_scheduled_tokens"] = value
    path = edited(tmp_path, f"count{value}", edit)
    code, out, exc = run("check", "--json", path)
    assert exc is None and code == 1, out
    report = json.loads(out)
    witness = report["violations"][0]
    assert (witness["invariant"], witness["step"], witness["request"]) == ("BUDGET-TOKENS", 0, "r000000")
    assert witness["message"] == f"num_scheduled_tokens {value} is not positive"
    code, out, exc = run("replay", path)
    assert exc is None and code == 1 and "VIOLATION BUDGET-TOKENS at step 0, request r000000" in out, out


# -- open_trace never lets another exception out ----------------------------------------
def _with_metadata(tmp_path: Path, raw: bytes) -> Path:
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    kv[METADATA_KEY] = raw
    path = tmp_path / "meta.parquet"
    pq.write_table(pq.read_table(SOURCE).replace_schema_metadata(kv), path)
    return path


@pytest.mark.parametrize("raw,fragment", [
    (b"\xff\xfe{", "sched-harness metadata is not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "unreadable trace (RecursionError"),
    (json.dumps({"schema_version": 7, "engine": "reference", "config": {"num_gpu_blocks": [1]}, "seed": 0,
                 "workload": {}, "config_fingerprint": "x"}).encode(), "bad config in metadata"),
])
def test_bad_metadata_bytes_are_one_line(tmp_path: Path, raw: bytes, fragment: str) -> None:
    """Regression: UnicodeDecodeError, RecursionError and TypeError escaped open_trace."""
    path = _with_metadata(tmp_path, raw)
    with pytest.raises(TraceError, match=fragment.replace("(", r"\(")):
        open_trace(path)
    assert_unusable(path, fragment, ("check",))


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    """Regression: a FIFO as the trace blocked forever (opened for reading)."""
    fifo = tmp_path / "trace.parquet"
    os.mkfifo(fifo)
    outcome: list[Any] = []
    worker = threading.Thread(target=lambda: outcome.append(run("check", fifo)), daemon=True)
    worker.start()
    worker.join(timeout=20)
    assert outcome, "check blocked on the FIFO"
    code, out, exc = outcome[0]
    assert exc is None and code == 2 and "not a regular file" in out, out


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "locked.parquet"
    path.write_bytes(SOURCE.read_bytes())
    path.chmod(0)
    assert_unusable(path, "permission denied", ("check",))


def test_a_directory_is_refused(tmp_path: Path) -> None:
    # `check` takes a folder as a corpus (issue 25): one without traces is refused in one line;
    # `replay` takes one trace.
    assert_unusable(tmp_path, "a folder without any *.parquet trace", ("check",))
    assert_unusable(tmp_path, "is a directory", ("replay",))


@pytest.mark.parametrize("digest, version, line", [
    ("abc", 7, "the footer's trace_sha256 is malformed ('abc': not 64 hex digits); "
               "the file was changed after it was recorded"),
    (None, 6, "the footer's trace_sha256 is malformed (None: not 64 hex digits); "
              "the file was changed after it was recorded"),
    ("drop", 7, "the footer has no digest (schema 7 traces carry one)"),
])
def test_regression_malformed_digest_error_named_the_wrong_schema(tmp_path: Path, digest: Any, version: int,
                                                                   line: str) -> None:
    """The digest error named this harness's schema (8), not the trace's, and
    called a malformed digest missing."""
    table = pq.read_table(SOURCE)
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    summary = json.loads(kv[SUMMARY_KEY])
    if digest == "drop":
        summary.pop("trace_sha256")
    else:
        summary["trace_sha256"] = digest
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    meta = json.loads(kv[METADATA_KEY])
    meta["schema_version"] = version
    kv[METADATA_KEY] = json.dumps(meta, sort_keys=True).encode()
    path = tmp_path / "t.parquet"
    pq.write_table(table.replace_schema_metadata(kv), path)
    with pytest.raises(TraceError) as info:
        open_trace(path)
    assert str(info.value) == f"{path}: {line}"


# -- the property: mutate a valid trace at random ----------------------------------------
def _mutate_value(value: Any, pick: int) -> Any:
    """A different value of the same Arrow type (for a resealed edit), or of
    a broken one (NaN, a negative or huge int)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return [value + 1, value - 1, -value - 1, 0 if value else 7, 2**31 - 1][pick % 5]
    if isinstance(value, float):
        return [value + 0.5, float("nan"), float("inf"), -1.0][pick % 4]
    if isinstance(value, str):
        return [value + "x", "", "BOGUS"][pick % 3]
    if isinstance(value, list):
        if value and pick % 3 == 0:
            return value[:-1]
        if value and pick % 3 == 1:
            return [*value, value[0]]
        return []
    return None


_MUTATIONS = st.tuples(st.sampled_from(["drop", "swap", "value", "null", "type", "flip", "meta"]),
                       st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6))
_SOURCE_TABLE = pq.read_table(SOURCE)
_SOURCE_ROWS = _SOURCE_TABLE.to_pylist()
_SOURCE_KV = dict(pq.ParquetFile(SOURCE).metadata.metadata)


def _write_mutant(out: Path, mutation: tuple[str, int, int, int]) -> None:
    """Write SOURCE with one mutation applied (no digest recomputed)."""
    what, a, b, c = mutation
    if what == "flip":
        data = bytearray(SOURCE.read_bytes())
        data[a % len(data)] ^= 1 + c % 255
        out.write_bytes(bytes(data))
        return
    kv = dict(_SOURCE_KV)
    rows = [dict(r) for r in _SOURCE_ROWS]
    schema = _SOURCE_TABLE.schema
    if what == "drop":
        del rows[a % len(rows)]
    elif what == "swap":
        i, j = a % len(rows), b % len(rows)
        rows[i], rows[j] = rows[j], rows[i]
    elif what in ("value", "null"):
        row = rows[a % len(rows)]
        columns = [k for k, v in row.items() if v is not None]
        column = columns[b % len(columns)]
        row[column] = None if what == "null" else _mutate_value(row[column], c)
        if row[column] is None and not schema.field(column).nullable:
            schema = schema.set(schema.get_field_index(column), schema.field(column).with_nullable(True))
    elif what == "type":
        name = schema.names[a % len(schema.names)]
        new_type = [pa.int64(), pa.float64(), pa.string()][b % 3]
        table = pa.Table.from_pylist(rows, schema=schema)
        try:
            column = table.column(name).cast(new_type)
        except pa.ArrowException:
            column = pa.nulls(len(table), new_type)
        table = table.set_column(table.schema.get_field_index(name), pa.field(name, new_type), column)
        pq.write_table(table.replace_schema_metadata(kv), out)
        return
    elif what == "meta":
        key = [METADATA_KEY, SUMMARY_KEY][a % 2]
        info = json.loads(kv[key])
        field = sorted(info)[b % len(info)]
        info[field] = _mutate_value(info[field], c) if not isinstance(info[field], dict) else \
            {**info[field], "extra": c}
        kv[key] = json.dumps(info, sort_keys=True).encode()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema).replace_schema_metadata(kv), out)


def _assert_outcome(command: str, path: Path, *, may_pass: bool) -> None:
    code, out, exc = run(command, path)
    assert exc is None, f"{command}: traceback {exc!r}"
    if code == 2:
        assert len(out.strip().splitlines()) == 1 and out.startswith("error: "), out
    elif code == 1:
        assert "VIOLATION" in out or "DIVERGENCE" in out or "divergence" in out, out
    elif code == 3:  # a changed num_requests reads as a run cut short: named, never a pass
        assert "incomplete run (exit 3)" in out, out
    else:
        assert code == 0 and may_pass, f"{command} exit {code} on a changed file: {out[-300:]}"


@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=_MUTATIONS)
def test_any_change_is_refused_or_a_witness_never_a_traceback(tmp_path: Path, mutation) -> None:
    """Row drops, swaps, value, null and type edits, byte flips, metadata
    edits: as written (no digest recomputed) every one is exit 2 with one
    line or exit 1 with a witness; never a traceback, never exit 0."""
    path = tmp_path / "mutant.parquet"
    _write_mutant(path, mutation)
    if path.read_bytes() == SOURCE.read_bytes():
        return  # the flip or edit changed nothing
    for command in ("check", "replay"):
        _assert_outcome(command, path, may_pass=False)


@settings(max_examples=40, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mutation=_MUTATIONS.filter(lambda m: m[0] != "flip"))
def test_a_resealed_change_is_never_a_traceback(tmp_path: Path, mutation) -> None:
    """The same edits with the digest recomputed (a deliberate editor): the
    row validation and the invariants answer; a harmless edit may pass (the
    digest is no signature), but never a traceback, and exit 2 is one line."""
    path = tmp_path / "mutant.parquet"
    _write_mutant(path, mutation)
    try:
        reseal(path, path)
    except (OSError, ValueError, pa.ArrowException):
        return  # not even pyarrow reads it back: the unsealed test covers it
    for command in ("check", "replay"):
        _assert_outcome(command, path, may_pass=True)
