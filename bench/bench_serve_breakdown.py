#!/usr/bin/env python3
"""Where the recording scheduler's time goes inside real vLLM, per function (issue 15).

Run from the repository root:  .venv/bin/python bench/bench_serve_breakdown.py [--limit N]

Needs the serving env (``harness vllm-env --serving``). Two vLLM runs of the
workload of ``bench/bench_serve.py`` (Azure code, first 64 requests, ``--time-scale
20``): the first, driven by ``harness/serve/offline.py``, captures the ops it sends
to ``harness/serve/offline_runner.py``; the second replays them in one process
under the serving env's Python with timers around the recorder's functions
(``_Recorder`` methods, ``events`` helpers, the writer's encoding and ``os.write``)
and around the decision hooks (``KVCacheManager.allocate_slots``/``free``, timed
outside and inside the hook: the difference is the hook's own time, which counts
inside vLLM's). Prints microseconds per step (mean over the steps) and per call
(mean and median) for each; nested entries overlap (``rec.after_update``
contains ``writer.flush``, which contains ``os.write``), and every timer adds
about 0.2-0.5 us to what contains it. Nothing is asserted; figures vary ~2x with
the machine's load.

``--cprofile N`` replays without those timers under ``cProfile``, enabled only
inside the scheduler's ``schedule()`` and ``update_from_output()`` calls: it
prints their CPU time by area (the recorder's own code in ``harness/``, vLLM's,
the C functions each calls) and the ``N`` functions of the recorder with the
most own time, per step. cProfile's per-call cost inflates Python-heavy code
(~2x): read shares, not microseconds. ``--ops PATH`` keeps the captured ops in
``PATH`` and, when it exists, replays it instead of capturing again (the
profile of a change on the same ops).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def capture_ops(limit: int, ops_path: Path, tmp: Path) -> int:
    """Run the workload once (our venv drives the runner), writing each op sent."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_serve
    import harness.serve.offline as offline
    from harness.serve.cli import default_model, load_serve_inputs

    config, wl, seed = load_serve_inputs(str(bench_serve.AZURE), bench_serve.SETS, limit, 20.0, None, 1, False)
    with bench_serve.capturing_ops(ops_path):
        rec = offline.record_offline(wl, config, tmp / "capture.parquet", default_model(), seed=seed)
    return rec.steps


def _replay(runner, lines: list[str]) -> tuple[int, list[float], list[float]]:
    """Send the ops after ``init`` to ``runner``; (steps, sched_s, vllm_s) per step."""
    steps, sched_s, vllm_s = 0, [], []
    for line in lines[1:]:
        msg = json.loads(line)
        if msg["op"] == "close":
            break
        out = getattr(runner, msg["op"])(msg)
        if msg["op"] == "step":
            steps += 1
            sched_s.append(out["sched_s"])
            vllm_s.append(out["vllm_s"])
    runner.close({})
    return steps, sched_s, vllm_s


