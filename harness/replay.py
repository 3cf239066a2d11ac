"""Re-drive an engine with a trace's inputs and find the first divergence.

The workload (every arrival and rejection, with its prompt and sampling
parameters) and the config come from the trace itself; the scripted model is
re-created from the trace's seed, so the candidate sees the same model outputs
for the same positions. A trace recorded with a real model (metadata key
``model``) is re-driven with its recorded outputs instead
(``harness.trace.playback``): no torch needed; so is a recording of a real
vLLM engine (workload source ``live``, ``recording_convert.convert``), whose
tokens came from the model it ran. The candidate's steps are compared
with the trace's as they are produced; the run stops at the first differing
step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import zip_longest
from operator import countOf
from collections.abc import Callable
from typing import Any

import pyarrow.parquet as pq
from deepdiff import DeepDiff

from reference.candidate import CandidateCrash, CandidateError, CandidateFactory, CandidateRefused, crash_line
from reference.engine import EngineStalled
from reference.workload import Action, Workload

from harness.paths import arrow_source
from harness.trace.playback import playback_factory, trace_model
from harness.trace.recorder import Row, run_to_rows, spec_from_row
from harness.trace import SCHEMA_VERSION, Trace, TraceError
from harness.trace.schema import rows_as_of


@dataclass
class Divergence:
    """The first point where the candidate's events differ from the trace's.

    ``field`` is a column name (or "event" when one side has no event at
    that position); ``context`` holds the step's events on both sides.
    """

    step: int
    request: str | None
    field: str
    expected: Any
    actual: Any
    event_index: int
    kind: str | None
    diff: str
    context_expected: list[Row]
    context_actual: list[Row]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "request": self.request, "field": self.field,
                "expected": self.expected, "actual": self.actual,
                "event_index": self.event_index, "kind": self.kind}


class _Diverged(Exception):
    pass


class _Salvaged(Exception):
    """The re-driven run passed the last step of a salvaged trace."""


def workload_from_trace(trace: Trace) -> Workload:
    """Rebuild the recorded workload (arrivals and rejections, in order).

    A scenario's workload keeps its file order in the metadata
    (``workload.params.request_order``): step and ``after`` arrivals of one
    step are added in that order, which the rows alone lose under data
    parallelism (each rank's rows are grouped). Its actions come back from
    ``workload.params.actions`` (``Action.from_dict``), re-driven at the
    same steps."""
    try:
        table = pq.read_table(arrow_source(trace.path), filters=[("kind", "in", ["arrival", "reject"])])
    except Exception as exc:  # pyarrow raises several types for bad files
        raise TraceError(f"{trace.path}: cannot read arrivals ({' '.join(str(exc).split())[:200]})") from None
    try:
        # A few rows at a time: the whole workload as Python lists at once would double the peak.
        specs = tuple(spec_from_row(r) for batch in table.to_batches(max_chunksize=256)
                      for r in batch.to_pylist())
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceError(f"{trace.path}: bad arrival row ({exc})") from None
    w = trace.meta.get("workload")
    if not isinstance(w, dict) or not isinstance(w.get("source"), str) or not isinstance(w.get("sha256"), str) \
            or not isinstance(w.get("params", {}), dict):
        # Regression (issue 17): `workload: {}` in the metadata was a KeyError traceback.
        raise TraceError(f"{trace.path}: metadata 'workload' needs a source and a sha256 (strings) and "
                         f"params (an object), got {json.dumps(w)[:120]}")
    order = (w.get("params") or {}).get("request_order")
    if isinstance(order, list):
        position = {rid: i for i, rid in enumerate(order)}
        specs = tuple(sorted(specs, key=lambda s: position.get(s.request_id, len(position))))
    try:
        actions = tuple(Action.from_dict(a) for a in (w.get("params") or {}).get("actions", ()))
    except (ValueError, TypeError, KeyError) as exc:
        raise TraceError(f"{trace.path}: bad workload.params.actions ({exc})") from None
    return Workload(source=w["source"], sha256=w["sha256"], params=w.get("params", {}), requests=specs,
                    actions=actions)


def _normalise(row: Row) -> Row:
    return {k: v for k, v in row.items() if v is not None}


def _same(expected: Row, actual: Row) -> bool:
    """``_normalise(expected) == _normalise(actual)`` without building either
    (a trace's rows hold every column, a fresh run's only the set ones), at C
    speed (issue 24: no Python loop over a row's keys): every key of
    ``actual`` has its value in ``expected`` (a null there: null, or absent),
    and both hold as many non-null values. (An ``actual`` null where
    ``expected`` has a value fails the first test, as it fails the count.)"""
    values = list(actual.values())
    if list(map(expected.get, actual)) != values:
        return False
    # (countOf: the trace row's nulls counted without a list of its ~45 values)
    return len(expected) - countOf(expected.values(), None) == len(values) - values.count(None)


def first_difference(step: int, expected: list[Row], actual: list[Row]) -> Divergence | None:
    """Compare one step's events; None when identical."""
    if len(expected) == len(actual) and all(map(_same, expected, actual)):
        return None
    for index, (exp, act) in enumerate(zip_longest(expected, actual)):
        exp_n = _normalise(exp) if exp is not None else None
        act_n = _normalise(act) if act is not None else None
        if exp_n == act_n:
            continue
        request = (exp or act or {}).get("request_id")
        kind = (exp or act or {}).get("kind")
        if exp_n is None or act_n is None or exp_n.get("kind") != act_n.get("kind") \
                or exp_n.get("request_id") != act_n.get("request_id"):
            field_name = "event"
            exp_v = _brief(exp_n)
            act_v = _brief(act_n)
        else:
            keys = sorted(set(exp_n) | set(act_n))
            field_name = next(k for k in keys if exp_n.get(k) != act_n.get(k))
            exp_v, act_v = exp_n.get(field_name), act_n.get(field_name)
        # A field-level diff only helps when both sides are the same event.
        diff = "" if field_name == "event" else DeepDiff(exp_n, act_n, verbose_level=2).pretty()
        return Divergence(step, request, field_name, exp_v, act_v, index, kind, diff,
                          expected, actual)
    return None


def _as_crash(found: Divergence, rows: list[Row]) -> Divergence:
    """A divergence in a step where the candidate crashed (and the trace
    did not, or not so) is that crash: field ``exception`` at its row."""
    index, crash = next(((i, r) for i, r in enumerate(rows) if r.get("kind") == "crash"), (None, None))
    if crash is None:
        return found
    expected = found.context_expected
    exp = _brief(_normalise(expected[index])) if index < len(expected) else "end of step"
    line = crash_line(found.step, crash.get("status") or "?", crash.get("message") or "?",
                      crash.get("stop_reason"))
    return Divergence(found.step, None, "exception", exp, line, index, "crash", "", expected, rows)


def _brief(row: Row | None) -> str | None:
    if row is None:
        return None
    return f"{row.get('kind')} {row.get('request_id') or ''}".strip()


class _Peekable:
    """An iterator whose next item can be looked at first (``peek``)."""

    _NONE = object()

    def __init__(self, it) -> None:
        self._it, self._next = iter(it), self._NONE

    def __iter__(self):
        return self

    def __next__(self):
        if self._next is not self._NONE:
            item, self._next = self._next, self._NONE
            return item
        return next(self._it)

    def peek(self, default=None):
        if self._next is self._NONE:
            self._next = next(self._it, self._NONE)
        return default if self._next is self._NONE else self._next


def _cut_off_step(trace: Trace, recorded: _Peekable, expected: list[Row], actual: list[Row]) -> bool:
    """Whether ``expected`` is the last step of a trace cut off by a protocol
    break or a salvage (its footer's ``protocol`` / ``salvaged``), holding only
    the inputs before the break (no ``schedule_begin``, ``update_begin`` or
    ``crash`` row), all matched by the first rows of ``actual``. Regression:
    vLLM's test_delayed_kv_connector_free_keeps_scheduler_active adds a
    request and then calls ``update_from_output()`` with a hand-built output;
    the trace's last step holds that arrival only, and replay reported the
    reference's schedule() of that step as a divergence."""
    if trace.summary.get("protocol") is None and trace.summary.get("salvaged") is None:
        return False
    if recorded.peek() is not None or not expected or len(actual) <= len(expected):
        return False
    if any(row.get("kind") in ("schedule_begin", "update_begin", "crash") for row in expected):
        return False
    return first_difference(0, expected, actual[:len(expected)]) is None


def replay(trace: Trace, candidate_factory: CandidateFactory,
           on_step: Callable[[int], object] | None = None) -> tuple[Divergence | None, int]:
    """Re-drive ``candidate_factory`` with the trace's inputs (``on_step(step)``
    after each step compared: progress).

    Returns (first divergence or None, number of steps compared). A candidate
    that stalls or raises diverges at the step where it did: a crash as field
    ``exception``, kind ``crash``, at its ``crash`` row (``actual``: the
    crash's one line). A trace that ended in the same stall or crash (the
    same rows) is matched, not diverged from. A salvaged trace (its footer's
    ``salvaged``: the recording was killed), or one whose driver left the
    engine's protocol or stopped (``protocol``), is compared up to its last step.
    """
    config = trace.config
    workload = workload_from_trace(trace)
    # A real model's tokens (a torch run, or a live vLLM recording) are played back.
    played = trace_model(trace) is not None or trace.meta["workload"].get("source") == "live"
    runner_factory = playback_factory(trace) if played else None
    recorded = _Peekable(trace.iter_steps())
    compared = 0
    version = trace.meta.get("schema_version", SCHEMA_VERSION)

    def on_step_rows(step: int, rows: list[Row]) -> None:
        nonlocal compared
        expected_step, expected = next(recorded, (None, []))
        if expected_step is None and (trace.summary.get("salvaged") is not None
                                      or trace.summary.get("protocol") is not None):
            # The recording was cut off here, or its driver left the engine's protocol
            # or stopped driving (the footer's "protocol"): nothing more to compare.
            raise _Salvaged()
        if expected_step is None:
            raise _Diverged(Divergence(step, None, "event", "end of trace", f"step {step}", 0, None,
                                       "", [], rows))
        if expected_step != step:
            raise _Diverged(Divergence(step, None, "step", expected_step, step, 0, None, "", expected, rows))
        # An older trace records less: compare what it records.
        actual = rows_as_of(version, rows)
        if _cut_off_step(trace, recorded, expected, actual):
            # The recording's last step was cut off by the break (its inputs, no
            # schedule or update after them): what it holds matched; nothing more to compare.
            compared += 1
            raise _Salvaged()
        found = first_difference(step, expected, actual)
        compared += 1
        if on_step is not None:
            on_step(step)
        if found is not None:
            raise _Diverged(_as_crash(found, rows))

    try:
        run_to_rows(workload, config, seed=trace.meta["seed"], candidate_factory=candidate_factory,
                    on_step_rows=on_step_rows, runner_factory=runner_factory)
    except _Diverged as d:
        return d.args[0], compared
    except _Salvaged:
        return None, compared
    except CandidateCrash as exc:
        # The crashed step was handed over (and compared) before the raise.
        if trace.summary.get("crashed") is not None and next(recorded, None) is None:
            return None, compared
        return Divergence(exc.step, None, "exception", "no exception", str(exc), 0, "crash",
                          "", [], []), compared
    except CandidateError as exc:
        if isinstance(exc.__cause__, CandidateRefused):
            raise exc.__cause__  # it cannot run this trace's config: no verdict, the caller says so
        return Divergence(exc.step, None, "exception", "no exception", str(exc), 0, None,
                          "", [], []), compared
    except EngineStalled as exc:
        # A trace that ended in the same stall is matched, not diverged from; so is a
        # trace cut off (salvaged) or ended by its driver (the footer's "protocol")
        # whose every step matched: the stall comes after what it recorded (regression:
        # vLLM 0.33.0's test_priority_preemption_bug.py breaks the protocol after
        # step 0, which admits nothing; its next request, which unblocked vLLM, is not
        # in the trace, and the reference's stall was reported as a divergence).
        if next(recorded, None) is None and any(trace.summary.get(k) is not None
                                                for k in ("stalled", "salvaged", "protocol")):
            return None, compared
        return Divergence(compared, None, "event", "next step", f"engine stalled: {exc}", 0, None,
                          "", [], []), compared
    leftover = next(recorded, None)
    if leftover is not None:
        step, rows = leftover
        return Divergence(step, None, "event", f"step {step}", "end of run", 0, None, "", rows, []), compared
    return None, compared


@dataclass
class OwnRun:
    """The candidate's own run of a trace's inputs (``own_run``): its rows
    checked under the profile the trace was checked under.

    ``result``: that check (a crash inside a step is its ENGINE-CRASH
    witness); ``ended``: "" when the run ended as runs do (or in the stall
    the trace ended in too), else why it ended early ("stalled: ...", or
    "raised: ..." for a candidate error outside a step)."""

    result: Any  # harness.check.CheckResult
    ended: str
    steps: int

    @property
    def ok(self) -> bool:
        """No violation of the profile's rules and no early end."""
        return self.result.ok and not self.ended

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "steps": self.steps, "ended": self.ended or None,
                "profile": self.result.profile, "num_violations": self.result.num_violations,
                "violations_by_invariant": self.result.by_invariant,
                "violations": [v.to_dict() for v in self.result.violations]}


def own_run(trace: Trace, candidate_factory: CandidateFactory, profile: Any,
            on_step: Callable[[int], object] | None = None) -> OwnRun:
    """Run ``candidate_factory`` on ``trace``'s workload, config and seed from
    step 0 (the played-back model outputs for a trace of a real model, as
    ``replay``) and check its rows under ``profile`` (a
    ``harness.check.profiles.Profile``): what the fork gate holds a candidate
    to once its decisions differ from the trace's, as ``harness fuzz
    --semantics fork`` does (``harness.fuzz.run.evaluate``: a decision is the
    fork's policy, a violation, a crash or a stall is a failure).

    A stall the trace ended in too is no early end. A candidate that refuses
    the config raises ``CandidateRefused`` (no verdict), as ``replay``."""
    from harness.check import check_steps
    from harness.fuzz.run import close_candidates

    steps: list[tuple[int, list[Row]]] = []
    built: list[Any] = []
    ended = ""

    def build(cfg):
        candidate = candidate_factory(cfg)
        built.append(candidate)
        return candidate

    def on_step_rows(step: int, rows: list[Row]) -> None:
        steps.append((step, rows))
        if on_step is not None:
            on_step(step)

    played = trace_model(trace) is not None or trace.meta["workload"].get("source") == "live"
    try:
        run_to_rows(workload_from_trace(trace), trace.config, seed=trace.meta["seed"],
                    candidate_factory=candidate_factory if isinstance(candidate_factory, type) else build,
                    on_step_rows=on_step_rows, runner_factory=playback_factory(trace) if played else None)
    except EngineStalled as exc:
        if trace.summary.get("stalled") is None:
            ended = f"stalled after step {steps[-1][0] if steps else 0}: {' '.join(str(exc).split())[:300]}"
    except CandidateCrash as exc:
        if not any(r.get("kind") == "crash" for r in (steps[-1][1] if steps else ())):
            ended = f"crashed: {exc}"  # (a crash row is the check's ENGINE-CRASH witness)
    except CandidateError as exc:
        if isinstance(exc.__cause__, CandidateRefused):
            raise exc.__cause__
        ended = f"raised: {exc}"
    finally:
        close_candidates(built)
    result = check_steps(trace.meta["config"], steps, profile)
    return OwnRun(result, ended, len(steps))
