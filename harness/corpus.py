"""``harness check PATH...`` over a corpus: many traces, one row each.

A corpus is what the command's PATHs name (``expand_paths``): files, folders
(their ``*.parquet``, recursively) and globs. Each trace is checked by the
very code of a single ``harness check TRACE --json`` (the task the CLI hands
in, ``harness.check_cli.check_one_json``), in this process, a local process pool
(``--workers N``) or on a Ray cluster (``--ray [ADDRESS]``, ``harness.corpus_ray``);
its exit code, verdict line and counts become a ``TraceRow``, so a row says
exactly what ``harness check`` says of that trace alone, whatever exit codes
and verdicts check computes. Rows come back in input order whatever finished
first, so the output is the same bytes for any N, except the CPU seconds.

The corpus exit (``corpus_exit``) is the most severe row's code with the
order 0 < 3 < 1 < 2 (conformant, incomplete, violation, unusable); an exit
code this module does not know ranks between 1 and 2 and is reported as it is.
One trace's failure never hides another: an unreadable file is a row with its
error (exit 2), and a worker process that dies is retried for the traces it
held (locally: each alone in a fresh process; a trace whose own process dies
is a row saying so).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.richtext import keep_words_whole
from harness.trace.writer import SEGMENT_GLOB

#: Exit codes as ``harness check`` gives them (``harness.check_cli``): 3 is an
#: incomplete run with no violation in the steps it has (issue 26).
EXIT_OK, EXIT_FOUND, EXIT_UNUSABLE, EXIT_INCOMPLETE = 0, 1, 2, 3

#: Severity of each known exit code; an unknown non-zero code ranks 2.5
#: (worse than a violation, not as bad as an unusable trace).
SEVERITY = {EXIT_OK: 0, EXIT_INCOMPLETE: 1, EXIT_FOUND: 2, EXIT_UNUSABLE: 4}
UNKNOWN_SEVERITY = 3

#: The task checking one trace: (path, check's options) -> (exit code, stdout, stderr)
#: of ``harness check PATH --json`` run in-process (``harness.check_cli.check_one_json``).
CheckTask = Callable[[str, dict[str, Any]], tuple[int, str, str]]


class CorpusError(ValueError):
    """The PATHs name no trace (a folder without ``*.parquet``, a glob that
    matches nothing, a path that does not exist); the message names it."""


@dataclass(frozen=True)
class TraceRow:
    """One trace's outcome: ``exit`` and ``verdict`` exactly as ``harness check
    PATH`` gives them (``verdict`` its last line; for an unusable trace, its
    one-line ``error``), ``violations`` by invariant id, ``steps`` checked,
    ``cpu_s`` the CPU seconds its check took (in the process that ran it);
    ``sealed`` whether the trace carries tamper evidence and ``incomplete``
    why its run did not end (None when it did), as check's report says (None
    both for a trace without a report). A row exiting 0 with ``incomplete``
    set (``--allow-incomplete``) is tolerated, never counted conformant."""

    path: str
    exit: int
    verdict: str
    violations: dict[str, int] = field(default_factory=dict)
    steps: int | None = None
    cpu_s: float = 0.0
    error: str | None = None
    sealed: bool | None = None
    incomplete: str | None = None

    @property
    def category(self) -> str:
        """How the corpus counts the row: its exit's word, except that an
        incomplete run let through by ``--allow-incomplete`` (exit 0) is
        "incomplete (allowed)", never "conformant"."""
        if self.exit == EXIT_OK and self.incomplete is not None:
            return ALLOWED_INCOMPLETE
        return _WORDS.get(self.exit, f"exit {self.exit}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def same_outcome(self, other: TraceRow) -> bool:
        """Equal in everything but the CPU seconds."""
        return {**self.to_dict(), "cpu_s": 0} == {**other.to_dict(), "cpu_s": 0}


@dataclass(frozen=True)
class CorpusEntry:
    """One entry of a corpus, in input order: a trace to check (``error``
    None), or a PATH that names none (``error``: the one line saying why;
    its row is exit 2, and the rest are still checked)."""

    path: str
    error: str | None = None


def _same_file_key(path: str) -> str:
    """The key two names of one file share: its real path (symbolic links
    resolved as far as they lead: a dangling link's key is its target)."""
    try:
        return os.path.realpath(path)
    except (OSError, ValueError):
        return os.path.normpath(path)


def expand_corpus(paths: Sequence[str]) -> list[CorpusEntry]:
    """The traces PATHs name, in the order given: a file as it is, a folder as
    its ``*.parquet`` entries (recursively, sorted), anything else as a glob
    (sorted matches, ``**`` recursive). A killed recording's folder of
    segments (``seg-*.parquet``) is one path, whose check says to salvage it.
    A folder's ``*.parquet`` that is no regular file (a dangling symbolic link,
    a FIFO, a link loop) is kept: its row says why it was not read. A trace
    named twice, or reached twice (a symbolic link, a link loop under a
    ``**`` glob), is checked once. A PATH that names no trace (an empty
    folder, a glob matching nothing) is an entry with its ``error``.

    Regressions (adversarial trial): folders skipped dangling links and FIFOs
    named ``*.parquet`` silently; one PATH naming no trace aborted the whole
    corpus; the same file reached through a link was checked twice; a folder
    named ``*.parquet`` with no trace in it was skipped silently (now its row
    says it is a folder)."""
    out: list[CorpusEntry] = []
    seen: set[str] = set()
    hollow_errors: dict[str, str] = {}
    for raw in paths:
        p = Path(raw)
        error = None
        if p.is_dir() and any(p.glob(SEGMENT_GLOB)):
            found = [raw]  # a killed recording's segments: check names it and says to salvage it
        elif p.is_dir():
            # The segments of a killed recording under it: one row for their folder, as above.
            named = list(p.rglob("*.parquet"))
            found = sorted(dict.fromkeys(str(f.parent) if fnmatch.fnmatch(f.name, SEGMENT_GLOB) else str(f)
                                         for f in named if not f.is_dir()))
            # A folder named *.parquet is searched like any other; one with no trace in it is
            # a row saying so, not skipped silently (regression, trial finding).
            hollow = [str(f) for f in named if f.is_dir() and not any(
                x == str(f) or x.startswith(str(f) + os.sep) for x in found)]
            hollow_errors.update((f, f"{f}: a folder, not a trace (named *.parquet, no *.parquet trace in it)")
                                 for f in hollow)
            found = sorted(found + hollow)
            if not found:
                error = f"{raw}: a folder without any *.parquet trace"
        elif p.exists() or p.is_symlink():
            found = [raw]  # a file (or a FIFO, a dangling link): check says what it is
        elif glob.has_magic(raw):
            found = sorted(glob.glob(raw, recursive=True))
            found = [f for f in found if not Path(f).is_dir()]
            if not found:
                error = f"{raw}: no file matches this pattern"
        else:
            found = [raw]  # a missing file: its row says so, as check would
        if error is not None:
            found = []
            if raw not in seen:
                seen.add(raw)
                out.append(CorpusEntry(raw, error))
        for f in found:
            key = _same_file_key(f)
            if key not in seen:
                seen.add(key)
                out.append(CorpusEntry(f, hollow_errors.get(f)))
    return out


def expand_paths(paths: Sequence[str]) -> list[str]:
    """The traces of ``expand_corpus(paths)``. Raises CorpusError (the first
    entry's error) when a PATH names no trace."""
    entries = expand_corpus(paths)
    for e in entries:
        if e.error is not None:
            raise CorpusError(e.error)
    return [e.path for e in entries]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def error_row(path: str, code: int, error: str, cpu_s: float = 0.0) -> TraceRow:
    """The row of a trace without a report: ``error`` the one line naming
    the file and the problem, ``verdict`` that line without the path."""
    return TraceRow(path, code, error.removeprefix(f"{path}: "), cpu_s=cpu_s, error=error)


def row_of(path: str, code: int, stdout: str, stderr: str, cpu_s: float) -> TraceRow:
    """The row of one check's exit code and output (``--json``'s object on
    stdout; for an unusable trace the error line on stderr)."""
    try:
        report = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        report = None
    cpu_s = round(cpu_s, 3)
    if isinstance(report, dict) and isinstance(report.get("error"), str):  # check --json of an unusable trace
        return error_row(path, code, report["error"], cpu_s)
    if not isinstance(report, dict):
        error = _last_line(stderr).removeprefix("error: ") or f"{path}: exit {code} without a report"
        return error_row(path, code, error, cpu_s)
    verdict = report.get("verdict") or ("conformant" if report.get("ok") else "not conformant")
    sealed = report.get("sealed")
    incomplete = report.get("incomplete")
    return TraceRow(path, code, verdict, dict(sorted((report.get("violations_by_invariant") or {}).items())),
                    report.get("steps"), cpu_s, sealed=sealed if isinstance(sealed, bool) else None,
                    incomplete=str(incomplete) if incomplete is not None else None)


def check_row(path: str, params: dict[str, Any], task: CheckTask) -> TraceRow:
    """Check one trace with ``task`` and time its CPU (this process's)."""
    start = time.process_time()
    try:
        code, stdout, stderr = task(path, params)
    except Exception as exc:  # a bug in the check: this trace's row, not the corpus's end
        code, stdout, stderr = EXIT_UNUSABLE, "", f"{path}: check failed: {type(exc).__name__}: {exc}"
    return row_of(path, code, stdout, stderr, time.process_time() - start)


def _init_worker(parent: int) -> None:
    """A pool worker dies with the process that started the pool (PID ``parent``)."""
    from harness.fuzz.parallel import die_with_parent

    die_with_parent(parent)


def check_local(paths: Sequence[str], params: dict[str, Any], task: CheckTask, workers: int = 1,
                on_row: Callable[[int, TraceRow], None] | None = None) -> list[TraceRow]:
    """Rows of ``paths`` in input order, checked here (``workers`` 1) or in a
    pool of ``workers`` processes (spawned; each dies with this one).
    ``on_row(index, row)`` as each finishes. If a worker dies, the traces
    without a row are checked again, each in a fresh process of its own; a
    trace whose own process dies gets a row saying so (exit 2)."""
    rows: dict[int, TraceRow] = {}

    def done(i: int, row: TraceRow) -> None:
        rows[i] = row
        if on_row is not None:
            on_row(i, row)

    if workers <= 1 or len(paths) <= 1:
        for i, path in enumerate(paths):
            done(i, check_row(path, params, task))
        return [rows[i] for i in range(len(paths))]
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(max_workers=min(workers, len(paths)), mp_context=ctx, initializer=_init_worker,
                               initargs=(os.getpid(),))
    try:
        futures = {pool.submit(check_row, p, params, task): i for i, p in enumerate(paths)}
        for fut in as_completed(futures):
            done(futures[fut], fut.result())
        pool.shutdown()
    except BrokenProcessPool:
        pool.shutdown(wait=False, cancel_futures=True)
        for i, path in enumerate(paths):
            if i in rows:
                continue
            try:
                with ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_init_worker,
                                         initargs=(os.getpid(),)) as alone:
                    done(i, alone.submit(check_row, path, params, task).result())
            except BrokenProcessPool:
                done(i, error_row(path, EXIT_UNUSABLE, f"{path}: the process checking it died"))
    except BaseException:  # Ctrl-C, SIGTERM: the queued traces are not waited for
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return [rows[i] for i in range(len(paths))]


