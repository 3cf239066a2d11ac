"""Open and validate a trace: metadata, schema version, config fingerprint, rows by step.

``open_trace(path)`` refuses anything unusable (not Parquet, truncated, unknown
schema version, missing column, bad or tampered config) with ``TraceError``,
whose ``str()`` is one line naming the file; ``Trace.iter_steps()`` streams
``(step, rows)`` in file order.
"""

from __future__ import annotations

import collections
import functools
import gzip
import itertools
import json
import operator
import os
import re
import stat
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from harness.trace.schema import (COLUMNS, DIGEST_SINCE, HYBRID_SCHEMA_VERSION, METADATA_KEY, READABLE_VERSIONS,
                                  SCHEMA, SCHEMA_VERSION,
                                  SUMMARY_KEY, absent_columns, is_hybrid_config)
from harness.paths import arrow_source
from harness.trace.clock import VirtualClock
from harness.trace.queues import DELTA_COLUMNS, SNAPSHOT_KINDS, QueueChange, QueueDecoder
from harness.trace.validate import RowError, StepValidator, suspect_rows
from harness.trace.writer import digest_of_file
from reference.config import ConfigError, EngineConfig
from reference.words import missing_file_hint, plural


class TraceError(Exception):
    """An unusable trace file. ``str()`` is a one-line message naming the file."""


