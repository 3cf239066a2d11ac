"""``harness bisect``: run one workload on a range of vLLM releases, find where it changes.

For each release (oldest first) the workload (a scenario file, or a trace's
inputs: workload, config, seed) is recorded with ``vllm@VERSION`` (with
``scheduler_cls`` when given), building the release's env when missing
(``env.ensure_env``); the recording is checked under ``--semantics auto``
(that release's measured profile, or the safety layer where none was
measured) and compared, step by step, with the previous release's recording
(``harness.diff.diff_traces``: the first divergent decision). A release that
cannot express the config is a ``refused`` row (its reason), one that cannot
be built a ``unavailable`` row; neither breaks the chain of comparisons.

The first release whose verdict (clean, or violations by invariant) or
decisions differ from the previous one's is the ``first_change``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.candidate import CandidateError, CandidateRefused
from reference.config import EngineConfig
from reference.words import did_you_mean, plural
from reference.workload import Workload

from harness.candidates.vllm.env import RELEASES, VLLMEnvError, check_version, ensure_env, version_tuple



class BisectError(ValueError):
    """Unusable arguments (a bad version range); the message is one line."""


def parse_versions(text: str) -> list[str]:
    """``A..B`` (the releases of ``RELEASES`` from A to B, both included) or
    ``V1,V2,...`` (exactly those, sorted). Raises BisectError."""
    text = text.strip()
    try:
        if ".." in text:
            lo, _, hi = text.partition("..")
            lo_t, hi_t = version_tuple(check_version(lo)), version_tuple(check_version(hi))
            if lo_t > hi_t:
                raise BisectError(f"--versions {text}: {lo} is newer than {hi}")
            chosen = [v for v in RELEASES if lo_t <= version_tuple(v) <= hi_t]
        else:
            chosen = sorted({check_version(v.strip()) for v in text.split(",") if v.strip()},
                            key=version_tuple)
            for v in chosen:
                # Up to the newest listed release, RELEASES is PyPI's list: anything else is a slip.
                if v not in RELEASES and version_tuple(v) < version_tuple(RELEASES[-1]):
                    raise BisectError(f"--versions {text}: {v} is not a vLLM release"
                                      + did_you_mean(v, RELEASES, list_whole=False))
    except VLLMEnvError as exc:
        raise BisectError(f"--versions {text}: {exc}") from None
    if len(chosen) < 2:
        raise BisectError(f"--versions {text}: names {plural(len(chosen), 'release')}; bisect needs two or more")
    return chosen


@dataclass
class Row:
    """One release: ``status`` is ``ran``, ``refused`` (it cannot express the
    config), ``unavailable`` (its env could not be built) or ``failed`` (the
    candidate raised at construction); ``verdict`` "clean" or "ID ×n, ...";
    ``violations`` by invariant; ``same_as_previous`` (None for the first
    release that ran); ``divergence`` vs the previous release that ran;
    ``seconds``: wall time of the row (build included)."""

    version: str
    status: str
    verdict: str = ""
    violations: dict[str, int] = field(default_factory=dict)
    profile: str = ""
    steps: int = 0
    same_as_previous: bool | None = None
    compared_with: str | None = None
    divergence: dict[str, Any] | None = None
    reason: str = ""
    seconds: float = 0.0
    build_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "status": self.status, "verdict": self.verdict,
                "violations": dict(self.violations), "profile": self.profile, "steps": self.steps,
                "same_as_previous": self.same_as_previous, "compared_with": self.compared_with,
                "divergence": self.divergence, "reason": self.reason,
                "seconds": round(self.seconds, 1), "build_seconds": round(self.build_seconds, 1)}


@dataclass
class BisectResult:
    """All rows, and the first release whose verdict or decisions changed."""

    source: str
    scheduler_cls: str | None
    rows: list[Row]

    @property
    def first_change(self) -> Row | None:
        previous: Row | None = None
        for row in self.rows:
            if row.status != "ran":
                continue
            if previous is not None and (row.verdict != previous.verdict or not row.same_as_previous):
                return row
            previous = row
        return None

    def to_dict(self) -> dict[str, Any]:
        change = self.first_change
        return {"source": self.source, "scheduler_cls": self.scheduler_cls,
                "rows": [r.to_dict() for r in self.rows],
                "first_change": None if change is None else {
                    "version": change.version, "previous": change.compared_with,
                    "verdict_changed": change.verdict != self._previous_verdict(change),
                    "decisions_changed": not change.same_as_previous}}

    def _previous_verdict(self, row: Row) -> str:
        prev = next(r for r in self.rows if r.version == row.compared_with)
        return prev.verdict


def _without_crash_site(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A step's rows with each ``crash`` row's source location (``stop_reason``:
    ``path:line``) left out. Between releases the same failing ``assert`` moves
    with the code around it (0.10.0's ``scheduler.py:521`` is 0.10.1.1's
    ``:530``): the crash's step, call, type and text are the behaviour, its line
    number is not. Regression: bisect named 0.10.1.1 the first change of
    priority-tight for that line number alone."""
    return [{**r, "stop_reason": None} if r.get("kind") == "crash" else r for r in rows]


