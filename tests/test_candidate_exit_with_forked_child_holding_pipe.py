"""Regression: a candidate that forked (without exec: the forked Python keeps
the answer pipe open) and then exited was not seen to die: the harness waited
out the whole call bound and reported ``StepTimeout: no answer from schedule()
within 20 s`` (at import: ``no answer from importing ... within 60 s``)
instead of ``CandidateDied ... exited with code 0``. The wait now checks, every
half second, that the candidate's process is alive."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from processes import outlived

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-roomy.parquet"

# Fork a Python that holds the pipe (and writes its PID), then exit 0.
FORK_THEN_EXIT = """\
if os.fork() == 0:
    with open(os.environ["FORKED_PID_FILE"], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
    os._exit(0)
time.sleep(0.3)
os._exit(0)
"""

IN_SCHEDULE = """\
import os, time
from reference.scheduler import Scheduler


class S(Scheduler):
    n = 0

    def schedule(self, throttle_prefills=False):
        self.n += 1
        if self.n == 5:
""" + textwrap.indent(FORK_THEN_EXIT, " " * 12) + """\
        return super().schedule(throttle_prefills)


def make(config):
    return S(config)
"""

AT_IMPORT = "import os, time\n" + FORK_THEN_EXIT


def _replay(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess, float, int]:
    (tmp_path / "forker.py").write_text(source)
    pid_file = tmp_path / "forked.pid"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", FORKED_PID_FILE=str(pid_file))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN), "--candidate",
                           "forker:make", "--step-timeout", "20"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    return proc, time.monotonic() - start, int(pid_file.read_text())


def test_regression_exit_in_schedule_with_forked_child_is_candidate_died(tmp_path: Path) -> None:
    proc, took, pid = _replay(tmp_path, IN_SCHEDULE)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert ("kind=crash status=schedule message=CandidateDied: the candidate process exited with code 0 "
            "during schedule()") in proc.stdout
    assert took < 15, took
    assert not outlived(pid)


def test_regression_exit_at_import_with_forked_child_is_one_line(tmp_path: Path) -> None:
    proc, took, pid = _replay(tmp_path, AT_IMPORT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("error: Invalid value: candidate 'forker:make': the candidate process exited with "
                           "code 0 while importing it (harness replay --help)\n")
    assert took < 15, took
    assert not outlived(pid)
