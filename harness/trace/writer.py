"""Write a trace as the run goes: row groups cut at step boundaries, atomic rename.

Rows go to a temporary name in the target folder (a row group per
``rows_per_group`` events, never splitting a step) and the file is renamed
into place only when the run ends, so a crashed run never leaves a file that
looks complete. The key-value metadata (``sched_harness``) makes the trace
self-contained: schema version, engine, full config and fingerprint, workload
source and sha256, seed; the footer adds the run's summary.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from harness.trace.schema import METADATA_KEY, SCHEMA, SCHEMA_VERSION, SUMMARY_KEY


class TraceWriter:
    """Streams event rows to ``path`` via a temporary file renamed on ``close``.

    Use as a context manager; an exception inside discards the temporary
    file and leaves any existing ``path`` untouched. ``add_step(rows)`` takes
    one step's rows (dicts keyed by column name; missing keys are null).
    Every trace is written in schema ``SCHEMA_VERSION`` (all columns).
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any],
                 rows_per_group: int = 50_000) -> None:
        self.path = Path(path)
        self.rows_per_group = rows_per_group
        meta = {"schema_version": SCHEMA_VERSION, **meta}
        schema = SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        self._tmp = Path(tmp)
        try:
            os.close(fd)
            self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd")
        except BaseException:
            # Regression (issue 17): an interrupt (SIGTERM) right after the temp
            # file was made, before the context manager was entered, left it behind.
            self._tmp.unlink(missing_ok=True)
            raise
        self._schema = schema
        self._columns = tuple(schema.names)
        self._buffer: dict[str, list[Any]] = {c: [] for c in self._columns}
        self._buffered = 0
        self.num_rows = 0
        self._num_steps = 0
        self.stalled: str | None = None
        self.crashed: str | None = None  # the candidate raised (the footer's "crashed")

    def add_step(self, rows: list[dict[str, Any]]) -> None:
        self._num_steps += 1
        for row in rows:
            for column in self._columns:
                self._buffer[column].append(row.get(column))
        self._buffered += len(rows)
        if self._buffered >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._buffered:
            table = pa.Table.from_pydict(self._buffer, schema=self._schema)
            self._writer.write_table(table)
            self.num_rows += self._buffered
            self._buffer = {c: [] for c in self._columns}
            self._buffered = 0

    def close(self) -> None:
        """Flush, write the footer summary, finish the file and rename it
        into place (atomic)."""
        self._flush()
        summary = {"steps": self._num_steps, "events": self.num_rows, "stalled": self.stalled}
        if self.crashed is not None:  # only then: every other footer keeps its bytes
            summary["crashed"] = self.crashed
        self._writer.add_key_value_metadata({SUMMARY_KEY: json.dumps(summary, sort_keys=True)})
        self._writer.close()
        # mkstemp creates 0600; give the trace the usual umask-based mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Discard the temporary file (even if closing the writer fails too)."""
        try:
            self._writer.close()
        except Exception:  # noqa: BLE001 - the file is being discarded anyway
            pass
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self.close()
            except BaseException:
                # Regression (issue 17): a failure at close time (no space for the
                # footer, an interrupt) left the temp file behind.
                self.abort()
                raise
        else:
            self.abort()
