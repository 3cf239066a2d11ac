"""A candidate that raises inside a step: a ``crash`` row, a completed trace, ENGINE-CRASH.

The engine loop (``reference/engine.py``) ends the run in the crashed step, the
recorder writes that step's rows so far plus a ``crash`` row (``status``: the
call, ``message``: ``"<Type>: <text>"``, ``stop_reason``: the innermost frame of
candidate code) and completes the trace; ``harness check`` reports one
ENGINE-CRASH there (no LIVENESS pile-up), ``harness record`` and ``harness
replay`` exit 1 with one line. The vLLM cases (the driver, the recording
scheduler) are in tests/test_vllm.py and tests/test_vllm_recording.py, with the
other tests that need vLLM's environment.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.candidates.mutants import MUTANTS
from harness.candidates.mutants.queues import CrashInSchedule
from harness.check import check_steps
from harness.cli import main
from harness.fuzz import fuzz, known_reference_finding
from harness.mutation import kill_matrix
from harness.replay import replay
from harness.scenarios import SCENARIOS
from harness.trace import SUMMARY_KEY, open_trace
from harness.trace.recorder import record, run_to_rows
from reference.candidate import CandidateCrash, CandidateError
from reference.config import EngineConfig
from reference.engine import Engine
from reference.scheduler import Scheduler

REPO = Path(__file__).resolve().parent.parent
FCFS_TIGHT = SCENARIOS["fcfs-tight"]
MUTANT = "mutant:crash-in-schedule"


def run(*args) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def _line_of(func, text: str) -> int:
    """The file line of the first line of ``func`` containing ``text``."""
    lines, start = inspect.getsourcelines(func)
    return start + next(i for i, line in enumerate(lines) if text in line)


def _rows(factory, scenario=FCFS_TIGHT, workload=None, config=None):
    """(rows per step, the exception that ended the run or None), in memory."""
    steps: list = []
    try:
        run_to_rows(workload or scenario.make_workload(), config or scenario.engine_config(),
                    seed=scenario.seed, candidate_factory=factory,
                    on_step_rows=lambda step, rows: steps.append((step, rows)))
    except CandidateCrash as exc:
        return steps, exc
    return steps, None


def _set(row: dict) -> dict:
    return {k: v for k, v in row.items() if v is not None}


CRASHCANDS = """\
import sys
from reference.scheduler import Scheduler


class Exiting(Scheduler):
    def schedule(self, throttle_prefills=False):
        if len(self.running) >= 2:
            sys.exit(0)
        return super().schedule(throttle_prefills)


class AssertInAdd(Scheduler):
    def add_request(self, request):
        assert len(self.requests) < 2
        super().add_request(request)