@dataclass
class Trace:
    """An opened, validated trace: its path, ``meta`` (the metadata dict),
    ``config`` (validated, fingerprint verified) and ``summary`` (footer:
    steps, events, and why the engine stalled, if it did; the digest, once
    verified, is ``digest``)."""

    path: Path
    meta: dict[str, Any]
    config: EngineConfig
    summary: dict[str, Any]
    num_rows: int
    _file: pq.ParquetFile
    #: The footer's verified digest (schema 7 and later; None for a trace
    #: without one: ``sealed`` is then False).
    digest: str | None = None

    @property
    def sealed(self) -> bool:
        """True when the footer carries a digest that matched the bytes (tamper
        evidence). An unsealed trace (no ``trace_sha256``: an older schema, or
        a file rewritten without one, whatever version it claims) is read, but
        ``check`` and ``replay`` name it in their verdict and
        ``--require-sealed`` refuses it."""
        return self.digest is not None

    @property
    def incomplete(self) -> str | None:
        """Why the run this trace records did not end (one line), or None for a
        complete run: the footer's ``salvaged`` (a killed recording, or a vLLM
        recording that stopped early with requests live), ``crashed`` (the
        candidate raised), ``stalled`` (the engine stopped making progress) or
        ``protocol`` (a recording that left the engine's protocol: a unit test
        that stopped driving, called ``schedule()`` twice, ...), or a vLLM
        recording whose features the model cannot follow (its metadata's
        ``vllm_recording.unmodelled``: rules skipped). Read from the trace alone,
        so a forged flag can only make a trace count as incomplete, never as
        complete (exit 3 at best, not 0)."""
        for key, what in (("salvaged", ""), ("crashed", "the engine crashed: "),
                          ("stalled", "the engine stalled: "), ("protocol", "")):
            value = self.summary.get(key)
            if value is not None:
                return what + " ".join(str(value).split())[:300]
        # A vLLM recording with a feature the model cannot follow: the rules it
        # cannot judge are skipped (harness.check.checker.unjudged_rules), so the
        # verdict is no whole pass either; a forged key gets exit 3, never 0.
        missing = self.missing_requests
        if missing is not None:
            return missing
        recording = self.meta.get("vllm_recording")
        unmodelled = recording.get("unmodelled") if isinstance(recording, dict) else None
        if unmodelled:
            # A KV connector whose answers were recorded (config kv_connector_matches) is
            # followed: every rule judged (harness.check.checker.connector_followed, with
            # harness.check.invariants.RECORDED_CONNECTOR_UNJUDGED empty; not imported:
            # the trace layer reads no checker).
            config = self.meta.get("config")
            followed = ({"kv_connector"} if isinstance(config, dict)
                        and config.get("kv_connector_matches") is not None else set())
            features = ", ".join(sorted(str(f) for f in unmodelled if f not in followed))
            if features:
                return f"not every rule judged: the model cannot follow {features}"[:300]
        return None

    @property
    def missing_requests(self) -> str | None:
        """Why the trace's arrivals fall short of its workload, or None.

        The metadata's ``num_requests`` (the workload's request count, written
        at record time since this harness's issue-26 follow-up) against the
        distinct requests of the trace's ``arrival`` and ``reject`` rows. Regression (issue 26
        residual): a salvaged trace cut at a quiet point (every request that had
        arrived had finished), its ``salvaged`` marker removed and the file
        resealed, checked as a complete run (exit 0). A trace recorded before
        the field (no ``num_requests``) is read without this check.

        The workload's own params hold the count too where its loader wrote it
        (``workload.params.num_requests``: synthetic and fuzz workloads; the
        length of ``workload.params.request_order``: scenario files). Regression
        (trial finding): the footer's ``num_requests`` edited to the cut's count,
        or deleted, and the file resealed, passed as whole; now a disagreement
        of the two is named, and the params' count stands in for a deleted one."""
        expected = self.meta.get("num_requests")
        in_params = self._workload_param_count()
        if in_params is not None and expected is not None and in_params[1] != expected:
            return (f"metadata num_requests {expected} disagrees with its workload's {in_params[0]} "
                    f"{in_params[1]}: tampered, or the run was cut short")
        where = "metadata num_requests"
        if expected is None and in_params is not None:
            where, expected = in_params
        if expected is None:
            return None
        arrived = self.num_arrivals
        if arrived == expected:
            return None
        return (f"the trace holds {plural(arrived, 'request')} of its workload's {expected} "
                f"({where}): the run was cut short")

    def _workload_param_count(self) -> tuple[str, int] | None:
        """(where, count) of the workload's request count in its params, or None:
        ``params.num_requests`` (an int >= 0) or ``len(params.request_order)``."""
        workload = self.meta.get("workload")
        params = workload.get("params") if isinstance(workload, dict) else None
        if not isinstance(params, dict):
            return None
        count = params.get("num_requests")
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            return "params.num_requests", count
        order = params.get("request_order")
        if isinstance(order, list):
            return "params.request_order", len(order)
        return None

    @functools.cached_property
    def num_arrivals(self) -> int:
        """Distinct requests the trace received: those with an ``arrival`` or
        ``reject`` row (a request refused at arrival has only the latter).
        Reads two columns, SCAN_ROWS rows at a time (memory bounded by a
        batch and the distinct ids, not by the trace)."""
        kinds = pa.array(["arrival", "reject"])
        seen: set[str | None] = set()
        for batch in self._file.iter_batches(batch_size=SCAN_ROWS, columns=["kind", "request_id"]):
            seen.update(batch.column("request_id").filter(pc.is_in(batch.column("kind"), kinds)).to_pylist())
        return len(seen)

    def iter_steps(self, queue_changes: dict[int, QueueChange] | None = None
                   ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
        """Yield (step, events of that step in order), reading one row group at
        a time: memory is bounded by a row group, not by the trace.

        Raises TraceError on a corrupt row group or events out of order.

        Each batch of rows is read column by column (issue 24): the keys'
        order and the step boundaries from the ``step`` and ``event_index``
        columns, the rows as dicts built at C speed, the queue snapshots
        rebuilt on their rows alone. The first error is the one a row-by-row
        read meets first: a row's queue change or key, in file order, before
        the checks of the step it closes (``_first_bad_key``, ``fence``).

        ``queue_changes`` (a dict, filled as rows are read): each rebuilt
        ``waiting`` list's ``QueueChange`` by ``id`` of that list, for a
        consumer that follows the backlog by its changes (the checker,
        ``harness.check.queues.follow_waiting``) and pops what it reads.
        """
        current: int | None = None
        events: list[dict[str, Any]] = []
        suspects: list[bool] = []
        last_key = (-1, -1)
        num_steps = 0
        validator = StepValidator(self.config.data_parallel_size)
        clock = VirtualClock(self.config.step_fixed_s, self.config.step_per_token_s)
        queues = QueueDecoder(queue_changes)
        try:
            present = [c for c in COLUMNS if c in self._file.schema_arrow.names]
            absent = [c for c in COLUMNS if c not in present and c not in DELTA_COLUMNS]
            # The queue changes are read apart from the rows, which never hold them.
            stored = [c for c in present if c not in DELTA_COLUMNS]
            changed = [c for c in present if c in DELTA_COLUMNS]
            # Every row's keys in this order; an older schema's missing columns read as null.
            template = dict.fromkeys(stored + absent)
            for batch, batch_suspects in _batches(self._file, present):
                rows, steps, indices = _rows(batch, stored, template)
                fence, fence_error = _first_bad_key(batch, steps, indices, last_key, self.path)
                # Whole queues again (schema 8 stores changes), on the rows that chain or change;
                # a row's queue change is read before its key (the row at the fence too).
                changes = [batch.column(c).to_pylist() for c in changed]
                for i in _snapshot_rows(batch, changed, fence + 1):
                    row = rows[i]
                    try:
                        queues.decode_row(row, {c: values[i] for c, values in zip(changed, changes)})
                    except ValueError as exc:
                        fence, fence_error = i, RowError(f"step {row.get('step')} event "
                                                         f"{row.get('event_index')}: {exc}")
                        break
                if fence:
                    last_key = (steps[fence - 1], indices[fence - 1])
                for a, b in _step_spans(batch, fence):
                    step = steps[a]
                    if step == current:  # a step that began in the batch before
                        events += rows[a:b]
                        suspects += batch_suspects[a:b]
                        continue
                    if current is not None:
                        validator.check_step(current, events, suspects)
                        clock.check_step(current, events)
                        yield current, events
                    current, events, suspects = step, rows[a:b], batch_suspects[a:b]
                    num_steps += 1
                if fence_error is not None:
                    raise fence_error
                del rows, changes
            if current is not None:
                validator.check_step(current, events, suspects)
                clock.check_step(current, events)
        except RowError as exc:
            raise TraceError(f"{self.path}: bad row: {exc}") from None
        except (OSError, pa.ArrowException) as exc:
            raise TraceError(f"{self.path}: corrupt or truncated data ({_one_line(exc)})") from None
        if current is not None:
            yield current, events
        if num_steps != self.summary["steps"]:
            raise TraceError(f"{self.path}: incomplete trace: the footer says "
                             f"{self.summary['steps']} steps, the file holds {num_steps}")


def _first_bad_key(batch: pa.RecordBatch, steps: list[Any], indices: list[Any], last_key: tuple[int, int],
                   path: Path) -> tuple[int, TraceError | None]:
    """(the index of the batch's first row whose (step, event_index) is null
    or not after the row before it, its TraceError), or (the number of rows,
    None). Vectorised over the two columns when neither holds a null."""
    n = batch.num_rows
    step_column, index_column = batch.column("step"), batch.column("event_index")
    if n and not step_column.null_count and not index_column.null_count \
            and (steps[0], indices[0]) > last_key:
        s, s_next = step_column.slice(0, n - 1), step_column.slice(1)
        e, e_next = index_column.slice(0, n - 1), index_column.slice(1)
        after = pc.or_(pc.greater(s_next, s), pc.and_(pc.equal(s_next, s), pc.greater(e_next, e)))
        first = pc.index(after, False).as_py()
        if first < 0:
            return n, None
        first += 1
        return first, TraceError(f"{path}: events out of order at step {steps[first]} event {indices[first]}")
    for i, key in enumerate(zip(steps, indices)):
        if None in key:
            return i, TraceError(f"{path}: a row without its step or event_index")
        if key <= last_key:
            return i, TraceError(f"{path}: events out of order at step {key[0]} event {key[1]}")
        last_key = key
    return n, None


def _snapshot_rows(batch: pa.RecordBatch, changed: list[str], stop: int) -> list[int]:
    """The indices below ``stop`` of the rows whose queues the decoder reads:
    the snapshot kinds, and any row that stores a queue change."""
    mask = pc.is_in(batch.column("kind"), value_set=_SNAPSHOT_SET)
    for c in changed:
        mask = pc.or_(mask, pc.is_valid(batch.column(c)))
    found = pc.indices_nonzero(pc.fill_null(mask, False)).to_pylist()
    return found if not found or found[-1] < stop else [i for i in found if i < stop]


def _step_spans(batch: pa.RecordBatch, stop: int) -> list[tuple[int, int]]:
    """The [a, b) row ranges of each step in the batch's first ``stop`` rows
    (whose steps are not null)."""
    if not stop:
        return []
    s = batch.column("step").slice(0, stop)
    starts = pc.indices_nonzero(pc.not_equal(s.slice(1), s.slice(0, stop - 1))).to_pylist()
    bounds = [0, *(i + 1 for i in starts), stop]
    return list(zip(bounds, bounds[1:]))


_SNAPSHOT_SET = pa.array(sorted(SNAPSHOT_KINDS), pa.string())


#: Rows turned into dicts at a time by ``iter_steps`` (bounded memory).
BATCH_ROWS = 1024
#: Rows read and validated column by column at a time (``suspect_rows``: a
#: fixed cost per call, so more rows than BATCH_ROWS; Arrow memory only, but
#: a scan of the first steps of a long backlog is mostly arrival rows, whole
#: prompts: at 16 * BATCH_ROWS the first scan of the 4000-request Azure code
#: trace held 84 MiB of Arrow memory and check's peak RSS was 311 MiB, at
#: 4 * BATCH_ROWS 235 MiB, for the same CPU seconds within noise).
SCAN_ROWS = 4 * BATCH_ROWS


def _rows(batch: pa.RecordBatch, names: list[str], template: dict[str, None]) \
        -> tuple[list[dict[str, Any]], list[Any], list[Any]]:
    """(the batch's rows as dicts, its ``step`` and ``event_index`` columns as
    lists). Each row starts as a copy of ``template`` (every key, in order,
    null) and each column of ``names`` that holds a value in the batch is
    converted once at C speed and stored into the rows by ``map`` (no Python
    loop per row); a column that is null throughout the batch (most of a
    plain trace's optional ones) costs nothing. ~0.4x the cost of
    ``dict(zip(names, values))`` per row (issue 24)."""
    n = batch.num_rows
    copy = template.copy
    rows = [copy() for _ in itertools.repeat(None, n)]
    steps = indices = []
    for name in names:
        column = batch.column(name)
        if column.null_count == n:
            continue
        values = column.to_pylist()
        if name == "step":
            steps = values
        elif name == "event_index":
            indices = values
        _consume(map(operator.setitem, rows, itertools.repeat(name, n), values))
    if len(steps) != n:
        steps = [None] * n
    if len(indices) != n:
        indices = [None] * n
    return rows, steps, indices


def _consume(iterator: Iterator[Any]) -> None:
    """Run ``iterator`` to its end at C speed."""
    collections.deque(iterator, maxlen=0)


def _batches(file: pq.ParquetFile, columns: list[str]) -> Iterator[tuple[pa.RecordBatch, list[bool]]]:
    """(batch of at most BATCH_ROWS rows, its rows' ``suspect_rows`` flags), in file order."""
    for scan in file.iter_batches(batch_size=SCAN_ROWS, columns=columns):
        suspects = suspect_rows(scan)  # the stored columns, vectorised
        for start in range(0, scan.num_rows, BATCH_ROWS):
            yield scan.slice(start, BATCH_ROWS), suspects[start:start + BATCH_ROWS]
_HEX64 = re.compile(r"[0-9a-f]{64}")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def open_trace(path: str | os.PathLike[str]) -> Trace:
    """Open and validate a trace. Raises TraceError, one line naming the
    file, for anything unusable: missing, not a regular file (a directory,
    a FIFO: never opened), unreadable, not Parquet, truncated, no metadata,
    unknown schema version, missing column or a column of the wrong type,
    bad config, no rows, a digest (schema 7) that does not match the bytes,
    a page whose checksum does not match. Never lets another exception out
    for a bad file (OSError, UnicodeDecodeError, TypeError, RecursionError
    become TraceError)."""
    p = Path(path)
    try:
        return _open(p)
    except TraceError:
        raise
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError,
            pa.ArrowException) as exc:
        raise TraceError(f"{p}: unreadable trace ({type(exc).__name__}: {_one_line(exc)})") from None


