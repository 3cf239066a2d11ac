"""Regression (issue 26): a candidate whose grandchild detached itself (a
double fork and ``setsid``: its own session and process group, orphaned)
outlived ``harness replay`` and held the harness's stderr open for minutes,
so a caller reading that stderr (``subprocess.run(capture_output=True)``)
waited for it. The candidate now runs under the reaper shim
(``harness.children.shim_command``): the orphan is re-parented to the shim
and killed with the candidate, and the candidate's stderr is a pipe the
harness relays, never the harness's own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from processes import outlived

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"

DETACHER = """\
import os, sys
from reference.scheduler import Scheduler


class Detacher(Scheduler):
    def schedule(self, throttle_prefills=False):
        self._n = getattr(self, "_n", 0) + 1
        if self._n == 2 and os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # the grandchild: a daemon, in its own session
                with open(os.environ["DETACHED_PID_FILE"], "w") as f:
                    f.write(str(os.getpid()))
                print("detached grandchild holding stderr", file=sys.stderr, flush=True)
                os.execvp("sleep", ["sleep", "300"])
            os._exit(0)
        return super().schedule(throttle_prefills)


def make(config):
    return Detacher(config)
"""


def test_regression_setsid_grandchild_is_stopped_with_the_candidate(tmp_path: Path) -> None:
    (tmp_path / "detacher.py").write_text(DETACHER)
    pid_file = tmp_path / "detached.pid"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", DETACHED_PID_FILE=str(pid_file))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN),
                           "--candidate", "detacher:make"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("conformant (profile 0.33.0): ")
    assert "detached grandchild holding stderr" in proc.stderr  # relayed, not inherited
    assert took < 60, took  # stderr reached end of stream when replay ended
    assert not outlived(int(pid_file.read_text())), "the detached grandchild outlived replay"
