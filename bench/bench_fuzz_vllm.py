#!/usr/bin/env python3
"""Fuzzing real vLLM: examples per second once vLLM is imported (issue 24).

Run from anywhere:  .venv/bin/python bench/bench_fuzz_vllm.py [--version 0.33.0] [--examples 100] [--smoke]

What ``harness fuzz --candidate vllm@VERSION`` does, in this process: ``harness.fuzz.run.fuzz`` over
``--examples`` generated examples (hypothesis seed ``--seed``), each run on the reference and on vLLM's
real Scheduler and compared step by step. vLLM runs in driver processes under the release's env
(``harness/candidates/vllm/driver.py``): each imports vLLM once and builds a fresh Scheduler for every
example from its config (``init``); two are kept idle in a pool (``harness.candidates.vllm.candidate``),
enough for an example with two data-parallel ranks. Both are started first, their imports overlapping
(``prestart``: the import and the first scheduler, which costs as much, since vLLM inspects the model
class in a subprocess once per process), and that warm-up is reported on its own; the figures after it
are the steady state.

Goals: >= 10 examples per second, and 100 examples in under 30 s, after the first import. Printed:
wall seconds, and CPU seconds of this process (``resource.getrusage``) and of the drivers (their
``/proc/PID/stat``, read while they live) - on a shared, loaded machine wall time mostly measures the
load; the harness and a driver take turns (one call in flight), so their CPU seconds together are close
to the wall time of an idle machine, and the rate per CPU second is the one to read. Then where a
driver's time goes (its ``stats`` op: calls and seconds per op) and how many drivers had to be started
during the run (0 unless one crashed or hung: a new driver pays the import again).

Last, the cold start ``harness fuzz`` pays: its first 10 examples from no driver running, as ``fuzz``
runs them (the factory's ``prestart``: both drivers start in the background while hypothesis draws and
the reference runs the first example) and without that prestart (the first example starts its driver
and waits; a second starts when an example needs two), wall and CPU seconds each, and their ratio.

--smoke: 8 examples, no cold start (the test suite's run: figures printed, nothing asserted).
A benchmark, not a test: exit 0 unless the run fails (1) or the vLLM env is not built (2).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import page  # noqa: E402
from harness.candidates.vllm import candidate as vllm_candidate  # noqa: E402
from harness.candidates.vllm.env import is_ready  # noqa: E402
from harness.children import descendants  # noqa: E402
from harness.fuzz.run import fuzz, known_reference_finding  # noqa: E402
from reference.config import EngineConfig  # noqa: E402

GOAL_RATE = 10.0  # examples per second
GOAL_100_S = 30.0  # seconds for 100 examples
SEED = 0


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class DriverCPU:
    """CPU seconds of every driver process seen (the reaper shim and its
    descendants: the driver's Python, with its waited-for children), each
    PID's last reading kept, so a
    driver that died mid-run still counts what it had used when last read."""

    def __init__(self) -> None:
        self.seen: dict[int, float] = {}
        self.drivers: set[int] = set()  # the PIDs of the drivers' shims
        self.tick = os.sysconf("SC_CLK_TCK")

    def read(self) -> float:
        for driver in vllm_candidate.POOL.live():
            self.drivers.add(driver.pid)
            for pid in [driver.pid, *descendants(driver.pid)]:
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                # utime, stime, and cutime, cstime: what its waited-for children
                # used (vLLM inspects the model class in a subprocess).
                self.seen[pid] = sum(int(v) for v in fields[11:15]) / self.tick
        return sum(self.seen.values())


def driver_stats(version: str) -> dict[str, tuple[int, float]]:
    """Calls and wall seconds per op summed over the idle drivers (their
    ``stats``, since each started; asking builds one scheduler in each)."""
    candidates = [vllm_candidate.VLLMCandidate(EngineConfig(), version)
                  for _ in range(vllm_candidate.POOL.idle_count(
                      vllm_candidate._pool_key(vllm_candidate.release_target(version))))]
    totals: dict[str, tuple[int, float]] = {}
    try:
        for c in candidates:
            for op, s in c.stats()["stats"].items():
                n, t = totals.get(op, (0, 0.0))
                totals[op] = (n + s["count"], t + s["total_s"])
    finally:
        for c in candidates:
            c.close()
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="0.33.0", help="vLLM release (default 0.33.0)")
    parser.add_argument("--examples", type=int, default=100, help="generated examples (default 100)")
    parser.add_argument("--seed", type=int, default=SEED, help="hypothesis seed (default 0)")
    parser.add_argument("--smoke", action="store_true", help="8 examples")
    args = parser.parse_args()
    if args.smoke:
        args.examples = 8
    if not is_ready(args.version):
        print(f"error: the vLLM {args.version} env is not built (harness vllm-env {args.version})",
              file=sys.stderr)
        return 2
    drivers = DriverCPU()
    factory = vllm_candidate.make_factory(args.version)

    wall0, cpu0 = time.monotonic(), own_cpu()
    pids = vllm_candidate.prestart(args.version)
    warm_wall, warm_cpu, warm_drivers = time.monotonic() - wall0, own_cpu() - cpu0, drivers.read()
    print(f"warm-up: {len(pids)} vLLM {args.version} drivers started at once (vLLM imported, one scheduler built): "
          f"{warm_wall:.1f} s wall, CPU {warm_cpu:.2f} s here + {warm_drivers:.2f} s in the drivers")

    started = len(drivers.drivers)
    stats_before = driver_stats(args.version)
    wall0, cpu0, dcpu0 = time.monotonic(), own_cpu(), drivers.read()
    result = fuzz(factory, max_examples=args.examples, seed=args.seed, known=known_reference_finding,
                  shrink_budget_s=60.0, on_example=lambda n, shrinking: drivers.read())
    wall, cpu, dcpu = time.monotonic() - wall0, own_cpu() - cpu0, drivers.read() - dcpu0
    restarts = len(drivers.drivers) - started
    verdict = (f"found {result.failure.kind}: {result.failure.message[:160]}" if result.found
               else "nothing found")
    print(f"fuzz vllm@{args.version}, seed {args.seed}: {result.examples} examples "
          f"({result.refused} refused, {sum(result.known.values())} known reference findings), "
          f"{result.shrink_calls} shrinking runs: {verdict}")
    print(f"  wall {wall:.2f} s; CPU {cpu:.2f} s here + {dcpu:.2f} s in the drivers = {cpu + dcpu:.2f} s; "
          f"drivers started during the run: {restarts}")
    runs = result.examples + result.shrink_calls
    per_wall, per_cpu = runs / wall, runs / (cpu + dcpu)
    print(f"  per example: {wall / runs * 1000:.0f} ms wall, {cpu / runs * 1000:.0f} ms CPU here, "
          f"{dcpu / runs * 1000:.0f} ms CPU in the drivers")
    print("goals (after the first import):")
    for label, value in (("examples/s, wall", per_wall), ("examples/CPU-s", per_cpu)):
        met = "met" if value >= GOAL_RATE else "NOT MET"
        print(f"  {label:<20} {value:>8.2f}  goal >= {GOAL_RATE:g}  ratio {value / GOAL_RATE:.2f}  {met}")
    for label, value in (("100 examples, wall s", 100 / per_wall), ("100 examples, CPU s", 100 / per_cpu)):
        met = "met" if value < GOAL_100_S else "NOT MET"
        print(f"  {label:<20} {value:>8.2f}  goal < {GOAL_100_S:g}  ratio {value / GOAL_100_S:.2f}  {met}")
    after = driver_stats(args.version)
    totals = {op: (n - stats_before.get(op, (0, 0.0))[0], t - stats_before.get(op, (0, 0.0))[1])
              for op, (n, t) in after.items()}
    busy = sum(t for op, (n, t) in totals.items() if op != "stats")
    print("in the drivers during the run (their stats op: calls, wall seconds, share of the ops' time):")
    for op, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        if op != "stats":
            print(f"  {op:<20} {n:>7,} calls {t:>8.2f} s  {t / busy if busy else 0:>5.0%}")
    if args.smoke:  # four more vLLM imports (about 40 s CPU each on a loaded machine)
        print("cold start: not measured under --smoke")
    else:
        cold(args, factory, drivers)
    vllm_candidate.shutdown_pool()
    return 0


def cold(args: argparse.Namespace, factory, drivers: DriverCPU) -> None:
    """What ``harness fuzz --candidate vllm@VERSION`` pays from a cold start
    (no driver running) for its first examples: ``fuzz`` as is (its factory's
    ``prestart``: the drivers start in the background while hypothesis draws
    and the reference runs the first example), against the same factory
    without ``prestart`` (the first example starts its driver and waits for it;
    a second driver starts only when an example needs it). Each from an empty
    pool; wall and CPU seconds (here and in the drivers)."""
    n = 10

    def hidden(config):  # the factory without its prestart attribute
        return factory(config)

    hidden.__dict__.update({k: v for k, v in factory.__dict__.items() if k != "prestart"})
    rows = []
    for label, fac in (("without prestart", hidden), ("with prestart (fuzz's)", factory)):
        vllm_candidate.shutdown_pool()
        before = drivers.read()
        wall0, cpu0 = time.monotonic(), own_cpu()
        result = fuzz(fac, max_examples=n, seed=args.seed, known=known_reference_finding,
                      shrink_budget_s=60.0, on_example=lambda _n, _s: drivers.read())
        wall, cpu, dcpu = time.monotonic() - wall0, own_cpu() - cpu0, drivers.read() - before
        rows.append((label, result.examples, wall, cpu, dcpu))
        if result.found:  # a cold start that crashed must not pass as a figure
            print(f"  {label}: found {result.failure.kind}: {result.failure.message[:300]}")
    print(f"cold start, {n} examples from no driver running (seed {args.seed}):")
    for label, examples, wall, cpu, dcpu in rows:
        print(f"  {label:<24} {examples} examples: wall {wall:.2f} s; CPU {cpu:.2f} s here + "
              f"{dcpu:.2f} s in the drivers = {cpu + dcpu:.2f} s")
    (_, _, w0, c0, d0), (_, _, w1, c1, d1) = rows
    print(f"  with / without prestart: wall x{w1 / w0:.2f}, CPU x{(c1 + d1) / (c0 + d0):.2f}")


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_fuzz_vllm"))
