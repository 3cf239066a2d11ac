"""The ``harness`` command line: record, check, replay, invariants.

Exit codes for every command: 0 ok, 1 invariant violation or divergence,
2 unusable input (missing, not Parquet, truncated, unknown schema version,
missing column, bad config or workload), with a one-line message naming the
file and the problem.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from reference.config import ConfigError, EngineConfig
from reference.candidate import CandidateError, CandidateFactory
from reference.workload import WorkloadError
from workloads import load_workload, with_eos_stops

from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.check import MAX_PER_INVARIANT, CheckResult, check_steps
from harness.check.invariants import INVARIANTS
from harness.trace.recorder import record as record_run
from harness.replay import Divergence, replay as replay_trace
from harness.trace import Trace, TraceError, open_trace

console = Console(stderr=False, highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_OK, EXIT_FOUND, EXIT_UNUSABLE = 0, 1, 2


def _fail(message: str) -> None:
    # The message is plain text: escaped, so "[torch]" in an install hint is not taken as markup.
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    sys.exit(EXIT_UNUSABLE)


def _candidate(spec: str) -> CandidateFactory:
    try:
        return resolve_candidate(spec)
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sched-harness")
def main() -> None:
    """Record, check and replay step traces of LLM-serving schedulers.

    The reference engine mirrors vLLM 0.33.0's v1 scheduler and KV-cache
    manager. Exit codes: 0 ok, 1 violation or divergence, 2 unusable input.
    """


@main.command()
@click.argument("workload")
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Trace file to write (Parquet). Written to a temp file, renamed on success.")
@click.option("--limit", type=click.IntRange(min=1), help="Use the first N requests of the workload.")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="Divide arrival times by X (X=10: ten times the load).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed for synthesized prompt tokens and the scripted model.")
@click.option("--priority-levels", type=click.IntRange(min=1), default=1, show_default=True,
              help="Give requests seeded random priorities in [0, N) (for --set policy=priority).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Engine config (vLLM names): num_gpu_blocks, block_size, max_num_seqs, "
                   "max_num_batched_tokens, max_model_len, policy (fcfs|priority), "
                   "enable_prefix_caching, enable_chunked_prefill, long_prefill_token_threshold, ...")
@click.option("--stop-on-eos", is_flag=True,
              help="Make trace requests end on EOS at their recorded output length (max_tokens "
                   "doubled) instead of on max_tokens with ignore_eos.")
@click.option("--engine", default="reference", show_default=True,
              help="Engine to record: 'reference', 'mutant:NAME' (a deliberately broken one), "
                   "'vllm@VERSION' (real vLLM; build its env with `harness vllm-env VERSION`) "
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
def record(workload: str, output: str, limit: int | None, time_scale: float, seed: int,
           priority_levels: int, sets: tuple[str, ...], stop_on_eos: bool, engine: str,
           model: str, device: str | None, kv_integrity: bool, verify_outputs: bool) -> None:
    """Run WORKLOAD on the engine and write its step trace.

    WORKLOAD is an Azure LLM inference CSV, a Mooncake JSONL, or
    'synthetic[:N]'.
    """
    factory = _candidate(engine)
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
        config = EngineConfig().with_overrides(_parse_sets(sets))
    except ConfigError as exc:
        _fail(f"bad config: {exc}")
    try:
        wl = load_workload(workload, limit=limit, time_scale=time_scale, seed=seed,
                           priority_levels=priority_levels)
    except (WorkloadError, OSError) as exc:
        _fail(str(exc))
    if stop_on_eos:
        wl = with_eos_stops(wl)
    total = len(wl.requests)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} requests done"),
                  TextColumn("step {task.fields[step]}"), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("recording", total=total, step=0)
        done = 0

        def on_progress(rec) -> None:
            nonlocal done
            for r in [rec, *rec.peers]:
                done += len(r.update.finished if r.update else ()) + len(r.aborts) + len(r.rejections)
            if rec.step % 64 == 0:
                progress.update(task, completed=done, step=rec.step)
        try:
            summary = record_run(wl, config, output, seed=seed, engine=engine,
                                 candidate_factory=factory, on_progress=on_progress,
                                 runner_factory=runner_factory,
                                 model=runner_factory.metadata() if runner_factory else None)
        except CandidateError as exc:
            err.print(f"[bold red]error:[/] {engine}: {exc} (no trace written)")
            sys.exit(EXIT_FOUND)
        except ValueError as exc:
            if runner_factory is None:
                raise
            _fail(f"--model torch: {exc}")
    console.print(f"recorded [bold]{output}[/]: {summary.steps} steps, {summary.requests} requests "
                  f"({summary.finished} finished, {summary.rejected} rejected, {summary.aborted} aborted), "
                  f"{summary.preemptions} preemptions, {summary.prefix_hit_tokens} prefix-hit tokens, "
                  + (f"{summary.remote_kv_loads} remote KV loads ({summary.failed_kv_loads} failed), "
                     if summary.remote_kv_loads else "")
                  + f"{summary.clock:.2f} s virtual time")
    found = False
    if runner_factory is not None:
        found = _torch_report(runner_factory, output, kv_integrity, verify_outputs)
    if summary.stalled:
        err.print(f"[bold red]engine stalled:[/] {summary.stalled} (the trace ends there)")
        sys.exit(EXIT_FOUND)
    sys.exit(EXIT_FOUND if found else EXIT_OK)


def _torch_report(runner_factory: Any, output: str, kv_integrity: bool, verify_outputs: bool) -> bool:
    """Print the torch runner's figures, integrity findings and the output
    oracle's result; True when anything was found."""
    from rich.markup import escape

    from harness.outputs import OutputsError, verify_trace_outputs

    tokens = sum(r.num_scheduled_tokens for r in runner_factory.runners)
    console.print(f"model: tiny-transformer (torch, {runner_factory.device.type}), "
                  f"{tokens} tokens run through the paged KV cache")
    found = False
    if kv_integrity:
        n = runner_factory.num_findings
        if n:
            found = True
            kinds = {}
            for r in runner_factory.runners:
                for k, v in r.findings_by_kind.items():
                    kinds[k] = kinds.get(k, 0) + v
            console.print(f"[bold red]KV integrity: {n} finding(s)[/] "
                          f"({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))}); the first:")
            console.print(escape(runner_factory.findings[0].describe()))
        else:
            console.print("[bold green]KV integrity: every K/V read matched the dense computation[/]")
    if verify_outputs:
        try:
            report = verify_trace_outputs(_open(output), str(runner_factory.device.type))
        except OutputsError as exc:
            _fail(str(exc))
        found |= _print_outputs(report)
    return found