def severity(code: int) -> float:
    return SEVERITY.get(code, UNKNOWN_SEVERITY)


def corpus_exit(rows: Sequence[TraceRow]) -> int:
    """The most severe row's exit code (0 < 3 < 1 < unknown < 2); 0 for none."""
    return max((r.exit for r in rows), key=severity, default=EXIT_OK)


def totals(rows: Sequence[TraceRow]) -> dict[str, Any]:
    """Counts over the rows: traces, by exit code, violations by id, steps,
    CPU seconds; ``conformant`` counts complete runs only (an incomplete run
    exiting 0 under ``--allow-incomplete`` is ``incomplete_allowed``), and
    ``unsealed`` the traces without tamper evidence."""
    by_exit: dict[str, int] = {}
    violations: dict[str, int] = {}
    for r in rows:
        by_exit[str(r.exit)] = by_exit.get(str(r.exit), 0) + 1
        for inv, n in r.violations.items():
            violations[inv] = violations.get(inv, 0) + n
    allowed = sum(r.category == ALLOWED_INCOMPLETE for r in rows)
    return {"traces": len(rows), "by_exit": dict(sorted(by_exit.items())),
            "conformant": by_exit.get("0", 0) - allowed, "violating": by_exit.get("1", 0),
            "unusable": by_exit.get("2", 0), "incomplete": by_exit.get("3", 0),
            "incomplete_allowed": allowed, "unsealed": sum(r.sealed is False for r in rows),
            "violations": dict(sorted(violations.items())),
            "steps": sum(r.steps or 0 for r in rows),
            "cpu_s": round(sum(r.cpu_s for r in rows), 3)}


