"""Regression: SIGTERM to ``harness record`` under CI load left the writer's
``.NAME.XXXX.tmp/`` folder (tests/test_signals.py, seen once in CI): the
handler's UserInterrupt landed between the folder's mkdir (inside
``tempfile.mkdtemp``) and the ``with`` block that would abort it. The folder
is now registered before its mkdir and removed at exit
(harness/trace/writer.py ``_OPEN_TEMP_DIRS``); SIGKILL still leaves it for
``harness salvage``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.trace import writer as writer_mod
from harness.trace.writer import TraceWriter

REPO = Path(__file__).resolve().parents[1]


def test_interrupt_right_after_mkdir_leaves_nothing(tmp_path, monkeypatch) -> None:
    real_mkdir = os.mkdir

    def mkdir_then_interrupt(path, mode=0o777):
        real_mkdir(path, mode)
        raise KeyboardInterrupt  # the signal handler, at the first bytecode after the syscall

    monkeypatch.setattr(writer_mod.os, "mkdir", mkdir_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        TraceWriter(tmp_path / "t.parquet", {})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("how, left", [("sys.exit(143)", 0), ("os.kill(os.getpid(), 9)", 1)])
def test_a_writer_never_entered_is_removed_at_exit_but_not_on_sigkill(tmp_path, how, left) -> None:
    code = (f"import os, sys; from harness.trace.writer import TraceWriter; "
            f"w = TraceWriter({str(tmp_path / 't.parquet')!r}, {{}}); {how}")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".t.parquet.")]) == left
