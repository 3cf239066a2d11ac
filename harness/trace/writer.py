"""Write a trace as the run goes: crash-safe segments, one atomic rename at the end.

While the run goes, rows are written to a temporary folder beside the target
(``.NAME.XXXX.tmp/``) as *segments*: each a complete, footed Parquet file of
one row group (``seg-000000.parquet``, ...), cut at a step boundary once
``rows_per_group`` rows or ``bytes_per_group`` estimated bytes are buffered,
and itself written under a ``.part`` name and renamed, so a run killed at any
instant (SIGKILL included) leaves only whole segments behind (and the
joined file below, unfooted): ``harness salvage`` (``harness.trace.salvage``)
turns the segments into a trace.

Each segment's rows are also appended, as the next row group, to the joined
file (``trace.parquet.part`` in the same folder, page checksums on, zstd),
so nothing is read back at the end: when the run ends, ``close`` writes its
footer summary with the file's digest
(``SUMMARY_KEY``: ``trace_sha256``, the sha256 of the whole file with those 64 characters read
as ``0``; ``digest_of_file``), and renames it into place, so the final path
is never partial. The key-value metadata (``sched_harness``) makes the trace
self-contained: schema version, engine, full config and fingerprint,
workload source and sha256, seed.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from harness.trace.queues import QueueEncoder
from harness.trace.schema import METADATA_KEY, SUMMARY_KEY, schema_for

#: The digest's stand-in while the file is hashed: 64 zeros (a sha256 in hex).
DIGEST_PLACEHOLDER = "0" * 64
#: Segment file names inside the temporary folder, in order.
SEGMENT_GLOB = "seg-*.parquet"
#: The joined trace inside the temporary folder while the run goes (each
#: segment's row group appended as it is cut; footed and renamed by ``close``).
#: Not ``*.parquet``: a killed run's folder holds no file that reads as a trace.
JOINED_NAME = "trace.parquet.part"
# Rows converted to Arrow at a time while a row group fills (``TraceWriter._convert``).
_CHUNK_ROWS = 1000
# Parquet options of every file this harness writes (segments and traces).
_PARQUET_OPTIONS = {"compression": "zstd", "write_page_checksum": True}


def digest_of_file(path: Path, at: int) -> str:
    """sha256 (hex) of the bytes of ``path`` with the 64 bytes at offset
    ``at`` (where the digest itself is stored) read as ASCII ``0``.

    Streams the file in 1 MiB reads (memory does not grow with the file).
    Raises OSError if the file cannot be read."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        pos = 0
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                break
            end = pos + len(chunk)
            if pos < at + 64 and at < end:  # the digest's bytes fall in this chunk
                buf = bytearray(chunk)
                lo, hi = max(at, pos), min(at + 64, end)
                buf[lo - pos:hi - pos] = b"0" * (hi - lo)
                chunk = bytes(buf)
            sha.update(chunk)
            pos = end
    return sha.hexdigest()


def _row_bytes(row: dict[str, Any]) -> int:
    """A rough size of one row once encoded (bytes): 8 per scalar, 4 per list
    item, the length of each string (so a step's waiting list counts)."""
    size = 0
    for value in row.values():
        if isinstance(value, list):
            size += 4 * len(value)
            if value and value[0].__class__ is str:  # a list of ids: their lengths at C speed
                try:
                    size += sum(map(len, value))
                except TypeError:  # not only strings
                    size += sum(len(v) for v in value if isinstance(v, str))
        elif isinstance(value, str):
            size += len(value)
        else:
            size += 8
    return size


# The temporary folders of writers not yet closed or aborted, removed at
# interpreter exit. Regression: SIGTERM to `harness record` under load left
# one, when the signal's handler ran between the folder's mkdir and the `with`
# block that aborts it (inside mkdtemp, or before __enter__). A name is
# registered *before* its mkdir, so no instant leaves a folder unregistered;
# an exit by SIGTERM or SIGINT (exit 143/130, through atexit) removes it, while
# SIGKILL or a power cut leaves it for `harness salvage`, as designed.
_OPEN_TEMP_DIRS: set[Path] = set()


def _make_temp_dir(path: Path) -> Path:
    """Create ``.NAME.<random>.tmp/`` (mode 0700) beside ``path``, registered first."""
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
        _OPEN_TEMP_DIRS.add(tmp)
        try:
            os.mkdir(tmp, 0o700)
            return tmp
        except FileExistsError:  # someone else's: never ours to remove
            _OPEN_TEMP_DIRS.discard(tmp)
        except BaseException:  # mkdir failed (nothing there), or an interrupt right after it
            _remove_temp_dir(tmp)
            raise


