#!/usr/bin/env python3
"""The speed goals of issue 24, each as a ratio measured in one process.

Run from anywhere:  .venv/bin/python bench/bench_check.py [--small 500] [--large all] [--smoke]

Workload: the Azure LLM inference 2023 code trace
(../shared/data/azure-llm-inference-2023/AzureLLMInferenceTrace_code.csv relative to the repository
root) with the `make demo` settings (--time-scale 30, seed 0, num_gpu_blocks=600, max_num_seqs=64,
max_num_batched_tokens=2048, max_model_len=8192), its first --small requests and its first --large
(`all`: the whole file). The traces are recorded once into --out (default out/bench-check) and reused.

Goals (CPU seconds of this process, ``resource.getrusage``; a shared machine's load moves wall time,
not these ratios much):

  check / read      ``harness check``'s work (open_trace + check_trace) over ``pq.read_table`` of
                    the same file: goal <= 3.
  check linear      CPU per row of the check of the --large trace over that of the --small one:
                    goal <= 1.2.
  check large       CPU seconds to check the --large trace (the whole Azure code trace): goal <= 60.
  record / engine   ``record`` of the --small workload over ``Engine.run`` of it with no recording:
                    goal <= 1.05.
  replay            steps per CPU second replaying the --small trace against the reference:
                    goal >= 10,000.
  fuzz              examples per CPU second of ``harness fuzz`` on the reference (``fuzz(None)``):
                    goal >= 1,000. Where the rest goes is said by part (``FUZZ_PARTS``: drawing the
                    scenario, setting up the engine and config, running the engine, its rows,
                    checking, writing to disk, reporting, hypothesis's own search), percent of CPU.

--baseline CHECKOUT also checks the --small trace with another checkout's code (PYTHONPATH, a child
process) and prints ours over it: the before/after of a change, in one run.

Commands a user runs (no goal; issue 24 asks for their before/after): the CPU seconds of ``harness
check`` of the --small trace, ``golden check``, ``mutants --scenario fcfs-tight`` and ``report``, each
a child process (``os.wait4``, start-up included), and the --baseline checkout's beside them.

Where a goal is not met, the line after it names the functions the rest goes to (the top of a
cProfile of that part, own time). --smoke: 20 and 60 requests, 10 fuzz examples, no profiles (the
test suite's run: figures printed, nothing asserted). A benchmark, not a test: exit 0 unless a run
fails (1) or the data file is missing (2).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pyarrow.parquet as pq  # noqa: E402

import page  # noqa: E402
from harness.check.checker import check_trace  # noqa: E402
from harness.fuzz.run import fuzz  # noqa: E402
from harness.replay import replay  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from harness.trace.recorder import record  # noqa: E402
from reference.config import EngineConfig  # noqa: E402
from reference.engine import Engine  # noqa: E402
from reference.scheduler import Scheduler  # noqa: E402
from workloads import load_workload  # noqa: E402

AZURE_CODE = (REPO / ".." / "shared" / "data" / "azure-llm-inference-2023"
              / "AzureLLMInferenceTrace_code.csv").resolve()
DEMO_CONFIG = {"num_gpu_blocks": 600, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
               "max_model_len": 8192}
TIME_SCALE = 30.0
SEED = 0


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(CPU seconds, result) of ``fn()``."""
    start = cpu()
    result = fn()
    return cpu() - start, result


