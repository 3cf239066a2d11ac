"""``harness record`` and ``harness verify-outputs``: record a workload on an engine
(``harness.trace.recorder``), and check a torch recording's tokens (``harness.outputs``).

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reference.config import ConfigError
from reference.candidate import CandidateError, CandidateRefused, crash_site
from reference.engine import check_workload_supported
from reference.words import plural
from reference.workload import WorkloadError
from workloads.scenario import is_scenario_path, load_scenario

from harness.trace.recorder import record as record_run, record_inputs, requests_ended
from harness.trace import TraceError
from harness.cli_common import (EXIT_FOUND, EXIT_OK, _candidate, _fail, _open, _parse_sets,
                                _refuse_overwriting_input, _step_timeout, console, err)


@click.command()
@click.argument("workload")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Trace file to write (Parquet). Written to a temp file, renamed on success.")
@click.option("--limit", type=click.IntRange(min=1), help="Use the first N requests of the workload.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Divide arrival times by X (X=10: ten times the load).")
@click.option("--seed", type=int, default=None,
              help="Seed for synthesized prompt tokens and the scripted model [default: 0, or a "
                   "scenario file's seed; there it seeds only the model: a scenario's prompt_len "
                   "tokens are seeded by name].")
@click.option("--priority-levels", type=click.IntRange(min=1), default=1, show_default=True,
              help="Give requests seeded random priorities in [0, N) (for --set policy=priority).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Engine config (vLLM names): num_gpu_blocks, block_size, max_num_seqs, "
                   "max_num_batched_tokens, max_model_len, policy (fcfs|priority), "
                   "enable_prefix_caching, enable_chunked_prefill, long_prefill_token_threshold, "
                   "async_scheduling, pipeline_parallel_size (batches in flight derive from these "
                   "two, as in vLLM), ...")
@click.option("--stop-on-eos", is_flag=True,
              help="Make trace requests end on EOS at their recorded output length (max_tokens "
                   "doubled) instead of on max_tokens with ignore_eos.")
@click.option("--engine", default="reference", show_default=True,
              help="Engine to record: 'reference', 'mutant:NAME' (a deliberately broken one), "
                   "'vllm@VERSION' (a release; build its env with `harness vllm-env VERSION`), 'vllm@PATH' (the vLLM a Python interpreter or venv at PATH imports), either with ',scheduler_cls=package.module:Class' (a vLLM Scheduler subclass, found on PYTHONPATH) "
                   "or 'package.module:factory'.")
@click.option("--model", type=click.Choice(["scripted", "torch"]), default="scripted", show_default=True,
              help="Model runner: 'scripted' (seeded tokens, decisions only) or 'torch' (a tiny "
                   "transformer with a paged KV cache; needs torch). The trace records what it produced.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default=None,
              help="Device of the torch model (default auto: CUDA when present).")
@click.option("--kv-integrity", is_flag=True,
              help="Torch model: compare every K/V read with the dense computation; report the "
                   "first corrupted block with its owner history (exit 1).")
@click.option("--verify-outputs", is_flag=True,
              help="Torch model: after recording, compare every request's tokens with a dense, "
                   "unbatched greedy forward (exit 1 on a mismatch).")
@_step_timeout
@click.option("--traceback", "show_traceback", is_flag=True,
              help="When the candidate raises (its factory, or a step), print its full Python "
                   "traceback to stderr too (the report names only the innermost file and line).")
def record(workload: str, output: str, limit: int | None, time_scale: float, seed: int | None,
           priority_levels: int, sets: tuple[str, ...], stop_on_eos: bool, engine: str,
           model: str, device: str | None, kv_integrity: bool, verify_outputs: bool,
           step_timeout: float, show_traceback: bool) -> None:
    """Run WORKLOAD on the engine and write its step trace.

    WORKLOAD is an Azure LLM inference CSV, a Mooncake JSONL,
    'synthetic[:N]', or a scenario file (.toml or .json,
    docs/scenario-format.md: it carries its config; --set still overrides).
    """
    _refuse_overwriting_input(output, workload)
    factory = _candidate(engine, step_timeout)
    runner_factory = None
    if model != "torch":
        used = [flag for flag, on in (("--device", device is not None), ("--kv-integrity", kv_integrity),
                                      ("--verify-outputs", verify_outputs)) if on]
        if used:
            _fail(f"{', '.join(used)} need(s) --model torch")
    else:
        from harness.outputs import OutputsError, torch_runner_factory

        try:
            runner_factory = torch_runner_factory(device or "auto", kv_integrity)
        except OutputsError as exc:
            _fail(str(exc))
    try:
        if is_scenario_path(workload):
            loader_flags = [flag for flag, on in (("--limit", limit is not None), ("--time-scale", time_scale != 1.0),
                                                  ("--priority-levels", priority_levels != 1),
                                                  ("--stop-on-eos", stop_on_eos)) if on]
            if loader_flags:
                _fail(f"{workload}: {', '.join(loader_flags)} do(es) not apply to a scenario file "
                      f"(write it in the file)")
            scenario = load_scenario(workload)
            wl = scenario.workload
            seed = scenario.seed if seed is None else seed
            config = scenario.engine_config(_parse_sets(sets))
        else:
            seed = 0 if seed is None else seed
            config, wl = record_inputs(workload, _parse_sets(sets), limit=limit, time_scale=time_scale,
                                       seed=seed, priority_levels=priority_levels, stop_on_eos=stop_on_eos)
        check_workload_supported(config, wl)
    except ConfigError as exc:
        _fail(f"bad config: {exc}")
    except (WorkloadError, OSError) as exc:
        _fail(str(exc))
    total = len(wl.requests)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} requests done"),
                  TextColumn("step {task.fields[step]}"), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("recording", total=total, step=0)
        done = 0

        def on_progress(rec) -> None:
            nonlocal done
            done += requests_ended(rec)
            if rec.step % 64 == 0:
                progress.update(task, completed=done, step=rec.step)
        crashes: list[BaseException] = []
        try:
            summary = record_run(wl, config, output, seed=seed, engine=engine,
                                 candidate_factory=factory, on_progress=on_progress,
                                 runner_factory=runner_factory,
                                 model=runner_factory.metadata() if runner_factory else None,
                                 on_crash=crashes.append)
        except CandidateError as exc:
            if isinstance(exc.__cause__, CandidateRefused):
                # The candidate cannot run this config: unusable input, not a finding.
                _fail(f"{engine} refused the run: {exc.__cause__} (no trace written)")
            cause = exc.__cause__ or exc
            # Where the candidate's code raised (not the engine's own check of what a factory returned).
            # (An isolated candidate's exception names its own site: ``crash_where``.)
            where = (cause.crash_where if hasattr(cause, "crash_where")
                     else crash_site(cause.__traceback__))
            where = "" if not where or where.startswith("reference/engine.py") else f" (at {where})"
            progress.stop()
            if show_traceback:
                _print_traceback(cause)
            err.print(f"[bold red]error:[/] {engine}: {escape(str(exc))}{escape(where)} (no trace written)",
                      soft_wrap=True)
            sys.exit(EXIT_FOUND)
        except ValueError as exc:
            if runner_factory is None:
                raise
            _fail(f"--model torch: {exc}")
        except OSError as exc:  # no space left, a vanished folder, ...: the temp file is gone
            _fail(f"{output}: cannot write the trace: {exc.strerror or exc}")
    console.print(f"recorded [bold]{output}[/]: {plural(summary.steps, 'step')}, "
                  f"{plural(summary.requests, 'request')} "
                  f"({summary.finished} finished, {summary.rejected} rejected, {summary.aborted} aborted), "
                  f"{plural(summary.preemptions, 'preemption')}, "
                  f"{plural(summary.prefix_hit_tokens, 'prefix-hit token')}, "
                  + (f"{plural(summary.remote_kv_loads, 'remote KV load')} ({summary.failed_kv_loads} failed), "
                     if summary.remote_kv_loads else "")
                  + f"{summary.clock:.2f} s virtual time")
    found = False
    if runner_factory is not None:
        found = _torch_report(runner_factory, output, kv_integrity, verify_outputs)
    if summary.stalled:
        err.print(f"[bold red]engine stalled:[/] {summary.stalled} (the trace ends there)")
        sys.exit(EXIT_FOUND)
    if summary.crashed:
        if show_traceback and crashes:
            _print_traceback(crashes[0].__cause__ or crashes[0])
        err.print(f"[bold red]engine crashed:[/] {engine}: {escape(summary.crashed)} "
                  f"(the trace ends there; harness check reports ENGINE-CRASH)", soft_wrap=True)
        sys.exit(EXIT_FOUND)
    sys.exit(EXIT_FOUND if found else EXIT_OK)


def _print_traceback(exc: BaseException) -> None:
    """The candidate's exception with its whole traceback, on stderr (``--traceback``)."""
    import traceback

    # An isolated candidate's exception stands for the one its process raised.
    text = getattr(exc, "crash_traceback", "") or "".join(traceback.format_exception(exc))
    err.print(text.rstrip(), markup=False, highlight=False)


