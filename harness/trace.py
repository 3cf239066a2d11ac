"""Step traces: one Parquet file per run, one row per event (docs/trace-format.md).

Written with pyarrow as the run goes (a row group per ``rows_per_group``
events, cut at step boundaries) to a temporary name in the target folder and
renamed on success, so a crashed run never leaves a file that looks complete.
The file's key-value metadata (key ``sched_harness``) makes it self-contained:
schema version, engine, full config and its fingerprint, workload source and
sha256, seed.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from reference.config import ConfigError, EngineConfig

SCHEMA_VERSION = 4
#: Older versions this harness still reads: their missing columns read as null.
READABLE_VERSIONS = {3: ("num_external_tokens", "reserved_blocks", "mm_positions", "encoder_input_ids",
                         "free_encoder_mm_hashes")}
METADATA_KEY = b"sched_harness"
# Written in the footer when the run ends: {"steps", "events", "stalled"}.
SUMMARY_KEY = b"sched_harness_summary"

_i32 = pa.int32()
_ids = pa.list_(pa.int32())
_strs = pa.list_(pa.string())

SCHEMA = pa.schema([
    # Where: step number, order inside the step, event kind, request.
    pa.field("step", _i32, nullable=False),
    pa.field("event_index", _i32, nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    # Data-parallel rank whose scheduler the row concerns (0 without DP).
    pa.field("rank", _i32),
    pa.field("request_id", pa.string()),
    # schedule_begin: virtual clock at step start (seconds).
    pa.field("clock_s", pa.float64()),
    # arrival / reject: the request as the workload gave it.
    pa.field("arrival_time_s", pa.float64()),
    pa.field("abort_time_s", pa.float64()),
    pa.field("priority", _i32),
    pa.field("prompt_token_ids", _ids),
    pa.field("max_tokens", _i32),
    pa.field("min_tokens", _i32),
    pa.field("ignore_eos", pa.bool_()),
    pa.field("eos_token_id", _i32),
    pa.field("stop_token_ids", _ids),
    pa.field("scripted_output_len", _i32),
    # schedule / preempt decisions.
    pa.field("schedule_kind", pa.string()),
    pa.field("num_computed_tokens", _i32),
    pa.field("num_scheduled_tokens", _i32),
    pa.field("num_prefix_hit_tokens", _i32),
    pa.field("block_ids", _ids),
    pa.field("spec_token_ids", _ids),
    # output / finish / abort / reject.
    pa.field("token_ids", _ids),
    pa.field("status", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("stop_reason", pa.string()),
    pa.field("num_output_tokens", _i32),
    pa.field("message", pa.string()),
    # Per-step state snapshots (schedule_begin, schedule_end, update_end).
    pa.field("waiting", _strs),
    pa.field("running", _strs),
    pa.field("num_free_blocks", _i32),
    pa.field("token_budget", _i32),
    pa.field("total_num_scheduled_tokens", _i32),
    pa.field("preempted_req_ids", _strs),
    pa.field("finished_req_ids", _strs),
    # Pipelining and deferred frees.
    pa.field("batch_step", _i32),
    pa.field("fence", _i32),
    # Prefill gating: the throttle input (schedule_begin), the decision and
    # the capacity guard after it (schedule_end).
    pa.field("throttle_prefills", pa.bool_()),
    # KV connector (schema 4): external tokens of an async load, and the free
    # blocks it had to leave for in-flight prefills.
    pa.field("num_external_tokens", _i32),
    pa.field("reserved_blocks", _i32),
    pa.field("defer_prefills", pa.bool_()),
    pa.field("prefill_capacity_bound", pa.bool_()),
    # Encoder inputs (schema 4): a request's items as [offset, length] pairs
    # (arrival, reject), the inputs a step encodes for it (schedule,
    # encoder_plan, withdraw) and the encoder-cache entries evicted
    # (schedule_end).
    pa.field("mm_positions", pa.list_(_ids)),
    pa.field("encoder_input_ids", _ids),
    pa.field("free_encoder_mm_hashes", _strs),
])
COLUMNS = tuple(SCHEMA.names)

EVENT_KINDS = ("arrival", "reject", "abort", "schedule_begin", "encoder_plan", "schedule", "withdraw",
               "preempt", "skip", "kv_load", "kv_promote", "schedule_end", "update_begin", "free_drain",
               "kv_invalid", "output", "finish", "kv_finished", "kv_free", "draft", "update_end")


class TraceError(Exception):
    """An unusable trace file. ``str()`` is a one-line message naming the file."""


@dataclass
class Trace:
    """An opened, validated trace: its path, ``meta`` (the metadata dict),
    ``config`` (validated, fingerprint verified) and ``summary`` (footer:
    steps, events, and why the engine stalled, if it did)."""

    path: Path
    meta: dict[str, Any]
    config: EngineConfig
    summary: dict[str, Any]
    num_rows: int
    _file: pq.ParquetFile

    def iter_steps(self) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Yield (step, events of that step in order), reading one row group at
        a time: memory is bounded by a row group, not by the trace.

        Raises TraceError on a corrupt row group or events out of order.
        """
        current: int | None = None
        events: list[dict[str, Any]] = []
        last_key = (-1, -1)
        num_steps = 0
        try:
            present = [c for c in COLUMNS if c in self._file.schema_arrow.names]
            absent = dict.fromkeys(c for c in COLUMNS if c not in present)
            for batch in self._file.iter_batches(batch_size=65536, columns=present):
                for row in batch.to_pylist():
                    if absent:
                        row.update(absent)  # an older schema: its missing columns read as null
                    key = (row["step"], row["event_index"])
                    if key <= last_key:
                        raise TraceError(f"{self.path}: events out of order at step {key[0]} "
                                         f"event {key[1]}")
                    last_key = key
                    if row["step"] != current:
                        if current is not None:
                            yield current, events
                        current, events = row["step"], []
                        num_steps += 1
                    events.append(row)
        except (OSError, pa.ArrowException) as exc:
            raise TraceError(f"{self.path}: corrupt or truncated data ({_one_line(exc)})") from None
        if current is not None:
            yield current, events
        if num_steps != self.summary["steps"]:
            raise TraceError(f"{self.path}: incomplete trace: the footer says "
                             f"{self.summary['steps']} steps, the file holds {num_steps}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open and validate a trace. Raises TraceError (missing file, not Parquet,
    truncated, no metadata, unknown schema version, missing column)."""
    p = Path(path)
    if not p.exists():
        raise TraceError(f"{p}: no such file")
    if p.is_dir():
        raise TraceError(f"{p}: is a directory, not a trace file")
    try:
        pf = pq.ParquetFile(p)
    except (OSError, pa.ArrowException) as exc:
        raise TraceError(f"{p}: not a Parquet file or truncated ({_one_line(exc)})") from None
    raw = (pf.metadata.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise TraceError(f"{p}: Parquet file without sched-harness metadata (not a trace)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise TraceError(f"{p}: sched-harness metadata is not valid JSON") from None
    if not isinstance(meta, dict):
        raise TraceError(f"{p}: sched-harness metadata is not a JSON object")
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION and version not in READABLE_VERSIONS:
        hint = "; re-record it with this harness" if isinstance(version, int) and version < SCHEMA_VERSION else ""
        raise TraceError(f"{p}: unknown trace schema version {version!r} "
                         f"(this harness reads version {SCHEMA_VERSION}{hint})")
    names = set(pf.schema_arrow.names)
    absent = READABLE_VERSIONS.get(version, ())
    missing = [c for c in COLUMNS if c not in names and c not in absent]
    if missing:
        raise TraceError(f"{p}: missing column(s) {', '.join(missing)}")
    config = _validate_meta(p, meta)
    raw_summary = (pf.metadata.metadata or {}).get(SUMMARY_KEY)
    try:
        summary = json.loads(raw_summary) if raw_summary is not None else None
    except ValueError:
        summary = None
    if not isinstance(summary, dict) or not isinstance(summary.get("steps"), int) \
            or not isinstance(summary.get("events"), int):
        raise TraceError(f"{p}: no valid run summary in the footer (the run did not finish "
                         f"writing, or the file was rewritten)")
    if summary["events"] != pf.metadata.num_rows:
        raise TraceError(f"{p}: incomplete trace: the footer says {summary['events']} events, "
                         f"the file holds {pf.metadata.num_rows}")
    return Trace(p, meta, config, summary, pf.metadata.num_rows, pf)


def _validate_meta(p: Path, meta: Any) -> EngineConfig:
    """Check the metadata's shape; return its config, validated and fingerprint-checked."""
    for key, kind in (("engine", str), ("config", dict), ("seed", int), ("workload", dict),
                      ("config_fingerprint", str)):
        if key not in meta:
            raise TraceError(f"{p}: metadata lacks {key!r}")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise TraceError(f"{p}: metadata {key!r} must be a {kind.__name__}, got {meta[key]!r}")
    try:
        config = EngineConfig.from_dict(meta["config"])
    except ConfigError as exc:
        raise TraceError(f"{p}: bad config in metadata: {exc}") from None
    if config.fingerprint() != meta["config_fingerprint"]:
        raise TraceError(f"{p}: config does not match its fingerprint (metadata edited?)")
    return config