def cprofile(ops_path: Path, outdir: Path, top: int) -> None:
    """Under the serving env: replay the ops with cProfile on inside the
    scheduler's calls; print the time by area and the recorder's top functions."""
    import cProfile
    import pstats

    os.environ["SCHED_HARNESS_TRACE"] = str(outdir / "rec.jsonl")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "harness" / "serve"))
    import offline_runner
    from vllm.v1.core.sched.scheduler import Scheduler

    offline_runner._track_totals(Scheduler)
    lines = ops_path.read_text().splitlines()
    runner = offline_runner.Runner()
    runner.init(dict(json.loads(lines[0]), timing=True))
    sched = runner._scheduler()
    # CPU time of this thread: a shared machine's waits are nobody's.
    prof = cProfile.Profile(time.thread_time_ns, 1e-9)
    inside, gc_s, gc_runs, gc_start = [False], [0.0], defaultdict(int), [0.0]

    def on_gc(phase, info) -> None:  # collections inside the scheduler's calls
        if not inside[0]:
            return
        if phase == "start":
            gc_start[0] = time.thread_time()
        else:
            gc_s[0] += time.thread_time() - gc_start[0]
            gc_runs[info["generation"]] += 1
    gc.callbacks.append(on_gc)
    for name in ("schedule", "update_from_output"):
        bound = getattr(sched, name)

        def profiled(*a, __bound=bound, **k):
            inside[0] = True
            prof.enable()
            try:
                return __bound(*a, **k)
            finally:
                prof.disable()
                inside[0] = False
        setattr(sched, name, profiled)
    steps, sched_s, vllm_s = _replay(runner, lines)
    gc.callbacks.remove(on_gc)
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    harness = str(ROOT / "harness")
    recorder = ("recording_scheduler.py", "events.py", "offline_runner.py")

    def area(key, callers=None) -> str:
        file = key[0]
        if file.startswith(harness):
            return "recorder (harness/, Python)" if file.endswith(recorder[:2]) else "timers (offline_runner)"
        if file == "~":  # a C function: by its callers' area
            callers = callers or {}
            own = sum(v[2] for c, v in callers.items() if c[0].startswith(harness) and c[0].endswith(recorder[:2]))
            return "recorder's C calls" if own * 2 >= sum(v[2] for v in callers.values()) else "vLLM's C calls"
        return "vLLM (Python)"

    by_area: dict[str, float] = defaultdict(float)
    for key, (cc, nc, tt, ct, callers) in stats.items():
        by_area[area(key, callers)] += tt
    total = sum(by_area.values())
    a, b = sum(sched_s), sum(vllm_s)
    print(f"{steps} steps under cProfile, load {os.getloadavg()[0]:.1f}: schedule()+update_from_output() "
          f"{total / steps * 1e6:.0f} us a step profiled ({a / steps * 1e6:.0f} us timed, vLLM's own "
          f"{b / steps * 1e6:.0f} us)")
    for name, t in sorted(by_area.items(), key=lambda kv: -kv[1]):
        print(f"  {name:30s} {t / steps * 1e6:8.1f} us/step  {t / total * 100:5.1f} %")
    print(f"  (of which garbage collections: {gc_s[0] / steps * 1e6:.1f} us/step, runs by generation "
          f"{dict(sorted(gc_runs.items()))}, charged to the function that allocated)")
    mine = [(v[2], v[3], v[1], k) for k, v in stats.items()
            if area(k, v[4]) in ("recorder (harness/, Python)", "recorder's C calls")]
    print(f"the recorder's top {top} functions by own time (us/step own, cumulative; calls/step):")
    for tt, ct, nc, (file, line, fn) in sorted(mine, reverse=True)[:top]:
        where = f"{Path(file).name}:{line}" if file != "~" else "C"
        print(f"  {tt / steps * 1e6:7.1f} {ct / steps * 1e6:7.1f}  {nc / steps:6.1f}  {where} {fn}")


