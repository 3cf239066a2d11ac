"""Memory and time of record, check, replay and diff against trace length and backlog.

For each size (Azure LLM inference 2023, code: the first 1000, 4000 and all
8819 requests) and each arrival compression (``--time-scale 30``, the demo
settings' backlog, and ``--time-scale 1``, little backlog), runs each command
as its own process and prints its wall time and maximum resident set size
(``os.wait4``'s ``ru_maxrss``: the process's peak, not the machine's), plus
the trace's steps, rows and bytes. ``diff`` compares the trace with itself.
Demo settings: 600 blocks, ``max_num_seqs`` 64, 2048 tokens per step,
``max_model_len`` 8192, seed 0 (Makefile ``demo`` without ``--limit``).

    python bench/bench_memory.py [--sizes 1000,4000,all] [--time-scales 30,1] [--out DIR]

Figures vary with the machine's load (time far more than memory): read the
ratios, smallest to largest, not the absolute seconds. Prints one line per
command as it ends and a table at the end; the last line is the verdict on
the goal (check RSS under 1 GB at every size, RSS within 2x smallest to
largest).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
AZURE_CODE = REPO.parent / "shared" / "data" / "azure-llm-inference-2023" / "AzureLLMInferenceTrace_code.csv"
DEMO = ["--seed", "0", "--set", "num_gpu_blocks=600", "--set", "max_num_seqs=64",
        "--set", "max_num_batched_tokens=2048", "--set", "max_model_len=8192"]
HARNESS = [sys.executable, "-m", "harness.cli"]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402


def measure(args: list[str]) -> tuple[float, float, float, int]:
    """Run ``args`` (output discarded); (wall seconds, CPU seconds (user +
    system: what a shared machine's load does not inflate), max RSS in MiB,
    exit code)."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    return (time.perf_counter() - start, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024,
            os.waitstatus_to_exitcode(status))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,all", help="request counts (all: the whole file)")
    parser.add_argument("--time-scales", default="30,1", help="arrival compressions")
    parser.add_argument("--commands", default="record,check,replay,diff")
    parser.add_argument("--out", default=str(REPO / "out" / "bench-memory"), help="folder for the traces")
    parser.add_argument("--smoke", action="store_true",
                        help="the test suite's run: 20 requests, --time-scale 30, record and check, a temp folder")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.time_scales, args.commands = "20", "30", "record,check"
        args.out = tempfile.mkdtemp(prefix="bench-memory-")
    if not AZURE_CODE.is_file():
        print(f"error: {AZURE_CODE}: not found (the shared data folder beside the checkout)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commands = args.commands.split(",")
    results: list[tuple[str, str, str, int, int, float, float, float, float, int]] = []
    for scale in args.time_scales.split(","):
        for size in args.sizes.split(","):
            trace = out / f"azure-code-{size}-ts{scale}.parquet"
            limit = [] if size == "all" else ["--limit", size]
            plan = {
                "record": [*HARNESS, "record", str(AZURE_CODE), *limit, "--time-scale", scale, *DEMO,
                           "-o", str(trace)],
                "check": [*HARNESS, "check", str(trace)],
                "replay": [*HARNESS, "replay", str(trace)],
                "diff": [*HARNESS, "diff", str(trace), str(trace)],
            }
            if "record" not in commands and not trace.is_file():
                commands = ["record", *commands]
            for command in [c for c in plan if c in commands]:
                seconds, cpu, rss, code = measure(plan[command])
                meta = pq.ParquetFile(trace).metadata if trace.is_file() else None
                steps = len(pq.read_table(trace, columns=["step"]).column("step").unique()) if meta else 0
                rows = meta.num_rows if meta else 0
                mib = trace.stat().st_size / 2**20 if meta else 0.0
                results.append((command, size, scale, steps, rows, mib, seconds, cpu, rss, code))
                print(f"{command:7} {size:>5} requests, time-scale {scale:>3}: {steps} steps, {rows} rows, "
                      f"{mib:.1f} MiB trace: {seconds:.1f} s wall, {cpu:.1f} s CPU, max RSS {rss:.0f} MiB "
                      f"(exit {code})", flush=True)
    print()
    print(f"{'command':8}{'requests':>9}{'scale':>6}{'steps':>8}{'rows':>10}{'MiB':>7}{'wall s':>8}{'CPU s':>8}"
          f"{'RSS MiB':>9}")
    for command, size, scale, steps, rows, mib, seconds, cpu, rss, code in results:
        print(f"{command:8}{size:>9}{scale:>6}{steps:>8}{rows:>10}{mib:>7.1f}{seconds:>8.1f}{cpu:>8.1f}{rss:>9.0f}")
    ok = True
    for command in commands:
        rss = [r[8] for r in results if r[0] == command]
        if rss and max(rss) > 2 * min(rss):
            ok = False
            print(f"{command}: RSS grows {max(rss) / min(rss):.1f}x smallest to largest (goal: within 2x)")
    check_rss = [r[8] for r in results if r[0] == "check"]
    if check_rss and max(check_rss) >= 1024:
        ok = False
        print(f"check: max RSS {max(check_rss):.0f} MiB (goal: under 1 GiB)")
    if any(r[9] != 0 for r in results):
        ok = False
        print("a command exited non-zero: " + ", ".join(f"{r[0]} {r[1]}/ts{r[2]} exit {r[9]}"
                                                        for r in results if r[9] != 0))
    print("goal met: RSS within 2x and check under 1 GiB" if ok else "goal not met (see above)")
    return 0


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_memory"))