def _print_outputs(report: Any) -> bool:
    from rich.markup import escape

    if report.ok:
        console.print(f"[bold green]outputs: {report.requests} requests, {report.tokens} tokens, all "
                      f"equal to a dense unbatched forward[/]")
        return False
    console.print(f"[bold red]outputs: {len(report.mismatches)} of {report.requests} requests differ "
                  f"from a dense unbatched forward[/] ({report.tokens} tokens compared)")
    for m in report.mismatches[:5]:
        console.print("  " + escape(m.describe()))
    return True


@main.command("verify-outputs")
@click.argument("trace_path", metavar="TRACE")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Device for the dense forward.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
def verify_outputs_cmd(trace_path: str, device: str, as_json: bool) -> None:
    """Check a trace recorded with --model torch: every request's tokens must equal greedy
    generation by the same model over its prompt alone (dense, unbatched, unpaged).

    Exit 0 all equal, 1 a mismatch, 2 unusable trace (not a torch trace, no torch, no such device)."""
    from harness.outputs import OutputsError, verify_trace_outputs

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
        _print_outputs(report)
    sys.exit(EXIT_OK if report.ok else EXIT_FOUND)


def _open(path: str) -> Trace:
    try:
        return open_trace(path)
    except TraceError as exc:
        _fail(str(exc))
    raise AssertionError


def _check(trace: Trace) -> CheckResult:
    try:
        return check_steps(trace.meta["config"], trace.iter_steps())
    except TraceError as exc:
        _fail(str(exc))
    except (KeyError, TypeError) as exc:
        _fail(f"{trace.path}: malformed trace ({type(exc).__name__}: {exc})")
    raise AssertionError


