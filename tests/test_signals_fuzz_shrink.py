"""Regression: a Ctrl-C (SIGINT) while ``harness fuzz`` shrank a failure lost the
failure: the run exited 130 with "interrupted by SIGINT" and no witness, though a
failing scenario was already known. Now the smallest failing scenario found before
the signal is reported as a finding (its witness files and replay command), the
output says shrinking was interrupted, and the exit is the finding's, 1
(``harness.fuzz.run.fuzz``, ``FuzzResult.interrupted``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.candidates.mutants import MUTANTS
from harness.fuzz.run import fuzz
from harness.signals import user_interrupts

REPO = Path(__file__).resolve().parent.parent


def test_sigint_mid_shrink_returns_the_smallest_failure_so_far() -> None:
    """ignore-max-num-seqs, seed 0: the 9th example fails (3 requests) and shrinks, in 48 runs,
    to 2 requests. A SIGINT at the 6th shrink run (the harness's handler installed, as under
    ``harness fuzz``) ends the search with the last failing case before it, unshrunk past it."""
    shrink_runs: list[int] = []

    def on_example(n: int, shrinking: bool) -> None:
        if shrinking:
            shrink_runs.append(n)
            if len(shrink_runs) == 6:
                os.kill(os.getpid(), signal.SIGINT)

    with user_interrupts():
        result = fuzz(MUTANTS["ignore-max-num-seqs"], max_examples=100, seed=0, on_example=on_example)
    assert (result.examples, result.shrink_calls, result.interrupted, result.budget_exhausted) == (
        9, 6, signal.SIGINT, False)
    assert (result.failure.kind, result.failure.invariants) == ("violation", {"MAX-NUM-SEQS": 3})
    assert result.failure.message == ("MAX-NUM-SEQS at step 0, request r000001: admitted with 1 running = "
                                      "max_num_seqs 1")
    assert result.case.describe() == ("3 requests; bs=8 blocks=8 mml=56 seqs=1 budget=56 fcfs "
                                      "no-enable_chunked_prefill no-scheduler_reserve_full_isl")
    # Left alone, the same search shrinks further: the interrupted one kept an earlier case.
    whole = fuzz(MUTANTS["ignore-max-num-seqs"], max_examples=100, seed=0)
    assert (whole.interrupted, whole.shrink_calls, len(whole.case.requests)) == (None, 48, 2)


def test_sigint_before_any_failure_still_interrupts() -> None:
    """Nothing found yet: the interrupt goes on (the command exits 130, as before)."""
    def on_example(n: int, shrinking: bool) -> None:
        if n == 2:
            os.kill(os.getpid(), signal.SIGINT)

    with user_interrupts():
        try:
            fuzz(None, max_examples=100, seed=0, on_example=on_example)
        except KeyboardInterrupt as exc:
            assert getattr(exc, "signum", None) == signal.SIGINT
        else:
            raise AssertionError("the interrupt was swallowed")


# A candidate in its own process (module:factory), admitting past max_num_seqs like the
# ignore-max-num-seqs mutant, slowed down so that shrinking lasts. Each scheduler instance that
# shows the bug appends a line to SHRINK_MARK, during its run: a run whose bug shows fails, and
# has at most 2 instances (data_parallel_size <= 2), so with W workers 2 * W + 1 lines mean some
# worker's failing run is over: it is shrinking.
SLOW_OVERADMIT = """\
import os
import time

from reference.scheduler import Scheduler


class SlowOveradmit(Scheduler):
    def __init__(self, config):
        super().__init__(config)
        self.max_num_running_reqs = config.max_num_seqs + 4
        self.marked = False

    def schedule(self, throttle_prefills=False):
        out = super().schedule(throttle_prefills)
        if not self.marked and len(self.running) > self.config.max_num_seqs:
            self.marked = True
            with open(os.environ["SHRINK_MARK"], "a") as f:
                f.write("bug\\n")
        time.sleep(0.05)
        return out


def make(config):
    return SlowOveradmit(config)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_regression_sigint_during_fuzz_shrinking_reports_the_failure(tmp_path: Path, workers: int) -> None:
    """`harness fuzz --candidate slow:make`, SIGINT (to the command alone, as `kill -INT` sends
    it) once a shrink run has failed: exit 1 (the finding's), the summary says shrinking was
    interrupted, the witness is reported with its invariant, files and replay command, and its
    description records the interruption. With 2 workers the command passes the SIGINT on and
    takes the smallest failure of each worker that was shrinking."""
    (tmp_path / "slow.py").write_text(SLOW_OVERADMIT)
    mark = tmp_path / "mark"
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}", SHRINK_MARK=str(mark))
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "fuzz", "--candidate", "slow:make",
                             "--max-examples", "100", "--workers", str(workers), "-o", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (mark.exists() and len(mark.read_text().splitlines()) >= 2 * workers + 1):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no shrink run failed in 240 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, out + err
    lines = out.splitlines()
    assert ("shrinking interrupted by SIGINT: reporting the smallest failing scenario found before it"
            in lines), out
    found = next(line for line in lines if line.startswith("FOUND ") and "violation" in line)
    assert found.startswith("FOUND violation: MAX-NUM-SEQS at step " if workers == 1 else "FOUND worker "), out
    assert "violation: MAX-NUM-SEQS at step " in found, out
    assert any(line.startswith("  shrunk to ") and line.endswith(
        "; shrinking interrupted by SIGINT, the smallest so far)") for line in lines), out
    replay = next(line for line in lines if line.startswith("  replay: "))
    assert "harness replay " in replay and "--candidate slow:make" in replay, out
    assert lines[-1].startswith("found: ") and lines[-1].endswith(f"written to {tmp_path / 'out'}"), out
    description = sorted((tmp_path / "out").glob("*.json"))[0]
    info = json.loads(description.read_text())
    assert (info["shrink_interrupted"], info["failure"]["kind"]) == ("SIGINT", "violation")
    assert "MAX-NUM-SEQS" in info["failure"]["invariants"]
    assert "interrupted by SIGINT" not in err, err