# The recording scheduler's first record (harness/candidates/vllm/recording_scheduler.py
# writes compact JSON): ``{"t":"meta",...``; its temporary file ``.NAME.<pid>.tmp``.
_RECORDING_HEAD = re.compile(rb'\A\{\s*"t"\s*:\s*"meta"\s*,')
_RECORDING_TMP = re.compile(r"\A\..+\.jsonl\.\d+\.tmp\Z")


def vllm_recording_hint(p: Path) -> str | None:
    """The one-line refusal for a vLLM recording given where a trace is wanted
    (regression, new-user trial: `check run1.jsonl` said "not a Parquet file"
    and suggested `harness record`), or None when ``p`` is none: its first
    bytes are the recording scheduler's meta record (plain, or gzip-compressed),
    or it is named as the recorder's temporary file. Reads at most 4 KiB."""
    try:
        with open(p, "rb") as fh:
            head = fh.read(4096)
        if head[:2] == b"\x1f\x8b":
            with gzip.open(p, "rb") as gz:
                head = gz.read(64)
    except (OSError, EOFError, zlib.error):
        head = b""
    if not (_RECORDING_HEAD.match(head) or _RECORDING_TMP.match(p.name)):
        return None
    return (f"a vLLM recording (the recording scheduler's JSON lines), not a trace: convert it "
            f"first: harness convert {p} -o TRACE.parquet")


