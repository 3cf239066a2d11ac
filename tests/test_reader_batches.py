"""The column-wise reader (issue 24) reads what the row-by-row reader read.

``Trace.iter_steps`` turns each batch of rows into dicts column by column,
finds the step boundaries and the key order over whole columns, and decodes
the queue changes on the snapshot rows alone. These tests pin what must not
move with that: the rows (values and key order) whatever the batch size, a
step that spans batches, and which error comes first when one row is wrong
twice (its queue change is read before its key, as a row-by-row read does).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.trace import SUMMARY_KEY, TraceError, open_trace
from harness.trace import reader
from harness.trace.queues import DELTA_COLUMNS, QueueDecoder
from harness.trace.schema import COLUMNS
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
# 160 steps, 1,460 rows: queue changes with heads, every common row kind.
SOURCE = ROOT / "traces" / "preemption-heavy.parquet"


def by_row(path: Path) -> list[tuple[int, list[dict[str, Any]]]]:
    """The steps as a plain row-by-row read builds them: ``to_pylist``, the
    queue changes decoded in file order (their columns dropped), the columns
    a schema 8 trace lacks (``group_block_ids``) appended as null, grouped by
    step."""
    decoder = QueueDecoder()
    steps: list[tuple[int, list[dict[str, Any]]]] = []
    for row in pq.read_table(path).to_pylist():
        decoder.decode_row(row)
        row.update(dict.fromkeys(c for c in COLUMNS if c not in row and c not in DELTA_COLUMNS))
        if not steps or steps[-1][0] != row["step"]:
            steps.append((row["step"], []))
        steps[-1][1].append(row)
    return steps


def as_items(steps: list[tuple[int, list[dict[str, Any]]]]) -> list[tuple[int, list[list[tuple[str, Any]]]]]:
    return [(step, [list(row.items()) for row in rows]) for step, rows in steps]


@pytest.mark.parametrize("batch_rows, scan_rows", [(1024, 16 * 1024), (7, 20), (1, 3), (300, 300)])
def test_rows_and_key_order_do_not_depend_on_the_batch_size(monkeypatch: pytest.MonkeyPatch, batch_rows: int,
                                                           scan_rows: int) -> None:
    monkeypatch.setattr(reader, "BATCH_ROWS", batch_rows)
    monkeypatch.setattr(reader, "SCAN_ROWS", scan_rows)
    read = list(open_trace(SOURCE).iter_steps())
    assert len(read) == 160
    assert sum(len(rows) for _, rows in read) == 1460
    assert as_items(read) == as_items(by_row(SOURCE))


def edited(tmp_path: Path, index: int, **values: Any) -> Path:
    """SOURCE with row ``index``'s ``values`` set, resealed."""
    table = pq.read_table(SOURCE)
    rows = table.to_pylist()
    rows[index].update(values)
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    summary = json.loads(kv[SUMMARY_KEY])
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / "edited.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    return reseal(out, out)


# Row 187: step 21's schedule_end (event 3), its waiting stored as a kept slice [0, 6].
ROW = 187


def read_error(path: Path) -> str:
    with pytest.raises(TraceError) as info:
        for _ in open_trace(path).iter_steps():
            pass
    return str(info.value).split(": ", 1)[1]


def test_a_row_wrong_twice_reports_its_queue_change_first(tmp_path: Path) -> None:
    path = edited(tmp_path, ROW, event_index=2, waiting_kept=[0, 99])
    assert read_error(path) == ("bad row: step 21 event 2: waiting_kept [0, 99] is not a slice of the previous "
                                "waiting (6 ids)")


def test_a_key_out_of_order_alone_is_named(tmp_path: Path) -> None:
    assert read_error(edited(tmp_path, ROW, event_index=2)) == "events out of order at step 21 event 2"


def test_a_bad_queue_change_alone_is_named(tmp_path: Path) -> None:
    assert read_error(edited(tmp_path, ROW, waiting_kept=[5, 2])) == (
        "bad row: step 21 event 3: waiting_kept [5, 2] is not a slice of the previous waiting (6 ids)")
