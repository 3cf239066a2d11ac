"""``harness sweep``: canonical scenarios across many candidates (releases,
forks, mutants), one table of fidelity and verdicts.

For each candidate (``vllm@VERSION``, building the release's env when missing
with ``env.ensure_env``, once per node: the env root is a cache; or any
``--candidate`` spec) every scenario named is recorded with it, checked under
``--semantics auto`` (the candidate's measured profile, the safety layer where
none was measured) and compared step by step with the scenario's golden, the
reference's recording: identical steps, first divergent step. A candidate is
one unit of work (its driver, a release's process, reused across the
scenarios): ``sweep_candidate``, run here one after another or as Ray tasks
(``harness.sweep_ray``). The cells come back in (candidate, scenario) order
wherever they ran, so the table is the same.

This is the table ``bench/vllm_fidelity.py`` prints for the README's fidelity
section (steps identical to the reference), plus the verdicts.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.words import did_you_mean, plural

#: Exit codes: every cell that ran conformant / a violation / a candidate unusable.
EXIT_OK, EXIT_VIOLATION, EXIT_UNUSABLE = 0, 1, 2


class SweepError(ValueError):
    """Unusable arguments (an unknown scenario, a bad version range); one line."""


@dataclass
class Cell:
    """One (candidate, scenario): ``status`` ``ran``, ``refused`` (the
    candidate cannot express the scenario's config), ``unavailable`` (its env
    could not be built) or ``failed`` (the candidate could not be made or
    crashed the recording); ``verdict`` ``clean`` or ``ID ×n, ...``;
    ``identical`` of ``golden_steps`` steps repeat the golden's rows exactly;
    ``first_divergence``: the first step that does not (None: none);
    ``reason``: one line, why it did not run (refused, unavailable, failed) or
    how a run that did ended early (the candidate's crash, the engine's stall:
    the recording's ``crashed`` / ``stalled``); ``seconds``: wall time of the
    recording and its checks."""

    candidate: str
    scenario: str
    status: str
    verdict: str = ""
    violations: dict[str, int] = field(default_factory=dict)
    profile: str = ""
    steps: int = 0
    identical: int = 0
    identical_without_capacity_bound: int = 0
    golden_steps: int = 0
    first_divergence: int | None = None
    reason: str = ""
    seconds: float = 0.0

    def outcome(self) -> tuple:
        """Everything but the time: what must be equal wherever the cell ran."""
        return (self.candidate, self.scenario, self.status, self.verdict, self.violations, self.profile,
                self.steps, self.identical, self.golden_steps, self.first_divergence, self.reason)

    def to_dict(self) -> dict[str, Any]:
        return {"candidate": self.candidate, "scenario": self.scenario, "status": self.status,
                "verdict": self.verdict, "violations": dict(self.violations), "profile": self.profile,
                "steps": self.steps, "identical": self.identical,
                "identical_without_capacity_bound": self.identical_without_capacity_bound,
                "golden_steps": self.golden_steps,
                "first_divergence": self.first_divergence, "reason": self.reason,
                "seconds": round(self.seconds, 2)}


def scenario_names(names: Sequence[str]) -> list[str]:
    """The canonical scenarios named (all of them, in ``ORDER``, when none),
    each once; a hybrid model's scenario (``HYBRID_SCENARIOS``,
    harness/scenarios/hybrid/, its golden in golden/hybrid/) only when
    named. Raises SweepError for an unknown name (did you mean)."""
    from harness.scenarios import HYBRID_SCENARIOS, ORDER, SCENARIOS

    if not names:
        return [n for n in ORDER if n in SCENARIOS]
    chosen: list[str] = []
    for name in names:
        if name not in SCENARIOS and name not in HYBRID_SCENARIOS:
            raise SweepError(_unknown_scenario(name, sorted(SCENARIOS), sorted(HYBRID_SCENARIOS)))
        if name not in chosen:
            chosen.append(name)
    return chosen


def scenario_and_golden(name: str):
    """``(Scenario, its golden's path)`` for a canonical or a hybrid scenario name."""
    from harness.golden import DEFAULT_DIR
    from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

    if name in SCENARIOS:
        return SCENARIOS[name], DEFAULT_DIR / f"{name}.parquet"
    return HYBRID_SCENARIOS[name], DEFAULT_DIR / "hybrid" / f"{name}.parquet"


def _known_release(version: str, text: str) -> None:
    """Raise SweepError unless ``version`` is in ``RELEASES`` or its env is
    already built (a newer release a user built with ``harness vllm-env``).
    Regression: ``--versions 0.33.1`` went to PyPI for a release that does not
    exist, and the sweep reported it as a row of download failures (exit 2)."""
    from harness.bisect.core import RELEASES
    from harness.candidates.vllm.env import is_ready, version_tuple

    if version in RELEASES or is_ready(version):
        return
    newer = version_tuple(version) > version_tuple(RELEASES[-1])
    raise SweepError(f"--versions {text}: {version} is not a known vLLM release"
                     + (did_you_mean(version, RELEASES, list_whole=False)
                        or f" (known: {RELEASES[0]} to {RELEASES[-1]})")
                     + (f" (one newer than {RELEASES[-1]}: build its env first, harness vllm-env {version})"
                        if newer else ""))


def _unknown_scenario(name: str, known: list[str], hybrid: list[str] = ()) -> str:
    """The one line for a SCENARIO argument that names no canonical scenario
    (``known``) nor a hybrid one (``hybrid``). Regression: a path
    (``harness/scenarios/fcfs-tight.toml``, a scenario file of one's own, a
    trace) said only "unknown scenario" with no hint."""
    path = Path(name)
    every = [*known, *hybrid]
    names = ", ".join(known) + (f"; hybrid: {', '.join(hybrid)}" if hybrid else "")
    if "/" in name or path.suffix in (".toml", ".parquet") or path.exists():
        if path.stem in every:
            return f"{name}: sweep takes the canonical scenarios by name; did you mean {path.stem!r}?"
        return (f"{name}: not a canonical scenario name (sweep compares each recording with the "
                f"scenario's golden, which only the canonical ones have: {names}); "
                f"a scenario file or trace of your own: harness bisect {name} --versions A..B")
    return f"unknown scenario {name!r}" + (did_you_mean(name, every, list_whole=False)
                                           or f" (known: {names})")


def candidate_specs(candidates: Sequence[str], versions: str | None) -> list[str]:
    """``--candidate`` specs in the order given, then ``vllm@V`` for each
    release of ``--versions`` (``A..B`` or ``V1,V2``, oldest first), each
    once. A release named outright must be one of ``bisect.core.RELEASES``
    (or have its env built already): nothing is looked up on PyPI. Raises
    SweepError when none is named, a release is unknown or the range is bad."""
    from harness.bisect.core import RELEASES, BisectError, parse_versions
    from harness.candidates.vllm.env import VLLMEnvError, check_version, version_tuple

    specs = list(dict.fromkeys(candidates))
    if versions:
        text = versions.strip()
        try:
            if ".." in text or "," in text:
                releases = parse_versions(text)
            else:  # one release (bisect's parser wants two)
                releases = [check_version(text)]
            if ".." not in text:  # a range selects from RELEASES; named ones are checked
                for v in releases:
                    _known_release(v, text)
        except BisectError as exc:
            if "needs two or more" not in str(exc):
                raise SweepError(str(exc)) from None
            if ".." in text:  # a range holding one release
                lo, _, hi = text.partition("..")
                releases = [v for v in RELEASES if version_tuple(lo) <= version_tuple(v) <= version_tuple(hi)]
            else:  # one release named twice
                releases = sorted({check_version(v.strip()) for v in text.split(",") if v.strip()})
                for v in releases:
                    _known_release(v, text)
        except VLLMEnvError as exc:
            raise SweepError(f"--versions {text}: {exc}") from None
        if not releases:
            raise SweepError(f"--versions {text}: names no release")
        specs += [f"vllm@{v}" for v in releases if f"vllm@{v}" not in specs]
    if not specs:
        raise SweepError("name the candidates: --versions A..B and/or --candidate SPEC")
    return specs


def _release(spec: str) -> str | None:
    """The version of a ``vllm@VERSION[,...]`` spec naming a release (not a path)."""
    if not spec.startswith("vllm@"):
        return None
    target = spec[len("vllm@"):].split(",", 1)[0]
    return target if target[:1].isdigit() and "/" not in target else None


def sweep_candidate(spec: str, scenarios: Sequence[str], *, step_timeout: float | None = None,
                    log: Callable[[str], None] | None = None) -> list[Cell]:
    """Every scenario of ``scenarios`` (canonical names) on the candidate
    ``spec``, in order: one ``Cell`` each (see the module docstring). A
    release's env is built first when missing (``ensure_env``; ``log`` gets
    its progress lines). ``step_timeout``: seconds a call into an isolated
    candidate (``module:factory``, ``vllm@``) may take before the run ends as
    a hang at that step (None: ``isolated.DEFAULT_STEP_TIMEOUT_S``). Never
    raises for the candidate's failures: they are cells (``unavailable``,
    ``failed``, ``refused``; a crash or stall is a cell that ran, its one
    line in ``reason``). Recordings are temporary."""
    from harness.candidates.resolve import CandidateSpecError, resolve_candidate
    from harness.candidates.vllm.env import VLLMEnvError, ensure_env

    def every(status: str, reason: str) -> list[Cell]:
        return [Cell(spec, name, status, reason=" ".join(reason.split())) for name in scenarios]

    version = _release(spec)
    if version is not None:
        try:
            ensure_env(version, log=log)
        except (VLLMEnvError, OSError) as exc:
            return every("unavailable", str(exc))
    try:
        factory = None if spec == "reference" else resolve_candidate(spec, step_timeout=step_timeout)
    except CandidateSpecError as exc:
        return every("failed", str(exc))
    try:
        return _record_each(spec, factory, scenarios)
    finally:
        if version is not None:  # its idle drivers (~0.5 GB each) are no use to the next release
            from harness.candidates.vllm.candidate import shutdown_pool

            shutdown_pool()


def _record_each(spec: str, factory, scenarios: Sequence[str]) -> list[Cell]:
    """``sweep_candidate``'s cells once the candidate is made (``factory``
    None: the reference)."""
    from reference.candidate import CandidateError, CandidateRefused

    from harness.bisect.core import first_divergence, identical_steps, verdict_of
    from harness.check import check_trace
    from harness.trace import open_trace
    from harness.trace.recorder import record

    cells: list[Cell] = []
    with tempfile.TemporaryDirectory(prefix="sched-harness-sweep-") as tmp:
        for name in scenarios:
            t0 = time.monotonic()
            (scenario, golden_path), out = scenario_and_golden(name), Path(tmp) / f"{name}.parquet"
            cell = Cell(spec, name, "ran")
            try:
                summary = record(scenario.make_workload(), scenario.engine_config(), out, seed=scenario.seed,
                                 engine=spec, **({} if factory is None else {"candidate_factory": factory}))
                # Regression: a crash was only "ENGINE-CRASH ×1", its message nowhere in the table.
                if summary.crashed or summary.stalled:
                    cell.reason = " ".join((f"crashed: {summary.crashed}" if summary.crashed
                                            else f"stalled: {summary.stalled}").split())
            except CandidateError as exc:
                refused = isinstance(exc.__cause__, CandidateRefused)
                cell.status = "refused" if refused else "failed"
                cell.reason = " ".join(str(exc.__cause__ if refused else exc).split())
            if cell.status == "ran":
                trace = open_trace(out)
                checked = check_trace(trace, "auto")
                cell.violations = dict(checked.by_invariant)
                cell.verdict, cell.profile, cell.steps = verdict_of(cell.violations), checked.profile, checked.steps
                golden = open_trace(golden_path)
                cell.identical, cell.golden_steps = identical_steps(golden, trace)
                cell.identical_without_capacity_bound = identical_steps(
                    golden, trace, ignore=("prefill_capacity_bound",))[0]
                found = first_divergence(golden, trace)
                cell.first_divergence = None if found is None else int(found["step"])
            cell.seconds = time.monotonic() - t0
            cells.append(cell)
    return cells


def sweep_local(specs: Sequence[str], scenarios: Sequence[str], *, step_timeout: float | None = None,
                on_candidate: Callable[[int, list[Cell]], None] | None = None,
                log: Callable[[str], None] | None = None) -> list[list[Cell]]:
    """``sweep_candidate`` for each spec in turn, in this process;
    ``on_candidate(index, cells)`` after each."""
    results = []
    for i, spec in enumerate(specs):
        results.append(sweep_candidate(spec, scenarios, step_timeout=step_timeout, log=log))
        if on_candidate is not None:
            on_candidate(i, results[-1])
    return results


def sweep_exit(results: Sequence[Sequence[Cell]]) -> int:
    """2 if a candidate could run nothing (unavailable, refused or failed on
    every scenario), else 1 if any cell violates an invariant or failed, else 0.
    Refused cells and steps that differ from the reference's are information:
    releases legitimately decide differently."""
    # Regression: a release that refused every scenario exited 0 ("1 refused (exit 0)"): nothing ran.
    if any(cells and all(c.status != "ran" for c in cells) for cells in results):
        return EXIT_UNUSABLE
    if any(c.status == "failed" or c.violations for cells in results for c in cells):
        return EXIT_VIOLATION
    return EXIT_OK


def summary_rows(results: Sequence[Sequence[Cell]]) -> list[dict[str, Any]]:
    """One row per candidate: scenarios ran / refused, steps identical to
    the goldens, verdicts (clean scenarios, violations summed by id), first
    divergent scenario and step, seconds."""
    rows = []
    for cells in results:
        ran = [c for c in cells if c.status == "ran"]
        violations: dict[str, int] = {}
        for c in ran:
            for k, n in c.violations.items():
                violations[k] = violations.get(k, 0) + n
        bad = [c for c in cells if c.status in ("unavailable", "failed")]
        first = next((c for c in ran if c.first_divergence is not None), None)
        # Regression: a crash's (and a refusal's) one line was nowhere in the row.
        told = bad or [c for c in ran if c.reason] or [c for c in cells if c.reason]
        rows.append({
            "candidate": cells[0].candidate if cells else "",
            "ran": len(ran), "refused": sum(c.status == "refused" for c in cells),
            "unusable": len(bad), "reason": f"{told[0].scenario}: {told[0].reason}" if told else "",
            "notes": notes(cells),
            "identical": sum(c.identical for c in ran), "golden_steps": sum(c.golden_steps for c in ran),
            "identical_without_capacity_bound": sum(c.identical_without_capacity_bound for c in ran),
            "divergences": [[c.scenario, c.first_divergence] for c in ran if c.first_divergence is not None],
            "clean": sum(not c.violations for c in ran), "violations": dict(sorted(violations.items())),
            "first_divergence": None if first is None else [first.scenario, first.first_divergence],
            "seconds": round(sum(c.seconds for c in cells), 1)})
    return rows


def notes(cells: Sequence[Cell]) -> list[str]:
    """One candidate's lines under the table, one per outcome worth saying
    (a violation, a crash or stall, a refusal, an unusable candidate), the
    scenarios sharing it named together, in scenario order:
    ``"fcfs-tight, pipeline-3: refused: REASON"``,
    ``"priority-tight: ENGINE-CRASH ×1; crashed: LINE"``. Clean runs say nothing."""
    grouped: dict[str, list[str]] = {}
    for c in cells:
        if c.status == "ran":
            if not c.violations and not c.reason:
                continue
            what = "; ".join(x for x in (c.verdict if c.violations else "", c.reason) if x)
        else:
            what = f"{c.status}: {c.reason}" if c.reason else c.status
        grouped.setdefault(what, []).append(c.scenario)
    if len(grouped) == 1 and len(cells) > 1 and len(next(iter(grouped.values()))) == len(cells):
        return [f"every scenario: {next(iter(grouped))}"]
    return [f"{', '.join(names)}: {what}" for what, names in grouped.items()]


def verdict_line(results: Sequence[Sequence[Cell]]) -> str:
    """The last line: ``sweep: C candidates x S scenarios: ... (exit N)``."""
    cells = [c for cs in results for c in cs]
    scenarios = len(results[0]) if results else 0
    ran = [c for c in cells if c.status == "ran"]
    clean = sum(not c.violations for c in ran)
    parts = [f"{clean} clean", f"{len(ran) - clean} violating"]
    for status in ("refused", "failed", "unavailable"):
        n = sum(c.status == status for c in cells)
        if n:
            parts.append(f"{n} {status}")
    return (f"sweep: {plural(len(results), 'candidate')} x {plural(scenarios, 'scenario')}: "
            f"{', '.join(parts)} (exit {sweep_exit(results)})")


def markdown_table(cells: Sequence[dict[str, Any]]) -> str:
    """The fidelity table of the docs (``docs/explanation/releases.md``) from
    a sweep's cells (``Cell.to_dict``, as ``--json`` prints them; several
    sweeps' cells may be joined): one row per candidate, in the order met
    (``vllm@V`` shown as ``V``): scenarios run (refused), steps identical to
    the goldens (count and share), the same ignoring
    ``schedule_end.prefill_capacity_bound`` (no capacity guard before
    0.24.0), verdicts (clean scenarios; violations summed by id) and every
    scenario's first divergent step. One line per row; ``|`` in a reason is
    escaped."""
    by_candidate: dict[str, list[dict[str, Any]]] = {}
    for cell in cells:
        by_candidate.setdefault(cell["candidate"], []).append(cell)
    lines = ["| candidate | scenarios run (refused) | steps identical | without the capacity guard | verdicts "
             "| first divergences |", "|---|---|---|---|---|---|"]
    for candidate, group in by_candidate.items():
        name = candidate[len("vllm@"):] if _release(candidate) else candidate
        ran = [c for c in group if c["status"] == "ran"]
        if not ran:
            reasons = sorted({f"{c['status']}: {c['reason']}" for c in group})
            told = "; ".join(reasons).replace("|", "\\|")
            lines.append(f"| {name} | 0 ({len(group)}) | - | - | {told} | - |")
            continue
        golden = sum(c["golden_steps"] for c in ran)
        same = sum(c["identical"] for c in ran)
        loose = sum(c.get("identical_without_capacity_bound", c["identical"]) for c in ran)
        violations: dict[str, int] = {}
        for c in ran:
            for k, n in c["violations"].items():
                violations[k] = violations.get(k, 0) + n
        clean = sum(not c["violations"] for c in ran)
        verdicts = f"{clean} clean" + (f"; {verdict_of_counts(violations)}" if violations else "")
        diverging = ", ".join(f"{c['scenario']}@{c['first_divergence']}" for c in ran
                              if c["first_divergence"] is not None) or "none"
        refused = sum(c["status"] == "refused" for c in group)
        other = len(group) - len(ran) - refused
        run = f"{len(ran)} ({refused})" + (f", {other} unusable" if other else "")
        share = same / golden if golden else 0.0
        lines.append(f"| {name} | {run} | {same}/{golden} = {share:.1%} | "
                     f"{(loose / golden if golden else 0.0):.1%} | {verdicts} | {diverging} |")
    return "\n".join(line.replace("\n", " ") for line in lines)


def verdict_of_counts(violations: dict[str, int]) -> str:
    """``ID ×n, ...``, most frequent first (``bisect.core.verdict_of``)."""
    from harness.bisect.core import verdict_of

    return verdict_of(violations)