def where_it_goes(fn: Callable[[], Any], top: int = 3) -> str:
    """The ``top`` functions by own time in a cProfile of ``fn()``, one line."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    stats = pstats.Stats(profile, stream=io.StringIO())
    entries = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    total = sum(v[2] for v in stats.stats.values()) or 1.0
    return "; ".join(f"{Path(f).name}:{line}({name}) {v[2] / total:.0%}" for (f, line, name), v in entries)


def verdict(label: str, value: float, goal: float, higher_is_better: bool, unit: str = "",
            profile: Callable[[], str] | None = None) -> None:
    met = value >= goal if higher_is_better else value <= goal
    sign = ">=" if higher_is_better else "<="
    print(f"  {label:<16} {value:>12,.2f}{unit}  goal {sign} {goal:,g}{unit}  {'met' if met else 'NOT MET'}")
    if not met and profile is not None:
        print(f"  {'':<16} the rest goes to: {profile()}")


def trace_for(out: Path, limit: int | None) -> Path:
    """The demo-settings trace of the first ``limit`` requests (None: all), recorded once."""
    path = out / f"azure-code-{limit or 'all'}.parquet"
    if not path.is_file():
        workload = load_workload(str(AZURE_CODE), limit=limit, time_scale=TIME_SCALE, seed=SEED)
        record(workload, EngineConfig(**DEMO_CONFIG), path, seed=SEED)
    return path


def check_file(path: Path) -> Any:
    result = check_trace(open_trace(path))
    if not result.ok:
        raise SystemExit(f"error: {path}: not conformant ({result.num_violations} violations)")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=500, help="requests of the small trace (default 500)")
    parser.add_argument("--large", default="all", help="requests of the large trace (default all: 8,819)")
    parser.add_argument("--fuzz-examples", type=int, default=200, help="fuzz examples (default 200)")
    parser.add_argument("--out", default=str(REPO / "out" / "bench-check"), help="folder for the traces")
    parser.add_argument("--smoke", action="store_true", help="20 and 60 requests, 10 fuzz examples")
    parser.add_argument("--baseline", metavar="CHECKOUT",
                        help="also check the small trace with another checkout's code (e.g. the commit "
                             "before a change), in a child process: its CPU seconds, and ours over it")
    args = parser.parse_args()
    if args.smoke:
        args.small, args.large, args.fuzz_examples = 20, "60", 10
        args.out = tempfile.mkdtemp(prefix="bench-check-")
    large = None if args.large == "all" else int(args.large)
    if not AZURE_CODE.is_file():
        print(f"error: {AZURE_CODE}: Azure code trace not found", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profiles = not args.smoke

    small = trace_for(out, args.small)
    big = trace_for(out, large)
    print(f"traces (demo settings, --time-scale {TIME_SCALE:g}, seed {SEED}):")
    rows = {}
    for path in (small, big):
        rows[path] = pq.ParquetFile(path).metadata.num_rows
        print(f"  {path.name:<28} {rows[path]:>10,} rows  {path.stat().st_size / 2**20:>8.1f} MiB")
    print()

    read_s = min(timed(lambda: pq.read_table(small))[0] for _ in range(3))  # warm: best of 3
    check_s, _ = timed(lambda: check_file(small))
    big_read_s = min(timed(lambda: pq.read_table(big))[0] for _ in range(3))
    big_check_s, _ = timed(lambda: check_file(big))
    per_row_small, per_row_big = check_s / rows[small], big_check_s / rows[big]
    print("check (open_trace + check_trace), CPU seconds:")
    print(f"  {small.name}: read_table {read_s:.3f}, check {check_s:.3f} "
          f"({per_row_small * 1e6:.1f} us/row)")
    print(f"  {big.name}: read_table {big_read_s:.3f}, check {big_check_s:.3f} "
          f"({per_row_big * 1e6:.1f} us/row)")

    if args.baseline:
        before_s = baseline_check_cpu(Path(args.baseline), small)
        print(f"  {small.name} with {args.baseline}'s code (a child process): check {before_s:.3f} "
              f"CPU s; this checkout's over it: {check_s / before_s:.3f}x")

    workload = load_workload(str(AZURE_CODE), limit=args.small, time_scale=TIME_SCALE, seed=SEED)
    config = EngineConfig(**DEMO_CONFIG)
    engine_s, summary = timed(lambda: Engine(config, seed=SEED).run(workload))
    with tempfile.TemporaryDirectory(prefix="bench-check-record-") as tmp:
        record_s, _ = timed(lambda: record(workload, config, Path(tmp) / "r.parquet", seed=SEED))
    print(f"record of {args.small} requests ({summary.steps:,} steps), CPU seconds: engine alone "
          f"{engine_s:.3f}, record {record_s:.3f}")

    def replay_small() -> int:
        divergence, compared = replay(open_trace(small), Scheduler)
        if divergence is not None:
            raise SystemExit(f"error: replay of {small} diverged at step {divergence.step}")
        return compared
    replay_s, steps = timed(replay_small)
    print(f"replay of {small.name}: {steps:,} steps in {replay_s:.3f} CPU s")

    fuzz_s, fuzzed = timed(lambda: fuzz(None, max_examples=args.fuzz_examples, seed=SEED))
    if fuzzed.found:
        print(f"error: fuzz of the reference found a failure: {fuzzed.failure.message}", file=sys.stderr)
        return 1
    print(f"fuzz of the reference: {fuzzed.examples} examples in {fuzz_s:.3f} CPU s")
    print()

    commands_felt(small, out, Path(args.baseline) if args.baseline else None, args.smoke)

    print("goals (ratios of CPU seconds in this process):")
    verdict("check / read", check_s / read_s, 3, False, "x",
            (lambda: where_it_goes(lambda: check_file(small))) if profiles else None)
    verdict("check linear", per_row_big / per_row_small, 1.2, False, "x",
            (lambda: reading_split(small, big, rows, check_s, big_check_s)) if profiles else None)
    verdict("check large", big_check_s, 60, False, " s")
    verdict("record / engine", record_s / engine_s, 1.05, False, "x",
            (lambda: where_it_goes(lambda: _record_to_temp(workload, config))) if profiles else None)
    verdict("replay", steps / replay_s, 10_000, True, " steps/s",
            (lambda: where_it_goes(replay_small)) if profiles else None)
    verdict("fuzz", fuzzed.examples / fuzz_s, 1_000, True, " ex/s",
            (lambda: fuzz_parts(lambda: fuzz(None, max_examples=args.fuzz_examples, seed=SEED)))
            if profiles else None)
    return 0


def reading_split(small: Path, big: Path, rows: dict[Path, int], check_small: float, check_big: float) -> str:
    """Where check's CPU per row goes on each trace: reading (``iter_steps``:
    decode, validate, rebuild the queues) and the rest (the model's rules),
    microseconds per row, with the longest waiting queue (the backlog)."""
    parts = []
    for path, total in ((small, check_small), (big, check_big)):
        longest = 0

        def read() -> None:
            nonlocal longest
            for _, events in open_trace(path).iter_steps():
                for row in events:
                    if row["waiting"] is not None and len(row["waiting"]) > longest:
                        longest = len(row["waiting"])
        read_s, _ = timed(read)
        parts.append(f"{path.name}: reading {read_s / rows[path] * 1e6:.1f} us/row, rules "
                     f"{(total - read_s) / rows[path] * 1e6:.1f} us/row (longest waiting {longest:,})")
    return "; ".join(parts)


def command_cpu(checkout: Path, args: list[str]) -> tuple[float, int]:
    """(CPU seconds, exit code) of ``python -m harness.cli ARGS`` run with
    ``checkout``'s code (first on PYTHONPATH, in that folder): the child's user
    + system time from ``os.wait4``, start-up and imports included, as a user
    feels it."""
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve()), "HARNESS_VLLM_START_NOTICE": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", *args], env=env, cwd=checkout,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, proc.returncode


def commands_felt(small: Path, out: Path, baseline: Path | None, smoke: bool) -> None:
    """Print the CPU seconds of the commands a user runs (issue 24: check of
    the demo-size trace, golden check, mutants on one scenario, report), each
    a child process of this checkout, and of ``baseline``'s when given (the
    before/after of a change, in one run)."""
    commands = [("check", ["check", str(small)]),
                ("golden check", ["golden", "check"]),
                ("mutants (fcfs-tight)", ["mutants", "--scenario", "fcfs-tight"]),
                ("report", ["report", str(small), "-o", str(out / "report.html")])]
    if smoke:
        commands = commands[:1]
    print("commands a user runs, CPU seconds of the child process (start-up included):")
    for label, argv in commands:
        ours, code = command_cpu(REPO, argv)
        line = f"  {label:<22} {ours:8.2f} s (exit {code})"
        if baseline is not None:
            before, before_code = command_cpu(baseline, argv)
            line += f"   {baseline}: {before:8.2f} s (exit {before_code}); ours over it {ours / before:.2f}x"
        print(line)
    print()


def baseline_check_cpu(checkout: Path, path: Path) -> float:
    """CPU seconds of open_trace + check_trace of ``path`` with ``checkout``'s
    harness (first on PYTHONPATH), measured inside a child process."""
    code = ("import resource, sys\n"
            "from harness.trace import open_trace\n"
            "from harness.check.checker import check_trace\n"
            "u = resource.getrusage(resource.RUSAGE_SELF)\n"
            "check_trace(open_trace(sys.argv[1]))\n"
            "v = resource.getrusage(resource.RUSAGE_SELF)\n"
            "print(v.ru_utime + v.ru_stime - u.ru_utime - u.ru_stime)\n")
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True,
                          cwd=checkout)
    if proc.returncode:
        raise SystemExit(f"error: the baseline check failed: {proc.stderr.strip()[-500:]}")
    return float(proc.stdout.split()[-1])


#: The parts of a fuzz run, each named by the functions that start it (a path
#: fragment of the function's file and its name; "" any function of that
#: file). CPU spent under one of them is its part's, down to the innermost
#: one: the check a known-finding test runs is checking, the config
#: validation inside drawing is set-up. The rest is hypothesis's own search
#: (choosing and mutating choice sequences, its per-example bookkeeping) and
#: the fuzz loop around the examples.
FUZZ_PARTS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("drawing the scenario", (("hypothesis/control.py", "prep_args_kwargs_from_strategies"),)),
    ("engine+config set-up", (("harness/fuzz/strategies.py", "engine_config"),
                              ("harness/fuzz/strategies.py", "workload"),
                              ("reference/config.py", "from_dict"), ("reference/config.py", "to_dict"),
                              ("reference/config.py", "__post_init__"), ("reference/engine.py", "__init__"))),
    ("running the engine", (("reference/engine.py", "run"),)),
    ("its rows", (("harness/trace/recorder.py", "step_rows"),)),
    ("checking", (("harness/check/checker.py", "check_steps"), ("harness/fuzz/run.py", "known_reference_finding"),
                  ("harness/replay.py", "first_difference"))),
    ("writing to disk", (("harness/fuzz/witness.py", ""), ("harness/trace/writer.py", ""),
                         ("pyarrow/parquet", ""), ("_io.", "write"), ("posix", "write"))),
    ("reporting", (("harness/fuzz/report.py", ""), ("harness/fuzz_cli.py", "on_progress"),
                   ("harness/fuzz/parallel.py", "report"), ("rich/", ""))),
)
FUZZ_REST = "hypothesis's search"


def _fuzz_part(code: Any) -> str | None:
    """The part of ``FUZZ_PARTS`` function ``code`` (a code object, or a
    built-in's name as cProfile gives it) starts, or None."""
    if isinstance(code, str):  # a built-in: "<method 'write' of '_io.BufferedWriter' objects>"
        path, name = code, "write" if "'write'" in code or "posix.write" in code else ""
    else:
        path, name = code.co_filename.replace("\\", "/"), code.co_name
    for part, starts in FUZZ_PARTS:
        if any(fragment in path and (not fname or fname == name) for fragment, fname in starts):
            return part
    return None


def fuzz_parts(fn: Callable[[], Any]) -> str:
    """Percent of the CPU of a cProfile of ``fn()`` (a fuzz run) per part of
    ``FUZZ_PARTS``, one line.

    Each function's own time goes to the part that called it, call edge by
    call edge (cProfile's per-caller times); a function that starts no part
    inherits its callers' parts in proportion to the time spent in it from
    each (so a helper called from several parts is split by the calls, not
    by a guess). Read from ``Profile.getstats()`` (one entry per code
    object): pstats merges functions that share file, line and name, such
    as every dataclass's generated ``__init__``."""
    profile = cProfile.Profile()
    profile.runcall(fn)
    entries = profile.getstats()
    starts = {e.code: _fuzz_part(e.code) for e in entries}
    incoming: dict[Any, list[tuple[Any, float, float]]] = {}
    for e in entries:
        for sub in e.calls or ():
            incoming.setdefault(sub.code, []).append((e.code, sub.inlinetime, sub.totaltime))
    share = {e.code: {starts[e.code] or FUZZ_REST: 1.0} for e in entries}
    for _ in range(200):  # to a fixed point: a pass settles one more level of the call graph
        changed = False
        for code, edges in incoming.items():
            if starts.get(code):
                continue
            mix: dict[str, float] = {}
            total = sum(t for _, _, t in edges)
            for caller, _, t in edges:
                weight = t / total if total else 1.0 / len(edges)
                for part, x in share.get(caller, {FUZZ_REST: 1.0}).items():
                    mix[part] = mix.get(part, 0.0) + weight * x
            if any(abs(mix.get(k, 0.0) - share[code].get(k, 0.0)) > 1e-9 for k in mix.keys() | share[code].keys()):
                share[code], changed = mix, True
        if not changed:
            break
    cpu_by_part: dict[str, float] = {}
    for e in entries:
        edges = incoming.get(e.code)
        own = [(e.code, e.inlinetime)] if starts[e.code] or not edges else [(c, t) for c, t, _ in edges]
        for caller, t in own:
            for part, x in share.get(caller, {FUZZ_REST: 1.0}).items():
                cpu_by_part[part] = cpu_by_part.get(part, 0.0) + t * x
    total_cpu = sum(cpu_by_part.values()) or 1.0
    return "; ".join(f"{part} {cpu_by_part.get(part, 0.0) / total_cpu:.0%}"
                     for part in [p for p, _ in FUZZ_PARTS] + [FUZZ_REST])


def _record_to_temp(workload: Any, config: EngineConfig) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-check-record-") as tmp:
        record(workload, config, Path(tmp) / "r.parquet", seed=SEED)


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_check"))