def first_divergence(a, b) -> dict[str, Any] | None:
    """The first step where traces ``a`` and ``b`` (of one workload) differ, as
    ``{step, event_index, kind, request, field, a, b}``, or None: the rows of
    every step compared as ``harness replay`` compares them
    (``replay.first_difference``; a step only one trace has is a divergence,
    e.g. after a crash), a crash's source line excepted (``_without_crash_site``)."""
    from itertools import zip_longest

    from harness.replay import first_difference

    for item_a, item_b in zip_longest(a.iter_steps(), b.iter_steps()):
        if item_a is None or item_b is None:
            step = (item_a or item_b)[0]
            return {"step": step, "event_index": 0, "kind": None, "request": None, "field": "event",
                    "a": "end of trace" if item_a is None else f"step {step}",
                    "b": "end of trace" if item_b is None else f"step {step}"}
        d = first_difference(item_a[0], _without_crash_site(item_a[1]), _without_crash_site(item_b[1]))
        if d is not None:
            return {"step": d.step, "event_index": d.event_index, "kind": d.kind,
                    "request": d.request, "field": d.field, "a": d.expected, "b": d.actual}
    return None


def identical_steps(a, b, ignore: tuple[str, ...] = ()) -> tuple[int, int]:
    """``(steps of a whose rows b repeats exactly, steps of a)``: the fidelity
    share of ``bench/vllm_fidelity.py``; ``ignore``: row fields left out of
    the comparison (``prefill_capacity_bound``: releases before 0.24.0 have
    no prefill cadence guard, the field reads False)."""
    from itertools import zip_longest

    from harness.replay import first_difference

    def rows(items):
        return [{k: v for k, v in r.items() if k not in ignore} for r in items] if ignore else items

    same = total = 0
    for item_a, item_b in zip_longest(a.iter_steps(), b.iter_steps()):
        if item_a is None:
            break
        total += 1
        if item_b is not None and first_difference(item_a[0], rows(item_a[1]), rows(item_b[1])) is None:
            same += 1
    return same, total


def verdict_of(by_invariant: dict[str, int]) -> str:
    """``clean`` or ``ID ×n, ...`` (most frequent first, then by id)."""
    if not by_invariant:
        return "clean"
    items = sorted(by_invariant.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} ×{n}" for k, n in items)


def release_spec(version: str, scheduler_cls: str | None = None) -> str:
    """The candidate spec of one bisect row: ``vllm@VERSION[,scheduler_cls=...]``."""
    return f"vllm@{version}" + (f",scheduler_cls={scheduler_cls}" if scheduler_cls else "")


