"""``harness bisect SCENARIO|TRACE --versions A..B``: the command (see ``core``).

Exit codes: 0 every release that ran is clean with the same decisions as the
one before it; 1 a verdict or the decisions change somewhere (the row named
on the last line); 2 unusable input (a bad range, an unreadable scenario or
trace, no release could run it).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from harness.bisect.core import BisectError, BisectResult, parse_versions, run_bisect
from harness.richtext import keep_words_whole
from harness.sweep_cli import join_ray, ray_option, step_timeout_option


def _fail(err: Console, message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    sys.exit(2)


def _canonical_hint(source: str, err: Console) -> None:
    """A missing SOURCE that is a canonical (or hybrid) scenario's name, as `harness sweep`
    takes it: one line naming its file (regression:
    test_regression_bisect_scenario_name_said_no_such_file)."""
    from harness.scenarios import DIRECTORY, HYBRID_DIRECTORY, HYBRID_SCENARIOS, SCENARIOS

    name = source[:-len(".toml")] if source.endswith(".toml") else source
    for names, folder in ((SCENARIOS, DIRECTORY), (HYBRID_SCENARIOS, HYBRID_DIRECTORY)):
        if name in names:
            path = folder / f"{name}.toml"
            try:
                path = Path(os.path.relpath(path))
            except ValueError:  # another drive
                pass
            _fail(err, f"{source}: no such file; the canonical scenario {name!r} is {path}: "
                       f"harness bisect {path} --versions ...")


def _inputs(source: str, err: Console):
    """(workload, config, seed) of a scenario file or of a trace's inputs."""
    from reference.config import ConfigError
    from reference.workload import WorkloadError
    from workloads.scenario import is_scenario_path, load_scenario

    from harness.replay import workload_from_trace
    from harness.trace import TraceError, open_trace

    if not os.path.exists(source):
        _canonical_hint(source, err)
    try:
        if is_scenario_path(source):
            scenario = load_scenario(source)
            return scenario.workload, scenario.engine_config({}), scenario.seed
        from reference.config import EngineConfig

        from reference.engine import check_config_supported

        trace = open_trace(source)
        try:
            config = EngineConfig.from_dict(trace.meta["config"])
            check_config_supported(config)
        except ConfigError as exc:  # not "ConfigError: ..." from the last resort (trial finding)
            _fail(err, f"{source}: bad config in trace metadata: {exc}")
        return workload_from_trace(trace), config, int(trace.meta["seed"])
    except (ConfigError, WorkloadError, TraceError, OSError) as exc:
        _fail(err, str(exc))
    raise AssertionError


def _divergence_text(row) -> str:
    if row.same_as_previous is None:
        return "-" if row.status != "ran" else "(first)"
    if row.same_as_previous:
        return f"same as {row.compared_with}"
    d = row.divergence or {}
    where = " ".join(str(p) for p in (d.get("step"), d.get("kind"), d.get("request")) if p not in (None, ""))
    return f"vs {row.compared_with}: step {where} {d.get('field')}: {d.get('a')!s:.40} -> {d.get('b')!s:.40}"


def render(result: BisectResult, console: Console) -> None:
    """The table, one row per release, and the closing verdict line."""
    table = Table(title=f"bisect {result.source}"
                  + (f" (scheduler_cls {result.scheduler_cls})" if result.scheduler_cls else ""))
    for col in ("release", "verdict", "profile", "steps", "decisions", "s"):
        table.add_column(col, overflow="fold")
    for row in result.rows:
        verdict = row.verdict if row.status == "ran" else f"{row.status}: {row.reason}"
        table.add_row(row.version, verdict, row.profile or "-", str(row.steps or "-"),
                      _divergence_text(row), f"{row.seconds:.0f}")
    console.print(keep_words_whole(table))  # a piped table wrapped OUTPUT-ONLY-COMPLET|E
    console.print(verdict_line(result), soft_wrap=True)


def verdict_line(result: BisectResult) -> str:
    ran = [r for r in result.rows if r.status == "ran"]
    change = result.first_change
    head = f"{len(ran)} of {len(result.rows)} releases ran"
    if len(ran) == 1:  # regression: read "no change from 0.33.0 to 0.33.0" and exited 0
        return f"{head}: only {ran[0].version} ({ran[0].verdict}), nothing to compare it with"
    if change is None:
        last = ran[-1].verdict if ran else "-"
        return f"{head}: no change from {ran[0].version} to {ran[-1].version} ({last})" if ran else head
    what = []
    prev = next(r for r in result.rows if r.version == change.compared_with)
    if change.verdict != prev.verdict:
        what.append(f"verdict {prev.verdict} -> {change.verdict}")
    if not change.same_as_previous:
        d = change.divergence or {}
        what.append(f"decisions diverge at step {d.get('step')}")
    return f"{head}: first change at {change.version} (since {prev.version}): {'; '.join(what)}"


