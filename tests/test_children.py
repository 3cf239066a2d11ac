"""harness/children.py: no process the harness starts outlives it.

The regression: CI saw ``vllm serve`` and its EngineCore alive 60 s after
``harness serve-record`` was SIGKILLed; the only layer that covered SIGKILL
was ``PR_SET_PDEATHSIG`` (SIGTERM to the server alone), which a server still
starting up did not honour. The watchdog kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from harness.children import GroupWatchdog, die_with_parent
from processes import alive, outlived

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A "harness" that starts a "server" in its own session, the server ignoring
# SIGTERM and SIGINT and holding a grandchild; the harness prints both PIDs
# and its watchdog's, then waits to be killed.
_HARNESS = """
import subprocess, sys, time
from harness.children import GroupWatchdog, die_with_parent
server = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          "signal.signal(signal.SIGINT, signal.SIG_IGN); "
          "p = subprocess.Popen(['sleep', '600']); print(p.pid, flush=True); time.sleep(600)")
proc = subprocess.Popen([sys.executable, "-c", server], stdout=subprocess.PIPE, text=True,
                        start_new_session=True, preexec_fn=die_with_parent({pdeath}))
grandchild = int(proc.stdout.readline())
dog = GroupWatchdog(proc.pid, grace_s={grace})
print(proc.pid, grandchild, dog._proc.pid, flush=True)
time.sleep(600)
"""


def _start(grace: float, pdeath: int = signal.SIGTERM) -> tuple[subprocess.Popen, list[int]]:
    harness = subprocess.Popen([sys.executable, "-c", _HARNESS.format(grace=grace, pdeath=int(pdeath))],
                               stdout=subprocess.PIPE, text=True, cwd=REPO)
    pids = [int(x) for x in harness.stdout.readline().split()]
    assert len(pids) == 3, pids
    return harness, pids


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    """The PIDs still running after ``seconds`` (then SIGKILLed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if outlived(p, 0)]


def test_regression_sigkill_of_harness_leaves_server_that_ignores_sigterm() -> None:
    harness, (server, grandchild, dog) = _start(grace=1.0)
    t0 = time.monotonic()
    harness.kill()
    harness.wait()
    assert _gone_within([server, grandchild, dog], 20) == []
    # SIGTERM was ignored, so it took the SIGKILL after the 1 s grace, not before it.
    assert time.monotonic() - t0 >= 1.0


def test_watchdog_kills_grandchildren_when_the_server_itself_died() -> None:
    # PDEATHSIG SIGKILL: the server dies at once, its grandchild (another group
    # member, no death signal of its own; it inherited the server's ignored
    # SIGTERM) is what the watchdog must stop.
    harness, (server, grandchild, dog) = _start(grace=1.0, pdeath=signal.SIGKILL)
    harness.kill()
    harness.wait()
    assert _gone_within([server, grandchild, dog], 20) == []


def test_release_after_a_clean_stop_touches_nothing() -> None:
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True, preexec_fn=die_with_parent())
    dog = GroupWatchdog(proc.pid, grace_s=0.5)
    watchdog_pid = dog._proc.pid
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    t0 = time.monotonic()
    dog.release()
    assert time.monotonic() - t0 < 5 and not alive(watchdog_pid)
    dog.release()  # twice is harmless
