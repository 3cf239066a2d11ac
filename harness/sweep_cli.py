"""``harness sweep [SCENARIO...] --versions A..B | --candidate SPEC [--ray]``:
the command (see ``harness.sweep``).

Exit codes: 0 every scenario that ran is conformant on every candidate; 1 a
violation (or a recording that failed); 2 unusable input (an unknown
scenario, a bad range) or a candidate that could run nothing (its env could
not be built, its spec is bad).
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.candidates.isolated import DEFAULT_STEP_TIMEOUT_S
from harness.progress import progress
from harness.richtext import keep_words_whole
from harness.sweep import (Cell, SweepError, candidate_specs, markdown_table, scenario_names, summary_rows,
                           sweep_exit, sweep_local, verdict_line)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children
    (not the vLLM drivers', grandchildren that are killed, nor a Ray worker's)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _fail(err: Console, message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    sys.exit(2)


def render(results: list[list[Cell]], scenarios: list[str], console: Console) -> None:
    """The table, one row per candidate, its notes (one line each: a
    violation, a crash's or refusal's one line), and the closing verdict line.

    Regression: the table wrapped at 80 columns (every cell two or three lines
    deep): the columns are short now (a release's row fits 80 columns; a long
    ``--candidate`` name widens the table rather than breaking a word), and
    what is long (verdicts, reasons) is a note under it, never cut."""
    table = Table(title=f"sweep of {len(scenarios)} scenario{'s' * (len(scenarios) != 1)}",
                  box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
    table.add_column("candidate", no_wrap=True)
    table.add_column("ran", justify="right", no_wrap=True)
    table.add_column("clean", justify="right", no_wrap=True)
    table.add_column("identical steps", justify="right", no_wrap=True)
    table.add_column("first divergence", overflow="fold")
    table.add_column("s", justify="right", no_wrap=True)
    rows = summary_rows(results)
    for row, cells in zip(rows, results):
        share = row["identical"] / row["golden_steps"] if row["golden_steps"] else 0.0
        same = f"{row['identical']}/{row['golden_steps']} {share:.1%}" if row["golden_steps"] else "-"
        first = "none" if row["first_divergence"] is None else "{}@{}".format(*row["first_divergence"])
        table.add_row(escape(row["candidate"]), f"{row['ran']}/{len(cells)}",
                      str(row["clean"]) if row["ran"] else "-", same,
                      first if row["ran"] else "-", f"{row['seconds']:.0f}")
    console.print(keep_words_whole(table))
    for row in rows:
        for line in row["notes"]:
            console.print(f"{escape(row['candidate'])} {escape(line)}", soft_wrap=True)
    console.print(verdict_line(results), soft_wrap=True)


def join_ray(stack: contextlib.ExitStack, ray_address: str, err: Console, *, enabled: bool) -> None:
    """``--ray [ADDRESS]`` (``local``: a local cluster) joined for the rest
    of ``stack``, with progress while it starts; exit 2 in one line when Ray
    is missing or the cluster cannot be reached."""
    from harness.ray_cluster import RayUnavailable, ray_session

    with progress("starting Ray" if ray_address == "local" else f"joining Ray at {ray_address}",
                  None, enabled=enabled):
        try:
            stack.enter_context(ray_session(None if ray_address == "local" else ray_address))
        except RayUnavailable as exc:
            _fail(err, str(exc))


def ray_option(what: str):
    """``--ray [ADDRESS]``: ``local`` when given without ADDRESS."""
    return click.option(
        "--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
        help=f"Run {what} as a Ray task (the [ray] extra) on the cluster at ADDRESS ('auto', "
             "HOST:PORT, ray://HOST:PORT), or on a local 2-CPU cluster started for the run when no "
             "ADDRESS is given (write --ray=ADDRESS). Same result as without.")


def step_timeout_option(command):
    """``--step-timeout SECONDS`` (as ``harness replay`` has it): the limit on
    one call into an isolated candidate (``module:factory``, ``vllm@``)."""
    def finite(_ctx, _param, value):
        if value is not None and not math.isfinite(value):
            raise click.BadParameter(f"{value} is not a finite number of seconds", param_hint="--step-timeout")
        return value

    return click.option(
        "--step-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_STEP_TIMEOUT_S,
        show_default=True, metavar="SECONDS", callback=finite,
        help="A module:factory candidate runs in its own process; a call into it (or an op of a "
             "vllm@ candidate) that takes longer ends that recording as a hang at that step.")(command)


@click.command("sweep")
@click.argument("scenario_names_given", metavar="[SCENARIO]...", nargs=-1)
@click.option("--versions", metavar="A..B|V1,V2,...|V", default=None,
              help="vLLM releases to sweep (vllm@VERSION each): a range of the known v1-engine "
                   "releases, a comma list or one release; envs are built where missing "
                   "(HARNESS_VLLM_ENVS).")
@click.option("--candidate", "candidates", multiple=True, metavar="SPEC",
              help="A candidate to sweep, as `harness replay --candidate` takes it ('reference', "
                   "'mutant:NAME', 'vllm@VERSION,scheduler_cls=...', 'package.module:factory'); "
                   "repeat it for several, before the --versions releases.")
@ray_option("each candidate")
@step_timeout_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
@click.option("--markdown", "as_markdown", is_flag=True,
              help="Print the fidelity table in Markdown (one row per candidate: scenarios run and "
                   "refused, steps identical, verdicts, every first divergence), then the verdict line.")
def sweep(scenario_names_given: tuple[str, ...], versions: str | None, candidates: tuple[str, ...],
          ray_address: str | None, step_timeout: float, as_json: bool, as_markdown: bool) -> None:
    """Record each canonical SCENARIO (all of them when none is named; a hybrid model's,
    hybrid-alternating, hybrid-five-to-one or hybrid-mamba, when named) with every candidate,
    check it under --semantics auto and compare it step by step with the scenario's golden
    (the reference's recording); print one row per candidate: scenarios run (and refused),
    steps identical to the reference, verdicts, first divergence. Exit 0 all conformant,
    1 a violation, 2 unusable input or a candidate that could run nothing."""
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    console = Console(highlight=False, soft_wrap=True, emoji=False)
    if as_json and as_markdown:
        _fail(err, "--json and --markdown: choose one")
    try:
        scenarios = scenario_names(scenario_names_given)
        specs = candidate_specs(candidates, versions)
    except SweepError as exc:
        _fail(err, str(exc))
    from harness.candidates.resolve import CandidateSpecError, resolve_candidate

    for spec in specs:  # a typo is a usage error here, not a row of failures later
        if spec != "reference" and not spec.startswith("vllm@"):
            try:
                resolve_candidate(spec)
            except CandidateSpecError as exc:
                _fail(err, f"--candidate {spec}: {exc}")
    with contextlib.ExitStack() as stack:
        if ray_address is not None:
            join_ray(stack, ray_address, err, enabled=not as_json)
        with progress(f"sweeping {len(specs)} candidates x {len(scenarios)} scenarios", len(specs),
                      enabled=not as_json) as update:
            on_candidate = lambda _i, _cells: update(advance=1)  # noqa: E731
            if ray_address is not None:
                from harness.sweep_ray import sweep_ray

                results = sweep_ray(specs, scenarios, step_timeout=step_timeout, on_candidate=on_candidate)
            else:
                results = sweep_local(specs, scenarios, step_timeout=step_timeout, on_candidate=on_candidate)
    code = sweep_exit(results)
    if as_json:
        runner = "local" if ray_address is None else "Ray " + (
            "local cluster" if ray_address == "local" else ray_address)
        click.echo(json.dumps({"ok": code == 0, "exit": code, "runner": runner, "scenarios": scenarios,
                               "cpu_seconds": round(cpu_seconds(), 1),
                               "candidates": summary_rows(results),
                               "cells": [c.to_dict() for cells in results for c in cells]}))
    elif as_markdown:
        # The table alone on stdout (``--markdown > table.md`` is the use); the verdict on stderr.
        click.echo(markdown_table([c.to_dict() for cells in results for c in cells]))
        click.echo(verdict_line(results), err=True)
    else:
        render(results, scenarios, console)
    sys.exit(code)
