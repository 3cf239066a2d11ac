"""Measured fidelity of vLLM releases against the reference (the fidelity table of
``docs/explanation/releases.md``), from ``harness sweep``'s output.

Runs ``harness sweep [SCENARIO...] --versions VERSIONS --json`` (every
canonical scenario, whose golden is the reference's recording, recorded with
each release and compared step by step; a release's env is built when
missing) in a child process, or reads the JSON of sweeps already run
(``--from FILE``, repeatable: a long range swept in pieces), and prints the
table ``harness sweep --markdown`` prints: one row per release, scenarios run
(refused), steps identical to the reference, the same share ignoring
``schedule_end.prefill_capacity_bound`` (releases before the prefill cadence
do not have the field), verdicts, every first divergence. Then the releases
of the table, those of VERSIONS it lacks, the sweeps' own CPU seconds and the
verdict line.

    HARNESS_VLLM_ENVS=/path/to/envs python bench/vllm_fidelity.py 0.20.2..0.33.0 [--json out.json]
    python bench/vllm_fidelity.py 0.20.2..0.33.0 --from a.json --from b.json

``--smoke``: vLLM 0.33.0 on one scenario.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.candidates.vllm.env import version_tuple  # noqa: E402
from harness.sweep import SweepError, candidate_specs, markdown_table  # noqa: E402


def run_sweep(versions: str, scenarios: list[str]) -> dict:
    """``harness sweep SCENARIO... --versions VERSIONS --json`` in a child process (its CPU is this run's)."""
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "sweep", *scenarios, "--versions", versions,
                           "--json"], cwd=REPO, capture_output=True, text=True)
    if proc.returncode not in (0, 1, 2) or not proc.stdout.strip():
        raise SystemExit(f"harness sweep failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="?", help="releases: A..B or V1,V2,... (harness sweep --versions)")
    parser.add_argument("scenarios", nargs="*", help="canonical scenarios (default: all)")
    parser.add_argument("--from", dest="sources", action="append", default=[], metavar="FILE",
                        help="the JSON of a `harness sweep --json` already run (repeatable)")
    parser.add_argument("--json", dest="json_path", help="also write the joined cells as JSON here")
    parser.add_argument("--smoke", action="store_true", help="the test suite's run: vLLM 0.33.0, one scenario")
    args = parser.parse_args()
    if args.smoke:
        args.versions, args.scenarios = args.versions or "0.33.0", args.scenarios or ["fcfs-tight"]
    if not args.versions:
        parser.error("give the releases (A..B or V1,V2,...)")
    try:
        wanted = [s[len("vllm@"):] for s in candidate_specs([], args.versions)]
    except SweepError as exc:
        parser.error(str(exc))
    reports = [json.loads(Path(p).read_text()) for p in args.sources] or [run_sweep(args.versions, args.scenarios)]
    cells = [c for r in reports for c in r["cells"] if c["candidate"][len("vllm@"):] in wanted]
    cells.sort(key=lambda c: version_tuple(c["candidate"][len("vllm@"):]))  # stable: scenario order kept
    shown = list(dict.fromkeys(c["candidate"][len("vllm@"):] for c in cells))
    print(markdown_table(cells))
    print()
    print(f"releases in the table ({len(shown)}): {', '.join(shown)}")
    missing = [v for v in wanted if v not in shown]
    print(f"releases of {args.versions} not in it ({len(missing)}): {', '.join(missing) or 'none'}")
    for path, r in zip(args.sources, reports):
        names = [c["candidate"] for c in r["candidates"]]
        print(f"from {Path(path).name}: harness sweep over {', '.join(n[len('vllm@'):] for n in names)} "
              f"({r['runner']}, exit {r['exit']})")
    cpu = [r.get("cpu_seconds") for r in reports]
    if args.sources and all(c is not None for c in cpu):
        print(f"CPU seconds of the sweeps read (the harness processes, not their vLLM drivers): {sum(cpu):.0f} "
              f"({', '.join(f'{c:.0f}' for c in cpu)})")
    ran = [c for c in cells if c["status"] == "ran"]
    print(f"verdict: {len(shown)} releases x {len({c['scenario'] for c in cells})} scenarios: {len(ran)} ran, "
          f"{sum(not c['violations'] for c in ran)} clean, {sum(c['status'] == 'refused' for c in cells)} refused, "
          f"{sum(c['status'] in ('unavailable', 'failed') for c in cells)} unusable")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(cells, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "vllm_fidelity"))