def _open(p: Path) -> Trace:
    try:
        st = p.stat()
    except FileNotFoundError:
        if p.is_symlink():
            raise TraceError(f"{p}: a dangling symbolic link (to {os.readlink(p)}), not a trace") from None
        raise TraceError(f"{p}: no such file{missing_file_hint(p)}") from None
    except OSError as exc:
        raise TraceError(f"{p}: cannot access ({exc.strerror or _one_line(exc)})") from None
    if stat.S_ISDIR(st.st_mode):
        hint = ""
        if any(p.glob("seg-*.parquet")):
            hint = f" (a killed recording's segments: `harness salvage {p} -o TRACE.parquet`)"
        raise TraceError(f"{p}: is a directory, not a trace file{hint}")
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{p}: not a regular file (a FIFO, device or socket is not a trace)")
    if not os.access(p, os.R_OK):
        raise TraceError(f"{p}: permission denied")
    try:
        pf = pq.ParquetFile(arrow_source(p), page_checksum_verification=True)
    except (OSError, pa.ArrowException) as exc:
        recording = vllm_recording_hint(p)
        if recording:
            raise TraceError(f"{p}: {recording}") from None
        hint = ""
        if p.suffix.lower() in (".toml", ".json", ".csv", ".jsonl"):  # a scenario or workload (new-user trial)
            hint = f"; to run it and check the run: harness record {p} -o TRACE.parquet, then harness check TRACE.parquet"
        raise TraceError(f"{p}: not a Parquet file or truncated ({_one_line(exc)}){hint}") from None
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
    known = (HYBRID_SCHEMA_VERSION, SCHEMA_VERSION, *READABLE_VERSIONS)
    if version not in known or isinstance(version, bool):
        hint = "; re-record it with this harness" if isinstance(version, int) and version < SCHEMA_VERSION else ""
        raise TraceError(f"{p}: unknown trace schema version {version!r} "
                         f"(this harness reads versions {', '.join(map(str, sorted(known)))}{hint})")
    names = set(pf.schema_arrow.names)
    absent = absent_columns(version)
    missing = [c for c in COLUMNS if c not in names and c not in absent]
    if missing:
        raise TraceError(f"{p}: missing column(s) {', '.join(missing)}")
    for name in COLUMNS:
        if name in names and pf.schema_arrow.field(name).type != SCHEMA.field(name).type:
            raise TraceError(f"{p}: column {name} has type {pf.schema_arrow.field(name).type}, "
                             f"not {SCHEMA.field(name).type}")
    config = _validate_meta(p, meta)
    _check_version_of_config(p, version, meta["config"])
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
    if pf.metadata.num_rows == 0 or summary["steps"] < 1:
        raise TraceError(f"{p}: empty trace (no rows): nothing to check")
    digest = None
    # A digest present is verified whatever version the metadata claims: the
    # claim is itself a byte the digest covers (issue 26: a downgrade to 6 must
    # not switch the check off). Schema 7 and later must carry one.
    if version >= DIGEST_SINCE or "trace_sha256" in summary:
        _verify_digest(p, pf, summary, version)
        digest = summary.pop("trace_sha256")  # verified; the summary keeps the run's figures only
    return Trace(p, meta, config, summary, pf.metadata.num_rows, pf, digest)


