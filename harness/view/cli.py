"""``harness report`` and ``harness export``, and the ``--report FILE`` that
``check``, ``replay`` and ``diff`` take (``write_report``).

``register(main)`` adds the two commands to the CLI group; plotly is
imported only when a report is drawn. Exit codes as everywhere: 0 written,
2 unusable input (a one-line error naming the file); the last line is the
verdict.
"""

from __future__ import annotations

import sys
import os
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from harness.check import ProfileError
from harness.cli_common import AUTO_TRACE, semantics_option
from harness.progress import every_steps, progress
from harness.trace import Trace, TraceError, open_trace
from harness.view.files import write_atomic
from harness.view.series import Series, derive
from reference.words import plural

console = Console(stderr=False, highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


def _fail(message: str) -> None:
    err.print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(2)


def _open(path: str) -> Trace:
    try:
        return open_trace(path)
    except TraceError as exc:
        _fail(str(exc))
    raise AssertionError


def refuse_overwriting(output: str | None, *inputs: str | None, option: str = "-o") -> None:
    """Exit 2 if ``output`` is no place for the written file (``harness.paths``:
    one of the input traces, a device, a FIFO or other non-regular file, under a
    file, ...): it is written beside and renamed over, which would replace it.
    ``option``: the option the message names (``--report``, ``--tables``)."""
    from harness.paths import OutputPathError, check_output_file

    if output is None:
        return
    for source in inputs:
        try:
            if source is not None and Path(source).exists() and Path(output).exists() \
                    and os.path.samefile(source, output):
                _fail(f"{output}: the output names the input trace {source}; it would be overwritten")
        except OSError:
            pass
    try:
        check_output_file(output, tuple(s for s in inputs if s is not None), option)
    except OutputPathError as exc:
        _fail(str(exc))


def derive_with_progress(trace: Trace, semantics: str = "auto", what: str = "reading") -> Series:
    """``derive`` with a progress bar on a terminal's stderr (none when piped).
    Exits 2 on an unknown profile or an unreadable trace."""
    try:
        with progress(f"{what} {trace.path.name}", trace.summary.get("steps")) as update:
            return derive(trace, semantics, every_steps(update))
    except (ProfileError, TraceError) as exc:
        _fail(str(exc))
    raise AssertionError


def write_report(path: str, trace: Trace, semantics: str = "auto", *, series: Series | None = None,
                 against: Trace | None = None, divergence: Any = "find",
                 own_run: Any = None) -> tuple[Series, Series | None, Any]:
    """Draw the HTML report of ``trace`` (``series`` if already derived)
    into ``path`` atomically; ``against``: a second run to overlay, whose
    first divergence from ``trace`` (``harness.diff``) is highlighted unless
    ``divergence`` is given (a ``harness.view.html.Divergence``, or None:
    none); ``own_run``: a fork-gate replay's ``harness.view.html.OwnRunView``
    (the divergence is then information, the own run the verdict). Returns
    the series of ``trace`` and of ``against`` (None without) and the
    divergence shown. Exits 2 if the file cannot be
    written or the traces are not the same workload."""
    from harness.report import report_dict
    from harness.view.html import render

    series = series or derive_with_progress(trace, semantics)
    b_series = b_summary = None
    if against is not None:
        b_series = derive_with_progress(against, semantics)
        b_summary = report_dict(b_series.result, None, against)
        if divergence == "find":
            divergence = first_divergence(trace, against)
    if divergence == "find":
        divergence = None
    page = render(series, report_dict(series.result, None, trace), against=b_series,
                  against_summary=b_summary, divergence=divergence, own_run=own_run)
    try:
        write_atomic(path, page)
    except OSError as exc:
        _fail(f"{path}: cannot write the report ({exc.strerror or exc})")
    return series, b_series, divergence


def first_divergence(a: Trace, b: Trace) -> Any:
    """The first difference of two traces of one workload as a
    ``harness.view.html.Divergence`` (None: identical decisions). Exits 2
    when they are not the same workload."""
    from harness.diff import diff_traces

    try:
        result = diff_traces(a, b)
    except TraceError as exc:
        _fail(str(exc))
    return divergence_of_diff(result)


def divergence_of_diff(result: Any) -> Any:
    """A ``harness.diff.DiffResult``'s first divergence as a ``Divergence``."""
    from harness.view.html import Divergence

    d = result.first_divergence
    if d is None:
        return None
    return Divergence(d.step, f"event #{d.event_index} ({d.kind or '-'}), request {d.request or '-'}, "
                              f"field {d.field}: A {d.a!r}, B {d.b!r}")


def own_run_view(own: Any, candidate: str) -> Any:
    """A replay's ``harness.replay.OwnRun`` as the report shows it (``OwnRunView``)."""
    from harness.report import own_run_line
    from harness.view.html import OwnRunView

    return OwnRunView(own_run_line(own, candidate), own.ok,
                      tuple(v.to_dict() for v in own.result.violations), own.result.num_violations)


def divergence_of_replay(d: Any) -> Any:
    """A ``harness.replay.Divergence`` (trace vs candidate) as a ``Divergence``."""
    from harness.view.html import Divergence

    if d is None:
        return None
    if d.field == "exception":
        return Divergence(d.step, f"the candidate crashed: {d.actual}")
    return Divergence(d.step, f"replay: event #{d.event_index} ({d.kind or '-'}), request "
                              f"{d.request or '-'}, field {d.field}: trace {d.expected!r}, "
                              f"candidate {d.actual!r}")


def _verdict(series: Series, trace: Trace) -> str:
    """``check``'s verdict of ``trace``, with its incomplete and unsealed notes
    (adversarial trial: report's line dropped "unsealed: no tamper evidence")."""
    from harness.report import verdict

    return verdict(series.result, None, trace=trace)


def register(main: click.Group) -> None:
    """Add ``report`` and ``export`` to the ``harness`` group."""
    main.add_command(report)
    main.add_command(export)


_SEMANTICS = semantics_option(AUTO_TRACE, "Its violations are marked.")


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--against", "against_path", metavar="OTHER",
              help="A second trace of the same workload: overlaid (dashed), first divergence highlighted.")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="HTML file to write (self-contained, works offline). Temp file + rename.")
