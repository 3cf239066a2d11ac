"""``harness fuzz``: generated (or a scenario file's) workloads against a candidate
(``harness.fuzz``), locally or on Ray, and its witnesses.

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reference.config import ConfigError
from reference.candidate import CandidateFactory
from reference.words import plural
from reference.workload import WorkloadError
from workloads.scenario import load_scenario

from harness.check import ProfileError
from harness.progress import progress
from harness.cli_common import (EXIT_FOUND, EXIT_OK, _Workers, _candidate, _fail, _finite_or_none,
                                _step_timeout, console, err, semantics_option)


def _fuzz_base(path: str):
    """The FuzzCase of scenario file ``path`` (``harness fuzz --scenario``); exit 2 if unusable."""
    from harness.fuzz import FuzzCase

    try:
        scenario = load_scenario(path)
        scenario.engine_config()
    except WorkloadError as exc:
        _fail(str(exc))
    except ConfigError as exc:
        _fail(f"{path}: bad config: {exc}")
    if scenario.workload.actions:
        _fail(f"{path}: --scenario takes no [[actions]] yet (subsets of requests only)")
    return FuzzCase(scenario.engine_config().to_dict(), scenario.workload.requests, scenario.seed)


@click.command()
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to fuzz: 'reference', 'mutant:NAME', 'vllm@VERSION' (a release; build its env with `harness vllm-env VERSION`), 'vllm@PATH' (the vLLM a Python interpreter or venv at PATH imports), either with ',scheduler_cls=package.module:Class' (a vLLM Scheduler subclass, found on PYTHONPATH) "
                   "or 'package.module:factory'.")
@click.option("--max-examples", type=click.IntRange(min=1), default=200, show_default=True,
              help="Generated scenarios to try, shared equally by the workers (shrinking runs come "
                   "on top).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Hypothesis seed: the same seed generates the same scenarios (worker i > 0 uses "
                   "a seed derived from it and i).")
@click.option("--time-budget", type=click.FloatRange(min=0, min_open=True), default=None,
              callback=lambda _ctx, _param, value: _finite_or_none(value, "--time-budget"),
              metavar="SECONDS", help="Each worker stops after this many seconds, generation and "
                                      "shrinking together (a failure found is reported as far as it "
                                      "was shrunk; a candidate's call gets at most what is left).")
@click.option("--shrink-budget", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              callback=lambda _ctx, _param, value: _finite_or_none(value, "--shrink-budget"),
              metavar="SECONDS", help="Each worker stops shrinking its failure after this many seconds "
                                      "(a hanging candidate makes every shrink step wait --step-timeout).")
@click.option("--workers", type=_Workers(), default="1", show_default=True,
              help="Processes fuzzing in parallel, each with its own seed and share of "
                   "--max-examples; 0 or 'auto': one per available CPU. With --ray: the Ray tasks "
                   "(default: one per CPU of the cluster).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="local", default=None, metavar="[ADDRESS]",
              help="Run the workers as Ray tasks (the [ray] extra) on the cluster at ADDRESS ('auto', "
                   "HOST:PORT, ray://HOST:PORT), or on a local 2-CPU cluster started for the run when no "
                   "ADDRESS is given (write --ray=ADDRESS). Same seeds and shares as --workers: the same "
                   "findings for the same arguments.")
@click.option("--report-known", is_flag=True, default=False,
              help="Report the known reference findings (harness.fuzz.KNOWN_REFERENCE_FINDINGS, each "
                   "mirroring vLLM 0.33.0) like any failure, instead of passing over them.")
@click.option("--scenario", "scenario_path", default=None, type=click.Path(dir_okay=False),
              metavar="FILE", help="Instead of generated scenarios, try FILE (a scenario file) and "
                                   "subsets of its requests: a failure shrinks to the fewest requests "
                                   "that still fail (a bug report's workload cut down).")
@click.option("--async-spec", is_flag=True, default=False,
              help="Only async scheduling with speculative decoding (1-3 drafts, two batches in "
                   "flight); the default strategy never draws it (a new draw would shift every "
                   "generated example).")
@click.option("--hybrid", is_flag=True, default=False,
              help="Only hybrid models' KV caches: sliding-window or Mamba (linear_attention) layers beside "
                   "full attention, pools sized by vLLM's start-up check; the default strategy never draws "
                   "them (a new draw would shift every generated example).")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(),
              help="Folder for the minimal failing traces (Parquet) and their JSON descriptions.")
@semantics_option("every rule of the version the reference mirrors, and its decisions compared with the "
                  "reference's", "Under any but 'auto' only violations, crashes and stalls are findings, a "
                  "decision that differs from the reference's never is.")
@_step_timeout
def fuzz(candidate: str, max_examples: int, seed: int, time_budget: float | None, shrink_budget: float | None,
         workers: int, ray_address: str | None, report_known: bool, scenario_path: str | None,
         async_spec: bool, hybrid: bool, out_dir: str, semantics: str, step_timeout: float) -> None:
    """Fuzz CANDIDATE with small generated scenarios (hypothesis): check every invariant and,
    for a candidate other than the reference, compare its decisions with the reference's.

    With --workers N, N processes fuzz at once (worker 0 with --seed, worker i with a seed
    derived from --seed and i), each on its share of --max-examples; without --time-budget the
    outcome depends only on the arguments. Each worker stops at its first failure, which is
    shrunk and written to OUT_DIR as a replayable trace plus a JSON description (workers that
    shrink to the same scenario share one). A scenario on which the reference itself shows a
    known finding (a documented vLLM 0.33.0 behaviour, e.g. the KV-connector wedge) is passed
    over and counted in the summary, unless --report-known. A drawn config the candidate
    refuses (e.g. async scheduling for a plain Scheduler subclass) is skipped and counted,
    never a finding. Ctrl-C (or SIGTERM) while a failure is being shrunk reports the smallest
    failing scenario found so far, as a finding. Exit 0 nothing found, 1 something found, 2 bad
    arguments."""
    from harness.fuzz import fuzz_parallel
    from harness.fuzz.run import fuzz_profile

    try:
        fuzz_profile(semantics)
    except ProfileError as exc:
        _fail(str(exc))

    factory = _candidate(candidate, step_timeout)
    from harness.fuzz.witness import witness_names
    from harness.paths import OutputPathError, check_output_folder

    try:  # before any fuzzing: a finding must not be lost to an unwritable -o
        check_output_folder(out_dir, tuple(witness_names(candidate, seed, min(workers, max_examples))))
    except OutputPathError as exc:
        _fail(str(exc))
    if async_spec and scenario_path is not None:
        _fail("--async-spec does not apply to --scenario (the scenario file carries its config)")
    if hybrid and scenario_path is not None:
        _fail("--hybrid does not apply to --scenario (the scenario file carries its config)")
    base = _fuzz_base(scenario_path) if scenario_path is not None else None
    with contextlib.ExitStack() as stack:
        run_workers: Any = fuzz_parallel
        if ray_address is not None:
            run_workers, workers = _fuzz_on_ray(stack, ray_address, workers)
        _fuzz_run(run_workers, candidate, factory, workers, ray_address, max_examples, seed, time_budget,
                  shrink_budget, report_known, base, async_spec, out_dir, semantics, step_timeout, hybrid)


def _fuzz_on_ray(stack: contextlib.ExitStack, ray_address: str, workers: int) -> tuple[Any, int]:
    """Join or start the cluster for ``fuzz --ray`` (left or stopped when
    ``stack`` closes); the run function and the number of workers (the
    cluster's CPUs unless --workers was given)."""
    from harness.fuzz.parallel_ray import fuzz_ray
    from harness.ray_cluster import RayUnavailable, cluster_cpus, init_ray, shutdown

    with progress("starting Ray" if ray_address == "local" else f"joining Ray at {ray_address}", None):
        try:
            started = init_ray(None if ray_address == "local" else ray_address)
        except RayUnavailable as exc:
            _fail(str(exc))
    if started:
        stack.callback(shutdown)
    if click.get_current_context().get_parameter_source("workers") is click.core.ParameterSource.DEFAULT:
        workers = cluster_cpus()
    return fuzz_ray, workers


def _fuzz_run(run_workers: Any, candidate: str, factory: CandidateFactory | None, workers: int,
              ray_address: str | None, max_examples: int, seed: int, time_budget: float | None,
              shrink_budget: float | None, report_known: bool, base: Any, async_spec: bool, out_dir: str,
              semantics: str, step_timeout: float, hybrid: bool = False) -> None:
    """The campaign of ``harness fuzz`` on ``run_workers`` (``fuzz_parallel``
    or ``fuzz_ray``), its summary, witnesses and exit."""
    from harness.fuzz import FuzzWorkerError, WorkerProgress, write_witnesses
    from harness.fuzz.report import render_summary, render_witnesses

    workers = min(workers, max_examples)  # neither runner uses more
    where = " on Ray" if ray_address is not None else ""
    label = f"{candidate}" + (f" on {workers} workers{where}" if workers > 1 else where)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} examples"), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task(f"fuzzing {label}", total=max_examples)

        def on_progress(states: list[WorkerProgress]) -> None:
            shrinking = sum(1 for w in states if w.shrinking and not w.done)
            done = sum(1 for w in states if w.done)
            if len(states) == 1:
                what = f"shrinking {label}" if shrinking else f"fuzzing {label}"
            else:
                what = f"fuzzing {label}" + "".join(
                    f", {k} {word}" for k, word in ((shrinking, "shrinking"), (done, "done")) if k)
            progress.update(task, completed=sum(min(w.examples, w.share) for w in states),
                            description=what)
        try:
            result = run_workers(candidate, workers=workers, max_examples=max_examples, seed=seed,
                                 time_budget_s=time_budget, on_progress=on_progress,
                                 skip_known=not report_known, base=base, async_spec=async_spec,
                                 step_timeout=step_timeout, semantics=semantics,
                                 shrink_budget_s=shrink_budget, hybrid=hybrid)
        except FuzzWorkerError as exc:
            _fail(str(exc))
    render_summary(result, candidate, seed, console)
    if not result.found:
        console.print("[bold green]nothing found[/]")
        sys.exit(EXIT_OK)
    try:
        witnesses = write_witnesses(out_dir, candidate, factory, result, semantics)
    except OSError as exc:  # the folder changed under the run (checked above): keep the finding
        for w in result.found:
            click.echo(json.dumps({"worker": w.worker, "failure": w.result.failure.to_dict(),
                                   "scenario": w.result.case.to_dict()}, default=str))
        _fail(f"{out_dir}: cannot write the witness ({exc.strerror or exc}); the failing scenario "
              f"is printed above as JSON")
    render_witnesses(result, witnesses, console)
    console.print(f"found: {plural(len(witnesses), 'witness')} written to {out_dir}",
                  style="bold red", markup=False)
    sys.exit(EXIT_FOUND)
