"""Regression (two trials, new-user F1 and adversarial finding 1): the
progress rules assumed vLLM's walk order of running (the ``schedule_begin``
row's order) under the fork gate, where the walk order is the fork's own.

- ``deferred-frees`` step 3, PROGRESS-RUNNING on r000001: a shortest-remaining-
  first fork walked r000002 first; it needed a block, its victim's free was
  fenced, and the loop gave up there (as vLLM 0.33.0 does). r000001 came after.
- ``priority-tight`` step 39, PROGRESS-PREEMPT-NEEDED on r000004: in the fork's
  order r000007 came first and preempted itself (the PRIORITY victim was the
  request at hand); r000004 then got its block.
- A round-robin fork that puts ``self.running`` back in order after each step
  (``encoder-inputs``, ``deferred-frees``): its walk order shows in no queue row.

Under the fork gate the rules now judge only what holds for every walk order the
rows allow (``harness.check.progress.walk_order_known``); under a release's
profile vLLM's order is assumed, as before. A fork that really skips a runnable
request is still caught. Forks: ``tests/forks/running_order.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _own_run(golden: str, factory: str, semantics: str):
    from forks import running_order
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN / f"{golden}.parquet")
    profile, _ = resolve(semantics, trace.meta)
    return own_run(trace, getattr(running_order, factory), profile)


def _witnesses(run, invariant: str) -> list[tuple]:
    return [(v.step, v.request, v.message) for v in run.result.violations if v.invariant == invariant]


@pytest.mark.parametrize(("golden", "factory", "steps"), [
    ("deferred-frees", "make", 211),
    ("priority-tight", "make", 221),
    ("deferred-frees", "make_round_robin", 215),
    ("encoder-inputs", "make_round_robin", 497),
])
def test_a_fork_walking_running_in_its_own_order_passes_the_fork_gate(golden: str, factory: str,
                                                                      steps: int) -> None:
    run = _own_run(golden, factory, "fork")
    assert (run.ended, run.steps, run.result.by_invariant) == ("", steps, {})


def test_under_the_release_profile_vllms_walk_order_is_assumed_as_before() -> None:
    """The same runs under 0.33.0: RUNNING-ORDER, and the progress verdicts of
    vLLM's order (unchanged: a release walks its queue in order)."""
    run = _own_run("deferred-frees", "make", "0.33.0")
    assert run.result.by_invariant == {"RUNNING-ORDER": 29, "PROGRESS-RUNNING": 3}
    assert _witnesses(run, "PROGRESS-RUNNING")[0] == (
        3, "r000001", "running with 1 token(s) to compute but not scheduled, although the step left 63 "
                      "token(s) of budget and 1 free block(s) (it needed at most 0)")
    run = _own_run("priority-tight", "make", "0.33.0")
    assert run.result.by_invariant == {"RUNNING-ORDER": 44, "PROGRESS-PREEMPT-NEEDED": 5}
    assert _witnesses(run, "PROGRESS-PREEMPT-NEEDED")[0] == (
        39, "r000004", "preempted ['r000007'] to schedule it, but it was given 1 new block(s) and 3 were "
                       "free before the first preemption")


def test_a_reordering_fork_that_skips_a_runnable_request_is_still_caught() -> None:
    run = _own_run("fcfs-roomy", "make_skips", "fork")
    assert (run.ended, run.result.by_invariant) == ("", {"PROGRESS-RUNNING": 17})
    assert _witnesses(run, "PROGRESS-RUNNING")[0] == (
        9, "r000001", "running with 1 token(s) to compute but not scheduled, although the step left 18 "
                      "token(s) of budget and 168 free block(s) (it needed at most 0)")
