#!/usr/bin/env python3
"""Benchmark the reference engine and the trace tooling on the Azure code trace.

Run from anywhere:  .venv/bin/python bench/bench_reference.py [--limit N]

Workload: the first N requests (default 1000) of the Azure LLM inference 2023
code trace (../shared/data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv
relative to the repository root), arrivals compressed 10x (--time-scale 10),
seed 0, with the `make demo` engine config (num_gpu_blocks=1200,
max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=8192).

Figures:
  (a) engine only: reference.engine.Engine.run with no recording;
  (b) record: harness.trace.recorder.record to a temporary Parquet file
      (wall time, file size, rows);
  (c) check: harness.check.check_steps over open_trace(...).iter_steps();
  (d) pyarrow alone: pq.read_table of the same file, for comparison with (c);
  (e) replay: harness.replay.replay of the reference scheduler against the
      file (the `harness replay` command runs (c) first, then this);
  (f) feature presets (README "Feature presets"): engine only, one run
      each, on the same workload with the demo config plus the preset's keys,
      with the figure that shows the feature was exercised.

Timings use time.perf_counter. (a), (c) and (d) report the best of --repeat
runs (default 3); (b) and (e), the slow end-to-end parts, run once.
This is a benchmark, not a test: it prints figures and exits 0 unless a run
fails outright or the trace is not conformant (exit 1) or the data file is
missing (exit 2).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

import pyarrow  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from harness.check import check_steps  # noqa: E402
from harness.trace.recorder import record  # noqa: E402
from harness.replay import replay  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from reference.config import EngineConfig  # noqa: E402
from reference.engine import Engine  # noqa: E402
from reference.scheduler import Scheduler  # noqa: E402
from reference.workload import WorkloadError
from workloads import load_workload, with_eos_stops  # noqa: E402

AZURE_CODE = (REPO / ".." / "shared" / "data" / "azure-llm-inference-2023"
              / "AzureLLMInferenceTrace_code.csv").resolve()

# The `make demo` configuration (see Makefile).
DEMO_CONFIG = {"num_gpu_blocks": 1200, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
               "max_model_len": 8192}
# README presets: (name, extra config, stop on EOS?, summary figure).
PRESETS: list[tuple[str, dict[str, Any], bool]] = [
    ("spec decode", {"num_speculative_tokens": 3}, False),
    ("async + deferred frees", {"async_scheduling": True, "defer_block_free": True}, True),
    ("DP=2 + throttle", {"data_parallel_size": 2, "prefill_schedule_interval": 4}, False),
    ("KV connector", {"kv_connector": True, "kv_store_fraction": 0.98, "kv_load_steps": 4,
                      "kv_load_failure_rate": 0.1}, False),
]
TIME_SCALE = 10.0
SEED = 0

T = TypeVar("T")


def best_of(n: int, fn: Callable[[], T]) -> tuple[float, T]:
    """Run ``fn`` ``n`` times; return (fastest wall time in s, last result)."""
    best = float("inf")
    result: Any = None
    for _ in range(n):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def fmt_rate(value: float, unit: str) -> str:
    return f"{value:>12,.0f} {unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=1000,
                        help="use the first N requests of the trace (default 1000)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of the fast parts (a, c, d); the best is reported (default 3)")
    parser.add_argument("--smoke", action="store_true", help="the test suite's run: --limit 30 --repeat 1")
    args = parser.parse_args(argv)
    if args.smoke:
        args.limit, args.repeat = 30, 1
    if args.limit < 1 or args.repeat < 1:
        parser.error("--limit and --repeat must be >= 1")

    if not AZURE_CODE.is_file():
        print(f"error: {AZURE_CODE}: Azure code trace not found", file=sys.stderr)
        return 2

    print("machine")
    print(f"  platform   {platform.platform()}")
    print(f"  processor  {platform.processor() or platform.machine()}")
    print(f"  python     {platform.python_implementation()} {platform.python_version()}")
    print(f"  cpus       {os.cpu_count()}")
    print(f"  pyarrow    {pyarrow.__version__}")
    print()

    t0 = time.perf_counter()
    try:
        workload = load_workload(str(AZURE_CODE), limit=args.limit, time_scale=TIME_SCALE, seed=SEED)
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t0
    config = EngineConfig(**DEMO_CONFIG)
    num_prompt_tokens = sum(len(r.prompt_token_ids) for r in workload.requests)
    print("workload")
    print(f"  source     {workload.source} (first {len(workload.requests)} requests, "
          f"--time-scale {TIME_SCALE:g}, seed {SEED})")
    print(f"  prompts    {num_prompt_tokens:,} tokens; loaded in {load_s:.3f} s")
    print("  config     " + ", ".join(f"{k}={v}" for k, v in DEMO_CONFIG.items()))
    print()

    rows_out: list[tuple[str, str, float, str]] = []  # (stage, runs, seconds, figures)

    # (a) Engine only, no recording.
    def run_engine():
        return Engine(config, seed=SEED).run(workload)
    engine_s, summary = best_of(args.repeat, run_engine)
    if summary.stalled:
        print(f"error: engine stalled: {summary.stalled}", file=sys.stderr)
        return 1
    rows_out.append(("(a) engine only", f"best of {args.repeat}", engine_s,
                     f"{fmt_rate(summary.steps / engine_s, 'steps/s')}  "
                     f"{fmt_rate(summary.requests / engine_s, 'requests/s')}  "
                     f"{fmt_rate(summary.scheduled_tokens / engine_s, 'sched tokens/s')}"))

    with tempfile.TemporaryDirectory(prefix="bench-reference-") as tmp:
        path = Path(tmp) / "azure-code.parquet"

        # (b) Record to Parquet.
        t0 = time.perf_counter()
        rec_summary = record(workload, config, path, seed=SEED)
        record_s = time.perf_counter() - t0
        size = path.stat().st_size
        num_rows = pq.ParquetFile(path).metadata.num_rows
        rows_out.append(("(b) record", "1 run", record_s,
                         f"{fmt_rate(rec_summary.steps / record_s, 'steps/s')}  "
                         f"{size / 2**20:>8.2f} MiB  {num_rows:>10,} rows  "
                         f"{size / num_rows:.1f} B/row"))

        # (c) harness check (streaming, row group by row group).
        def run_check():
            trace = open_trace(path)
            return check_steps(trace.meta["config"], trace.iter_steps())
        check_s, result = best_of(args.repeat, run_check)
        rows_out.append(("(c) check", f"best of {args.repeat}", check_s,
                         f"{fmt_rate(result.events / check_s, 'events/s')}  "
                         f"{fmt_rate(result.steps / check_s, 'steps/s')}"))

        # (d) pyarrow only: read the whole file into a Table.
        read_s, table = best_of(args.repeat, lambda: pq.read_table(path))
        rows_out.append(("(d) pq.read_table", f"best of {args.repeat}", read_s,
                         f"{fmt_rate(table.num_rows / read_s, 'rows/s')}  "
                         f"check/read = {check_s / read_s:.1f}x"))
        del table

        # (e) replay the reference scheduler against the recorded trace.
        t0 = time.perf_counter()
        divergence, compared = replay(open_trace(path), Scheduler)
        replay_s = time.perf_counter() - t0
        rows_out.append(("(e) replay", "1 run", replay_s,
                         f"{fmt_rate(compared / replay_s, 'steps/s')}  "
                         f"{compared:,} steps compared, "
                         + ("identical" if divergence is None else f"DIVERGED at step {divergence.step}")))

    # (f) Feature presets, engine only.
    for name, extra, stop_on_eos in PRESETS:
        preset_workload = with_eos_stops(workload) if stop_on_eos else workload
        t0 = time.perf_counter()
        ps = Engine(EngineConfig(**DEMO_CONFIG, **extra), seed=SEED).run(preset_workload)
        preset_s = time.perf_counter() - t0
        feature = {"spec decode": f"{ps.draft_tokens:,} drafts, {ps.rejected_draft_tokens:,} rejected",
                   "KV connector": f"{ps.remote_kv_loads:,} remote loads, {ps.failed_kv_loads} failed"}.get(
                       name, f"{ps.preemptions} preemptions")
        rows_out.append((f"(f) {name}", "1 run", preset_s,
                         f"{fmt_rate(ps.steps / preset_s, 'steps/s')}  {ps.steps:,} steps, {feature}"))

    width = max(len(r[0]) for r in rows_out)
    runs_w = max(len(r[1]) for r in rows_out)
    print(f"{'stage':<{width}}  {'runs':<{runs_w}}  {'wall s':>8}  figures")
    print(f"{'-' * width}  {'-' * runs_w}  {'-' * 8}  {'-' * 60}")
    for stage, runs, seconds, figures in rows_out:
        print(f"{stage:<{width}}  {runs:<{runs_w}}  {seconds:>8.3f}  {figures}")
    print()
    print(f"run: {summary.steps:,} steps, {summary.requests:,} requests "
          f"({summary.finished:,} finished, {summary.rejected} rejected), "
          f"{summary.scheduled_tokens:,} scheduled tokens, {summary.preemptions} preemptions, "
          f"{summary.clock:.2f} s virtual time")
    print(f"check: {result.events:,} events, {result.num_violations} violations"
          f"{'' if result.ok else '  <-- NOT CONFORMANT'}")

    if not result.ok or divergence is not None:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_reference"))