def _report(result: CheckResult, divergence: Divergence | None, as_json: bool, trace: Trace,
            extra: dict[str, Any] | None = None) -> None:
    ok = result.ok and divergence is None
    if as_json:
        payload = {"ok": ok, "trace": str(trace.path), "engine": trace.meta.get("engine"),
                   "steps": result.steps, "requests": result.requests, "finished": result.finished,
                   "rejected": result.rejected, "aborted": result.aborted,
                   "preemptions": result.preemptions, "prefix_hit_tokens": result.prefix_hit_tokens,
                   "draft_tokens": result.draft_tokens,
                   "rejected_draft_tokens": result.rejected_draft_tokens,
                   "deferred_frees": result.deferred_frees,
                   "deferred_prefill_steps": result.deferred_prefill_steps,
                   "remote_kv_loads": result.remote_kv_loads,
                   "failed_kv_loads": result.failed_kv_loads,
                   "num_violations": result.num_violations,
                   "violations_by_invariant": result.by_invariant,
                   "violations": [v.to_dict() for v in result.violations],
                   "divergence": divergence.to_dict() if divergence else None, **(extra or {})}
        click.echo(json.dumps(payload, default=str))
        return
    table = Table(show_header=False, box=None)
    rows = [("trace", str(trace.path)), ("engine", trace.meta.get("engine")),
            ("steps", result.steps), ("requests", result.requests),
            ("finished", result.finished), ("rejected", result.rejected),
            ("aborted", result.aborted), ("preemptions", result.preemptions),
            ("prefix-hit tokens", result.prefix_hit_tokens)]
    if result.draft_tokens:
        rows.append(("draft tokens (rejected)", f"{result.draft_tokens} ({result.rejected_draft_tokens})"))
    if result.deferred_frees:
        rows.append(("deferred frees drained", result.deferred_frees))
    if result.deferred_prefill_steps:
        rows.append(("steps deferring prefills", result.deferred_prefill_steps))
    if result.remote_kv_loads:
        rows.append(("remote KV loads (failed)", f"{result.remote_kv_loads} ({result.failed_kv_loads})"))
    for label, value in rows:
        table.add_row(label, str(value))
    console.print(table)
    for v in result.violations:
        console.print(f"[bold red]VIOLATION[/] {v.invariant} at step {v.step}"
                      + (f", request {v.request}" if v.request else "") + f": {v.message}")
        console.print(f"  rule: {INVARIANTS[v.invariant].statement}")
        for line in v.history:
            console.print(f"    {line}")
    if result.num_violations > len(result.violations):
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(result.by_invariant.items()))
        console.print(f"... {result.num_violations} violations in all ({counts}); "
                      f"the first {MAX_PER_INVARIANT} of each are shown")
    if divergence is not None:
        console.print(f"[bold red]DIVERGENCE[/] at step {divergence.step}, event #{divergence.event_index}"
                      f" ({divergence.kind or '-'}), request {divergence.request or '-'}, "
                      f"field {divergence.field}: expected {divergence.expected!r}, got {divergence.actual!r}")
        if divergence.diff:
            console.print(divergence.diff)
        for side, rows in (("trace", divergence.context_expected), ("candidate", divergence.context_actual)):
            console.print(f"  {side} step {divergence.step}:")
            for row in rows[:12]:
                console.print("    " + _brief_row(row))
    if ok:
        console.print("[bold green]conformant[/]" + (f": {extra['replayed_steps']} steps replayed, "
                                                    f"identical decisions" if extra else ""))


def _brief_row(row: dict[str, Any]) -> str:
    keys = ("kind", "request_id", "schedule_kind", "num_computed_tokens", "num_scheduled_tokens",
            "num_prefix_hit_tokens", "block_ids", "token_ids", "finish_reason", "num_free_blocks")
    return " ".join(f"{k}={row[k]}" for k in keys if row.get(k) not in (None, []))


@main.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
def check(trace_path: str, as_json: bool) -> None:
    """Check every invariant of TRACE from the trace alone."""
    trace = _open(trace_path)
    result = _check(trace)
    _report(result, None, as_json, trace)
    sys.exit(EXIT_OK if result.ok else EXIT_FOUND)


@main.command()
@click.argument("trace_path", metavar="TRACE")
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to re-drive: 'reference', 'mutant:NAME', 'vllm@VERSION' or "
                   "'package.module:factory'.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
