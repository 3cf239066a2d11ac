#!/usr/bin/env python3
"""Benchmark the views of a trace (harness/view): derive, HTML report,
Perfetto export, SQL tables.

Run from anywhere:  .venv/bin/python bench/bench_views.py [TRACE]

TRACE defaults to out/azure-code-500.parquet (`make demo` writes it). For
each view: wall seconds (time.perf_counter, best of --repeat runs, default
2) and the bytes written; the derivation includes the invariant check it
runs on the way (as `harness check`, which it replaces under --report).
A benchmark, not a test: prints figures, exits 0, 2 when TRACE is missing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.report import report_dict  # noqa: E402
from harness.trace import TraceError, open_trace  # noqa: E402
from harness.view import html, perfetto  # noqa: E402
from harness.view.series import derive  # noqa: E402
from harness.view.tables import write_tables  # noqa: E402


def best(fn, repeat: int):
    """(best seconds, last result) of ``repeat`` calls of ``fn``."""
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", nargs="?", default=str(ROOT / "out" / "azure-code-500.parquet"))
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--smoke", action="store_true",
                    help="the test suite's run: traces/azure-code-15.parquet (unless TRACE is given), --repeat 1")
    args = ap.parse_args()
    if args.smoke:
        args.repeat = 1
        if args.trace == ap.get_default("trace"):
            args.trace = str(ROOT / "traces" / "azure-code-15.parquet")
    try:
        trace = open_trace(args.trace)
    except TraceError as exc:
        print(f"error: {exc} (run `make demo` first)", file=sys.stderr)
        return 2
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; python {platform.python_version()}")
    print(f"trace: {args.trace}: {trace.summary['steps']} steps, {trace.num_rows} rows")
    s_derive, series = best(lambda: derive(open_trace(args.trace)), args.repeat)
    print(f"derive (with the check): {s_derive:.2f} s")
    summary = report_dict(series.result, None, trace)
    s_html, page = best(lambda: html.render(series, summary), args.repeat)
    print(f"HTML report: {s_html:.2f} s, {len(page):,} bytes")
    s_pf, doc = best(lambda: perfetto.render(series), args.repeat)
    print(f"Perfetto JSON: {s_pf:.2f} s, {len(doc):,} bytes")
    with tempfile.TemporaryDirectory() as tmp:
        s_tab, paths = best(lambda: write_tables(series, tmp), args.repeat)
        sizes = ", ".join(f"{p.name} {p.stat().st_size:,} bytes" for p in paths)
    print(f"SQL tables: {s_tab:.2f} s ({sizes})")
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_views"))
