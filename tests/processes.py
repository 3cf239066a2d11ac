"""Test helper (not a test module): is a process still running after the
harness should have stopped it? Used by the regression tests of processes
that outlived their parent (``test_*_leaves_*.py``)."""

from __future__ import annotations

import os
import signal
import time


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (reads /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] != "Z"
    except OSError:
        return False


def outlived(pid: int, seconds: float = 5.0) -> bool:
    """Wait up to ``seconds`` for ``pid`` to end; True if it is still running
    then (it is SIGKILLed, so a failing test leaves nothing behind)."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        return True
    return False