def profile(ops_path: Path, outdir: Path) -> None:
    """Under the serving env: replay the ops with timers, print the breakdown."""
    os.environ["SCHED_HARNESS_TRACE"] = str(outdir / "rec.jsonl")
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "harness" / "serve"))
    import offline_runner
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    import harness.candidates.vllm.recording_scheduler as rs

    total, calls, each = defaultdict(float), defaultdict(int), defaultdict(list)

    def timed(name, fn):
        clock = time.perf_counter

        def wrapper(*a, **k):
            t = clock()
            try:
                return fn(*a, **k)
            finally:
                d = clock() - t
                total[name] += d
                calls[name] += 1
                each[name].append(d)
        return wrapper

    offline_runner._track_totals(Scheduler)
    for name in ("allocate_slots", "free"):  # inside the hooks (before they are installed)
        setattr(KVCacheManager, name, timed(f"kvm.{name} (vLLM's)", getattr(KVCacheManager, name)))
    ev = rs._ev
    for name in ("normalise", "prefill_gate", "finished_info", "num_free_blocks", "request_states",
                 "waiting_in_service_order"):
        setattr(ev, name, timed(f"events.{name}", getattr(ev, name)))
    for name in ("before_schedule", "after_schedule", "before_update", "after_update", "on_add",
                 "begin_abort", "end_abort", "on_drafts", "snap", "queues"):
        setattr(rs._Recorder, name, timed(f"rec.{name}", getattr(rs._Recorder, name)))
    for name in ("write", "flush"):
        setattr(rs._LineWriter, name, timed(f"writer.{name}", getattr(rs._LineWriter, name)))

    class _Os:  # the module's os, with os.write timed
        write = staticmethod(timed("os.write", os.write))

        def __getattr__(self, name):
            return getattr(os, name)
    rs.os = _Os()

    lines = ops_path.read_text().splitlines()
    runner = offline_runner.Runner()
    runner.init(dict(json.loads(lines[0]), timing=True))
    kvm = runner._scheduler().kv_cache_manager
    for name in ("allocate_slots", "free"):  # the hooks, around
        setattr(kvm, name, timed(f"kvm.{name} (hooked)", getattr(kvm, name)))
    steps, sched_s, vllm_s = _replay(runner, lines)
    a, b = sum(sched_s), sum(vllm_s)
    print(f"{steps} steps, load {os.getloadavg()[0]:.1f}: schedule()+update_from_output() {a * 1e3:.1f} ms, "
          f"vLLM's own {b * 1e3:.1f} ms (hooks and timers included); added {(a - b) / steps * 1e6:.1f} us a step")
    for name in sorted(total):
        print(f"  {name:34s} {total[name] / steps * 1e6:7.1f} us/step  ({calls[name]} calls, "
              f"{total[name] / calls[name] * 1e6:.2f} us mean, {statistics.median(each[name]) * 1e6:.2f} us median)")
    for name in ("allocate_slots", "free"):
        hooked, inner = total.get(f"kvm.{name} (hooked)", 0.0), total.get(f"kvm.{name} (vLLM's)", 0.0)
        print(f"  hook {name}: {(hooked - inner) / steps * 1e6:.1f} us/step (inside vLLM's own time)")


def replay_profiled(ops: Path, outdir: Path, top: int, python: Path | None = None) -> subprocess.CompletedProcess:
    """Replay ``ops`` (captured by ``capture_ops``, or by ``bench_serve.py``'s
    recorded run) under the serving env's Python (``python``; default: the one
    ``require_serving_env`` finds) in a child process: with ``top`` > 0 under
    cProfile (``cprofile``: time by area and the recorder's ``top`` functions),
    else with timers (``profile``). Returns the child (stdout: its figures)."""
    if python is None:
        from harness.serve.env import require_serving_env

        python = require_serving_env()
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_LOGGING_LEVEL="ERROR")
    extra = ["--cprofile", str(top)] if top else []
    return subprocess.run([str(python), __file__, "--profile", str(ops), str(outdir), *extra],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=64, help="requests of the Azure code trace [64]")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="cProfile instead of timers: time by area and the recorder's top N functions")
    ap.add_argument("--ops", default=None, help="keep the captured ops here; replay them when present")
    ap.add_argument("--profile", nargs=2, metavar=("OPS", "OUTDIR"), help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="the test suite's run: --limit 4")
    args = ap.parse_args()
    if args.smoke:
        args.limit = 4
    if args.profile:  # the second half, under the serving env
        if args.cprofile:
            cprofile(Path(args.profile[0]), Path(args.profile[1]), args.cprofile)
        else:
            profile(Path(args.profile[0]), Path(args.profile[1]))
        return 0
    from harness.serve.env import require_serving_env

    python = require_serving_env()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        ops = Path(args.ops) if args.ops else tmp_path / "ops.jsonl"
        if ops.exists():
            print(f"replaying the ops of {ops.name} under {python}", flush=True)
        else:
            steps = capture_ops(args.limit, ops, tmp_path)
            print(f"captured {steps} steps; replaying with {'cProfile' if args.cprofile else 'timers'} "
                  f"under {python}", flush=True)
        proc = replay_profiled(ops, tmp_path, args.cprofile, python)
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            sys.stderr.write(proc.stderr[-3000:])
        return proc.returncode


if __name__ == "__main__":
    # The --profile half runs under the serving env and prints to its parent: no page of its own.
    if "--profile" in sys.argv:
        sys.exit(main())
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
    import page
    sys.exit(page.run(main, "bench_serve_breakdown"))
