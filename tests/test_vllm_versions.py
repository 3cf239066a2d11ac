"""Older vLLM releases (0.29.0) through the driver: the waiting queues as the
scheduler serves them, skips, and the 0.29.0 profile's victim placement.

vLLM 0.29.0 (and 0.20.2) keep the requests the waiting loop skipped in a
separate ``skipped_waiting`` queue, served before ``waiting`` under FCFS
(``Scheduler._select_waiting_queue_for_scheduling``), and have no
``deferred_waiting`` set. Regression: the driver's snapshot listed
``waiting`` only and detected skips by adds to ``deferred_waiting``, so on
0.29.0 a skipped request vanished from the trace's queues and no skip row
was recorded (STATE-CONTINUITY and ADMISSION-ORDER on pipeline-3 and
async-pipeline-3, a harness observation gap, not vLLM's). The tests marked
``vllm`` need the 0.29.0 env (``harness vllm-env 0.29.0``) and skip without
it; the others need no vLLM.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm import events
from harness.check import PROFILES, check_steps
from harness.check.profiles import resolve
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from harness.trace.recorder import record

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
VERSION = "0.29.0"


class _Req:
    """A request as the queues see it: id and (priority, arrival) order."""

    def __init__(self, request_id: str, priority: int = 0, arrival: float = 0.0) -> None:
        self.request_id, self.key = request_id, (priority, arrival, request_id)

    def __lt__(self, other: "_Req") -> bool:
        return self.key < other.key


def _ids(requests) -> list[str]:
    return [r.request_id for r in requests]


def test_waiting_is_snapshotted_in_service_order() -> None:
    a, b, c, d = _Req("a", 0, 1.0), _Req("b", 1, 0.0), _Req("c", 0, 2.0), _Req("d", 2, 0.5)
    # 0.33.0: no skipped_waiting; kv-holding first, then waiting.
    new = SimpleNamespace(kv_holding_waiting=[d], waiting=[a, b], policy=SimpleNamespace(name="FCFS"))
    assert _ids(events.waiting_in_service_order(new)) == ["d", "a", "b"]
    # 0.29.0 FCFS: skipped_waiting is served first.
    fcfs = SimpleNamespace(skipped_waiting=[c, b], waiting=[a, d], policy=SimpleNamespace(name="FCFS"))
    assert _ids(events.waiting_in_service_order(fcfs)) == ["c", "b", "a", "d"]
    # 0.29.0 PRIORITY: both queues iterate sorted; the smaller head goes first.
    prio = SimpleNamespace(skipped_waiting=[a, d], waiting=[c, b], policy=SimpleNamespace(name="PRIORITY"))
    assert _ids(events.waiting_in_service_order(prio)) == ["a", "c", "b", "d"]


def test_0_29_0_profile_puts_fcfs_victims_behind_skipped_requests() -> None:
    """The reference (0.33.0) prepends a victim before the requests it skipped
    earlier; 0.29.0 behind them (victims_behind_skipped): the golden is clean
    under its own profile and breaks exactly that rule under 0.29.0's."""
    trace = open_trace(GOLDEN / "async-pipeline-3.parquet")
    assert check_steps(trace.meta["config"], trace.iter_steps(), PROFILES["0.33.0"]).ok
    result = check_steps(trace.meta["config"], trace.iter_steps(), PROFILES["0.29.0"])
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("PREEMPT-WAITING-HEAD", 106, "r000027",
         "victims ['r000027'] are not at the head of waiting ['r000027', 'r000025', 'r000028', 'r000029']..."),
        ("PREEMPT-WAITING-HEAD", 151, "r000036",
         "victims ['r000036'] are not at the head of waiting "
         "['r000036', 'r000034', 'r000037', 'r000038', 'r000039']..."),
        ("PREEMPT-WAITING-HEAD", 164, "r000039",
         "victims ['r000039'] are not at the head of waiting ['r000039', 'r000038']...")]
    assert check_steps(trace.meta["config"], trace.iter_steps(), PROFILES["safety"]).ok


def _needs_env() -> None:
    from harness.candidates.vllm.env import is_ready

    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    if not is_ready(VERSION):
        pytest.skip(f"no vLLM {VERSION} env (`harness vllm-env {VERSION}`)")


def _record(tmp_path: Path, name: str) -> Path:
    scenario = SCENARIOS[name]
    path = tmp_path / f"{name}.parquet"
    engine = f"vllm@{VERSION}"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
           engine=engine, candidate_factory=resolve_candidate(engine))
    gc.collect()  # the driver goes back to the pool
    return path


def _skips(trace) -> list[tuple[int, str, str]]:
    return [(step, row["request_id"], row["message"]) for step, rows in trace.iter_steps()
            for row in rows if row["kind"] == "skip"]


@pytest.mark.vllm
def test_regression_0_29_0_skipped_waiting_left_out_of_the_trace(tmp_path) -> None:
    """pipeline-3 on 0.29.0: the two stale-output skips are recorded (the
    golden's own), and the trace is clean under 0.29.0's profile."""
    _needs_env()
    trace = open_trace(_record(tmp_path, "pipeline-3"))
    assert _skips(trace) == [(49, "r000005", "stale output in flight"),
                             (150, "r000016", "stale output in flight")]
    assert _skips(trace) == _skips(open_trace(GOLDEN / "pipeline-3.parquet"))
    profile, _ = resolve("auto", trace.meta)
    assert profile.name == VERSION
    assert check_steps(trace.meta["config"], trace.iter_steps(), profile).ok


@pytest.mark.vllm
def test_0_29_0_victims_queue_behind_skipped_requests(tmp_path) -> None:
    """async-pipeline-3 on 0.29.0: 12 skips recorded; clean under its profile;
    under 0.33.0's the victims of steps 106, 151 and 164 sit behind the
    skipped request, the mirror of the reference under 0.29.0's profile."""
    _needs_env()
    trace = open_trace(_record(tmp_path, "async-pipeline-3"))
    assert len(_skips(trace)) == 12
    assert check_steps(trace.meta["config"], trace.iter_steps(), PROFILES[VERSION]).ok
    result = check_steps(trace.meta["config"], trace.iter_steps(), PROFILES["0.33.0"])
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("PREEMPT-WAITING-HEAD", 106, "r000027",
         "victims ['r000027'] are not at the head of waiting ['r000025', 'r000027', 'r000028', 'r000029']..."),
        ("PREEMPT-WAITING-HEAD", 151, "r000036",
         "victims ['r000036'] are not at the head of waiting "
         "['r000034', 'r000036', 'r000037', 'r000038', 'r000039']..."),
        ("PREEMPT-WAITING-HEAD", 164, "r000039",
         "victims ['r000039'] are not at the head of waiting ['r000038', 'r000039']...")]