def replay(trace_path: str, candidate: str, as_json: bool) -> None:
    """Check TRACE, then re-drive CANDIDATE with its inputs and compare decisions step by step."""
    factory = _candidate(candidate)
    trace = _open(trace_path)
    result = _check(trace)
    try:
        divergence, compared = replay_trace(trace, factory)
    except TraceError as exc:
        _fail(str(exc))
    except ConfigError as exc:
        _fail(f"{trace.path}: bad config in trace metadata: {exc}")
    _report(result, divergence, as_json, trace,
            {"candidate": candidate, "replayed_steps": compared})
    sys.exit(EXIT_OK if result.ok and divergence is None else EXIT_FOUND)


@main.command()
def invariants() -> None:
    """List the invariant catalogue: id, spec section, statement."""
    table = Table("id", "spec", "statement")
    for inv in INVARIANTS.values():
        table.add_row(inv.id, inv.spec, inv.statement)
    console.print(table)


@main.command()
@click.argument("trace_a", metavar="A")
@click.argument("trace_b", metavar="B")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a report.")
def diff(trace_a: str, trace_b: str, as_json: bool) -> None:
    """Compare two traces of the same workload step by step (A: expected, B: actual).

    Reports config differences, the first divergent step and summary deltas.
    Exit 0 identical, 1 different, 2 unusable or not the same workload.
    """
    from harness.diff import diff_traces, render_report

    a, b = _open(trace_a), _open(trace_b)
    try:
        result = diff_traces(a, b)
    except TraceError as exc:
        _fail(str(exc))
    if as_json:
        click.echo(json.dumps(result.to_dict(), default=str))
    else:
        render_report(result, console)
    sys.exit(EXIT_OK if result.same else EXIT_FOUND)


# ---------------------------------------------------------------- golden traces

@main.group()
def golden() -> None:
    """Golden traces: one reference recording per canonical scenario (harness/scenarios.py),
    pinned by MANIFEST.json."""


@golden.command("check")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to re-drive with each golden's inputs: 'reference', 'mutant:NAME', "
                   "'vllm@VERSION' or 'package.module:factory'.")
def golden_check(golden_dir: str, candidate: str) -> None:
    """Check every scenario's golden: present, sha256 and config fingerprint as in the manifest,
    invariants hold, and CANDIDATE makes identical decisions. Exit 0 all ok, 1 any failure,
    2 unusable folder or manifest."""
    from rich.markup import escape

    from harness.golden import DEFAULT_DIR, GoldenError, check_goldens

    golden_dir = golden_dir or str(DEFAULT_DIR)
    factory = _candidate(candidate)
    try:
        results = check_goldens(golden_dir, factory)
    except GoldenError as exc:
        _fail(str(exc))
    width = max(len(r.scenario) for r in results)
    for r in results:
        if r.ok:
            console.print(f"[bold green]ok  [/] {r.scenario:<{width}}  {r.steps} steps, "
                          f"{r.replayed_steps} replayed identically")
        else:
            console.print(f"[bold red]FAIL[/] {r.scenario:<{width}}  {escape(r.reason)}")
    failed = sum(not r.ok for r in results)
    colour = "red" if failed else "green"
    console.print(f"[bold {colour}]{len(results) - failed} ok, {failed} failed[/] "
                  f"({golden_dir}, candidate {candidate})")
    sys.exit(EXIT_FOUND if failed else EXIT_OK)


@golden.command("update")
@click.option("--dir", "golden_dir", default=None,
              type=click.Path(file_okay=False),
              help="Folder holding the goldens and MANIFEST.json (default: the repository's golden/).")
@click.option("--scenario", "names", multiple=True, metavar="NAME",
              help="Re-record only this scenario (repeatable); default: all.")
@click.option("--prune", is_flag=True, help="Remove goldens of scenarios that no longer exist.")
def golden_update(golden_dir: str, names: tuple[str, ...], prune: bool) -> None:
    """Re-record goldens with the reference (temp file + rename), rewrite MANIFEST.json
    atomically, and report per scenario: new, unchanged or changed (and how)."""
    from rich.markup import escape

    from harness.golden import DEFAULT_DIR, GoldenError, update_goldens

    golden_dir = golden_dir or str(DEFAULT_DIR)
    try:
        changes = update_goldens(golden_dir, list(names) or None, prune=prune)
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
    sys.exit(EXIT_FOUND if any(c.status == "refused" for c in changes) else EXIT_OK)


@main.command()
@click.option("--list", "list_only", is_flag=True, help="Print the mutant names, one per line, and exit.")
@click.option("--mutant", "mutant_names", multiple=True, metavar="NAME", help="Run only these mutants.")
@click.option("--scenario", "scenario_names", multiple=True, metavar="NAME",
              help="Run only these scenarios (default: all of harness/scenarios.py).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the matrix.")
