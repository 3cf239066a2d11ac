"""Regression: ``harness salvage`` checked page CRCs of the ``step`` column
only and joined the segments without checking the others, so a byte flipped
in a segment (a prompt token) came out in a freshly sealed trace that
``check`` called conformant; a folder missing a middle segment was joined
across the gap ("up to step 2077" over 1426 steps), which ``check`` then
refused as a bad row; a foreign Parquet segment was ``error: KeyError: ...``
naming no file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pathlib import Path

from harness.trace import TraceError
from harness.trace.salvage import salvage
from harness.trace.writer import TraceWriter


def _folder(tmp_path: Path, steps: int = 3) -> Path:
    """A writer's folder of ``steps`` one-step segments (2 rows each, a message per row)."""
    writer = TraceWriter(tmp_path / "t.parquet", {"engine": "x"}, rows_per_group=2)
    for step in range(steps):
        writer.add_step([{"step": step, "event_index": i, "kind": "update_end", "rank": 0,
                          "message": f"step {step} row {i} " * 20} for i in range(2)])
    return writer.temp_dir


def _flip_in_column(path: Path, column: str) -> None:
    md = pq.ParquetFile(path).metadata
    idx = pq.ParquetFile(path).schema_arrow.names.index(column)
    chunk = md.row_group(0).column(idx)
    at = chunk.data_page_offset + chunk.total_compressed_size - 1
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_regression_salvage_refuses_a_flipped_byte_outside_the_step_column(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    _flip_in_column(folder / "seg-000001.parquet", "message")
    result = salvage(folder, tmp_path / "s.parquet")
    assert (result.steps, result.events, result.segments, result.last_step) == (1, 2, 1, 0)
    assert len(result.skipped) == 1
    assert result.skipped[0].startswith("seg-000001.parquet: unreadable (")
    assert "CRC" in result.skipped[0] or "checksum" in result.skipped[0].lower()
    assert pq.read_table(tmp_path / "s.parquet").column("step").to_pylist() == [0, 0]


def test_regression_salvage_stops_at_a_missing_segment(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "seg-000001.parquet").unlink()
    result = salvage(folder, tmp_path / "s.parquet")
    assert (result.steps, result.events, result.segments, result.last_step) == (1, 2, 1, 0)
    assert result.skipped == ["seg-000002.parquet: starts at step 2, not 1 (a segment before it is missing); "
                              "the salvage stops before it"]


def test_regression_salvage_refuses_a_folder_without_its_first_segment(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "seg-000000.parquet").unlink()
    (folder / "seg-000001.parquet").rename(folder / "seg-000000.parquet")
    with pytest.raises(TraceError, match=r"the first segment starts at step 1, not 0"):
        salvage(folder, tmp_path / "s.parquet")


def test_regression_salvage_names_a_foreign_segment(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    pq.write_table(pa.table({"a": [1, 2]}), folder / "seg-000001.parquet")
    with pytest.raises(TraceError) as info:
        salvage(folder, tmp_path / "s.parquet")
    assert str(info.value) == f"{folder / 'seg-000001.parquet'}: not a trace segment (no step column)"
