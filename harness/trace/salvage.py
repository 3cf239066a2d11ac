"""Salvage a killed recording: its complete segments become a trace.

``TraceWriter`` writes a run as complete, footed Parquet segments in a
temporary folder (``.NAME.XXXX.tmp/seg-000000.parquet``, ...; each renamed
into place only once whole, never splitting a step) and joins them when the
run ends. A run killed before that (SIGKILL, SIGTERM, a power cut) leaves
the folder: ``salvage(folder, out)`` joins every complete segment into a
schema-7 trace whose footer summary says it was salvaged (``salvaged``: one
line), so ``check`` and ``replay`` read it, warn, and stop at its last step
(no LIVENESS for the requests the kill cut off). What is lost: the rows
after the last complete segment (at most one row group: ``rows_per_group``
rows or ``bytes_per_group`` bytes) and the run's own summary. Once the trace
is in place, the folder goes (``Salvaged.removed``): left behind, it made a
later ``harness check`` of the folder above it report it again (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from harness.paths import arrow_source
from harness.trace.reader import TraceError, _one_line
from harness.trace.schema import METADATA_KEY
from harness.trace.writer import SEGMENT_GLOB, join_segments


@dataclass
class Salvaged:
    """What ``salvage`` kept: ``steps`` and ``events`` (rows) from
    ``segments`` complete row groups, the last step kept (``last_step``),
    and ``skipped``: one line per segment that could not be read (none for a
    folder the writer left). ``removed``: the folder was removed (the
    writer's, every segment salvaged); ``kept``: why it was not, or None."""

    out: Path
    steps: int
    events: int
    segments: int
    last_step: int
    skipped: list[str]
    removed: bool = False
    kept: str | None = None

    @property
    def line(self) -> str:
        """The footer's ``salvaged`` line."""
        return (f"salvaged from a run cut off after step {self.last_step}: {self.segments} complete "
                f"row group(s) kept, the rows after them lost")


def salvage(folder: str | os.PathLike[str], out: str | os.PathLike[str]) -> Salvaged:
    """Join the complete segments of a killed run's temporary ``folder`` into
    the trace ``out`` (temp file + rename; an existing ``out`` is replaced
    only once the new one is whole).

    Raises TraceError (one line naming the folder) when ``folder`` is not a
    writer's temporary folder, holds no complete segment, or its segments
    disagree on the run's metadata; OSError when ``out`` cannot be written.
    A segment that cannot be read ends the salvage there (``skipped``).
    """
    src, dst = Path(folder), Path(out)
    if not src.is_dir():
        raise TraceError(f"{src}: not a folder (salvage reads the temporary folder a killed "
                         f"`harness record` left, .NAME.XXXX.tmp)")
    segments = sorted(src.glob(SEGMENT_GLOB))
    if not segments:
        raise TraceError(f"{src}: no complete segment to salvage (the run was killed before its first "
                         f"row group was written)")
    kept: list[Path] = []
    skipped: list[str] = []
    meta: bytes | None = None
    schema: pa.Schema | None = None
    steps = events = 0
    last_step = -1
    for segment in segments:
        try:
            pf = pq.ParquetFile(arrow_source(segment), page_checksum_verification=True)
            seg_meta = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
            # Every column, every page's CRC checked: the salvaged trace gets a
            # fresh digest, so a changed byte must be caught here or never.
            table = pf.read()
            if "step" not in table.column_names:
                raise TraceError(f"{segment}: not a trace segment (no step column)")
            step_column = table.column("step").to_pylist()
            del table
        except (OSError, pa.ArrowException) as exc:
            skipped.append(f"{segment.name}: unreadable ({_one_line(exc)})")
            break
        if seg_meta is None or (meta is not None and seg_meta != meta):
            raise TraceError(f"{segment}: its run metadata differs from the first segment's "
                             f"(not one run's folder)")
        if step_column and step_column[0] <= last_step:
            raise TraceError(f"{segment}: its steps do not follow the previous segment's")
        if step_column and step_column[0] != last_step + 1 and not (last_step < 0 and step_column[0] == 0):
            if last_step < 0:
                raise TraceError(f"{segment}: the first segment starts at step {step_column[0]}, not 0 "
                                 f"(the run's first segment is missing)")
            skipped.append(f"{segment.name}: starts at step {step_column[0]}, not {last_step + 1} (a segment "
                           f"before it is missing); the salvage stops before it")
            break
        meta, schema = seg_meta, pf.schema_arrow
        steps += len(set(step_column))
        events += len(step_column)
        last_step = step_column[-1] if step_column else last_step
        kept.append(segment)
    if not kept:
        raise TraceError(f"{src}: no readable segment ({skipped[0]})")
    try:
        info = json.loads(meta)
    except ValueError:
        raise TraceError(f"{kept[0]}: sched-harness metadata is not valid JSON") from None
    if not isinstance(info, dict):
        raise TraceError(f"{kept[0]}: sched-harness metadata is not a JSON object")
    result = Salvaged(dst, steps, events, len(kept), last_step, skipped)
    summary = {"steps": steps, "events": events, "stalled": None, "salvaged": result.line}
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".salvage", dir=dst.parent)
    os.close(fd)
    try:
        join_segments(kept, schema.with_metadata({METADATA_KEY: meta}), summary, Path(tmp))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, dst)
    finally:
        Path(tmp).unlink(missing_ok=True)
    result.removed, result.kept = _remove_salvaged_folder(src, skipped)
    return result


#: The temporary folder ``TraceWriter`` makes beside its output (``.NAME.<16 hex>.tmp``)
#: and the files it writes there: segments, a segment being written, the joined trace
#: (``trace.parquet.part`` while the run goes; ``trace.parquet`` as older writers named it).
_WRITER_FOLDER = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")
_WRITER_FILE = re.compile(r"seg-[0-9]{6}\.(parquet|part)|trace\.parquet(\.part)?")


def _remove_salvaged_folder(src: Path, skipped: list[str]) -> tuple[bool, str | None]:
    """Remove the writer's folder ``src`` once its trace is salvaged: (removed,
    why kept). Kept when a segment was skipped (its rows are not in the trace),
    when the folder is not named as the writer names it, or when it holds
    anything the writer does not write (nothing of anyone else's is removed)."""
    if skipped:
        return False, f"{len(skipped)} segment(s) not salvaged"
    if not _WRITER_FOLDER.fullmatch(src.name):
        return False, "not named as a recording's temporary folder (.NAME.XXXX.tmp)"
    entries = list(src.iterdir())
    foreign = [e.name for e in entries if not (_WRITER_FILE.fullmatch(e.name) and e.is_file()
                                               and not e.is_symlink())]
    if foreign:
        return False, f"it holds {foreign[0]!r}, not the recording's"
    try:
        for entry in entries:
            entry.unlink()
        src.rmdir()
    except OSError as exc:
        return False, f"cannot remove it ({exc.strerror or exc})"
    return True, None
