"""Regression (trials, missed bug): ``harness replay --semantics fork`` (and
``safety``) stopped at the first differing decision, printed "conformant
(profile fork); decisions differ from step S (information ...)" and exited 0
whatever the candidate did after it: a broken MAX-NUM-SEQS, a crash at step
50, a pool twice the config's size. Now, once decisions differ under a
profile that does not compare them, the candidate's own run of the trace's
workload, config and seed is checked under that profile (as ``fuzz
--semantics fork`` does): a violation, crash or stall there exits 1; a
correct fork (a different policy) still passes with the information line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from forks import put_on_path
from harness.cli import main

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "golden"

CANDIDATES = '''
import dataclasses
from reference.scheduler import Scheduler
from forks.shortest_prompt_first import ShortestPromptFirst  # the shared correct fork (tests/forks/)


class CrashAt50(ShortestPromptFirst):
    """The same policy, and a RuntimeError in schedule() at step 50."""

    calls = 0

    def schedule(self, throttle_prefills=False):
        self.calls += 1
        if self.calls > 50:
            raise RuntimeError("boom at step 50")
        return super().schedule(throttle_prefills)


class Stall(ShortestPromptFirst):
    """The same policy; from step 60 it schedules nothing (its queues hidden from schedule())."""

    calls = 0

    def schedule(self, throttle_prefills=False):
        self.calls += 1
        if self.calls > 60:
            waiting, running = self.waiting, self.running
            self.running = []
            self.waiting = type(waiting)()
            try:
                return super().schedule(throttle_prefills)
            finally:
                self.waiting, self.running = waiting, running
        return super().schedule(throttle_prefills)


def stall(config):
    return Stall(config)


def spf(config):
    return ShortestPromptFirst(config)


def crash_at_50(config):
    return CrashAt50(config)


def double_pool(config):
    """The reference on twice the config's KV pool and token budget."""
    return Scheduler(dataclasses.replace(config, num_gpu_blocks=2 * config.num_gpu_blocks,
                                         max_num_batched_tokens=2 * config.max_num_batched_tokens))