def corpus_dict(rows: Sequence[TraceRow], runner: str) -> dict[str, Any]:
    """``--json``: ``ok``, ``exit``, ``runner`` (where it ran), ``traces``
    (one object per row, input order) and ``totals``."""
    code = corpus_exit(rows)
    return {"ok": code == EXIT_OK, "exit": code, "runner": runner,
            "traces": [{**r.to_dict(), **({"target": target} if (target := link_target(r.path)) else {})}
                       for r in rows], "totals": totals(rows)}


def link_target(path: str) -> str | None:
    """The file a symbolic link ``path`` leads to (resolved as far as it
    leads), or None when ``path`` is no link. Regression (trial finding): a
    folder's row showed a link's name alone, not the file checked."""
    try:
        return os.path.realpath(path) if os.path.islink(path) else None
    except (OSError, ValueError):
        return None


def shown_path(path: str) -> str:
    """A row's trace as the table shows it: the path given, and ``-> TARGET``
    for a symbolic link."""
    target = link_target(path)
    return path if target is None else f"{path} -> {target}"


_WORDS = {EXIT_OK: "conformant", EXIT_FOUND: "violating", EXIT_UNUSABLE: "unusable",
          EXIT_INCOMPLETE: "incomplete"}
#: The word of an incomplete run that ``--allow-incomplete`` let exit 0.
ALLOWED_INCOMPLETE = "incomplete (allowed)"