@click.command("bisect")
@click.argument("source", metavar="SCENARIO|TRACE")
@click.option("--versions", required=True, metavar="A..B|V1,V2,...",
              help="Releases to run: a range of the known v1-engine releases (0.10.0..0.33.0, "
                   "four-part ones included) or a comma list.")
@click.option("--candidate-class", "scheduler_cls", metavar="package.module:Class", default=None,
              help="Run this vLLM Scheduler subclass on every release (found on PYTHONPATH), "
                   "as vllm@VERSION,scheduler_cls=... does.")
@ray_option("each release")
@step_timeout_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def bisect(source: str, versions: str, scheduler_cls: str | None, ray_address: str | None,
           step_timeout: float, as_json: bool) -> None:
    """Record SCENARIO (or TRACE's inputs) on each vLLM release of --versions, building
    envs as needed (HARNESS_VLLM_ENVS), check each under its own profile and compare its
    decisions with the previous release's; name the first release where the verdict or
    the decisions change. Exit 0 no change, 1 a change, 2 unusable input (or fewer than two
    releases could run it: nothing compared)."""
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    console = Console(highlight=False, soft_wrap=True, emoji=False)
    try:
        chosen = parse_versions(versions)
    except BisectError as exc:
        _fail(err, str(exc))
    if scheduler_cls is not None:
        from harness.candidates.vllm.spec import VLLMSpecError, normalise_class_name

        try:
            scheduler_cls = normalise_class_name(scheduler_cls)
        except VLLMSpecError as exc:
            _fail(err, f"--candidate-class: {exc}")
    workload, config, seed = _inputs(source, err)
    from harness.candidates.vllm.env import envs_root, is_ready

    # Say up front which envs a range will build (minutes, disk), piped or not: this machine's
    # (a local Ray cluster's nodes are this machine); a joined cluster's nodes each build their own.
    if ray_address is None or ray_address == "local":
        to_build = [v for v in chosen if not is_ready(v)]
        if to_build:
            err.print(f"bisect: building the vLLM env of {len(to_build)} release(s) not yet built under "
                      f"{envs_root()}: {', '.join(to_build)} (35-90 s and 16-170 MB each)", soft_wrap=True)
    else:
        err.print(f"bisect: on Ray at {ray_address}, a node lacking a release's vLLM env builds it first "
                  f"(35-90 s and 16-170 MB each, under that node's HARNESS_VLLM_ENVS)", soft_wrap=True)
    with contextlib.ExitStack() as stack:
        if ray_address is not None:
            join_ray(stack, ray_address, err, enabled=err.is_terminal)
        with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total} releases"), TimeElapsedColumn(),
                      console=err, transient=True, disable=not err.is_terminal) as progress:
            task = progress.add_task("bisect" + (" on Ray" if ray_address else ""), total=len(chosen))

            def on_row(version, row) -> None:
                if row is None:
                    progress.update(task, description=f"vLLM {version}")
                else:
                    progress.advance(task)

            if ray_address is not None:
                from harness.bisect.parallel_ray import bisect_ray

                result = bisect_ray(source, workload, config, seed, chosen, scheduler_cls=scheduler_cls,
                                    step_timeout=step_timeout, on_row=on_row)
            else:
                result = run_bisect(source, workload, config, seed, chosen, scheduler_cls=scheduler_cls,
                                    step_timeout=step_timeout, on_row=on_row,
                                    log=lambda line: progress.update(task, description=line[:60]))
    if not any(r.status == "ran" for r in result.rows):
        reasons = "; ".join(f"{r.version}: {r.reason}" for r in result.rows)
        _fail(err, f"{source}: no release could run it ({reasons[:400]})")
    if as_json:
        click.echo(json.dumps(result.to_dict(), default=str))
    else:
        render(result, console)
    if sum(r.status == "ran" for r in result.rows) < 2:
        sys.exit(2)  # one release: no bisection happened
    sys.exit(0 if result.first_change is None else 1)
