#!/usr/bin/env python3
"""What the candidate boundary costs on a golden run (issue 17).

Run from anywhere:  .venv/bin/python bench/bench_isolation.py [--repeat N]

Replays every golden (``harness.golden.check_goldens``: the goldens' check plus
the re-driven candidate, what ``harness golden check`` does) with the same
scheduler, the reference's, behind three boundaries:

  (a) in-process, trusted: ``reference.scheduler.Scheduler`` itself (the
      reference and the mutants run so: return values not checked);
  (b) in-process, checked: a subclass defined here, so the engine's guard
      checks every return value (``reference.validate``), as it does for any
      candidate that is not ours;
  (c) isolated: ``reference.scheduler:Scheduler`` in its own process
      (``harness.candidates.isolated``, what a ``module:factory`` candidate
      gets), return values checked too.

Prints the best of --repeat runs (default 3) of each, wall seconds
(time.perf_counter), the number of candidate calls, and the cost per call of
(b) and (c) over (a). A benchmark, not a test: exit 0 unless a golden fails.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # importable even without the editable install
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

from harness.candidates.isolated import isolated_factory  # noqa: E402
from harness.golden import DEFAULT_DIR, check_goldens  # noqa: E402
from harness.replay import replay  # noqa: E402
from harness.trace import open_trace  # noqa: E402
from reference.scheduler import Scheduler  # noqa: E402


class CheckedScheduler(Scheduler):
    """The reference, in a module the guard does not trust (this script)."""


class _Counting:
    """Counts the calls the engine makes into a scheduler."""

    calls = 0

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            _Counting.calls += 1
            return attr(*args, **kwargs)
        return call


# --smoke: one golden replayed instead of `golden check` of them all.
SMOKE_GOLDEN = Path(DEFAULT_DIR) / "preemption-heavy.parquet"


def _run(factory, smoke: bool) -> list[str]:
    """The goldens (or, with ``smoke``, SMOKE_GOLDEN) that failed."""
    if smoke:
        divergence, _ = replay(open_trace(SMOKE_GOLDEN), factory)
        return [] if divergence is None else [SMOKE_GOLDEN.stem]
    return [r.scenario for r in check_goldens(DEFAULT_DIR, factory) if not r.ok]


def _time(factory, repeat: int, smoke: bool = False) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        failed = _run(factory, smoke)
        best = min(best, time.perf_counter() - start)
        if failed:
            print(f"golden check failed: {', '.join(failed)}")
            sys.exit(1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the test suite's run: --repeat 1")
    args = parser.parse_args()
    if args.smoke:
        args.repeat = 1
    print(f"# {' '.join(sys.argv)} | Python {platform.python_version()} | {platform.machine()} | "
          f"{os.cpu_count()} CPUs | load average {os.getloadavg()[0]:.1f}")
    _Counting.calls = 0
    _run(lambda config: _Counting(Scheduler(config)), args.smoke)
    calls = _Counting.calls
    goldens = 1 if args.smoke else len(list(Path(DEFAULT_DIR).glob("*.parquet")))
    trusted = _time(Scheduler, args.repeat, args.smoke)
    checked = _time(CheckedScheduler, args.repeat, args.smoke)
    isolated = _time(isolated_factory("reference.scheduler:Scheduler"), args.repeat, args.smoke)
    print(f"golden {'replay' if args.smoke else 'check'} of {goldens} goldens, {calls} candidate calls, "
          f"best of {args.repeat}:")
    print(f"  (a) in-process, trusted:   {trusted:6.2f} s")
    print(f"  (b) in-process, checked:   {checked:6.2f} s  (+{(checked - trusted) / trusted:.0%}, "
          f"{(checked - trusted) / calls * 1e6:.1f} us per call)")
    print(f"  (c) isolated process:      {isolated:6.2f} s  (+{(isolated - trusted) / trusted:.0%}, "
          f"{(isolated - trusted) / calls * 1e6:.1f} us per call)")


if __name__ == "__main__":
    sys.exit(page.run(main, "bench_isolation"))
