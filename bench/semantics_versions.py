"""Which invariants fire on traces that real vLLM releases record? (issue 13)

For each version (``--versions``, default 0.33.0,0.29.0,0.25.0,0.20.2: the releases with a
profile) this records every canonical scenario (``harness/scenarios/*.toml``, the goldens'
workloads) and every bug-shape scenario (``traces/scenarios/*.toml``) with ``vllm@VERSION`` through the
driver (what ``harness record SCENARIO --engine vllm@VERSION`` does, in-process so the
driver pool pays vLLM's import once per version), then checks each trace (``harness
check --semantics auto``, i.e. under that version's profile). With ``--recording NAME,...`` it also records those scenarios through
``RecordingScheduler`` (the ``--scheduler-cls`` subclass), driven inside the version's
venv by the drive script of ``tests/test_vllm_recording.py``, converts the JSONL and
checks it too.

A config a version cannot express is refused by the driver at init (one line,
counted as *refused*); anything else failing is counted as an *error*.

Output: OUT/VERSION/{driver,recording}/NAME.parquet, OUT/results.json (per trace:
status, steps, violations by invariant, the first witnesses), one row per version on
stdout, progress on stderr, and a verdict last line. Run from the repository root:

    HARNESS_VLLM_ENVS=/path/.vllm-envs .venv/bin/python bench/semantics_versions.py \
        --versions 0.33.0,0.29.0 --out /tmp/versions --recording fcfs-tight,prefix-sharing

Exit 0 when every recorded trace is clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.candidates.resolve import resolve_candidate  # noqa: E402
from harness.check import check_trace  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from harness.trace.recorder import record as record_run  # noqa: E402
from reference.candidate import CandidateCrash, CandidateError, CandidateRefused  # noqa: E402
from reference.config import ConfigError  # noqa: E402
from reference.engine import check_workload_supported  # noqa: E402
from workloads.scenario import load_scenario  # noqa: E402

SCENARIO_DIRS = (REPO / "harness" / "scenarios", REPO / "traces" / "scenarios")
SEMANTICS = "auto"  # --semantics


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def check(path: Path) -> dict:
    """Check a trace under ``--semantics`` (default auto: the recording
    version's profile): steps, violations by invariant, the first few witnesses."""
    trace = open_trace(path)
    res = check_trace(trace, SEMANTICS)
    return {"steps": res.steps, "profile": res.profile, "by_invariant": dict(res.by_invariant),
            "witnesses": [f"{v.invariant} step {v.step} {v.request}: {v.message}"
                          for v in res.violations[:12]]}


def record_driver(scenario_path: Path, version: str, out: Path) -> dict:
    """Record one scenario on vllm@VERSION through the driver and check it."""
    t0 = time.monotonic()
    try:
        sc = load_scenario(scenario_path)
        config = sc.engine_config({})
        check_workload_supported(config, sc.workload)
        record_run(sc.workload, config, out, seed=sc.seed, engine=f"vllm@{version}",
                   candidate_factory=resolve_candidate(f"vllm@{version}"))
    except ConfigError as exc:
        return {"status": "refused", "why": f"harness config: {exc}"}
    except CandidateError as exc:
        msg = str(exc)
        # The driver's init refusals (DriverError, raised as VLLMRefused) arrive on the first call,
        # at step 0, as a CandidateError caused by a CandidateRefused. Regression: only the message
        # " raised during 'init'" was looked for, so every refusal (encoder-inputs, kv-connector)
        # was counted as an error.
        refused = isinstance(exc.__cause__, CandidateRefused) and not isinstance(exc, CandidateCrash)
        status = "refused" if refused or " raised during 'init'" in msg else "error"
        return {"status": status, "why": msg[:400], "s": round(time.monotonic() - t0, 1)}
    return {"status": "recorded", "s": round(time.monotonic() - t0, 1), **check(out)}


def _drive_script(version: str) -> str:
    """tests/test_vllm_recording.py's DRIVE script for ``version``, cut before its
    0.33.0-only epilogue (the --scheduler-cls resolution and async refusal)."""
    spec = importlib.util.spec_from_file_location("_tvr", REPO / "tests" / "test_vllm_recording.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    head = mod.DRIVE.split("# What --scheduler-cls does")[0]
    return head.replace(f'"{mod.VERSION}", seed=seed', f'"{version}", seed=seed') + \
        'print("RESULTS " + json.dumps(results))\n', mod.HARNESS_ONLY


def record_recording(names: list[str], version: str, outdir: Path) -> dict[str, dict]:
    """Record ``names`` through RecordingScheduler in vLLM's venv; convert and check each."""
    from harness.candidates.vllm.env import env_python
    from harness.candidates.vllm.recording_convert import convert
    from harness.scenarios import SCENARIOS

    script, harness_only = _drive_script(version)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "drive.py").write_text(script)
    runs, overrides = {}, {}
    for name in names:
        sc = SCENARIOS[name]
        config = sc.engine_config()
        overrides[name] = {k: v for k, v in config.to_dict().items() if k in harness_only}
        runs[name] = {"jsonl": str(outdir / f"{name}.jsonl"), "config": config.to_dict(), "seed": sc.seed,
                      "requests": [dataclasses.asdict(r) for r in sc.make_workload().requests]}
    (outdir / "runs.json").write_text(json.dumps(runs))
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHED_HARNESS_STRICT="1", VLLM_USE_V2_MODEL_RUNNER="0",
               PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    t0 = time.monotonic()
    proc = subprocess.run([str(env_python(version)), str(outdir / "drive.py"), str(outdir / "runs.json")],
                          cwd=outdir, env=env, capture_output=True, text=True, timeout=1200)
    (outdir / "drive.log").write_text(proc.stdout + proc.stderr)
    took = round(time.monotonic() - t0, 1)
    results = {}
    for name in names:
        jsonl = outdir / f"{name}.jsonl"
        if not jsonl.is_file():
            tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            results[name] = {"status": "error", "why": f"drive exit {proc.returncode}: {tail[:400]}"}
            continue
        trace = outdir / f"{name}.parquet"
        summary = convert(jsonl, trace, overrides=overrides[name])
        results[name] = {"status": "recorded", "s": took, "warnings": summary["warnings"], **check(trace)}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--versions", default="0.33.0,0.29.0,0.25.0,0.20.2")
    ap.add_argument("--out", type=Path, default=Path("/tmp/versions"))
    ap.add_argument("--scenarios", default="", help="comma-separated scenario names (default: all)")
    ap.add_argument("--recording", default="fcfs-tight,prefix-sharing,eos-stop-abort,spec-decode-priority",
                    help="canonical scenarios to record through RecordingScheduler too ('' for none)")
    ap.add_argument("--semantics", default="auto", help="profile to check under (auto, safety, a version)")
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: vLLM 0.33.0, the fcfs-tight scenario, a temp folder")
    args = ap.parse_args()
    if args.smoke:
        args.versions, args.scenarios, args.recording = "0.33.0", "fcfs-tight", "fcfs-tight"
        args.out = Path(tempfile.mkdtemp(prefix="semantics-versions-"))
    global SEMANTICS
    SEMANTICS = args.semantics
    wanted = {n for n in args.scenarios.split(",") if n}
    paths = [p for d in SCENARIO_DIRS for p in sorted(d.glob("*.toml")) if not wanted or p.stem in wanted]
    all_results: dict[str, dict] = {}
    dirty = 0
    for version in [v for v in args.versions.split(",") if v]:
        res: dict[str, dict] = {}
        for p in paths:
            kind = "canonical" if p.parent == SCENARIO_DIRS[0] else "bug-shape"
            out = args.out / version / "driver" / f"{p.stem}.parquet"
            out.parent.mkdir(parents=True, exist_ok=True)
            r = res[f"driver/{p.stem}"] = {"kind": kind, **record_driver(p, version, out)}
            say(f"{version} driver {p.stem}: {r['status']} {r.get('by_invariant') or r.get('why', '')}")
        names = [n for n in args.recording.split(",") if n]
        if names:
            for name, r in record_recording(names, version, args.out / version / "recording").items():
                res[f"recording/{name}"] = {"kind": "canonical", **r}
                say(f"{version} recording {name}: {r['status']} {r.get('by_invariant') or r.get('why', '')}")
        all_results[version] = res
        rec = [r for r in res.values() if r["status"] == "recorded"]
        viol = sum((Counter(r["by_invariant"]) for r in rec), Counter())
        clean = sum(1 for r in rec if not r["by_invariant"])
        dirty += len(rec) - clean
        print(f"{version}: {len(rec)} recorded, "
              f"{sum(r['status'] == 'refused' for r in res.values())} refused, "
              f"{sum(r['status'] == 'error' for r in res.values())} errors, {clean} clean; violations: "
              + (", ".join(f"{k} x{n}" for k, n in viol.most_common()) or "none"), flush=True)
    (args.out / "results.json").write_text(json.dumps(all_results, indent=1))
    print("verdict: every recorded trace is clean" if not dirty else
          f"verdict: {dirty} recorded trace(s) have violations (details: {args.out / 'results.json'})")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(page.run(main, "semantics_versions"))