@_SEMANTICS
def report(trace_path: str, against_path: str | None, output: str, semantics: str) -> None:
    """Draw TRACE as one self-contained HTML report: summary table, KV blocks, queues,
    tokens per step, preemptions, prefix hits, draft acceptance, remote loads, a
    per-request Gantt and every violation with its witness.

    Exit 0 once written (the last line gives the check's verdict; `harness check`
    is the gate), 2 unusable input.
    """
    refuse_overwriting(output, trace_path, against_path)
    trace = _open(trace_path)
    against = _open(against_path) if against_path else None
    series, b_series, divergence = write_report(output, trace, semantics, against=against)
    line = (f"report written to {output}: {plural(len(series.steps), 'step')}, "
            f"{plural(len(series.requests), 'request')}; ")
    if b_series is None:
        line += _verdict(series, trace)
    else:
        line += f"A: {_verdict(series, trace)}; B: {_verdict(b_series, against)}; "
        line += f"first divergence at step {divergence.step}" if divergence else "identical decisions"
    console.print(line, markup=False)


@click.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--perfetto", is_flag=True,
              help="Write the Chrome trace event JSON that ui.perfetto.dev opens (needs -o).")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False), help="The --perfetto file.")
@click.option("--tables", "tables_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Write steps.parquet, scheduled.parquet and requests.parquet into DIR (docs/tables.md).")
@_SEMANTICS
def export(trace_path: str, perfetto: bool, output: str | None, tables_dir: str | None,
           semantics: str) -> None:
    """Export TRACE for other tools: a Perfetto timeline (--perfetto -o T.json: a track
    per request, counters for blocks and queues, violations as instants) and/or
    SQL-friendly Parquet tables (--tables DIR).

    Exit 0 written, 2 unusable input or nothing asked for.
    """
    if not perfetto and not tables_dir:
        _fail("nothing to export: give --perfetto -o FILE and/or --tables DIR")
    if perfetto and not output:
        _fail("--perfetto needs -o FILE")
    if output and not perfetto:
        _fail("-o is the --perfetto file; add --perfetto")
    refuse_overwriting(output, trace_path)
    if tables_dir:
        for name in ("steps", "scheduled", "requests"):  # harness.view.tables.write_tables
            refuse_overwriting(str(Path(tables_dir) / f"{name}.parquet"), trace_path, output, option="--tables")
    trace = _open(trace_path)
    series = derive_with_progress(trace, semantics)
    written: list[str] = []
    try:
        if perfetto:
            from harness.view.perfetto import render

            write_atomic(output, render(series))
            written.append(str(output))
        if tables_dir:
            from harness.view.tables import write_tables

            written += [str(p) for p in write_tables(series, tables_dir)]
    except OSError as exc:
        _fail(f"{exc.filename or output or tables_dir}: cannot write ({exc.strerror or exc})")
    for path in written:
        console.print(f"wrote {path}", markup=False)
    console.print(f"exported {plural(len(series.steps), 'step')}, {plural(len(series.requests), 'request')}; "
                  + _verdict(series, trace), markup=False)

