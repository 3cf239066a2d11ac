"""A fork developer's experiment (issue 23): Scheduler subclasses of vLLM 0.33.0,
eight with one realistic bug each, one with a semantics-only change and three
correct policies that decide differently (bench/forks/fork_schedulers.py), each
recorded through the driver (``vllm@0.33.0,scheduler_cls=fork_schedulers:Class``,
what ``harness record SCENARIO --engine SPEC`` does) on the progress scenarios of
the library and a set of canonical scenarios, then checked three ways: the fork
gate (``--semantics fork``: safety + progress), safety alone, and the base
release's profile (``--semantics auto``: 0.33.0, every rule of its design).

Per class it prints the first witness under each semantics (id, scenario, step;
several ids of one request and step: the root cause first) and, for the correct
policies, the false alarms of the fork gate (goal 0). A config a plain Scheduler
subclass cannot run (async scheduling needs an AsyncScheduler) is refused by the
driver and counted, never a finding.

    HARNESS_VLLM_ENVS=/path/.vllm-envs .venv/bin/python bench/fork_experiment.py \
        --out /tmp/fork-experiment

``--smoke`` (what tests/test_bench_smoke.py runs; needs the 0.33.0 env): one progress
bug (SkipTailEveryThird) on one scenario (running-skipped-with-room), one vLLM start,
in a temporary folder. The figures go to the
``fork_experiment`` section of docs/benchmarks.md (bench/page.py).

Exit 0 when every bug that breaks safety or progress is caught by the fork gate
and no correct policy fails it, 1 otherwise.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FORKS = REPO / "bench" / "forks"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.candidates.resolve import resolve_candidate  # noqa: E402
from harness.check import check_trace  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from harness.trace.recorder import record as record_run  # noqa: E402
from reference.candidate import CandidateError, CandidateRefused  # noqa: E402
from workloads.scenario import load_scenario  # noqa: E402

#: (class, kind, what should catch it): "safety"/"progress" bugs must fail the
#: fork gate; "semantics" only a release's profile; "correct" nothing under the gate.
CLASSES = [
    ("FreeBeforeFence", "safety"), ("PreemptKeepsComputed", "safety"), ("LeakOnFinish", "safety"),
    ("ForgetFinishedIds", "safety"), ("RunningCapPlusTwo", "safety"), ("AdmitOnePerStep", "progress"),
    ("KeepReserve", "progress"), ("SkipTailEveryThird", "progress"), ("NoLongPrefillThreshold", "semantics"),
    ("TighterTokenCap", "correct"), ("RunningCapTwo", "correct"), ("ChunkAt32", "correct"),
]
SCENARIOS = [
    "traces/scenarios/running-skipped-with-room", "traces/scenarios/admit-all-that-fit",
    "traces/scenarios/preempt-only-when-full", "traces/scenarios/preempt-fenced-victim",
    "traces/scenarios/running-after-preemption", "traces/scenarios/preempt-and-recompute",
    "harness/scenarios/fcfs-tight", "harness/scenarios/fcfs-roomy", "harness/scenarios/priority-tight",
    "harness/scenarios/chunked-threshold", "harness/scenarios/deferred-frees",
    "harness/scenarios/pipeline-3", "traces/scenarios/deferred-free-pipeline",
]
SEMANTICS = ("fork", "safety", "auto")


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_class(cls: str, out: Path, scenarios: list[str]) -> dict:
    """Record each of ``scenarios`` (paths under the repository, no suffix) with the
    class; check each trace three ways."""
    spec = f"vllm@0.33.0,scheduler_cls=fork_schedulers:{cls}"
    factory = resolve_candidate(spec)
    per: dict[str, dict] = {}
    for name in scenarios:
        sc = load_scenario(REPO / f"{name}.toml")
        path = out / cls / f"{Path(name).name}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            record_run(sc.workload, sc.engine_config(), path, seed=sc.seed, engine=spec,
                       candidate_factory=factory)
        except CandidateError as exc:
            if isinstance(exc.__cause__, CandidateRefused):
                per[name] = {"status": "refused", "why": " ".join(str(exc.__cause__).split())[:200]}
                continue
            if not path.exists():
                per[name] = {"status": "error", "why": str(exc)[:200]}
                continue
        trace = open_trace(path)
        per[name] = {"status": "recorded", **{
            sem: [(v.invariant, v.step, v.request) for v in check_trace(trace, sem).violations[:3]]
            for sem in SEMANTICS}}
        say(f"{cls} {Path(name).name}: " + ", ".join(
            f"{sem} {per[name][sem][0][0] if per[name][sem] else '-'}" for sem in SEMANTICS))
    return per


def first(per: dict, sem: str) -> str:
    """The first witness under ``sem`` over the scenarios (in SCENARIOS order)."""
    for name in SCENARIOS:
        r = per.get(name, {})
        if r.get("status") == "recorded" and r[sem]:
            inv, step, _ = r[sem][0]
            return f"{inv} ({Path(name).name}, step {step})"
    return "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/fork-experiment"))
    ap.add_argument("--classes", default="", help="comma-separated class names (default: all)")
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all 13)")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: one progress bug on one scenario (one vLLM start), a temp folder")
    args = ap.parse_args()
    if args.smoke:
        args.classes, args.scenarios = "SkipTailEveryThird", "running-skipped-with-room"
        args.out = Path(tempfile.mkdtemp(prefix="fork-experiment-"))
    known = {c for c, _ in CLASSES}
    names = {Path(n).name: n for n in SCENARIOS}
    for bad in [c for c in args.classes.split(",") if c and c not in known] + \
            [n for n in args.scenarios.split(",") if n and n not in names]:
        close = difflib.get_close_matches(bad, [*known, *names], n=1)
        ap.error(f"no class or scenario {bad!r}" + (f"; did you mean {close[0]!r}?" if close else
                 f"; the classes: {', '.join(sorted(known))}; the scenarios: {', '.join(names)}"))
    scenarios = [n for n in SCENARIOS if not args.scenarios or Path(n).name in args.scenarios.split(",")]
    # The driver imports the classes from the caller's PYTHONPATH.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FORKS), os.environ.get("PYTHONPATH", "")) if p)
    wanted = {c for c in args.classes.split(",") if c}
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    for cls, _ in CLASSES:
        if not wanted or cls in wanted:
            results[cls] = run_class(cls, args.out, scenarios)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("| class | kind | fork gate: first witness | safety only | profile 0.33.0 | fork-gate scenarios failed | refused |")
    print("|---|---|---|---|---|---:|---:|")
    bad = 0
    for cls, kind in CLASSES:
        if cls not in results:
            continue
        per = results[cls]
        failed = sum(1 for r in per.values() if r.get("status") == "recorded" and r["fork"])
        refused = sum(1 for r in per.values() if r.get("status") == "refused")
        print(f"| {cls} | {kind} | {first(per, 'fork')} | {first(per, 'safety')} | {first(per, 'auto')} | "
              f"{failed} | {refused} |")
        if kind in ("safety", "progress") and not failed:
            bad += 1
        if kind in ("correct", "semantics") and failed:
            bad += 1
    say(f"{len(results)} classes in {time.monotonic() - t0:.0f} s wall")
    print("verdict: the fork gate catches every safety and progress bug, and no correct policy fails it"
          if not bad else f"verdict: {bad} class(es) judged wrongly (details: {args.out / 'results.json'})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(page.run(main, "fork_experiment"))