def factory_exits(config):
    sys.exit(0)
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch):
    """A user's candidate module ``crashcands`` on sys.path: ``Exiting``
    (schedule() calls sys.exit(0) once two requests run, line 8),
    ``AssertInAdd`` (a bare assert refuses the third request, line 14) and
    ``factory_exits`` (the factory exits)."""
    (tmp_path / "crashcands.py").write_text(CRASHCANDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import crashcands

    yield crashcands
    sys.modules.pop("crashcands", None)


MUTANT_LINE = _line_of(CrashInSchedule._select_victim, "raise AssertionError")
MUTANT_WHERE = f"harness/candidates/mutants/queues.py:{MUTANT_LINE}"
MUTANT_LINE_TEXT = (f"candidate raised AssertionError in schedule() at step 148: out of KV blocks: the "
                    f"running loop would preempt r000025 (at {MUTANT_WHERE})")


# -- the crash row -----------------------------------------------------------------

def test_crash_in_schedule_is_recorded_at_its_step_with_the_decisions_before_it(tmp_path) -> None:
    """fcfs-tight's first preemption is at step 148 (r000024 needs a block, the
    tail r000025 is the victim): the mutant raises there. The step keeps
    schedule_begin and the decision schedule() had taken (r000024 scheduled),
    then the crash row; the trace is complete (footer: steps, events, crashed)."""
    path = tmp_path / "crash.parquet"
    summary = record(FCFS_TIGHT.make_workload(), FCFS_TIGHT.engine_config(), path, seed=FCFS_TIGHT.seed,
                     engine=MUTANT, candidate_factory=CrashInSchedule)
    assert summary.crashed == MUTANT_LINE_TEXT
    assert (summary.steps, summary.stalled) == (149, None)
    trace = open_trace(path)  # complete: renamed, footer valid
    assert trace.summary == {"steps": 149, "events": trace.num_rows, "stalled": None,
                             "crashed": MUTANT_LINE_TEXT}
    steps = list(trace.iter_steps())
    step, rows = steps[-1]
    ref_rows, _ = _rows(Scheduler)
    ref_step = dict(ref_rows)[148]
    assert step == 148 and [r["kind"] for r in ref_step[:3]] == ["schedule_begin", "schedule", "preempt"]
    assert [_set(r) for r in rows[:2]] == [_set(r) for r in ref_step[:2]]  # what was decided before
    assert (rows[1]["request_id"], rows[1]["num_scheduled_tokens"]) == ("r000024", 1)
    assert _set(rows[2]) == {"step": 148, "event_index": 2, "kind": "crash", "rank": 0, "status": "schedule",
                             "message": "AssertionError: out of KV blocks: the running loop would preempt "
                                        "r000025", "stop_reason": MUTANT_WHERE}
    assert len(rows) == 3
    # Every earlier step is the reference's.
    assert [(s, [_set(r) for r in rs]) for s, rs in steps[:-1]] == \
        [(s, [_set(r) for r in rs]) for s, rs in ref_rows[:148]]


def test_check_reports_one_engine_crash_with_the_steps_last_decisions() -> None:
    steps, exc = _rows(CrashInSchedule)
    assert str(exc) == MUTANT_LINE_TEXT and exc.step == 148 and exc.call == "schedule"
    result = check_steps(FCFS_TIGHT.engine_config().to_dict(), steps)
    # 3 requests are still live: no LIVENESS for them, the crash is the finding.
    assert result.by_invariant == {"ENGINE-CRASH": 1}
    (v,) = result.violations
    assert (v.invariant, v.step, v.request) == ("ENGINE-CRASH", 148, None)
    assert v.message == ("schedule() raised AssertionError: out of KV blocks: the running loop would "
                         f"preempt r000025 at {MUTANT_WHERE}")
    assert v.history == [
        "step 148: queues at step start: waiting ['r000026'], running ['r000024', 'r000025'], 1 free blocks",
        "step 148: decisions before the crash: scheduled r000024 (running, 1 token)",
    ]


def test_record_exits_1_with_one_line_and_a_checkable_trace(tmp_path) -> None:
    path = tmp_path / "t.parquet"
    code, out = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", MUTANT, "-o", path)
    assert code == 1
    assert out.splitlines()[-1] == (f"engine crashed: {MUTANT}: {MUTANT_LINE_TEXT} (the trace ends there; "
                                    f"harness check reports ENGINE-CRASH)")
    code, out = run("check", path, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert (report["steps"], report["violations_by_invariant"]) == (149, {"ENGINE-CRASH": 1})
    assert report["violations"][0]["step"] == 148
    code, out = run("check", path)
    assert code == 1
    assert out.splitlines()[-1] == "1 violation of 1 invariant: ENGINE-CRASH ×1 (profile 0.33.0)"


def test_replay_reports_the_crash_in_one_line_at_its_step() -> None:
    golden = REPO / "golden" / "fcfs-tight.parquet"
    code, out = run("replay", golden, "--candidate", MUTANT)
    assert code == 1
    lines = out.splitlines()
    assert f"CRASH at step 148: {MUTANT_LINE_TEXT} (the trace has preempt r000025 at event #2)" in lines
    assert lines[-1] == "not conformant (profile 0.33.0); the candidate crashed at step 148"
    code, out = run("replay", golden, "--candidate", MUTANT, "--json")
    assert code == 1
    assert json.loads(out)["divergence"] == {"step": 148, "request": None, "field": "exception",
                                             "expected": "preempt r000025", "actual": MUTANT_LINE_TEXT,
                                             "event_index": 2, "kind": "crash"}


def test_a_crash_trace_replayed_by_its_candidate_matches_but_never_passes(tmp_path) -> None:
    path = tmp_path / "crash.parquet"
    record(FCFS_TIGHT.make_workload(), FCFS_TIGHT.engine_config(), path, seed=FCFS_TIGHT.seed,
           engine=MUTANT, candidate_factory=CrashInSchedule)
    assert replay(open_trace(path), CrashInSchedule) == (None, 149)  # the same crash, matched
    code, out = run("replay", path, "--candidate", MUTANT, "--json")
    report = json.loads(out)
    assert code == 1 and report["divergence"] is None and report["violations_by_invariant"] == {"ENGINE-CRASH": 1}
    # The reference does not crash there: it diverges at the crash row.
    divergence, compared = replay(open_trace(path), Scheduler)
    assert (divergence.step, divergence.field, divergence.event_index, divergence.expected,
            divergence.actual, compared) == (148, "event", 2, "crash", "preempt r000025", 149)


# -- other calls ---------------------------------------------------------------------

class RaiseInUpdate(Scheduler):
    """Raises in its fourth update_from_output (step 3)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.updates = 0

    def update_from_output(self, output, sampled_token_ids, kv_connector_output=None):
        self.updates += 1
        if self.updates == 4:
            raise KeyError("r000001")
        return super().update_from_output(output, sampled_token_ids, kv_connector_output)


class RaiseInDrafts(Scheduler):
    """Raises in its third update_draft_token_ids (step 2)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.calls = 0

    def update_draft_token_ids(self, draft_token_ids):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("drafts for a finished request")
        return super().update_draft_token_ids(draft_token_ids)


def _here(cls, name: str, text: str) -> str:
    return f"test_engine_crash.py:{_line_of(getattr(cls, name), text)}"


def test_crash_in_update_from_output_keeps_the_schedule_and_the_model_output() -> None:
    steps, exc = _rows(RaiseInUpdate)
    ref = dict(_rows(Scheduler)[0])[3]
    where = _here(RaiseInUpdate, "update_from_output", "raise KeyError")
    assert (exc.step, exc.call, exc.stage, str(exc)) == (
        3, "update_from_output", "update",
        f"candidate raised KeyError in update_from_output() at step 3: 'r000001' (at {where})")
    step, rows = steps[-1]
    # Everything up to the update's model output is the reference's; then the crash.
    n = max(i for i, r in enumerate(ref) if r["kind"] in ("update_begin", "output")) + 1
    assert step == 3 and [r["kind"] for r in ref[n:]] == ["update_end"]
    assert rows[:n] == ref[:n]
    assert _set(rows[n]) == {"step": 3, "event_index": n, "kind": "crash", "rank": 0,
                             "status": "update_from_output", "message": "KeyError: 'r000001'",
                             "stop_reason": where}
    result = check_steps(FCFS_TIGHT.engine_config().to_dict(), steps)
    assert result.by_invariant == {"ENGINE-CRASH": 1}
    assert result.violations[0].message == f"update_from_output() raised KeyError: 'r000001' at {where}"
    assert result.violations[0].history[-1].startswith("step 3: update of the batch of step 3: outputs ")


def test_crash_in_update_draft_token_ids_keeps_the_update() -> None:
    scenario = SCENARIOS["spec-decode"]
    steps, exc = _rows(RaiseInDrafts, scenario)
    ref = dict(_rows(Scheduler, scenario)[0])[2]
    assert (exc.step, exc.call, exc.stage) == (2, "update_draft_token_ids", "update_end")
    step, rows = steps[-1]
    # The whole step but its draft rows and update_end.
    kept = [r for r in ref if r["kind"] not in ("draft", "update_end")]
    assert step == 2 and rows[:-1] == kept and len(kept) < len(ref)
    assert _set(rows[-1])["message"] == "RuntimeError: drafts for a finished request"
    assert check_steps(scenario.engine_config().to_dict(), steps).by_invariant == {"ENGINE-CRASH": 1}


def test_crash_in_add_request_keeps_the_arrival_and_quotes_a_bare_assert(user_module) -> None:
    """(The candidate lives outside this module: pytest rewrites this module's asserts.)"""
    steps, exc = _rows(user_module.AssertInAdd)
    where = "crashcands.py:14"
    step, rows = steps[-1]
    assert exc.call == "add_request" and exc.stage == "inputs"
    # The third arrival's row (the request the candidate was given), then the crash.
    assert [(r["kind"], r.get("request_id")) for r in rows] == [("arrival", "r000002"), ("crash", None)]
    assert _set(rows[1]) == {"step": step, "event_index": 1, "kind": "crash", "rank": 0,
                             "status": "add_request",
                             "message": "AssertionError: `assert len(self.requests) < 2`", "stop_reason": where}
    result = check_steps(FCFS_TIGHT.engine_config().to_dict(), steps)
    assert result.by_invariant == {"ENGINE-CRASH": 1}
    assert result.violations[0].history == [f"step {step}: inputs: arrival r000002"]


class RaiseOnRank1(Scheduler):
    """With data parallelism, rank 1's scheduler raises in its 6th schedule()."""

    instances = 0

    def __init__(self, config) -> None:
        super().__init__(config)
        self.rank = RaiseOnRank1.instances % 2
        RaiseOnRank1.instances += 1
        self.calls = 0

    def schedule(self, throttle_prefills: bool = False):
        self.calls += 1
        if self.rank == 1 and self.calls == 6:
            raise ValueError("rank 1 is broken")
        return super().schedule(throttle_prefills)


def test_a_crash_on_one_dp_rank_ends_every_rank_without_liveness_findings() -> None:
    scenario = SCENARIOS["dp2-throttle"]
    RaiseOnRank1.instances = 0
    steps, exc = _rows(RaiseOnRank1, scenario)
    assert (exc.rank, exc.call) == (1, "schedule")
    crash = [r for r in steps[-1][1] if r["kind"] == "crash"]
    assert [(r["rank"], r["message"]) for r in crash] == [(1, "ValueError: rank 1 is broken")]
    # Rank 0's step is complete, rank 1's ends on the crash.
    assert [r["kind"] for r in steps[-1][1] if r["rank"] == 0][-1] == "update_end"
    assert [r["kind"] for r in steps[-1][1] if r["rank"] == 1][-2:] == ["schedule_begin", "crash"]
    assert check_steps(scenario.engine_config().to_dict(), steps).by_invariant == {"ENGINE-CRASH": 1}


# -- sys.exit is a crash (issue 17) ----------------------------------------------------


def test_sys_exit_0_in_schedule_is_a_crash_not_a_success(tmp_path, user_module) -> None:
    """Regression (issue 17): SystemExit passed through the guard, so record,
    replay, golden check and fuzz exited 0 with nothing printed."""
    spec = "crashcands:Exiting"
    path = tmp_path / "t.parquet"
    code, out = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", spec, "-o", path)
    assert code == 1
    assert out.splitlines()[-1] == (f"engine crashed: {spec}: candidate raised SystemExit in schedule() at "
                                    f"step 9: 0 (at crashcands.py:8) (the trace ends there; harness check "
                                    f"reports ENGINE-CRASH)")
    code, out = run("check", path, "--json")
    assert code == 1 and json.loads(out)["violations"][0]["message"] == \
        "schedule() raised SystemExit: 0 at crashcands.py:8"
    code, out = run("replay", REPO / "golden" / "fcfs-tight.parquet", "--candidate", spec)
    assert code == 1 and out.splitlines()[-1] == "not conformant (profile 0.33.0); the candidate crashed at step 9"
    code, out = run("golden", "check", "--candidate", spec)
    num_goldens = len(list((REPO / "golden").glob("*.parquet")))
    assert code == 1 and out.splitlines()[-1].startswith(f"0 ok, {num_goldens} failed")
    code, out = run("fuzz", "--candidate", spec, "--max-examples", 5, "-o", tmp_path / "fuzz")
    assert code == 1 and "FOUND violation: ENGINE-CRASH" in out


def test_a_factory_that_exits_is_an_error_with_no_trace(tmp_path, user_module) -> None:
    with pytest.raises(CandidateError, match=r"^candidate raised SystemExit at step 0: 0$"):
        Engine(FCFS_TIGHT.engine_config(), candidate_factory=user_module.factory_exits)
    path = tmp_path / "t.parquet"
    code, out = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine",
                    "crashcands:factory_exits", "-o", path)
    assert code == 1 and out.strip().endswith("(no trace written)") and not path.exists()


# -- the mutant: caught by the kill matrix and by the fuzzer ------------------------------

def test_the_crash_mutant_is_killed_by_engine_crash() -> None:
    assert MUTANTS["crash-in-schedule"] is CrashInSchedule
    (row,) = kill_matrix(["crash-in-schedule"], ["fcfs-tight", "fcfs-roomy"])
    assert row.killed and row.target == "ENGINE-CRASH"
    assert row.cells["fcfs-tight"].result.by_invariant == {"ENGINE-CRASH": 1}
    assert row.cells["fcfs-tight"].ended == MUTANT_LINE_TEXT
    assert row.cells["fcfs-roomy"].result.ok  # no preemption there: no crash


def test_the_fuzzer_finds_the_crash_mutant() -> None:
    result = fuzz(CrashInSchedule, max_examples=100, seed=0, known=known_reference_finding)
    assert result.found and result.failure.kind == "violation"
    # Found at example 42, shrunk to 2 requests that need a preemption at step 2.
    assert (result.examples, len(result.case.requests), result.failure.step) == (42, 2, 2)
    assert result.failure.invariants == {"ENGINE-CRASH": 1}
    assert result.failure.message == ("ENGINE-CRASH at step 2: schedule() raised AssertionError: out of KV "
                                      f"blocks: the running loop would preempt r000001 at {MUTANT_WHERE}")


def test_footer_of_a_run_without_crash_keeps_its_bytes() -> None:
    """Only a crashed run's footer has the ``crashed`` key: the goldens' have
    the run's figures and (schema 7) the file's digest only."""
    golden = pq.ParquetFile(REPO / "golden" / "fcfs-tight.parquet")
    assert set(json.loads(golden.metadata.metadata[SUMMARY_KEY])) == {"steps", "events", "stalled",
                                                                      "trace_sha256"}


def test_a_vllm_crash_config_is_refused_for_the_reference_but_read_from_a_trace() -> None:
    """vLLM 0.33.0 accepts this config and crashes on it (tests/test_vllm.py): the
    reference refuses to run it, a trace of it (vLLM's crash) is still read."""
    fields = dict(num_speculative_tokens=4, long_prefill_token_threshold=4)
    with pytest.raises(ValueError, match="crashes vLLM 0.33.0's spec-decode padding"):
        EngineConfig(**fields)
    data = {**EngineConfig(num_speculative_tokens=4).to_dict(), "long_prefill_token_threshold": 4}
    assert EngineConfig.from_dict(data, accept_vllm_crash=True).long_prefill_token_threshold == 4
    with pytest.raises(ValueError, match="crashes vLLM"):
        EngineConfig.from_dict(data)  # accepted only while building that config


BADCANDS = '''
from reference.scheduler import Scheduler


class _ReturnsNone(Scheduler):
    def schedule(self, throttle_prefills=False):
        return None


class _GeneratorExit(Scheduler):
    def schedule(self, throttle_prefills=False):
        raise GeneratorExit()


def returns_none(config):
    return _ReturnsNone(config)


def factory_none(config):
    return None


def generator_exit(config):
    return _GeneratorExit(config)
'''


@pytest.mark.parametrize("factory, code, last", [
    ("returns_none", 1, "engine crashed: badcands:returns_none: candidate raised TypeError in schedule() at step 0: "
                        "schedule() returned NoneType, not a SchedulerOutput (the trace ends there; harness check "
                        "reports ENGINE-CRASH)"),
    ("generator_exit", 1, "engine crashed: badcands:generator_exit: candidate raised GeneratorExit in schedule() at "
                          "step 0: `raise GeneratorExit()` (at badcands.py:12) (the trace ends there; harness "
                          "check reports ENGINE-CRASH)"),
    ("factory_none", 1, "error: badcands:factory_none: candidate raised TypeError at step 0: the candidate factory "
                        "returned NoneType, not a scheduler (no schedule() method) (no trace written)"),
])
def test_regression_a_candidate_returning_the_wrong_thing_is_one_line_not_a_traceback(
        tmp_path, monkeypatch, factory: str, code: int, last: str) -> None:
    """Regression (a hostile user, issue 16/17): schedule() returning None, a
    factory returning None and a GeneratorExit in schedule() each ended in a
    Python traceback (exit 1, no trace)."""
    (tmp_path / "badcands.py").write_text(BADCANDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        out_path = tmp_path / "t.parquet"
        rc, out = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", f"badcands:{factory}",
                      "-o", out_path)
        assert (rc, out.splitlines()[-1]) == (code, last)
        assert out_path.exists() == (factory != "factory_none")
    finally:
        sys.modules.pop("badcands", None)


RAISING = '''
from reference.scheduler import Scheduler


def raising_factory(config):
    raise ValueError("bad factory config")


class _Boom(Scheduler):
    def schedule(self):
        return _helper()


def _helper():
    raise RuntimeError("boom in schedule")


def boom(config):
    return _Boom(config)
'''


@pytest.mark.parametrize("factory, last, frames", [
    ("raising_factory", "error: raisecands:raising_factory: candidate raised ValueError at step 0: bad factory "
                        "config (at raisecands.py:6) (no trace written)", ["raising_factory"]),
    ("boom", "engine crashed: raisecands:boom: candidate raised RuntimeError in schedule() at step 0: boom in "
             "schedule (at raisecands.py:15) (the trace ends there; harness check reports ENGINE-CRASH)",
     ["schedule", "_helper"]),
])
def test_regression_a_candidate_exception_names_its_file_and_line_and_traceback_shows_it_all(
        tmp_path, monkeypatch, factory: str, last: str, frames: list[str]) -> None:
    """Regression (issue 16): a factory's exception was reported without file
    and line; `--traceback` prints the candidate's whole traceback, and
    without it no traceback is printed."""
    (tmp_path / "raisecands.py").write_text(RAISING)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        args = ("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", f"raisecands:{factory}",
                "-o", tmp_path / "t.parquet")
        rc, out = run(*args)
        assert (rc, out.splitlines()[-1]) == (1, last)
        assert "Traceback" not in out
        rc, out = run(*args, "--traceback")
        assert (rc, out.splitlines()[-1]) == (1, last)
        assert "Traceback (most recent call last):" in out
        for name in frames:
            assert 'raisecands.py", line' in out and f"in {name}" in out
    finally:
        sys.modules.pop("raisecands", None)