def _check_version_of_config(p: Path, version: int, config: dict[str, Any]) -> None:
    """TraceError unless the schema version is the one the recorder writes for
    ``config`` (``schema.schema_for``): 9 exactly for a config naming
    ``sliding_window`` / ``layer_types``. Regression: a hybrid trace relabelled
    schema 8 was checked as one (1803 violations when its group column was
    dropped), and a schema-9 trace with a plain config had its per-group
    blocks ignored; neither is anything a recorder writes."""
    hybrid = is_hybrid_config(config)
    if hybrid and version != HYBRID_SCHEMA_VERSION:
        raise TraceError(f"{p}: schema {version} trace with a hybrid config (sliding_window / layer_types): "
                         f"such a trace is written in schema {HYBRID_SCHEMA_VERSION} (metadata edited?)")
    if not hybrid and version == HYBRID_SCHEMA_VERSION:
        raise TraceError(f"{p}: schema {version} trace whose config names no sliding_window or layer_types: "
                         f"a one-group trace is written in schema {SCHEMA_VERSION} (metadata edited?)")


def _verify_digest(p: Path, pf: pq.ParquetFile, summary: dict[str, Any], version: int) -> None:
    """The footer's ``trace_sha256`` must be the digest of the file's bytes (with
    its own 64 characters read as ``0``: ``writer.digest_of_file``), so any
    changed byte, data or footer, is refused. ``version``: the schema version
    the trace's metadata claims (named when the digest is absent).

    Regression: a malformed digest was reported as "no digest (schema 9 traces
    carry one)", naming this harness's schema, not the trace's, and hiding
    that a digest was there."""
    digest = summary.get("trace_sha256")
    if "trace_sha256" not in summary:
        raise TraceError(f"{p}: the footer has no digest (schema {version} traces carry one)")
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        shown = repr(digest) if len(repr(digest)) <= 80 else repr(digest)[:77] + "..."
        raise TraceError(f"{p}: the footer's trace_sha256 is malformed ({shown}: not 64 hex digits); "
                         f"the file was changed after it was recorded")
    needle = f'"trace_sha256": "{digest}"'.encode()
    size = p.stat().st_size
    with open(p, "rb") as f:
        f.seek(size - 8)
        footer_len = int.from_bytes(f.read(4), "little")
        f.seek(max(0, size - 8 - footer_len))
        footer = f.read(footer_len)
    index = footer.find(needle)
    if index < 0:
        raise TraceError(f"{p}: the footer's digest is not where this harness writes it (file rewritten?)")
    at = size - 8 - footer_len + index + len(needle) - 65
    if digest_of_file(p, at) != digest:
        raise TraceError(f"{p}: digest mismatch: the file was changed after it was recorded")


