"""Measured fidelity of vLLM releases against the reference (README "Fidelity by release").

For each release: every canonical scenario (its golden is the reference's
recording) is recorded with ``vllm@VERSION`` in this process (one driver per
release, reused across scenarios), and each step's rows are compared with the
golden's as ``harness replay`` compares them. Prints one line per release:
scenarios it can express (the others are refused by the driver, per option),
steps identical to the reference / golden steps of those scenarios, the same
share ignoring ``schedule_end.prefill_capacity_bound`` (a field releases
before the prefill cadence do not have), the first divergent scenario and
step, and the wall time. Also writes the rows as JSON (``--json PATH``).

    HARNESS_VLLM_ENVS=/work/vllm-envs-extra:/work/main/.vllm-envs \\
        python bench/vllm_fidelity.py 0.10.0 0.10.2 0.20.2 0.33.0 [--json out.json]

Envs must be built (``harness vllm-env VERSION``); a missing one is reported
and skipped.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from itertools import zip_longest
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from reference.candidate import CandidateError, CandidateRefused  # noqa: E402

from harness.candidates.resolve import CandidateSpecError, resolve_candidate  # noqa: E402
from harness.golden import DEFAULT_DIR  # noqa: E402
from harness.replay import first_difference  # noqa: E402
from harness.scenarios import SCENARIOS  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from harness.trace.recorder import record  # noqa: E402


def _strip_bound(rows):
    return [{k: v for k, v in r.items() if k != "prefill_capacity_bound"} for r in rows]


def compare(golden: Path, trace: Path) -> tuple[int, int, int, int | None]:
    """(identical steps, identical ignoring prefill_capacity_bound, golden
    steps, first divergent step or None)."""
    same = same_loose = total = 0
    first = None
    for item_g, item_t in zip_longest(open_trace(golden).iter_steps(), open_trace(trace).iter_steps()):
        if item_g is None:
            break
        total += 1
        if item_t is None:
            first = item_g[0] if first is None else first
            continue
        if first_difference(item_g[0], item_g[1], item_t[1]) is None:
            same += 1
        elif first is None:
            first = item_g[0]
        if first_difference(item_g[0], _strip_bound(item_g[1]), _strip_bound(item_t[1])) is None:
            same_loose += 1
    return same, same_loose, total, first


def run_release(version: str, tmp: Path, names: list[str] | None = None) -> dict:
    t0 = time.monotonic()
    out = {"version": version, "scenarios": 0, "refused": [], "identical": 0,
           "identical_without_capacity_bound": 0, "steps": 0, "first_divergence": None,
           "diverging": []}
    try:
        factory = resolve_candidate(f"vllm@{version}")
    except CandidateSpecError as exc:
        out["error"] = str(exc)
        return out
    for name in names or sorted(SCENARIOS):
        scenario = SCENARIOS[name]
        path = tmp / f"{version}-{name}.parquet"
        try:
            record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
                   engine=f"vllm@{version}", candidate_factory=factory)
        except CandidateError as exc:
            if isinstance(exc.__cause__, CandidateRefused):
                out["refused"].append(name)
                continue
            raise
        finally:
            gc.collect()
        same, loose, total, first = compare(DEFAULT_DIR / f"{name}.parquet", path)
        out["scenarios"] += 1
        out["identical"] += same
        out["identical_without_capacity_bound"] += loose
        out["steps"] += total
        if first is not None:
            out["diverging"].append([name, first])
            if out["first_divergence"] is None:
                out["first_divergence"] = [name, first]
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run: vLLM 0.33.0 (unless versions are given), one scenario")
    args = parser.parse_args()
    names = None
    if args.smoke:
        args.versions = args.versions or ["0.33.0"]
        names = [sorted(SCENARIOS)[0]]
    if not args.versions:
        parser.error("give at least one vLLM version")
    rows = []
    with tempfile.TemporaryDirectory(prefix="sched-harness-fidelity-") as tmp:
        for version in args.versions:
            row = run_release(version, Path(tmp), names)
            rows.append(row)
            if "error" in row:
                print(f"{version}: {row['error']}", flush=True)
                continue
            share = row["identical"] / row["steps"] if row["steps"] else 0.0
            loose = row["identical_without_capacity_bound"] / row["steps"] if row["steps"] else 0.0
            print(f"{version}: {row['scenarios']} scenarios ({len(row['refused'])} refused), "
                  f"{row['identical']}/{row['steps']} steps identical ({share:.1%}; "
                  f"{loose:.1%} without prefill_capacity_bound), "
                  f"diverging: {', '.join(f'{n}@{s}' for n, s in row['diverging']) or 'none'}, "
                  f"{row['seconds']} s", flush=True)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "vllm_fidelity"))
