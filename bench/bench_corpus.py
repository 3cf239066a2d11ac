#!/usr/bin/env python3
"""Benchmark `harness check PATH...` over a corpus (issue 25): one worker,
a local pool of 2, and a local 2-CPU Ray cluster, on the same traces.

Run from anywhere:  .venv/bin/python bench/bench_corpus.py [--traces N] [--smoke] [--no-ray]

The corpus is N traces (default 500; --smoke: 12) in a temporary folder,
hard links to the 20 goldens and the mutant's trace (2 MAX-NUM-SEQS
violations) in turn. For each runner: wall seconds, CPU seconds (this
process and its waited-for children, ``resource.getrusage``: the pool's
workers; for Ray, every process of the cluster it starts, read just before
it stops), the CPU seconds of the
per-trace checks themselves (the sum of the rows' ``cpu_s``), and the
speed-up against one worker (wall ratio, measured in this one process).
Ray's figures include starting and stopping its cluster. Every runner must
give the rows of one worker, trace for trace (exit 1 otherwise). A
benchmark, not a test: prints figures; exit 0, 1 when rows differ.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.check_cli import check_one_json  # noqa: E402
from harness.corpus import check_local, corpus_verdict, expand_paths  # noqa: E402

OPTIONS = {"semantics": "auto"}


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def descendants_cpu() -> float:
    """CPU seconds of every live descendant of this process (and of their
    waited-for children), read with psutil (a dependency of Ray)."""
    import psutil

    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


def build_corpus(folder: Path, n: int) -> list[str]:
    """``n`` hard links (copies where links fail) to the goldens and the mutant's trace, in turn."""
    sources = sorted((ROOT / "golden").glob("*.parquet")) + [ROOT / "traces" / "mutant-ignore-max-num-seqs.parquet"]
    for i in range(n):
        src = sources[i % len(sources)]
        dst = folder / f"{i:04d}-{src.name}"
        try:
            os.link(src, dst)
        except OSError:
            dst.write_bytes(src.read_bytes())
    return expand_paths([str(folder)])


def measure(label: str, run):
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    rows = run()
    wall, cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    return label, rows, wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=int, default=None, help="corpus size (default 500; --smoke: 12)")
    ap.add_argument("--smoke", action="store_true", help="a small corpus (what the test suite runs)")
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray runner")
    args = ap.parse_args()
    n = args.traces or (12 if args.smoke else 500)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}")
    with tempfile.TemporaryDirectory(prefix="bench-corpus-") as tmp:
        paths = build_corpus(Path(tmp), n)
        results = [measure("1 worker", lambda: check_local(paths, OPTIONS, check_one_json, 1)),
                   measure("2 workers", lambda: check_local(paths, OPTIONS, check_one_json, 2))]
        if not args.no_ray:
            try:
                from harness.corpus_ray import check_ray, init_ray, shutdown
                import ray  # noqa: F401
            except ImportError:
                print("Ray: not installed (pip install 'sched-harness[ray]'), skipped")
            else:
                cluster_cpu = []

                def on_ray():
                    init_ray(None)
                    try:
                        return check_ray(paths, OPTIONS, check_one_json)
                    finally:
                        cluster_cpu.append(descendants_cpu())
                        shutdown()

                label, rows, wall, cpu = measure("Ray, local 2 CPUs", on_ray)
                # The cluster's processes (GCS, raylet, workers) are not waited for by this one:
                # their CPU is read from them just before the cluster stops.
                results.append((label, rows, wall, cpu + cluster_cpu[0]))
    base_rows, base_wall = results[0][1], results[0][2]
    print(f"corpus: {n} traces, {sum(r.steps or 0 for r in base_rows)} steps; {corpus_verdict(base_rows)}")
    print(f"{'runner':<18} {'wall s':>8} {'CPU s':>8} {'check CPU s':>12} {'speed-up':>9}  rows as 1 worker")
    same_all = True
    for label, rows, wall, cpu in results:
        same = len(rows) == len(base_rows) and all(a.same_outcome(b) for a, b in zip(rows, base_rows))
        same_all &= same
        print(f"{label:<18} {wall:>8.2f} {cpu:>8.2f} {sum(r.cpu_s for r in rows):>12.2f} "
              f"{base_wall / wall:>8.2f}x  {'yes' if same else 'NO'}")
    print("(CPU s: this process and its children, for Ray the whole local cluster; check CPU s: the "
          "per-trace checks alone; Ray's wall and CPU include starting and stopping its cluster)")
    return 0 if same_all else 1


if __name__ == "__main__":
    try:  # bench/page.py (issue 24), where present: this bench's section of docs/benchmarks.md
        import page
    except ImportError:
        sys.exit(main())
    sys.exit(page.run(main, "bench_corpus"))