def corpus_verdict(rows: Sequence[TraceRow]) -> str:
    """The last line: "20 traces: 18 conformant, 1 violating, 1 unusable (exit 2)";
    "; 2 unsealed" when some trace has no tamper evidence."""
    counts: dict[str, tuple[float, int]] = {}
    for r in rows:
        rank = severity(r.exit) + (0.5 if r.category == ALLOWED_INCOMPLETE else 0)
        counts[r.category] = (rank, counts.get(r.category, (rank, 0))[1] + 1)
    parts = [f"{n} {word}" for word, (_rank, n) in sorted(counts.items(), key=lambda kv: kv[1][0])]
    n = len(rows)
    unsealed = totals(rows)["unsealed"]
    tail = f"; {unsealed} unsealed" if unsealed else ""
    return f"{n} trace{'s' * (n != 1)}: {', '.join(parts)}{tail} (exit {corpus_exit(rows)})"


def render_corpus(rows: Sequence[TraceRow], runner: str, console: Console) -> None:
    """The table (path, exit, verdict or error, violations by id, steps, CPU s),
    the totals, and the verdict as the last line."""
    table = Table(box=None, show_edge=False)
    for name, justify in (("trace", "left"), ("exit", "right"), ("verdict", "left"),
                          ("violations", "left"), ("steps", "right"), ("CPU s", "right")):
        table.add_column(name, justify=justify, no_wrap=name == "trace")  # type: ignore[arg-type]
    for r in rows:
        table.add_row(escape(shown_path(r.path)), str(r.exit), escape(r.verdict),
                      ", ".join(f"{k} ×{v}" for k, v in r.violations.items()) or "-",
                      "-" if r.steps is None else str(r.steps), f"{r.cpu_s:.2f}")
    console.print(keep_words_whole(table))
    t = totals(rows)
    if t["violations"]:
        console.print("violations: " + ", ".join(f"{k} ×{v}" for k, v in t["violations"].items()))
    console.print(f"{t['steps']} steps checked, {t['cpu_s']:.2f} CPU s ({runner})")
    code = corpus_exit(rows)
    console.print(corpus_verdict(rows), style="bold green" if code == EXIT_OK else "bold red",
                  markup=False, highlight=False)
