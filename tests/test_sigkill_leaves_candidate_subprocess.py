"""Regression: SIGKILL of the harness left a candidate's processes running.

* ``module:factory``: the candidate's process died with the harness
  (PR_SET_PDEATHSIG), but a subprocess the candidate had started (``sleep``)
  was left, reparented to init (measured: ``sleep 321`` alive after
  ``kill -KILL`` of ``harness replay``);
* ``vllm@...``: the driver had no parent-death signal and no watchdog: a driver
  busy in a ``scheduler_cls`` that hangs (tests/vllm_classes HangingScheduler)
  was alive 5 s after SIGKILL of ``harness replay``, reparented to init.

Each child now has a ``GroupWatchdog`` (the driver also PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from processes import outlived

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-roomy.parquet"

CANDIDATE = """\
import os, subprocess, time
from reference.scheduler import Scheduler


class S(Scheduler):
    n = 0

    def schedule(self, throttle_prefills=False):
        self.n += 1
        if self.n == 3:
            p = subprocess.Popen(["sleep", "300"])
            with open(os.environ["SPAWNED_PID_FILE"], "w") as f:
                f.write(str(p.pid))
            time.sleep(300)
        return super().schedule(throttle_prefills)


def make(config):
    return S(config)
"""

# A process that starts a vLLM driver (a fake one: a Python that sleeps) and
# is then SIGKILLed while the driver runs.
DRIVER_HOLDER = """\
import os, signal, sys, time
from pathlib import Path
from harness.candidates.vllm import candidate as c
from harness.candidates.vllm.spec import VLLMTarget
fake = Path(sys.argv[1])
fake.write_text("import time\\ntime.sleep(300)\\n")
c.DRIVER = fake
target = VLLMTarget.__new__(VLLMTarget)
object.__setattr__(target, "version", "0.0.0")
object.__setattr__(target, "python", Path(sys.executable))
object.__setattr__(target, "release", False)
object.__setattr__(target, "pythonpath", ())
object.__setattr__(target, "scheduler_cls", None)
c._pool_key = lambda t: "fake"
d = c._DriverProcess(target)
print(d.proc.pid, flush=True)
time.sleep(300)
"""


def _wait_for(path: Path, seconds: float = 60) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


def test_regression_sigkill_of_replay_kills_the_candidates_subprocess(tmp_path: Path) -> None:
    (tmp_path / "spawner.py").write_text(CANDIDATE)
    pid_file = tmp_path / "spawned.pid"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", SPAWNED_PID_FILE=str(pid_file))
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN), "--candidate",
                             "spawner:make"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env, cwd=tmp_path)
    try:
        spawned = _wait_for(pid_file)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not outlived(spawned, 10), "the candidate's subprocess outlived SIGKILL of the harness"


def test_regression_sigkill_of_the_harness_kills_a_busy_vllm_driver(tmp_path: Path) -> None:
    script = tmp_path / "holder.py"
    script.write_text(DRIVER_HOLDER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "fake_driver.py")],
                            stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        driver = int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
    assert not outlived(driver, 10), "the vLLM driver outlived SIGKILL of the harness"
