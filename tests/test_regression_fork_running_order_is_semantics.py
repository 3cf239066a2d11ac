"""Regression (two trials, new-user F1 and adversarial finding 1): a correct
fork that reorders its running queue (shortest remaining first, decode first,
round robin: ``self.running`` sorted before vLLM 0.33.0's
``Scheduler.schedule``) failed the fork gate, and ``--semantics safety``, with
STATE-CONTINUITY on 20 of 20 goldens: ``running after schedule ['r000005',
'r000004'] != expected ['r000004', 'r000005']``. The order of running is vLLM's
design (RUNNING-ORDER, semantics); that it holds the same requests, each once,
stays safety (STATE-CONTINUITY), as for the waiting queue
(``test_regression_fork_queue_order_is_semantics.py``). The forks:
``tests/forks/running_order.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from forks import put_on_path
from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _own_run(golden: str, factory: str, semantics: str):
    """The fork's own run of ``golden``'s inputs, checked under ``semantics``."""
    from forks import running_order
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN / f"{golden}.parquet")
    profile, _ = resolve(semantics, trace.meta)
    return own_run(trace, getattr(running_order, factory), profile)


def _first(run, invariant: str) -> tuple:
    v = next(v for v in run.result.violations if v.invariant == invariant)
    return (v.step, v.request, v.message)


def test_a_shortest_remaining_first_fork_passes_the_fork_gate(monkeypatch) -> None:
    put_on_path(monkeypatch)
    r = CliRunner().invoke(main, ["replay", str(GOLDEN / "fcfs-roomy.parquet"),
                                  "--candidate", "forks.running_order:make", "--semantics", "fork"])
    assert r.exit_code == 0, r.output[-3000:]
    assert "STATE-CONTINUITY" not in r.output
    assert r.output.splitlines()[-1].startswith("conformant (profile fork); decisions differ from step ")


@pytest.mark.parametrize("semantics", ["fork", "safety"])
def test_the_reorder_breaks_no_safety_rule(semantics: str) -> None:
    run = _own_run("fcfs-roomy", "make", semantics)
    assert (run.ended, run.steps, run.result.by_invariant) == ("", 372, {})


def test_under_the_release_profile_the_order_is_running_order_not_state_continuity() -> None:
    run = _own_run("fcfs-roomy", "make", "0.33.0")
    assert run.result.by_invariant == {"RUNNING-ORDER": 20}
    assert _first(run, "RUNNING-ORDER") == (10, "r000001", "scheduled out of running order "
                                                           "['r000000', 'r000001', 'r000002']")
    # The queue rows' order, too, is RUNNING-ORDER's (the witness the trial saw as STATE-CONTINUITY).
    queue = [v.message for v in run.result.violations if v.request is None]
    assert queue and all(" is not in running-queue order: " in m for m in queue), queue


@pytest.mark.parametrize("semantics", ["fork", "safety"])
def test_a_running_request_lost_is_still_state_continuity(semantics: str) -> None:
    run = _own_run("fcfs-roomy", "make_drops", semantics)
    assert run.result.by_invariant == {"STATE-CONTINUITY": 24, "IDLE-ADMISSION": 35, "LIVENESS": 59}
    assert _first(run, "STATE-CONTINUITY") == (1, None, "running after schedule [] != expected ['r000000']")


@pytest.mark.parametrize("semantics", ["fork", "safety"])
def test_a_running_request_doubled_is_still_state_continuity(semantics: str) -> None:
    run = _own_run("fcfs-roomy", "make_doubles", semantics)
    assert run.result.by_invariant == {"STATE-CONTINUITY": 107, "MAX-NUM-SEQS": 6}
    assert _first(run, "STATE-CONTINUITY") == (
        0, None, "running after schedule ['r000000', 'r000000'] != expected ['r000000']")


def test_the_queue_rule_splits_membership_from_order() -> None:
    """``check_running_queue`` alone: another order is RUNNING-ORDER; a lost,
    added or doubled id is STATE-CONTINUITY."""
    from harness.check.model import TraceModel
    from harness.check.profiles import resolve
    from harness.check.queues import check_running_queue
    from harness.trace import open_trace

    config = open_trace(GOLDEN / "fcfs-roomy.parquet").meta["config"]
    seen = []
    for running in (["b", "a"], ["a"], ["a", "b", "c"], ["a", "a"], ["a", "b", "b"]):
        m = TraceModel(config, resolve("0.33.0", {})[0])
        check_running_queue(m, running, ["a", "b"], "running after schedule", "expected")
        seen.append([(v.invariant, v.message) for v in m.result.violations])
    assert seen == [
        [("RUNNING-ORDER", "running after schedule ['b', 'a'] is not in running-queue order: expected ['a', 'b']")],
        [("STATE-CONTINUITY", "running after schedule ['a'] != expected ['a', 'b']")],
        [("STATE-CONTINUITY", "running after schedule ['a', 'b', 'c'] != expected ['a', 'b']")],
        [("STATE-CONTINUITY", "running after schedule ['a', 'a'] != expected ['a', 'b']")],
        [("STATE-CONTINUITY", "running after schedule ['a', 'b', 'b'] != expected ['a', 'b']")],
    ]