def record_release(version: str, spec: str, workload: Workload, config: EngineConfig, seed: int, out: Path,
                   *, step_timeout: float | None = None,
                   log: Callable[[str], None] | None = None) -> Row:
    """One bisect row without its comparison: build the env of a ``vllm@``
    release when missing (``ensure_env``; ``log`` gets its progress lines),
    record ``workload`` with ``spec`` to ``out`` and check it under
    ``--semantics auto``. ``status`` ``ran`` (the trace is at ``out``),
    ``refused``, ``unavailable`` or ``failed`` (no trace); never raises for
    the candidate's failures. ``step_timeout``: seconds a call into the
    candidate's process may take (None: its default)."""
    from harness.candidates.resolve import CandidateSpecError, resolve_candidate
    from harness.check import check_trace
    from harness.trace import open_trace
    from harness.trace.recorder import record

    t0 = time.monotonic()
    row = Row(version, "ran")
    if spec.startswith("vllm@") and spec[5:6].isdigit():
        try:
            ensure_env(spec[5:].split(",", 1)[0], log=log)
        except (VLLMEnvError, OSError) as exc:
            row.status, row.reason = "unavailable", " ".join(str(exc).split())
    row.build_seconds = time.monotonic() - t0
    if row.status == "ran":
        try:
            factory = resolve_candidate(spec, step_timeout=step_timeout)
            record(workload, config, out, seed=seed, engine=spec, candidate_factory=factory)
        except CandidateSpecError as exc:
            row.status, row.reason = "failed", str(exc)
        except CandidateError as exc:
            cause = exc.__cause__
            if isinstance(cause, CandidateRefused):
                row.status, row.reason = "refused", " ".join(str(cause).split())
            else:
                row.status, row.reason = "failed", " ".join(str(exc).split())
        if spec.startswith("vllm@"):  # its idle driver (~0.5 GB) is no use to the next release
            from harness.candidates.vllm.candidate import shutdown_pool

            shutdown_pool()
    if row.status == "ran":
        checked = check_trace(open_trace(out), "auto")
        row.violations = dict(checked.by_invariant)
        row.verdict = verdict_of(row.violations)
        row.profile = checked.profile
        row.steps = checked.steps
    row.seconds = time.monotonic() - t0
    return row


def compare_rows(rows: list[Row], traces: dict[str, Path]) -> None:
    """Fill each row that ran (oldest first) with its comparison against the
    previous one that ran (``compared_with``, ``same_as_previous``,
    ``divergence``); ``traces``: each such row's recording by version. The
    same wherever the rows were recorded."""
    from harness.trace import open_trace

    previous: Row | None = None
    for row in rows:
        if row.status != "ran":
            continue
        if previous is not None:
            found = first_divergence(open_trace(traces[previous.version]), open_trace(traces[row.version]))
            row.compared_with, row.same_as_previous, row.divergence = previous.version, found is None, found
        previous = row


def run_bisect(source: str, workload: Workload, config: EngineConfig, seed: int, versions: list[str],
               *, scheduler_cls: str | None = None, step_timeout: float | None = None,
               on_row: Callable[[str, Row | None], None] | None = None,
               log: Callable[[str], None] | None = None,
               spec_for: Callable[[str], str] | None = None) -> BisectResult:
    """Record ``workload`` on every release of ``versions`` (oldest first) and
    compare each with the previous one that ran; see the module docstring.
    ``on_row(version, None)`` is called when a release starts, ``on_row(version,
    row)`` when it is recorded (its comparison is filled in at the end).
    ``spec_for(version)``: the candidate of a row (default ``release_spec``;
    tests bisect over the reference and mutants). Recordings are temporary
    files, removed after use. ``harness.bisect.ray.bisect_ray`` is the same
    with the rows recorded in parallel on a Ray cluster."""
    spec_of = spec_for or (lambda v: release_spec(v, scheduler_cls))
    notify = on_row or (lambda _v, _r: None)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="sched-harness-bisect-") as tmp:
        traces: dict[str, Path] = {}
        for i, version in enumerate(versions):
            notify(version, None)
            out = Path(tmp) / f"{i}.parquet"
            row = record_release(version, spec_of(version), workload, config, seed, out,
                                 step_timeout=step_timeout, log=log)
            if row.status == "ran":
                traces[version] = out
            rows.append(row)
            notify(version, row)
        compare_rows(rows, traces)
    return BisectResult(source, scheduler_cls, rows)
