"""Regression (issue 26): a ``harness golden update`` killed with SIGKILL left
its temporary files (up to 15: each scenario's ``.NAME.parquet.XXXX.tmp`` and
the segment folder of its recording) in the golden folder, ignored and never
cleaned. The next update takes the folder's lock and removes them first."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest

from harness.golden import GoldenError, update_goldens

REPO = Path(__file__).resolve().parent.parent


def test_regression_next_golden_update_removes_a_killed_runs_debris(tmp_path: Path) -> None:
    folder = tmp_path / "golden"
    shutil.copytree(REPO / "golden", folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}  # golden/hybrid/ is its own set
    debris = [folder / ".fcfs-tight.parquet.k3j2h1.tmp", folder / ".MANIFEST.json.a1b2c3.tmp",
              folder / ".spec-decode.parquet.zz9.tmp"]
    for path in debris:
        path.write_bytes(b"half a trace")
    segments = folder / "..fcfs-roomy.parquet.q1w2e3.tmp.0123456789abcdef.tmp"
    segments.mkdir()
    (segments / "seg-000000.parquet").write_bytes(b"PAR1")
    mine = folder / ".notes.tmp"  # not a name an update writes: kept
    mine.write_text("kept")
    changes = update_goldens(folder, ["fcfs-tight"])
    assert [(c.scenario, c.status) for c in changes] == [("fcfs-tight", "unchanged")]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*before, mine.name, "hybrid"])
    assert all((folder / name).read_bytes() == data for name, data in before.items())


def test_a_second_update_of_the_same_folder_is_refused_while_one_runs(tmp_path: Path) -> None:
    folder = tmp_path / "golden"
    folder.mkdir()
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(GoldenError, match="another 'harness golden update' is updating this folder"):
            update_goldens(folder, ["fcfs-tight"])
    finally:
        os.close(fd)
