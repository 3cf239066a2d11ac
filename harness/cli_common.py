"""What the ``harness`` commands share: the consoles, the exit codes, the one-line
failure (``_fail``), the shared options (``--semantics``, ``--report``,
``--require-sealed``, ``--allow-incomplete``, ``--step-timeout``, ``--workers``) and
the open / check / report steps of check, replay and the serving commands.

Imported by the command modules (``harness/*_cli.py``, ``harness/serve/cli.py``);
imports none of them, nor ``harness.cli``.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from reference.config import ConfigError
from reference.candidate import CandidateFactory

from harness.candidates.isolated import DEFAULT_STEP_TIMEOUT_S
from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.check import PROFILES, CheckResult, ProfileError, check_trace
from harness.progress import every_steps, progress
from harness.replay import Divergence
from harness.report import render_report as render_check_report, report_dict
from harness.trace import Trace, TraceError, open_trace


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

        refuse_overwriting(html_report, *inputs, option="--report")


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


def _open(path: str) -> Trace:
    try:
        return open_trace(path)
    except TraceError as exc:
        _fail(str(exc))
    raise AssertionError


def _check(trace: Trace, semantics: str = "auto", show_progress: bool = False,
           as_json: bool = False) -> CheckResult:
    """Check ``trace``, with a progress bar on a terminal when ``show_progress``;
    exit 2 (``_unusable``: with ``as_json`` also its JSON object) when it
    cannot be checked."""
    try:
        with progress(f"checking {trace.path.name}", trace.summary.get("steps"),
                      enabled=show_progress) as update:
            return check_trace(trace, semantics,
                               observe=every_steps(update))
    except (ProfileError, TraceError) as exc:
        _unusable(str(exc), as_json)
    except (KeyError, TypeError) as exc:
        _unusable(f"{trace.path}: malformed trace ({type(exc).__name__}: {exc})", as_json)
    raise AssertionError


def _report(result: CheckResult, divergence: Divergence | None, as_json: bool, trace: Trace,
            extra: dict[str, Any] | None = None, exit_code: int | None = None,
            allow_incomplete: bool = False) -> None:
    """The report of check or replay: one JSON object (with ``exit``, the
    command's exit code, when given) or the text report ending on the verdict."""
    if as_json:
        click.echo(json.dumps(report_dict(result, divergence, trace, extra, exit_code, allow_incomplete),
                              default=str))
    else:
        render_check_report(result, divergence, trace, console, extra, allow_incomplete)


#: The --semantics metavar of every command.
SEMANTICS_METAVAR = "auto|safety|fork|VERSION"


def semantics_help(auto: str, tail: str = "") -> str:
    """The one --semantics help of every command (check, replay, report, export,
    golden check, fuzz, serve-record): ``auto`` says what 'auto' means for the
    command, ``tail`` what follows the names; the names and the releases'
    profiles (``PROFILES`` less safety and fork) are written once, here
    (new-user trial: report's help left fork out, replay's listed it twice)."""
    releases = ", ".join(p for p in PROFILES if p not in ("safety", "fork"))
    return (f"Which rules to check: 'auto' ({auto}), 'safety' (the safety invariants only), "
            f"'fork' (the fork gate: safety + progress, no version's design) or a release's "
            f"profile: {releases}." + (f" {tail}" if tail else ""))


def semantics_option(auto: str, tail: str = ""):
    """The ``--semantics`` option (default auto), its help from ``semantics_help``."""
    return click.option("--semantics", default="auto", show_default=True, metavar=SEMANTICS_METAVAR,
                        help=semantics_help(auto, tail))


#: What 'auto' means for a recorded trace (check, replay, report, export).
AUTO_TRACE = ("the profile of the engine and version in the trace's metadata; safety only for an engine "
              "of unknown origin, a module:factory fork's trace included: add 'fork' for the progress rules")

_SEMANTICS = semantics_option(AUTO_TRACE)


_SEMANTICS_GOLDEN = semantics_option(
    "every rule of the version the reference mirrors, and the goldens' decisions",
    "Under safety or fork a decision that differs from a golden's is information, and the candidate's "
    "own run of that golden's inputs is checked instead: a violation, crash or stall fails.")


def _refuse_unknown_semantics(semantics: str) -> None:
    """Exit 2, one line (with "did you mean"), for a ``--semantics`` that names
    no profile: before any trace is read. Regression (trial finding): a
    corpus check spawned its workers and printed one error row per trace."""
    from harness.check.profiles import resolve

    if semantics != "auto":
        try:
            resolve(semantics, {})
        except ProfileError as exc:
            _fail(str(exc))


_REQUIRE_SEALED = click.option(
    "--require-sealed", is_flag=True,
    help="Refuse (exit 2) a trace without tamper evidence (no trace_sha256 digest in its footer, "
         "whatever schema version it claims). Without it such a trace is checked and its verdict "
         "ends on 'unsealed: no tamper evidence'.")

_ALLOW_INCOMPLETE = click.option(
    "--allow-incomplete", is_flag=True,
    help="Exit 0 instead of 3 for an incomplete run (salvaged, crashed, stalled, or a recording "
         "stopped with requests live) with no violation in the steps it has.")


def _unsealed_refusal(trace: Trace, require_sealed: bool) -> str | None:
    """The one line ``--require-sealed`` refuses an unsealed trace with, else None."""
    if require_sealed and not trace.sealed:
        return (f"{trace.path}: unsealed: no tamper evidence (schema {trace.meta.get('schema_version')} "
                f"trace without a trace_sha256 digest); --require-sealed refuses it")
    return None


def _refuse_unsealed(trace: Trace, require_sealed: bool) -> None:
    """Exit 2, one line, for an unsealed trace under ``--require-sealed``."""
    message = _unsealed_refusal(trace, require_sealed)
    if message is not None:
        _fail(message)


def _unusable(message: str, as_json: bool) -> None:
    """Exit 2 with ``message`` on stderr; under ``--json`` also one object on
    stdout, ``{"ok": false, "exit": 2, "error": message}``, so a script that
    parses stdout gets a verdict (adversarial trial: stdout was empty)."""
    if as_json:
        click.echo(json.dumps({"ok": False, "exit": EXIT_UNUSABLE, "error": message}))
    _fail(message)


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
        return _check(trace, semantics, show_progress=not as_json, as_json=as_json), None
    from harness.view.cli import derive_with_progress

    series = derive_with_progress(trace, semantics, "checking")
    return series.result, series


def _finite_or_none(value: float | None, name: str) -> float | None:
    """Refuse NaN and infinity (click's FloatRange lets NaN through)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number of seconds", param_hint=name)
    return value