class TraceWriter:
    """Streams event rows to ``path`` via a temporary file renamed on ``close``.

    Use as a context manager; an exception inside discards the temporary
    file and leaves any existing ``path`` untouched. ``add_step(rows)`` takes
    one step's rows (dicts keyed by column name; missing keys are null).
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any],
                 rows_per_group: int = 50_000) -> None:
        self.path = Path(path)
        self.rows_per_group = rows_per_group
        meta = {"schema_version": SCHEMA_VERSION, **meta}
        schema = SCHEMA.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=self.path.parent)
        os.close(fd)
        self._tmp = Path(tmp)
        self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd")
        self._schema = schema
        self._buffer: dict[str, list[Any]] = {c: [] for c in COLUMNS}
        self._buffered = 0
        self.num_rows = 0
        self._num_steps = 0
        self.stalled: str | None = None

    def add_step(self, rows: list[dict[str, Any]]) -> None:
        self._num_steps += 1
        for row in rows:
            for column in COLUMNS:
                self._buffer[column].append(row.get(column))
        self._buffered += len(rows)
        if self._buffered >= self.rows_per_group:
            self._flush()

    def _flush(self) -> None:
        if self._buffered:
            table = pa.Table.from_pydict(self._buffer, schema=self._schema)
            self._writer.write_table(table)
            self.num_rows += self._buffered
            self._buffer = {c: [] for c in COLUMNS}
            self._buffered = 0

    def close(self) -> None:
        """Flush, write the footer summary, finish the file and rename it
        into place (atomic)."""
        self._flush()
        summary = {"steps": self._num_steps, "events": self.num_rows, "stalled": self.stalled}
        self._writer.add_key_value_metadata({SUMMARY_KEY: json.dumps(summary, sort_keys=True)})
        self._writer.close()
        # mkstemp creates 0600; give the trace the usual umask-based mode.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self._tmp, 0o666 & ~umask)
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        """Discard the temporary file."""
        try:
            self._writer.close()
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
