"""The vectorised row validation (issue 24) refuses exactly what the per-row
check refuses, with the same message.

``harness.trace.validate.suspect_rows`` flags, column by column, the rows
that may fail ``_check_values``; ``StepValidator.check_step`` runs the
per-row check on those alone. These tests doctor one stored value of a small
trace (a bad id, time, token, status, a null inside a list, ...) and read the
rows both ways: every row checked (``suspects=None``, the behaviour before
issue 24) and only the flagged rows checked. The outcome (the first
RowError's message, or none) must be equal.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.trace.queues import QueueDecoder
from harness.trace.validate import RowError, StepValidator, suspect_rows

ROOT = Path(__file__).resolve().parents[1]
# 160 steps, 40 requests, 15 preemptions: queue changes with heads, every common row kind.
SOURCE = ROOT / "traces" / "preemption-heavy.parquet"
TABLE = pq.read_table(SOURCE)
ROWS = TABLE.to_pylist()


def outcome(rows: list[dict[str, Any]], vectorised: bool) -> str | None:
    """The first RowError's message reading ``rows`` (as stored) in order, or None."""
    table = pa.RecordBatch.from_pylist(rows, schema=TABLE.schema)
    flags = suspect_rows(table) if vectorised else None
    validator, decoder = StepValidator(1), QueueDecoder()
    step, events, marks = None, [], []
    try:
        for index, row in enumerate(table.to_pylist()):
            decoder.decode_row(row)
            if row["step"] != step:
                if events:
                    validator.check_step(step, events, marks if vectorised else None)
                step, events, marks = row["step"], [], []
            events.append(row)
            marks.append(flags[index] if flags is not None else True)
        validator.check_step(step, events, marks if vectorised else None)
    except RowError as exc:
        return str(exc)
    except ValueError as exc:  # the decoder's: the same for both ways
        return f"decode: {exc}"
    return None


def doctored(index: int, column: str, value: Any) -> list[dict[str, Any]]:
    rows = list(ROWS)
    rows[index] = {**rows[index], column: value}
    return rows


def where(kind: str, column: str | None = None) -> int:
    """The index of the first ``kind`` row (whose ``column`` is not null)."""
    return next(i for i, r in enumerate(ROWS) if r["kind"] == kind and (column is None or r[column] is not None))


def test_the_source_trace_reads_clean_both_ways() -> None:
    assert outcome(ROWS, vectorised=False) is None
    assert outcome(ROWS, vectorised=True) is None
    assert not any(suspect_rows(TABLE.combine_chunks().to_batches()[0]))


# Each doctored value, and the message both ways must give (a fragment).
CASES = [
    (lambda: where("schedule"), "request_id", "r\x1b[2J", "request_id 'r\\x1b[2J' holds a control character"),
    (lambda: where("schedule"), "request_id", "", "schedule row without a request_id"),
    (lambda: where("output"), "request_id", None, "output row without a request_id"),
    (lambda: where("schedule_begin", "waiting"), "waiting", ["ok", "bad\n"], "waiting 'bad\\n' holds a control"),
    (lambda: where("schedule_end", "waiting_head"), "waiting_head", ["x\x85"], "waiting 'x\\x85' holds a control"),
    (lambda: where("schedule_end", "running_head"), "running_head", [None], "null inside running"),
    (lambda: where("schedule_end"), "request_data_ids", ["\x7f"], "request_data_ids '\\x7f' holds a control"),
    (lambda: where("update_end"), "finished_req_ids", ["a", None], "null inside finished_req_ids"),
    (lambda: where("schedule_begin"), "clock_s", math.nan, "clock_s nan is not a finite number"),
    (lambda: where("schedule_begin"), "clock_s", None, "schedule_begin without clock_s"),
    (lambda: where("arrival"), "arrival_time_s", -1.0, "arrival_time_s -1.0 is not a finite number"),
    (lambda: where("arrival"), "prompt_token_ids", [1, -5, 2], "prompt_token_ids holds a negative token id (-5)"),
    (lambda: where("arrival"), "max_tokens", -3, "arrival row is not a valid request"),
    (lambda: where("output"), "token_ids", [None], "null inside token_ids"),
    (lambda: where("schedule"), "block_ids", [1, None], "null inside block_ids"),
    (lambda: where("schedule"), "schedule_kind", "later", "schedule_kind 'later' is not new"),
    (lambda: where("schedule"), "num_scheduled_tokens", None, "schedule row without num_scheduled_tokens"),
    (lambda: where("finish"), "status", "RUNNING", "finish status 'RUNNING' is not a finished"),
    (lambda: where("finish"), "finish_reason", "tired", "unknown finish_reason 'tired'"),
    (lambda: where("preempt"), "status", "ASLEEP", "unknown request status 'ASLEEP'"),
    (lambda: where("request_state"), "status", None, "unknown request status None"),
]


@pytest.mark.parametrize("index, column, value, message", CASES, ids=[f"{c[1]}={c[2]!r}" for c in CASES])
def test_a_doctored_value_is_refused_the_same_way(index: Any, column: str, value: Any, message: str) -> None:
    rows = doctored(index(), column, value)
    slow, fast = outcome(rows, vectorised=False), outcome(rows, vectorised=True)
    assert slow == fast
    assert fast is not None and message in fast, fast


_COLUMNS = [c for c in TABLE.schema.names if c not in ("step", "event_index", "kind", "rank")]
_VALUES = st.sampled_from([None, "", "x", "a\x1b", "\x9f", -1, 0, 7, -0.5, math.inf, math.nan, 1.5,
                           "RUNNING", "FINISHED_STOPPED", "stop", "new", [], [None], [-1], [3, 4],
                           ["r\n"], ["a", "b"], [0, 1]])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(index=st.integers(0, len(ROWS) - 1), column=st.sampled_from(_COLUMNS), value=_VALUES)
def test_any_doctored_value_is_refused_the_same_way(index: int, column: str, value: Any) -> None:
    rows = doctored(index, column, value)
    try:
        pa.RecordBatch.from_pylist(rows, schema=TABLE.schema)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        return  # a value the column's type cannot hold: no file carries it
    assert outcome(rows, vectorised=False) == outcome(rows, vectorised=True)
