"""Is every progress rule silent on every correct engine we can drive? (issue 23)

For the reference and each vLLM release (``--versions``, default 0.33.0,0.29.0) this
records every canonical scenario (``harness/scenarios/*.toml``), every bug-shape and
progress scenario (``traces/scenarios/*.toml``) with ``vllm@VERSION`` through the driver
(bench/semantics_versions.py's ``record_driver``: what ``harness record SCENARIO
--engine vllm@VERSION`` does) and checks each trace under ``--semantics fork`` (safety +
progress: the progress layer is checked whatever the release, measured profile or
not). The reference also records every golden's scenario in memory.

It prints the release x rule table: per release, the traces recorded (and refused by
the driver: a config the release cannot express), then for each progress rule the
number of violations over all its traces ("silent" for none); a last column counts
the safety violations (not this script's concern, shown so nothing hides). A rule
that fires on a release's deliberate design belongs in the semantics layer.

    HARNESS_VLLM_ENVS=/path/.vllm-envs .venv/bin/python bench/progress_soundness.py \
        --versions 0.33.0,0.29.0 --out /tmp/progress-soundness

``--smoke`` (what tests/test_bench_smoke.py runs, no vLLM): the reference alone on
every scenario (about 2 CPU s), in a temporary folder. The figures go to the ``progress_soundness``
section of docs/benchmarks.md (bench/page.py).

Exit 0 when every progress rule is silent everywhere, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.check import check_steps  # noqa: E402
from harness.check.invariants import PROGRESS_IDS, SAFETY_IDS  # noqa: E402
from harness.check.profiles import PROFILES  # noqa: E402
from harness.trace.recorder import run_to_rows  # noqa: E402
from workloads.scenario import load_scenario  # noqa: E402

SCENARIO_DIRS = (REPO / "harness" / "scenarios", REPO / "traces" / "scenarios")
_FENCED_VICTIM = "vllm-project/vllm#49674, fixed by #49675 in 0.31.0"
#: (release, scenario) -> {rule: violations}: a release's real bug the rule is for, exactly
#: (a finding, not a false alarm; docs/explanation/progress.md, "Soundness"). 0.25.0 and
#: 0.29.0 preempt a victim whose free is fenced behind a step in flight: the preemption frees
#: nothing and the retry preempts the next victim.
KNOWN_FINDINGS: dict[tuple[str, str], tuple[dict[str, int], str]] = {
    (version, scenario): ({"PROGRESS-PREEMPT-FREES": n}, _FENCED_VICTIM)
    for version in ("0.25.0", "0.29.0")
    for scenario, n in (("deferred-frees", 7), ("preempt-fenced-victim", 2))
}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _semantics_versions():
    spec = importlib.util.spec_from_file_location("_sv", REPO / "bench" / "semantics_versions.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.SEMANTICS = "fork"
    return mod


def run_reference(paths: list[Path]) -> dict[str, dict]:
    """Every scenario on the reference, in memory, checked under the fork gate."""
    res = {}
    for p in paths:
        sc = load_scenario(p)
        config = sc.engine_config({})
        steps: list = []
        run_to_rows(sc.workload, config, seed=sc.seed, on_step_rows=lambda s, rows: steps.append((s, rows)))
        r = check_steps(config.to_dict(), steps, PROFILES["fork"])
        res[p.stem] = {"status": "recorded", "by_invariant": dict(r.by_invariant),
                       "witnesses": [f"{v.invariant} step {v.step} {v.request}: {v.message}"
                                     for v in r.violations[:6]]}
    return res


def progress_fired(engine: str, scenario: str, result: dict) -> tuple[dict[str, int], bool]:
    """The progress violations of one trace (rule -> count) and whether they are
    exactly a known finding of the release (``KNOWN_FINDINGS``)."""
    fired = {i: n for i, n in result.get("by_invariant", {}).items() if i in PROGRESS_IDS and n}
    known = KNOWN_FINDINGS.get((engine.removeprefix("vllm "), scenario))
    return fired, bool(fired) and known is not None and known[0] == fired


def table(results: dict[str, dict[str, dict]]) -> list[str]:
    """Markdown rows: engine | traces | refused | errors | each progress rule | safety.
    A progress cell: "silent", or the violations over all the engine's traces in bold,
    marked "(known)" when every one is a known finding of the release."""
    short = [i.removeprefix("PROGRESS-") for i in PROGRESS_IDS]
    lines = ["| engine | traces | refused | errors | " + " | ".join(short) + " | safety |",
             "|---|---:|---:|---:|" + "---|" * len(short) + "---:|"]
    for engine, res in results.items():
        rec = {name: r for name, r in res.items() if r["status"] == "recorded"}
        viol = sum((Counter(r["by_invariant"]) for r in rec.values()), Counter())
        unknown: Counter = Counter()
        for name, r in rec.items():
            fired, known = progress_fired(engine, name, r)
            if not known:
                unknown.update(fired)
        cells = [("silent" if not viol[i] else f"**{viol[i]}**" + ("" if unknown[i] else " (known)"))
                 for i in PROGRESS_IDS]
        safety = sum(viol[i] for i in SAFETY_IDS)
        lines.append(f"| {engine} | {len(rec)} | {sum(r['status'] == 'refused' for r in res.values())} | "
                     f"{sum(r['status'] == 'error' for r in res.values())} | " + " | ".join(cells) + f" | {safety} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.33.0,0.29.0", help="releases ('' for the reference only)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/progress-soundness"))
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--recheck", action="store_true",
                    help="do not record: check the traces a previous run left under --out again "
                         "(after a change to the rules)")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: the reference alone (every scenario, ~2 CPU s), a temp folder")
    args = ap.parse_args()
    if args.smoke:
        args.versions = ""
        args.out = Path(tempfile.mkdtemp(prefix="progress-soundness-"))
    wanted = {n for n in args.scenarios.split(",") if n}
    paths = [p for d in SCENARIO_DIRS for p in sorted(d.glob("*.toml")) if not wanted or p.stem in wanted]
    results: dict[str, dict[str, dict]] = {}
    t0 = time.process_time()
    results["reference"] = run_reference(paths)
    say(f"reference: {len(paths)} scenarios in {time.process_time() - t0:.1f} CPU s")
    sv = _semantics_versions() if args.versions else None
    for version in [v for v in args.versions.split(",") if v]:
        res = results[f"vllm {version}"] = {}
        for p in paths:
            out = args.out / version / f"{p.stem}.parquet"
            out.parent.mkdir(parents=True, exist_ok=True)
            if args.recheck:
                r = res[p.stem] = ({"status": "recorded", **sv.check(out)} if out.exists()
                                   else {"status": "refused", "why": "no trace left by the last run"})
                continue
            r = res[p.stem] = sv.record_driver(p, version, out)
            if r["status"] == "error" and "VLLMRefused" in r.get("why", ""):
                r["status"] = "refused"  # the driver's refusal of a config the release cannot express
            say(f"{version} {p.stem}: {r['status']} {r.get('by_invariant') or r.get('why', '')[:160]}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)))
    known, unknown = [], 0
    for engine, res in results.items():
        for name, r in res.items():
            fired, is_known = progress_fired(engine, name, r) if r["status"] == "recorded" else ({}, False)
            if is_known:
                known.append(f"{engine} {name}: " + ", ".join(f"{i} x{n}" for i, n in fired.items())
                             + f" ({KNOWN_FINDINGS[(engine.removeprefix('vllm '), name)][1]})")
            else:
                unknown += sum(fired.values())
    for line in known:
        print(f"known finding: {line}")
    errors = sum(r["status"] == "error" for res in results.values() for r in res.values())
    if unknown or errors:
        print(f"verdict: progress rules fired {unknown} time(s) beyond the known findings, {errors} "
              f"recording error(s) (details: {args.out / 'results.json'})")
        return 1
    print("verdict: every progress rule is silent on every engine"
          + (f" but for {len(known)} known finding(s) of a release" if known else ""))
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "progress_soundness"))
