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

Exit 0 when every progress rule is silent everywhere, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.check import check_steps  # noqa: E402
from harness.check.invariants import PROGRESS_IDS, SAFETY_IDS  # noqa: E402
from harness.check.profiles import PROFILES  # noqa: E402
from harness.trace.recorder import run_to_rows  # noqa: E402
from workloads.scenario import load_scenario  # noqa: E402

SCENARIO_DIRS = (REPO / "harness" / "scenarios", REPO / "traces" / "scenarios")


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


def table(results: dict[str, dict[str, dict]]) -> list[str]:
    """Markdown rows: release | traces | refused | each progress rule | safety."""
    short = [i.removeprefix("PROGRESS-") for i in PROGRESS_IDS]
    lines = ["| engine | traces | refused | " + " | ".join(short) + " | safety |",
             "|---|---:|---:|" + "---|" * len(short) + "---:|"]
    for engine, res in results.items():
        rec = [r for r in res.values() if r["status"] == "recorded"]
        viol = sum((Counter(r["by_invariant"]) for r in rec), Counter())
        cells = [("silent" if not viol[i] else f"**{viol[i]}**") for i in PROGRESS_IDS]
        safety = sum(viol[i] for i in SAFETY_IDS)
        lines.append(f"| {engine} | {len(rec)} | {sum(r['status'] == 'refused' for r in res.values())} | "
                     + " | ".join(cells) + f" | {safety} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.33.0,0.29.0", help="releases ('' for the reference only)")
    ap.add_argument("--out", type=Path, default=Path("/tmp/progress-soundness"))
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--recheck", action="store_true",
                    help="do not record: check the traces a previous run left under --out again "
                         "(after a change to the rules)")
    args = ap.parse_args()
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
    fired = sum(r["by_invariant"].get(i, 0) for res in results.values() for r in res.values()
                if r["status"] == "recorded" for i in PROGRESS_IDS)
    print("verdict: every progress rule is silent on every engine" if not fired else
          f"verdict: progress rules fired {fired} time(s) (details: {args.out / 'results.json'})")
    return 1 if fired else 0


if __name__ == "__main__":
    sys.exit(main())