def mutants(list_only: bool, mutant_names: tuple[str, ...], scenario_names: tuple[str, ...],
            as_json: bool) -> None:
    """Run every mutant on every scenario and print the kill matrix.

    Shows, per mutant, the scenarios where its intended invariant fired.
    Exit 1 if any mutant survives (its invariant fired on no scenario), or if
    the clean reference violates anything. With --scenario, mutants of
    features those scenarios never exercise are expected to survive.
    """
    from harness.mutation import kill_matrix, run_candidate
    from harness.scenarios import SCENARIOS
    from harness.candidates.mutants import MUTANTS_AND_TARGETS
    from reference.scheduler import Scheduler

    if list_only:
        for name in MUTANTS_AND_TARGETS:
            click.echo(name)
        return
    for name in mutant_names:
        if name not in MUTANTS_AND_TARGETS:
            raise click.BadParameter(f"unknown mutant {name!r}", param_hint="--mutant")
    for name in scenario_names:
        if name not in SCENARIOS:
            raise click.BadParameter(f"unknown scenario {name!r}", param_hint="--scenario")
    scenario_list = list(scenario_names) or list(SCENARIOS)
    clean = {s: run_candidate(Scheduler, SCENARIOS[s]) for s in scenario_list}
    rows = kill_matrix(list(mutant_names) or None, scenario_list)
    dirty = {s: c.result.by_invariant for s, c in clean.items() if not c.result.ok}
    survivors = [r.mutant for r in rows if not r.killed]
    if as_json:
        click.echo(json.dumps({
            "ok": not survivors and not dirty, "survivors": survivors, "reference_violations": dirty,
            "matrix": {r.mutant: {"target": r.target, "killed": r.killed,
                                  "cells": {s: {"target_hits": c.result.by_invariant.get(r.target, 0),
                                                "violations": c.result.by_invariant, "ended": c.ended}
                                            for s, c in r.cells.items()}} for r in rows}}))
    else:
        # One row per mutant: readable at any terminal width.
        table = Table("mutant", "target invariant", "fired on (scenario: times)", "killed")
        clean_cells = [s for s in scenario_list if not clean[s].result.ok]
        table.add_row("[dim]reference[/]", "[dim](none)[/]",
                      "clean on every scenario" if not clean_cells else
                      f"[red]violations on {', '.join(clean_cells)}[/]", "")
        for r in rows:
            hits = [f"{s}: {r.cells[s].result.by_invariant.get(r.target, 0)}"
                    + ("*" if r.cells[s].ended else "")
                    for s in scenario_list if r.cells[s].result.by_invariant.get(r.target)]
            table.add_row(r.mutant, r.target, ", ".join(hits) or "-",
                          "[green]yes[/]" if r.killed else "[bold red]SURVIVED[/]")
        console.print(table)
        console.print("times the target invariant fired per scenario; * = the run ended early "
                      "(stalled or the candidate raised)")
        if dirty:
            console.print(f"[bold red]the reference violates invariants:[/] {dirty}")
        console.print(f"{len(rows) - len(survivors)}/{len(rows)} mutants killed"
                      + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
    sys.exit(EXIT_FOUND if survivors or dirty else EXIT_OK)


@main.command("vllm-env")
@click.argument("version")
@click.option("--force", is_flag=True, help="Rebuild even if the env is ready.")
def vllm_env(version: str, force: bool) -> None:
    """Build (or find) the CPU-only virtual environment of vLLM VERSION under .vllm-envs/,
    needed by the candidate `vllm@VERSION`. Idempotent; prints progress and the env's Python.
    Exit 2 with a one-line message on failure."""
    from rich.markup import escape

    from harness.candidates.vllm.env import VLLMEnvError, ensure_env

    try:
        python = ensure_env(version, log=lambda line: err.print(f"[dim]vllm-env:[/] {escape(line)}"),
                            force=force)
    except VLLMEnvError as exc:
        _fail(str(exc))
    except OSError as exc:
        _fail(f"cannot build the vLLM {version} env: {exc}")
    console.print(str(python))


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


def _finite_or_none(value: float | None, name: str) -> float | None:
    """Refuse NaN and infinity (click's FloatRange lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param_hint=name)
    return value


@main.command()
@click.option("--candidate", default="reference", show_default=True,
              help="Engine to fuzz: 'reference', 'mutant:NAME', 'vllm@VERSION' or 'package.module:factory'.")
@click.option("--max-examples", type=click.IntRange(min=1), default=200, show_default=True,
              help="Generated scenarios to try, shared equally by the workers (shrinking runs come "
                   "on top).")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Hypothesis seed: the same seed generates the same scenarios (worker i > 0 uses "
                   "a seed derived from it and i).")
@click.option("--time-budget", type=click.FloatRange(min=0, min_open=True), default=None,
              callback=lambda _ctx, _param, value: _finite_or_none(value, "--time-budget"),
              metavar="SECONDS", help="Each worker stops generating after this many seconds "
                                      "(shrinking a found failure still completes).")
@click.option("--workers", type=_Workers(), default="1", show_default=True,
              help="Processes fuzzing in parallel, each with its own seed and share of "
                   "--max-examples; 0 or 'auto': one per available CPU.")
@click.option("--report-known", is_flag=True, default=False,
              help="Report the known reference findings (harness.fuzz.KNOWN_REFERENCE_FINDINGS, each "
                   "mirroring vLLM 0.33.0) like any failure, instead of passing over them.")
@click.option("-o", "--output", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Folder for the minimal failing traces (Parquet) and their JSON descriptions.")
def fuzz(candidate: str, max_examples: int, seed: int, time_budget: float | None, workers: int,
         report_known: bool, out_dir: str) -> None:
    """Fuzz CANDIDATE with small generated scenarios (hypothesis): check every invariant and,
    for a candidate other than the reference, compare its decisions with the reference's.

    With --workers N, N processes fuzz at once (worker 0 with --seed, worker i with a seed
    derived from --seed and i), each on its share of --max-examples; without --time-budget the
    outcome depends only on the arguments. Each worker stops at its first failure, which is
    shrunk and written to OUT_DIR as a replayable trace plus a JSON description (workers that
    shrink to the same scenario share one). A scenario on which the reference itself shows a
    known finding (a documented vLLM 0.33.0 behaviour, e.g. the KV-connector wedge) is passed
    over and counted in the summary, unless --report-known. Exit 0 nothing found, 1 something
    found, 2 bad arguments."""
    from rich.markup import escape

    from harness.fuzz import FuzzWorkerError, WorkerProgress, fuzz_parallel, write_witnesses

    factory = _candidate(candidate)
    workers = min(workers, max_examples)  # fuzz_parallel never uses more
    label = f"{candidate}" + (f" on {workers} workers" if workers > 1 else "")
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
            result = fuzz_parallel(candidate, workers=workers, max_examples=max_examples, seed=seed,
                                   time_budget_s=time_budget, on_progress=on_progress,
                                   skip_known=not report_known)
        except FuzzWorkerError as exc:
            _fail(str(exc))
    stop = " (time budget spent)" if result.budget_exhausted and not result.found else ""
    used = len(result.workers)
    on = f" on {used} workers" if used > 1 else ""
    console.print(f"fuzzed [bold]{candidate}[/]: {result.examples} examples{on} in "
                  f"{result.elapsed_s:.1f} s, seed {seed}{stop}")
    if result.known:
        console.print("passed over known reference findings: "
                      + ", ".join(f"{name} x{n}" for name, n in result.known.items())
                      + " (--report-known to stop at them)")
    if not result.found:
        console.print("[bold green]nothing found[/]")
        sys.exit(EXIT_OK)
    witnesses = write_witnesses(out_dir, candidate, factory, result)
    if used > 1:
        console.print(f"[bold red]FOUND[/] by {len(result.found)} of {used} workers, "
                      f"{len(witnesses)} distinct shrunk scenario(s):")
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
        console.print(f"  shrunk to {escape(case.describe())} ({res.shrink_calls} shrink runs)")
        console.print(f"  trace {wit.trace}, description {wit.json}")
        console.print(f"  replay: {wit.command}")
    if len(witnesses) > 1:
        smallest = result.smallest()
        best = next(w for w in witnesses if smallest.worker in w.found_by)
        console.print(f"smallest: worker {best.worker.worker}, {escape(best.worker.result.case.describe())}; "
                      f"replay: {best.command}")
    sys.exit(EXIT_FOUND)


if __name__ == "__main__":
    main()
