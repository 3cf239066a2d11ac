"""Regression: ``harness salvage TMPDIR -o OUT`` skipped the output check every
other writer makes: ``-o`` a FIFO (or, as root, a device) was replaced by the
trace (exit 0), and ``-o TMPDIR/seg-000000.parquet`` named a segment it reads."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.test_salvage import _killed_record, run


@pytest.fixture(scope="module")
def killed(tmp_path_factory) -> Path:
    folder, _ = _killed_record(tmp_path_factory.mktemp("salvage"), segments=1)
    return folder


def test_regression_salvage_refuses_a_fifo(killed: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, out = run("salvage", killed, "-o", fifo)
    assert code == 2, out
    assert out.strip() == f"error: {fifo}: -o names a FIFO, not a regular file; refusing to replace it"
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_regression_salvage_refuses_a_segment_or_a_path_in_the_folder(killed: Path) -> None:
    segment = killed / "seg-000000.parquet"
    before = segment.read_bytes()
    code, out = run("salvage", killed, "-o", segment)
    assert code == 2, out
    assert out.strip() == f"error: {segment}: -o names the input file; it would be overwritten (choose another path)"
    assert segment.read_bytes() == before
    code, out = run("salvage", killed, "-o", killed / "new.parquet")
    assert code == 2, out
    assert out.strip() == f"error: {killed / 'new.parquet'}: -o is inside the folder being salvaged; choose another path"
    assert not (killed / "new.parquet").exists()


def test_salvage_still_writes_a_plain_path(killed: Path, tmp_path: Path) -> None:
    code, out = run("salvage", killed, "-o", tmp_path / "ok.parquet")
    assert code == 0, out
    assert (tmp_path / "ok.parquet").is_file()