def _torch_report(runner_factory: Any, output: str, kv_integrity: bool, verify_outputs: bool) -> bool:
    """Print the torch runner's figures, integrity findings and the output
    oracle's result; True when anything was found."""
    from harness.outputs import OutputsError, render_outputs, render_torch_run, verify_trace_outputs

    found = render_torch_run(runner_factory, kv_integrity, console)
    if verify_outputs:
        try:
            report = verify_trace_outputs(_open(output), str(runner_factory.device.type))
        except OutputsError as exc:
            _fail(str(exc))
        found |= render_outputs(report, console)
    return found


@click.command("verify-outputs")
@click.argument("trace_path", metavar="TRACE")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Device for the dense forward.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
def verify_outputs_cmd(trace_path: str, device: str, as_json: bool) -> None:
    """Check a trace recorded with --model torch: every request's tokens must equal greedy
    generation by the same model over its prompt alone (dense, unbatched, unpaged).

    Exit 0 all equal, 1 a mismatch, 2 unusable trace (not a torch trace, no torch, no such device)."""
    from harness.outputs import OutputsError, render_outputs, verify_trace_outputs

    trace = _open(trace_path)
    try:
        report = verify_trace_outputs(trace, device)
    except OutputsError as exc:
        _fail(str(exc))
    except TraceError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps({"trace": str(trace.path), **report.to_dict()}))
    else:
        render_outputs(report, console)
    sys.exit(EXIT_OK if report.ok else EXIT_FOUND)
