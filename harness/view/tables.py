"""SQL-friendly tables (``harness export --tables DIR``): three narrow Parquet
files, one row per thing, no nulls where a value exists, so a query needs
no self-join over the trace's wide event table (docs/tables.md has recipes).

- ``steps.parquet``: one row per step (``harness.view.series.StepPoint``):
  clock, budget used, blocks, queue lengths, token split, preemptions and
  their victims, prefix hits, draft verification, remote loads, violations.
- ``scheduled.parquet``: one row per (step, request) scheduled (``Scheduled``).
- ``requests.parquet``: one row per request (``RequestInfo``): arrival,
  first scheduling, first token, end, preemptions, hits, remote loads.

Each file is written atomically (temp file + rename). Same trace, same
pyarrow: same bytes.
"""

from __future__ import annotations

import io
import os
from dataclasses import asdict, fields
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.view.files import write_atomic
from harness.view.series import RequestInfo, Scheduled, Series

_i32, _i64, _f64, _str = pa.int32(), pa.int64(), pa.float64(), pa.string()

STEPS_SCHEMA = pa.schema([
    ("step", _i32), ("clock_s", _f64), ("end_s", _f64), ("token_budget", _i32),
    ("scheduled_tokens", _i32), ("budget_used", _f64), ("prefill_tokens", _i32),
    ("decode_tokens", _i32), ("draft_tokens", _i32), ("accepted_drafts", _i32),
    ("verified_drafts", _i32), ("free_blocks", _i32), ("held_blocks", _i32), ("cached_blocks", _i32),
    ("waiting", _i32), ("running", _i32), ("preemptions", _i32), ("victims", pa.list_(_str)),
    ("admitted", _i32), ("prefix_hit_tokens", _i32), ("lookup_tokens", _i32), ("kv_loads", _i32),
    ("failed_kv_loads", _i32), ("finished", _i32), ("violations", _i32),
])
_PY_TYPES = {"int": _i32, "str": _str, "float": _f64, "int | None": _i32,
             "float | None": _f64, "str | None": _str}


def _schema_of(cls: type) -> pa.Schema:
    """A dataclass's fields as Arrow columns (ints int32, floats float64)."""
    return pa.schema([(f.name, _PY_TYPES[f.type]) for f in fields(cls)])


SCHEDULED_SCHEMA = _schema_of(Scheduled)
REQUESTS_SCHEMA = _schema_of(RequestInfo)
TABLES = ("steps", "scheduled", "requests")


def tables(series: Series) -> dict[str, pa.Table]:
    """The three tables of ``series`` (name -> pyarrow Table)."""
    steps = []
    for row in series.step_dicts():
        row["budget_used"] = round(row["scheduled_tokens"] / row["token_budget"], 6) if row["token_budget"] else 0.0
        steps.append(row)
    return {
        "steps": pa.Table.from_pylist(steps, schema=STEPS_SCHEMA),
        "scheduled": pa.Table.from_pylist([asdict(c) for c in series.scheduled], schema=SCHEDULED_SCHEMA),
        "requests": pa.Table.from_pylist([asdict(r) for r in series.requests], schema=REQUESTS_SCHEMA),
    }


def write_tables(series: Series, directory: str | os.PathLike[str]) -> list[Path]:
    """Write ``steps.parquet``, ``scheduled.parquet`` and ``requests.parquet``
    into ``directory`` (created if missing); returns their paths. Raises OSError."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in tables(series).items():
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        paths.append(write_atomic(out / f"{name}.parquet", buf.getvalue()))
    return paths