def _control_in(value: Any, where: str = "") -> str | None:
    """The path of the first string inside ``value`` holding a control
    character (ESC, newline, ...), else None."""
    if isinstance(value, str):
        return where if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _control_in(key, f"{where}.{key}" if where else str(key)) if isinstance(key, str) else None
            found = found or _control_in(item, f"{where}.{key}" if where else str(key))
            if found:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _control_in(item, f"{where}[{i}]")
            if found:
                return found
    return None


def _validate_meta(p: Path, meta: Any) -> EngineConfig:
    """Check the metadata's shape; return its config, validated and fingerprint-checked."""
    if isinstance(meta, dict):
        # No engine writes one, and printed raw it would drive the terminal
        # (an ESC sequence hiding the verdict, a newline forging a line).
        found = _control_in(meta)
        if found:
            raise TraceError(f"{p}: metadata {found!r} holds a control character (ESC, newline, ...); "
                             f"no engine writes one")
    for key, kind in (("engine", str), ("config", dict), ("seed", int), ("workload", dict),
                      ("config_fingerprint", str)):
        if key not in meta:
            raise TraceError(f"{p}: metadata lacks {key!r}")
        if not isinstance(meta[key], kind) or isinstance(meta[key], bool):
            raise TraceError(f"{p}: metadata {key!r} must be a {kind.__name__}, got {meta[key]!r}")
    num_requests = meta.get("num_requests")
    if num_requests is not None and (not isinstance(num_requests, int) or isinstance(num_requests, bool)
                                     or num_requests < 0):
        raise TraceError(f"{p}: metadata 'num_requests' must be an int >= 0, got {num_requests!r}")
    try:
        # What the engine ran: a config vLLM accepts and crashes on is read too.
        config = EngineConfig.from_dict(meta["config"], accept_vllm_crash=True)
    except ConfigError as exc:
        raise TraceError(f"{p}: bad config in metadata: {exc}") from None
    if config.fingerprint() != meta["config_fingerprint"]:
        raise TraceError(f"{p}: config does not match its fingerprint (metadata edited?)")
    return config
