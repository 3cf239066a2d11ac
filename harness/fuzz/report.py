"""What ``harness fuzz`` prints: the run's summary line (examples, workers,
seconds, seed, known findings passed over) and, per written witness, its
failure, its shrunk case, its files and the ``harness replay`` command that
reproduces it. Rendering only; ``harness.fuzz_cli`` calls it with its console.
"""

from __future__ import annotations

import signal

from rich.console import Console
from rich.markup import escape

from harness.check.invariants import fork_hint
from harness.fuzz.parallel import ParallelFuzzResult
from harness.fuzz.witness import Witness
from reference.words import plural


def render_summary(result: ParallelFuzzResult, candidate: str, seed: int, console: Console) -> None:
    """Print ``fuzzed CANDIDATE: N examples [on W workers] [on Ray] in S s, seed SEED``
    (noting a spent time budget when nothing was found), that a Ctrl-C (or
    SIGTERM) cut shrinking short, if so, and the known reference findings
    passed over, if any."""
    stop = " (time budget spent)" if result.budget_exhausted and not result.found else ""
    used = len(result.workers)
    on = (f" on {used} workers" if used > 1 else "") + (f" on {result.runner}" if result.runner else "")
    console.print(f"fuzzed [bold]{candidate}[/]: {plural(result.examples, 'example')}{on} in "
                  f"{result.elapsed_s:.1f} s, seed {seed}{stop}")
    if result.interrupted is not None and result.found:
        console.print(f"shrinking interrupted by {signal.Signals(result.interrupted).name}: reporting the "
                      f"smallest failing scenario found before it", markup=False)
    if result.known:
        console.print("passed over known reference findings: "
                      + ", ".join(f"{name} x{n}" for name, n in result.known.items())
                      + " (--report-known to stop at them)")
    if result.refused:
        console.print(f"skipped {result.refused} drawn config{'s' * (result.refused != 1)} the candidate "
                      f"refused (not findings), e.g. {escape(result.refusal)}")


def render_witnesses(result: ParallelFuzzResult, witnesses: list[Witness], console: Console) -> None:
    """Print each witness (``write_witnesses``): which workers found it, the
    failure and its invariants, the shrunk case, its files and replay
    command; with several, the smallest one's replay command last."""
    used = len(result.workers)
    if used > 1:
        console.print(f"[bold red]FOUND[/] by {len(result.found)} of {used} workers, "
                      f"{plural(len(witnesses), 'distinct shrunk scenario')}:")
    for wit in witnesses:
        res = wit.worker.result
        failure, case = res.failure, res.case
        who = ""
        if used > 1:
            others = [i for i in wit.found_by if i != wit.worker.worker]
            who = (f"worker {wit.worker.worker} (seed {wit.worker.seed})"
                   + (f", also worker{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
                      if others else "") + ": ")
        console.print(f"[bold red]FOUND[/] {who}{failure.kind}: {escape(failure.message)}")
        if failure.invariants:
            console.print("  invariants: " + ", ".join(f"{k}: {v}" for k, v in sorted(failure.invariants.items())))
        hint = fork_hint(failure.invariants or (), diverged=failure.kind == "divergence") \
            if failure.kind in ("violation", "divergence") else None
        if hint:
            console.print(f"  hint: {escape(hint)}")
        cut = (f"; shrinking interrupted by {signal.Signals(res.interrupted).name}, the smallest so far"
               if res.interrupted else "")
        console.print(f"  shrunk to {escape(case.describe())} ({res.shrink_calls} shrink runs{cut})")
        console.print(f"  trace {wit.trace}, scenario {wit.scenario}, description {wit.json}")
        console.print(f"  replay: {wit.command}")
        console.print(f"  re-record the scenario: {wit.record_command}")
    if len(witnesses) > 1:
        smallest = result.smallest()
        best = next(w for w in witnesses if smallest.worker in w.found_by)
        console.print(f"smallest: worker {best.worker.worker}, {escape(best.worker.result.case.describe())}; "
                      f"replay: {best.command}")
