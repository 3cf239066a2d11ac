"""``harness check`` (one trace, or a corpus: a folder, a glob, several paths;
``harness.corpus``) and ``harness invariants`` (the catalogue it checks).

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.table import Table

from reference.words import plural

from harness.check import PROFILES
from harness.check.invariants import INVARIANTS
from harness.progress import progress
from harness.richtext import keep_words_whole
from harness.cli_common import (EXIT_OK, EXIT_UNUSABLE, _ALLOW_INCOMPLETE, _HTML_REPORT, _REQUIRE_SEALED,
                                _SEMANTICS, _Workers, _checked, _exit_code, _fail,
                                _refuse_report_path, _refuse_unknown_semantics, _report, _unsealed_refusal,
                                _unusable, console)
from harness.trace import TraceError, open_trace


@click.command()
@click.argument("trace_paths", metavar="PATH...", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
@_SEMANTICS
@_HTML_REPORT
@click.option("--workers", type=_Workers(), default="1", show_default=True,
              help="Several traces: processes checking them in parallel; 0 or 'auto': one per CPU.")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Several traces: check them as Ray tasks (the [ray] extra) on the cluster at ADDRESS "
                   "('auto', HOST:PORT, ray://HOST:PORT), or on a local 2-CPU cluster started for the "
                   "run when no ADDRESS is given (put --ray after the paths, or write --ray=ADDRESS).")
@_REQUIRE_SEALED
@_ALLOW_INCOMPLETE
def check(trace_paths: tuple[str, ...], as_json: bool, semantics: str, html_report: str | None,
          workers: int, ray_address: str | None, require_sealed: bool, allow_incomplete: bool) -> None:
    """Check every invariant of a trace from the trace alone.

    Exit 0 conformant, 1 a violation, 2 unusable (or unsealed under
    --require-sealed), 3 an incomplete run (salvaged, crashed, stalled, or a
    recording stopped with requests live) with no violation in the steps it
    has (0 with --allow-incomplete).

    PATH is a trace, a folder (its *.parquet, recursively) or a glob. Several
    traces: one row each (exit, verdict, violations by id, steps, CPU s) and
    the totals, each trace checked as `harness check TRACE` would; the corpus
    exits with its most severe row (0 < 3 < 1 < 2; every trace still reported).
    """
    _refuse_unknown_semantics(semantics)
    if ray_address not in (None, "local") and (Path(ray_address).exists() or "*" in ray_address):
        trace_paths, ray_address = (*trace_paths, ray_address), "local"  # `--ray PATH`: PATH is a trace
    if len(trace_paths) > 1 or not Path(trace_paths[0]).is_file():
        from harness.corpus import expand_corpus

        entries = expand_corpus(trace_paths)
        if len(entries) > 1:
            # Every other option of check goes to each trace's check as it is.
            options = {k: v for k, v in click.get_current_context().params.items() if k not in _CORPUS_OWN}
            _check_corpus(entries, as_json, html_report, workers, ray_address, options)
        if entries[0].error is not None:
            _unusable(entries[0].error, as_json)
        trace_paths = (entries[0].path,)
    trace_path = trace_paths[0]
    _refuse_report_path(html_report, trace_path)
    try:
        trace = open_trace(trace_path)
    except TraceError as exc:
        _unusable(str(exc), as_json)
    refusal = _unsealed_refusal(trace, require_sealed)
    if refusal is not None:
        _unusable(refusal, as_json)
    result, series = _checked(trace, semantics, html_report, as_json)
    if html_report is not None:
        from harness.view.cli import write_report

        write_report(html_report, trace, semantics, series=series)
    code = _exit_code(result.ok, trace, allow_incomplete)
    _report(result, None, as_json, trace, exit_code=code, allow_incomplete=allow_incomplete)
    sys.exit(code)


#: check's parameters corpus mode sets per trace (the rest go to each trace's check as given).
_CORPUS_OWN = ("trace_paths", "as_json", "html_report", "workers", "ray_address")


def check_one_json(path: str, options: dict[str, Any]) -> tuple[int, str, str]:
    """``harness check PATH --json`` with ``options`` (check's other options
    by parameter name; those not given take their defaults), run in this
    process: its exit code, stdout and stderr. The task of every corpus row
    (``harness.corpus``), so a row is what check says of that trace."""
    import io

    params = {p.name: p.default for p in check.params if p.name}
    params.update(options, trace_paths=(path,), as_json=True, html_report=None, workers=1, ray_address=None)
    out, errs = io.StringIO(), io.StringIO()
    code: Any = EXIT_OK
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
        try:
            check.callback(**params)
        except SystemExit as exc:
            code = exc.code
    return (code if isinstance(code, int) else EXIT_UNUSABLE), out.getvalue(), errs.getvalue()


def _check_corpus(entries: list[Any], as_json: bool, html_report: str | None, workers: int,
                  ray_address: str | None, options: dict[str, Any]) -> None:
    """``harness check`` of several traces (``harness.corpus``): rows, totals,
    the corpus exit. ``entries``: ``CorpusEntry`` in input order; one naming
    no trace is a row of its own (exit 2), the others are checked."""
    from harness.corpus import check_local, corpus_dict, corpus_exit, error_row, render_corpus

    paths = [e.path for e in entries if e.error is None]
    if html_report is not None:
        _fail("--report takes one trace; several PATHs (or a folder or glob) name "
              f"{len(paths)} traces")
    with progress("checking traces", len(paths), enabled=not as_json) as update:
        on_row = lambda _i, _row: update(advance=1)  # noqa: E731
        if ray_address is not None:
            from harness.corpus_ray import RayUnavailable, check_ray, init_ray, shutdown

            try:
                started = init_ray(None if ray_address == "local" else ray_address)
            except RayUnavailable as exc:
                _fail(str(exc))
            try:
                rows = check_ray(paths, options, check_one_json, on_row)
            finally:
                if started:
                    shutdown()
            runner = "Ray " + ("local cluster" if ray_address == "local" else ray_address)
        else:
            rows = check_local(paths, options, check_one_json, workers, on_row)
            runner = f"{workers} worker{'s' * (workers != 1)}"
    checked = iter(rows)
    rows = [next(checked) if e.error is None else error_row(e.path, EXIT_UNUSABLE, e.error) for e in entries]
    if as_json:
        click.echo(json.dumps(corpus_dict(rows, runner)))
    else:
        render_corpus(rows, runner, console)
    sys.exit(corpus_exit(rows))


@click.command()
@click.option("--layer", type=click.Choice(["safety", "progress", "semantics"]), help="List one layer only.")
@click.option("--why", is_flag=True, help="Show why each is in its layer instead of its statement.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per line (every field).")
def invariants(layer: str | None, why: bool, as_json: bool) -> None:
    """List the invariant catalogue: id, layer, spec section, statement.

    Safety invariants hold for every correct engine whatever its version
    (nothing corrupts); progress rules too (the engine makes the progress it
    can; every profile but 'safety' checks them, and 'fork' checks only
    these two layers); semantics rules are one vLLM version's design,
    checked under the profiles that have them (see --semantics of check)."""
    chosen = [inv for inv in INVARIANTS.values() if layer is None or inv.layer == layer]
    if as_json:
        for inv in chosen:
            profiles = [p.name for p in PROFILES.values() if p.checks(inv.id)]
            click.echo(json.dumps({"id": inv.id, "layer": inv.layer, "spec": inv.spec,
                                   "statement": inv.statement, "why": inv.why, "profiles": profiles}))
        return
    table = Table("id", "layer", "spec", "why" if why else "statement")
    for column in table.columns[:2]:
        column.no_wrap = True  # ids and layers whole, so they can be grepped
    for inv in chosen:
        table.add_row(inv.id, inv.layer, inv.spec, inv.why if why else inv.statement)
    console.print(keep_words_whole(table))
    count = {name: sum(inv.layer == name for inv in chosen) for name in ("safety", "progress", "semantics")}
    console.print(f"{plural(len(chosen), 'invariant')}: {count['safety']} safety, {count['progress']} progress, "
                  f"{count['semantics']} semantics")