def _remove_temp_dir(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
    _OPEN_TEMP_DIRS.discard(tmp)


@atexit.register
def _remove_open_temp_dirs() -> None:
    for tmp in list(_OPEN_TEMP_DIRS):
        _remove_temp_dir(tmp)


class TraceWriter:
    """Streams event rows to ``path`` via crash-safe segments, renamed on ``close``.

    Use as a context manager; an exception inside discards the temporary
    folder and leaves any existing ``path`` untouched (a SIGKILL leaves the
    folder, whose complete segments ``harness salvage`` reads).
    ``add_step(rows)`` takes one step's rows (dicts keyed by column name;
    missing keys are null); a row group (segment) is cut after the step that
    brings the buffer to ``rows_per_group`` rows or ``bytes_per_group``
    estimated bytes, never inside a step. A trace is written in schema
    ``SCHEMA_VERSION``, a hybrid model's in ``HYBRID_SCHEMA_VERSION``
    (``harness.trace.schema.schema_for``). Raises OSError when the folder cannot
    be written.
    """

    def __init__(self, path: str | os.PathLike[str], meta: dict[str, Any],
                 rows_per_group: int = 10_000, bytes_per_group: int = 4 << 20) -> None:
        self.path = Path(path)
        self.rows_per_group = rows_per_group
        self.bytes_per_group = bytes_per_group
        version, schema = schema_for(meta)
        meta = {"schema_version": version, **meta}
        self._schema = schema.with_metadata({METADATA_KEY: json.dumps(meta, sort_keys=True)})
        self._row_type = pa.struct(list(self._schema))  # a row as one struct value (``_flush``)
        # The joined file, written a row group per segment as they are cut (``close``).
        self._joined: pq.ParquetWriter | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = _make_temp_dir(self.path)
        self._buffer: list[dict[str, Any]] = []  # rows as stored (queue changes), in order
        self._chunks: list[pa.StructArray] = []  # the rows before them, converted (``_convert``)
        self._buffered = 0
        self._buffered_bytes = 0
        self._segments: list[Path] = []
        self._queues = QueueEncoder()  # snapshots stored as changes (schema 8)
        self.num_rows = 0
        self._num_steps = 0
        self.stalled: str | None = None
        self.crashed: str | None = None  # the candidate raised (the footer's "crashed")
        # The rows end where the run was cut off (the footer's "salvaged", as
        # ``harness.trace.salvage`` writes it): a recording without its end.
        self.salvaged: str | None = None
        # The driver left the engine's protocol, or stopped with requests live (the
        # footer's "protocol", a vLLM recording of a unit test): the rows before it
        # are complete steps; end-of-trace rules are not claimed.
        self.protocol: str | None = None

    @property
    def temp_dir(self) -> Path:
        """The temporary folder holding the segments written so far."""
        return self._tmp

    def add_step(self, rows: list[dict[str, Any]], *, copy: bool = True) -> None:
        """Buffer one step's rows; write a segment when the buffer is full.
        ``copy=False``: the caller hands the row dicts over (it neither keeps
        nor changes them), so a row stored as given is not copied."""
        self._num_steps += 1
        encode = self._queues.encode_row
        stored = [encode(row) for row in rows]
        if copy:  # the caller keeps its rows: a row stored as given is copied (C speed)
            stored = [s if s is not r else dict(r) for s, r in zip(stored, rows)]
        self._buffer += stored
        self._buffered_bytes += sum(map(_row_bytes, stored))
        self._buffered += len(rows)
        if self._buffered >= self.rows_per_group or self._buffered_bytes >= self.bytes_per_group:
            self._flush()
        elif len(self._buffer) >= _CHUNK_ROWS:
            self._convert()

    def _convert(self) -> None:
        """Convert the buffered row dicts to one Arrow struct array (at C
        speed: missing keys read as null, keys outside the schema left out,
        as pyarrow's ``Table.from_pylist``), kept until the flush. Done every
        ``_CHUNK_ROWS`` rows, so the dicts die young: held for a whole row
        group they reached the garbage collector's oldest generation, whose
        full collections traversed them (0.07 CPU s of the 500-request
        record, with 0.08 s of younger collections)."""
        if self._buffer:
            self._chunks.append(pa.array(self._buffer, type=self._row_type))
            self._buffer = []

    def _flush(self) -> None:
        """Write the buffer as the next segment (``.part``, then renamed), and
        append it to the joined file as its next row group (``close`` then
        only adds the footer: no segment is read back)."""
        if not self._buffered:
            return
        # The rows as one struct array (the chunks joined: the same values as
        # one conversion of every row, so the same bytes).
        self._convert()
        chunks, self._chunks = self._chunks, []
        rows = chunks[0] if len(chunks) == 1 else pa.concat_arrays(chunks)
        table = pa.Table.from_arrays(rows.flatten(), schema=self._schema)
        final = self._tmp / f"seg-{len(self._segments):06d}.parquet"
        part = final.with_suffix(".part")
        pq.write_table(table, part, **_PARQUET_OPTIONS)
        os.replace(part, final)
        self._segments.append(final)
        if self._joined is None:
            self._joined = pq.ParquetWriter(self._tmp / JOINED_NAME, self._schema, **_PARQUET_OPTIONS)
        self._joined.write_table(table)
        self.num_rows += self._buffered
        self._buffered = 0
        self._buffered_bytes = 0

    def close(self) -> None:
        """Flush, finish the joined file (the segments' row groups, written as
        they were cut) with the footer summary and its digest, and rename it
        into place (atomic); the temporary folder is removed. Raises OSError
        (the folder is then removed too)."""
        try:
            self._flush()
            summary = {"steps": self._num_steps, "events": self.num_rows, "stalled": self.stalled}
            if self.crashed is not None:  # only then: every other footer keeps its bytes
                summary["crashed"] = self.crashed
            if self.salvaged is not None:
                summary["salvaged"] = self.salvaged
            if self.protocol is not None:
                summary["protocol"] = self.protocol
            out = self._tmp / JOINED_NAME
            if self._joined is None:  # no row at all
                self._joined = pq.ParquetWriter(out, self._schema, **_PARQUET_OPTIONS)
            joined, self._joined = self._joined, None
            _finish(joined, summary, out)
            # mkdtemp's folder is 0700 and files take the umask: the trace gets the usual mode.
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(out, 0o666 & ~umask)
            os.replace(out, self.path)
        finally:
            self._close_joined()
            _remove_temp_dir(self._tmp)

    def _close_joined(self) -> None:
        """Close the joined file's writer, if open (an abort: the file goes with the folder)."""
        joined, self._joined = self._joined, None
        if joined is not None:
            try:
                joined.close()
            except Exception:  # noqa: BLE001 (a half-written file being discarded)
                pass

    def abort(self) -> None:
        """Discard the temporary folder."""
        self._close_joined()
        _remove_temp_dir(self._tmp)

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


def join_segments(segments: list[Path], schema: pa.Schema, summary: dict[str, Any], out: Path) -> Path:
    """Write the row groups of ``segments`` (in order, one row group each)
    to ``out`` under ``schema`` (its metadata included), with ``summary`` in
    the footer (``SUMMARY_KEY``) plus ``trace_sha256``: the digest of the finished
    file (``digest_of_file``), patched in place of its placeholder. Returns
    ``out``. Raises OSError or pyarrow.ArrowException for an unreadable
    segment."""
    writer = pq.ParquetWriter(out, schema, **_PARQUET_OPTIONS)
    try:
        for segment in segments:
            # One segment at a time: memory is bounded by a row group.
            writer.write_table(pq.ParquetFile(segment, page_checksum_verification=True).read())
    except BaseException:
        writer.close()
        raise
    return _finish(writer, summary, out)


def _finish(writer: pq.ParquetWriter, summary: dict[str, Any], out: Path) -> Path:
    """Close ``writer`` (writing to ``out``) with ``summary`` in the footer
    (``SUMMARY_KEY``) plus ``trace_sha256``: the digest of the finished file
    (``digest_of_file``), patched in place of its placeholder. Returns ``out``.
    Raises OSError."""
    summary = {**summary, "trace_sha256": DIGEST_PLACEHOLDER}
    try:
        writer.add_key_value_metadata({SUMMARY_KEY: json.dumps(summary, sort_keys=True)})
    finally:
        writer.close()
    at = _placeholder_offset(out)
    digest = digest_of_file(out, at)
    with open(out, "r+b") as f:
        f.seek(at)
        f.write(digest.encode())
        f.flush()
        os.fsync(f.fileno())
    return out


def _placeholder_offset(path: Path) -> int:
    """Where the digest's 64 characters start in the footer of ``path``."""
    needle = f'"trace_sha256": "{DIGEST_PLACEHOLDER}"'.encode()
    size = path.stat().st_size
    with open(path, "rb") as f:
        f.seek(size - 8)
        footer_len = int.from_bytes(f.read(4), "little")
        start = size - 8 - footer_len
        f.seek(start)
        footer = f.read(footer_len)
    index = footer.find(needle)
    if index < 0 or footer.find(needle, index + 1) >= 0:
        raise OSError(f"{path}: the footer's digest placeholder is not found once")
    return start + index + len(needle) - 65


def reseal(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> Path:
    """Copy the Parquet file ``src`` (a trace edited with pyarrow, its
    metadata and footer summary kept) to ``dst`` with page checksums and a
    fresh digest: what a deliberate editor (a doctored test trace, a forger)
    does. The digest is evidence that nobody changed the file after it was
    written, not of who wrote it (docs/explanation/threat-model.md). Writes a temp file
    beside ``dst`` and renames it. Raises OSError or pyarrow.ArrowException
    for an unreadable ``src``, ValueError if it has no footer summary."""
    src, dst = Path(src), Path(dst)
    source = pq.ParquetFile(src)
    kv = dict(source.metadata.metadata or {})
    raw = kv.pop(SUMMARY_KEY, None)
    if raw is None:
        raise ValueError(f"{src}: no footer summary to reseal")
    summary = json.loads(raw)
    summary.pop("trace_sha256", None)
    kv.pop(b"ARROW:schema", None)
    table = source.read()
    schema = table.schema.with_metadata(kv)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        part = Path(tmp)
        pq.write_table(table.replace_schema_metadata(kv), part, **_PARQUET_OPTIONS)
        joined = join_segments([part], schema, summary, part.with_name(part.name + ".joined"))
        os.replace(joined, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dst
