"""``harness replay`` (re-drive a candidate with a trace's inputs, ``harness.replay``)
and ``harness diff`` (compare two traces, ``harness.diff``).

Registered on ``main`` by ``harness/cli.py``.
"""

from __future__ import annotations

import json
import sys

import click

from reference.config import ConfigError
from reference.candidate import CandidateRefused

from harness.check import PROFILES
from harness.check.invariants import fork_hint
from harness.progress import every_steps, progress
from harness.replay import own_run, replay as replay_trace
from harness.trace import TraceError
from harness.cli_common import (EXIT_FOUND, EXIT_OK, _ALLOW_INCOMPLETE, _HTML_REPORT, _REQUIRE_SEALED,
                                _SEMANTICS, _candidate, _checked, _exit_code, _fail, _open,
                                _refuse_report_path, _refuse_unknown_semantics, _refuse_unsealed, _report,
                                _step_timeout, console, err)


@click.command()
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
    _refuse_unknown_semantics(semantics)
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
    # Under the fork gate (or safety), asked for with --semantics, a decision that
    # differs is information: the fork's own policy, not a failure; a crash still
    # is one. An engine of unknown origin checked under safety by `auto` still
    # fails on a divergence: nobody said its policy may differ.
    information = (semantics != "auto" and result.profile in PROFILES
                   and not PROFILES[result.profile].semantics)
    extra = {"candidate": candidate, "replayed_steps": compared}
    if information:
        extra["divergence_is_information"] = True
        if divergence is not None and divergence.field != "exception":
            # The replay stopped at the first differing decision: the candidate's
            # rows after it were never checked. Its own run of the trace's inputs
            # is, under the same profile (as `fuzz --semantics fork`): a violation,
            # a crash or a stall there fails the gate.
            try:
                with progress(f"re-running {candidate} on {trace.path.name}'s inputs from step 0",
                              trace.summary.get("steps"), enabled=not as_json) as update:
                    extra["own_run"] = own_run(trace, factory, PROFILES[result.profile],
                                               on_step=every_steps(update))
            except CandidateRefused as exc:
                _fail(f"{candidate} cannot replay {trace.path}: {exc}")
    if html_report is not None:
        from harness.view.cli import divergence_of_replay, own_run_view, write_report

        write_report(html_report, trace, semantics, series=series, divergence=divergence_of_replay(divergence),
                     own_run=own_run_view(extra["own_run"], candidate) if "own_run" in extra else None)
    ok = divergence is None or (information and divergence.field != "exception"
                                and ("own_run" not in extra or extra["own_run"].ok))
    code = _exit_code(result.ok and ok, trace, allow_incomplete)
    if not ok and not as_json and result.ok and divergence.field != "exception":
        # Only the decisions differ: a fork or another release may differ by design
        # (new-user trial: vllm@0.29.0 on a 0.33.0-semantics golden read as a bare failure).
        release = (f"{candidate} is another release than the trace's engine ({trace.meta.get('engine')}); "
                   "`harness bisect` names the release whose design changed it. "
                   if candidate.startswith("vllm@") else "")
        err.print(f"hint: {release}{fork_hint((), diverged=True)}", markup=False, soft_wrap=True)
    _report(result, divergence, as_json, trace, extra, exit_code=code, allow_incomplete=allow_incomplete)
    sys.exit(code)


@click.command()
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
