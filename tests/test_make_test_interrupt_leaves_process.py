"""Regression (issue 26): a Ctrl-C of ``make test`` left a process running (a
vLLM model-registry subprocess, in a session of its own). ``make test`` now
runs pytest under the reaper shim (``python -m harness.children -- ...``):
whatever the run leaves behind, even a process that called ``setsid`` and
whose parent is gone, is killed when the command ends; the exit status is the
command's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from processes import outlived

REPO = Path(__file__).resolve().parent.parent

# Stands for pytest: leaves a daemon (double fork + setsid), then waits for Ctrl-C.
RUN = """\
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a test runner may start us with it ignored
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        with open(sys.argv[1], "w") as f:
            f.write(str(os.getpid()))
        os.execvp("sleep", ["sleep", "300"])
    os._exit(0)
try:
    time.sleep(300)
except KeyboardInterrupt:
    sys.exit(2)
"""


def test_regression_ctrl_c_under_the_shim_leaves_no_process(tmp_path: Path) -> None:
    pid_file = tmp_path / "daemon.pid"
    proc = subprocess.Popen([sys.executable, "-m", "harness.children", "--", sys.executable, "-c", RUN,
                             str(pid_file)], cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C: the whole foreground group
    assert proc.wait(timeout=30) == 2  # the command's own status
    assert not outlived(int(pid_file.read_text())), "the daemon outlived the interrupted run"


def test_the_makefile_runs_pytest_under_the_shim() -> None:
    text = (REPO / "Makefile").read_text()
    assert "$(BIN)/python -m harness.children -- $(BIN)/python -m pytest" in text
