"""The serving commands: ``harness model tiny``, ``harness serve-record``, ``harness vllm-env --serving``.

Registered on ``harness.cli.main`` by ``register(main)`` (``harness/cli.py``); the
shared consoles and steps come from ``harness.cli_common``. Exit codes as everywhere: 0 ok, 1 violation found (or the
engine crashed), 2 unusable input or an engine/server that could not be run, with
a one-line message; 130 on Ctrl-C (after the server is stopped).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from reference.config import ConfigError
from reference.words import plural
from reference.workload import WorkloadError

from harness.cli_common import semantics_option


def _consoles():
    from harness.cli_common import console, err

    return console, err


def _fail(message: str) -> None:
    from harness.cli_common import _fail as fail

    fail(message)


def build_serving_env(force: bool) -> None:
    """``harness vllm-env --serving``: build (or find) the CPU serving env; print its Python."""
    from harness.candidates.vllm.env import VLLMEnvError
    from harness.serve.env import ensure_serving_env

    console, err = _consoles()
    try:
        python = ensure_serving_env(log=lambda line: err.print(f"[dim]vllm-env:[/] {escape(line)}"),
                                    force=force)
    except VLLMEnvError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot build the serving env: {exc}")
    console.print(str(python))


@click.group("model")
def model_group() -> None:
    """Models for a real vLLM engine (no hub needed)."""


@model_group.command("tiny")
@click.option("-o", "--output", "output", required=True, type=click.Path(file_okay=False),
              help="Folder to write (config.json, generation_config.json, model.safetensors).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random weights.")
@click.option("--arch", type=click.Choice(["llama", "qwen2", "opt"]), default="llama", show_default=True,
              help="Architecture (transformers' LlamaForCausalLM, Qwen2ForCausalLM, OPTForCausalLM).")
@click.option("--vocab", type=int, default=32000, show_default=True,
              help="Vocabulary size (prompt token ids must be below it; the workloads' are below 32000).")
@click.option("--force", is_flag=True, help="Replace a non-empty OUTPUT folder.")
def model_tiny(output: str, seed: int, arch: str, vocab: int, force: bool) -> None:
    """Write a tiny random-weight causal LM (2 layers, hidden 256, bf16) with save_pretrained.

    Deterministic: the same seed, arch and vocab give the same bytes (the sha256
    printed is over the files). Runs in the serving env, which it builds first
    when it is missing (as `harness vllm-env --serving`: once, typically 2-5 min,
    with progress).
    """
    from harness.candidates.vllm.env import VLLMEnvError
    from harness.serve.model import ModelError, build_tiny_model, check_tiny_model_args

    console, err = _consoles()
    try:
        check_tiny_model_args(output, arch=arch, vocab=vocab, force=force)  # before a build of minutes
        _serving_env_with_progress()
        with err.status(f"writing a tiny {arch} model", spinner="dots") if err.is_terminal else _null():
            info = build_tiny_model(output, seed=seed, arch=arch, vocab=vocab, force=force)
    except (ModelError, VLLMEnvError) as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot build the serving env: {exc}")
    console.print(f"wrote {info['path']}: {arch}, {info['parameters']:,} parameters, "
                  f"{info['bytes'] / 1e6:.1f} MB, sha256 {info['sha256'][:16]}")


def _serving_env_with_progress() -> Path:
    """The serving env's Python, building it first when it is missing: a line
    saying so, each build stage on stderr and a spinner with the elapsed time
    (regression, issue 27: `harness model tiny` failed until it was built by
    hand). Raises VLLMEnvError."""
    from harness.progress import progress
    from harness.serve.env import ensure_serving_env, serving_env_dir, serving_env_ready

    _, err = _consoles()
    if serving_env_ready():
        return ensure_serving_env()
    err.print(f"the CPU serving env is not built: building it at {escape(str(serving_env_dir()))} first "
              f"(once; typically 2-5 min)", soft_wrap=True)
    with progress("building the CPU serving env", None) as update:
        def log(line: str) -> None:
            err.print(f"[dim]vllm-env:[/] {escape(line)}", soft_wrap=True)
            update(description=f"building the CPU serving env: {line}")
        return ensure_serving_env(log=log)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def default_model() -> Path:
    """The tiny llama (seed 0, vocab 32000) serve-record uses without --model; built once."""
    from harness.serve.env import serving_env_dir
    from harness.serve.model import build_tiny_model

    path = serving_env_dir().parent / f"{serving_env_dir().name}-tiny-llama-s0"
    if not (path / "config.json").is_file():
        build_tiny_model(path, seed=0, arch="llama", force=True)
    return path


def load_serve_inputs(workload: str, sets: dict[str, str], limit, time_scale, seed, priority_levels,
                      stop_on_eos):
    """(config, workload, seed) as ``harness record`` loads them, block_size 32 unless set."""
    from workloads.scenario import is_scenario_path, load_scenario

    from harness.trace.recorder import record_inputs

    sets = dict(sets)
    if is_scenario_path(workload):
        scenario = load_scenario(workload)
        if "block_size" not in sets and scenario.engine_config().block_size == 16:
            sets["block_size"] = "32"
        return scenario.engine_config(sets), scenario.workload, scenario.seed if seed is None else seed
    sets.setdefault("block_size", "32")
    seed = 0 if seed is None else seed
    config, wl = record_inputs(workload, sets, limit=limit, time_scale=time_scale, seed=seed,
                               priority_levels=priority_levels, stop_on_eos=stop_on_eos)
    return config, wl, seed


@click.command("serve-record")
@click.argument("workload")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Trace to write (Parquet); T.jsonl (the recording) and T.log (vLLM's log) go beside it.")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Model folder [default: a tiny llama, seed 0, built once beside the serving env].")
@click.option("--offline", is_flag=True,
              help="vLLM's in-process engine instead of a server: arrivals at exact steps, deterministic.")
@click.option("--limit", type=click.IntRange(min=1), help="Use the first N requests of the workload.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Divide arrival times by X.")
@click.option("--seed", type=int, default=None, help="Seed of the prompts and of vLLM [default 0].")
@click.option("--priority-levels", type=click.IntRange(min=1), default=1, show_default=True,
              help="Seeded random priorities in [0, N) (with --set policy=priority).")
@click.option("--stop-on-eos", is_flag=True, help="Requests may end on EOS (ignore_eos off).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Engine config, vLLM's names (num_gpu_blocks, block_size (default 32 on CPU), "
                   "max_model_len, max_num_seqs, max_num_batched_tokens, policy, async_scheduling "
                   "(vLLM forces it off on CPU: kept on with --offline, or on a server under "
                   "SCHED_HARNESS_CPU_ASYNC=1; testing only), ...).")
@click.option("--time-limit", type=click.FloatRange(min=1), default=900, show_default=True,
              help="Seconds the run may take in all (server start, requests, drain).")
@semantics_option("vLLM 0.32.0 has no measured profile: safety", "The final check's profile.")
@click.option("--candidate-class", "candidate_class", metavar="package.module:Class", default=None,
              help="Your vLLM Scheduler subclass (what vllm serve --scheduler-cls takes), found on "
                   "PYTHONPATH: recorded instead of vLLM's own; checked in the serving env first.")
def serve_record(workload: str, output: str, model_dir: str | None, offline: bool, limit, time_scale,
                 seed, priority_levels, stop_on_eos, sets, time_limit, semantics,
                 candidate_class: str | None) -> None:
    """Run WORKLOAD (or a scenario file) on real vLLM executing a real model, record its
    scheduler, convert the recording to a trace and check it (the verdict is the last line).

    Without --offline: vLLM's OpenAI server (`python -m
    vllm.entrypoints.openai.api_server`, what `vllm serve` runs) on 127.0.0.1 (a
    free port) with the recording scheduler; the requests go over /v1/completions at their arrival times
    (token-id prompts, max_tokens, ignore_eos, priority under --set policy=priority;
    an abort_time is a client disconnect); the server is drained and stopped by its
    PID on every path, Ctrl-C included.

    --candidate-class runs your Scheduler subclass with the recording layered
    over it (a class that does not import, is not a Scheduler or raises in
    __init__: one line, exit 2, before vLLM starts). When vLLM raises (in
    schedule() or update_from_output()), one line on stderr names the step,
    the exception and its innermost frame; the steps before it are checked.

    Exit 0: conformant and every request answered; 1: a violation, an
    unanswered request, or vLLM failing mid-run (what it recorded is still
    converted and checked); 2: unusable input, or vLLM that cannot start;
    130: interrupted (the server is stopped first).
    """
    from harness.candidates.vllm.env import VLLMEnvError
    from harness.cli_common import _parse_sets
    from harness.serve.config import ServeConfigError
    from harness.serve.model import ModelError
    from harness.serve.offline import ServeError, side_files

    console, err = _consoles()
    from harness.cli_common import _refuse_overwriting_input

    _refuse_overwriting_input(output, workload)
    try:
        config, wl, seed = load_serve_inputs(workload, _parse_sets(sets), limit, time_scale, seed,
                                             priority_levels, stop_on_eos)
        from harness.serve.config import check_servable

        check_servable(config, offline=offline)
        model = Path(model_dir) if model_dir else default_model()
    except ConfigError as exc:
        _fail(f"bad config: {exc}")
    except (WorkloadError, OSError, ServeConfigError, ModelError, VLLMEnvError) as exc:
        _fail(str(exc))
    candidate = None
    if candidate_class is not None:
        from harness.serve.candidate_class import CandidateClassError, check_candidate_class

        try:
            with err.status(f"checking {candidate_class} in the serving env", spinner="dots") \
                    if err.is_terminal else _null():
                candidate = check_candidate_class(candidate_class, config)
        except (CandidateClassError, VLLMEnvError) as exc:
            _fail(str(exc))
    total = len(wl.requests)
    jsonl, log_path = side_files(output)
    started_at = time.time() - 1
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} requests done"), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("starting vLLM", total=total)

        def on_step(step: int, ended: int) -> None:
            progress.update(task, completed=ended, description=f"step {step}")

        def on_event(what: str, ended: int) -> None:
            progress.update(task, completed=ended, description=what)
        try:
            if offline:
                from harness.serve.offline import record_offline

                res = record_offline(wl, config, output, model, seed=seed, time_limit_s=time_limit,
                                     on_step=on_step, candidate=candidate)
                line = (f"offline vLLM {res.vllm_version}: {res.steps} engine steps, {res.finished}/"
                        f"{res.requests} finished, {res.aborted} aborted, {res.rejected} rejected, "
                        f"{res.output_tokens} output tokens in {res.wall_s:.1f} s")
            else:
                from harness.serve.server import serve_workload

                res = serve_workload(wl, config, output, model, seed=seed, time_limit_s=time_limit,
                                     on_event=on_event, say=lambda m: err.print(f"[dim]serve:[/] {escape(m)}"),
                                     candidate=candidate)
                line = (f"vLLM {res.vllm_version} server: {res.answered}/{res.requests} answered "
                        f"({res.aborted} aborted by disconnect, {res.rejected} refused, {res.failed} "
                        f"failed), {plural(res.output_tokens, 'output token')}"
                        f" in {res.serve_s:.1f} s ({res.tokens_per_s:.0f} tokens/s)")
        except KeyboardInterrupt as exc:
            import signal as _signal

            signum = getattr(exc, "signum", _signal.SIGINT)
            if signum == _signal.SIGTERM:
                err.print(f"interrupted by SIGTERM: vLLM stopped; log kept at {log_path}")
            else:
                err.print(f"interrupted: vLLM stopped; log kept at {log_path}")
            sys.exit(128 + int(signum))
        except (ServeError, ServeConfigError, VLLMEnvError, ModelError) as exc:
            from harness.serve.offline import log_tail

            fresh = log_path.is_file() and log_path.stat().st_mtime >= started_at
            tail = log_tail(log_path) if fresh else ""
            if tail:
                err.print(f"[dim]--- last lines of {escape(str(log_path))} ---[/]\n{escape(tail)}")
            _fail(str(exc))
    console.print(line)
    conv = res.convert
    if conv.get("crashed"):
        # vLLM raised in the scheduler (the recording's crash record): one line naming the step,
        # the exception and its innermost frame; the trace ends on its crash row.
        err.print(f"[bold red]vLLM {escape(crash_text(conv['crashed']))}[/]", soft_wrap=True)
    elif res.error:
        err.print(f"[bold red]vLLM failed mid-run:[/] {escape(res.error)}; the trace holds the steps "
                  f"recorded up to it")
    for warning in conv.get("warnings", ()):
        err.print(f"[yellow]warning:[/] {escape(warning)}")
    console.print(f"converted {jsonl} -> [bold]{output}[/]: {plural(conv['steps'], 'step')}, "
                  f"{plural(conv['requests'], 'request')}, {conv['finished']} finished, {conv['aborted']} aborted, "
                  f"{plural(conv['preemptions'], 'preemption')}, "
                  f"{plural(conv['prefix_hit_tokens'], 'prefix-hit token')}")
    from harness.cli_common import _check, _open, _report

    for req_id, why in sorted(getattr(res, "errors", {}).items())[:0 if conv.get("crashed") else 5]:
        err.print(f"[yellow]request {req_id}:[/] {escape(why)}")
    failed = getattr(res, "failed", 0)
    if failed and not conv.get("crashed"):  # after a crash, every request left fails with it
        err.print(f"[bold red]{failed} request(s) were not answered[/] (log: {escape(str(log_path))})")
    if not conv["steps"] and (res.error or conv.get("crashed")):
        # vLLM failed before its first step (a time limit spent starting it, a hang in the
        # first schedule()): a failed run (exit 1), not unusable input (the empty trace's exit 2).
        err.print(f"[bold red]no engine step was recorded: nothing to check[/] (log: {escape(str(log_path))})")
        sys.exit(1)
    trace = _open(output)
    result = _check(trace, semantics)
    _report(result, None, False, trace)
    sys.exit(0 if result.ok and not failed and not res.error and not conv.get("crashed") else 1)


def crash_text(crashed: str) -> str:
    """``convert``'s crash line (``reference.candidate.crash_line``: "candidate raised
    <Type> in <call>() at step S: <text> (at <where>)") said of vLLM."""
    return crashed.removeprefix("candidate ")


def register(main: click.Group) -> None:
    """Add ``model`` and ``serve-record`` to the ``harness`` group."""
    main.add_command(model_group)
    main.add_command(serve_record)