'''


@pytest.fixture
def fork_candidates(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "fg_candidates.py").write_text(CANDIDATES)
    put_on_path(monkeypatch, tmp_path)
    monkeypatch.delitem(sys.modules, "fg_candidates", raising=False)


def _replay(golden: str, candidate: str, semantics: str = "fork", *extra: str):
    return CliRunner().invoke(main, ["replay", str(GOLDEN / golden), "--candidate", candidate,
                                     "--semantics", semantics, *extra])


def _witnesses(output: str) -> list[str]:
    return [line.split(":")[0] for line in output.splitlines() if line.startswith("VIOLATION ")]


@pytest.mark.parametrize("semantics", ["fork", "safety"])
def test_ignoring_max_num_seqs_fails_the_gate(semantics: str) -> None:
    r = _replay("fcfs-roomy.parquet", "mutant:ignore-max-num-seqs", semantics)
    assert r.exit_code == 1, r.output[-3000:]
    lines = r.output.splitlines()
    assert lines[-1] == (f"not conformant (profile {semantics}): the candidate's own run has 6 violations of "
                         "1 invariant: MAX-NUM-SEQS ×6; decisions differ from step 10 (information: not "
                         "held to a version's design)")
    assert (f"own run: mutant:ignore-max-num-seqs re-run on the trace's workload, config and seed from "
            f"step 0: 371 steps, 6 violations (profile {semantics})") in lines
    assert _witnesses(r.output) == ["VIOLATION MAX-NUM-SEQS at step 10, request r000004",
                                    "VIOLATION MAX-NUM-SEQS at step 10",
                                    "VIOLATION MAX-NUM-SEQS at step 131, request r000025",
                                    "VIOLATION MAX-NUM-SEQS at step 131",
                                    "VIOLATION MAX-NUM-SEQS at step 132, request r000026",
                                    "VIOLATION MAX-NUM-SEQS at step 132"]


def test_json_says_the_own_run_failed() -> None:
    r = _replay("fcfs-roomy.parquet", "mutant:ignore-max-num-seqs", "fork", "--json")
    assert r.exit_code == 1
    doc = json.loads(r.output)
    assert (doc["ok"], doc["exit"], doc["divergence_is_information"], doc["divergence"]["step"]) == (False, 1, True, 10)
    own = doc["own_run"]
    assert (own["ok"], own["steps"], own["ended"], own["profile"], own["num_violations"],
            own["violations_by_invariant"]) == (False, 371, None, "fork", 6, {"MAX-NUM-SEQS": 6})


def test_a_crash_after_the_first_difference_fails_the_gate(fork_candidates) -> None:
    r = _replay("preemption-heavy.parquet", "fg_candidates:crash_at_50")
    assert r.exit_code == 1, r.output[-3000:]
    lines = r.output.splitlines()
    assert lines[-1] == ("not conformant (profile fork): the candidate's own run has 1 violation of 1 "
                         "invariant: ENGINE-CRASH ×1; decisions differ from step 3 (information: not held "
                         "to a version's design)")
    assert [line.split(" at fg_candidates")[0] for line in lines if line.startswith("VIOLATION ")] == [
        "VIOLATION ENGINE-CRASH at step 50: schedule() raised RuntimeError: boom at step 50"]


def test_a_stall_after_the_first_difference_fails_the_gate(fork_candidates) -> None:
    r = _replay("preemption-heavy.parquet", "fg_candidates:stall")
    assert r.exit_code == 1, r.output[-3000:]
    lines = r.output.splitlines()
    assert ("own run: fg_candidates:stall re-run on the trace's workload, config and seed from step 0: 101 steps, "
            "206 violations; stalled after step 100: step 100: 46 unfinished requests but nothing scheduled and "
            "no arrival or abort ahead (profile fork)") in lines
    assert lines[-1] == ("not conformant (profile fork): the candidate's own run has 206 violations of 3 "
                         "invariants: LIVENESS ×46, PROGRESS-ADMIT ×37, PROGRESS-RUNNING ×123; decisions differ "
                         "from step 3 (information: not held to a version's design)")


def test_a_pool_larger_than_the_config_fails_the_gate(fork_candidates) -> None:
    r = _replay("preemption-heavy.parquet", "fg_candidates:double_pool")
    assert r.exit_code == 1, r.output[-3000:]
    assert r.output.splitlines()[-1] == (
        "not conformant (profile fork): the candidate's own run has 622 violations of 2 invariants: "
        "BLOCK-CONSERVATION ×615, BUDGET-TOKENS ×7; decisions differ from step 0 (information: not held "
        "to a version's design)")
    assert _witnesses(r.output)[:1] == ["VIOLATION BLOCK-CONSERVATION at step 0"]
    assert "VIOLATION BUDGET-TOKENS at step 11" in _witnesses(r.output)


def test_a_correct_fork_still_passes_with_the_information_line(fork_candidates) -> None:
    r = _replay("preemption-heavy.parquet", "fg_candidates:spf")
    assert r.exit_code == 0, r.output[-3000:]
    assert r.output.splitlines()[-2:] == [
        "own run: fg_candidates:spf re-run on the trace's workload, config and seed from step 0: 232 steps, "
        "no violation (profile fork)",
        "conformant (profile fork); decisions differ from step 3 (information: not held to a version's design)"]


def test_identical_and_auto_replays_are_unchanged() -> None:
    same = _replay("fcfs-roomy.parquet", "reference")
    assert (same.exit_code, same.output.splitlines()[-1]) == (
        0, "conformant (profile fork): 372 steps replayed, identical decisions")
    assert "own run" not in same.output
    auto = _replay("fcfs-roomy.parquet", "mutant:ignore-max-num-seqs", "auto")
    assert (auto.exit_code, auto.output.splitlines()[-1]) == (
        1, "not conformant (profile 0.33.0); first divergence at step 10")
    assert "own run" not in auto.output
