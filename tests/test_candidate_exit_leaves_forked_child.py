"""Regression: a candidate that forked a process and then exited (``os._exit``)
left that process running after ``harness replay`` ended: the process group was
only killed while the candidate's own process was still alive."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from processes import outlived

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"

FORKER = """\
import os
from reference.scheduler import Scheduler


class ForkExit(Scheduler):
    def schedule(self, throttle_prefills=False):
        out = super().schedule(throttle_prefills)
        self._n = getattr(self, "_n", 0) + 1
        if self._n == 3:
            if os.fork() == 0:
                with open(os.environ["FORKED_PID_FILE"], "w") as f:
                    f.write(str(os.getpid()))
                os.execvp("sleep", ["sleep", "300"])
            import time as _t
            _t.sleep(0.5)
            os._exit(3)
        return out


def make(config):
    return ForkExit(config)
"""


def test_regression_candidate_exit_leaves_no_forked_child(tmp_path: Path) -> None:
    (tmp_path / "forker.py").write_text(FORKER)
    pid_file = tmp_path / "forked.pid"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", FORKED_PID_FILE=str(pid_file))
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN),
                           "--candidate", "forker:make"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the candidate process exited with code 3 during schedule()" in proc.stdout
    pid = int(pid_file.read_text())
    assert not outlived(pid), "the candidate's forked process outlived the harness"
