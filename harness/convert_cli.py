"""``harness convert``: turn a vLLM recording (the recording scheduler's JSONL) into a trace.

Registered on the CLI's ``main`` group by ``harness/cli.py``; the work is
``harness.candidates.vllm.recording_convert.convert`` (which writes through
``harness.trace.TraceWriter``: a temporary folder beside the output, renamed
into place once whole).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import click
from rich.markup import escape

from harness.cli_common import EXIT_UNUSABLE, _refuse_overwriting_input, console, err
from reference.words import plural


def _unfinished_hint(path: Path) -> str:
    """A hint when ``path`` is missing but the recorder's temporary file for it is
    there (``.NAME.<pid>.tmp``: the server was stopped before it finished the
    recording, e.g. without ``--shutdown-timeout``), else ''."""
    if path.exists() or not path.parent.is_dir():
        return ""
    tmps = sorted(path.parent.glob(f".{path.name}.*.tmp"), key=lambda p: p.stat().st_mtime)
    if not tmps:
        return ""
    return (f"; the recorder's unfinished file {tmps[-1]} is there (vLLM stopped before it finished "
            f"the recording: start vllm serve with --shutdown-timeout 10): convert that file")


@click.command("convert")
@click.argument("recording", metavar="RECORDING")
@click.option("-o", "--output", "output", required=True, metavar="TRACE.parquet",
              help="Where to write the trace (written to a temporary folder beside it, renamed once whole).")
def convert_cmd(recording: str, output: str) -> None:
    """Convert a vLLM recording into a trace that check, replay and diff read.

    RECORDING is what the recording scheduler wrote (SCHED_HARNESS_TRACE, see
    docs/how-to/record-a-server.md): NAME.jsonl, the same gzip-compressed
    (NAME.jsonl.gz), or the temporary .NAME.jsonl.<pid>.tmp a killed server left
    (its complete steps are converted, marked cut off). Prints the warnings,
    then the summary as the last line: steps, requests, and why the trace ends
    early when it does (a crash, a recording cut off, a step the trace cannot
    hold).

    Exit 0 converted, 2 unusable input (one line naming the file: missing, not a
    recording, a log out of order, a config the model refuses) or output path.
    The output is left untouched on any failure."""
    from harness.candidates.vllm.recording_convert import ConvertError, convert

    _refuse_overwriting_input(output, recording)
    src = Path(recording)
    # A long recording takes a while: a transient spinner on a terminal (convert reports
    # no steps as it goes), nothing in a pipe or a log.
    status = err.status(f"converting {escape(recording)}") if err.is_terminal else nullcontext()
    try:
        with status:
            summary = convert(src, output)
    except ConvertError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc) + _unfinished_hint(src))}", soft_wrap=True)
        sys.exit(EXIT_UNUSABLE)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as exc:
        # A record without a field the recorder always writes (a log edited, or another
        # program's JSONL): one line naming the file, never a traceback.
        err.print(f"[bold red]error:[/] {escape(str(src))}: not a recording this converter reads "
                  f"({type(exc).__name__}: {escape(str(exc)[:200])})", soft_wrap=True)
        sys.exit(EXIT_UNUSABLE)
    except OSError as exc:
        where = exc.filename or output
        err.print(f"[bold red]error:[/] {escape(str(where))}: {escape(exc.strerror or str(exc))}",
                  soft_wrap=True)
        sys.exit(EXIT_UNUSABLE)
    for warning in summary.get("warnings", ()):
        err.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)
    from harness.cli_common import _open

    # Why the trace ends early, as check and replay will say it (its footer).
    console.print(summary_line(recording, output, summary, _open(output).incomplete))


def summary_line(recording: str, output: str, summary: dict, incomplete: str | None) -> str:
    """``convert``'s summary as one line (rich markup): what the trace holds, and
    why it ends early when it does (``incomplete``: the trace's own line for a
    crash, a step the trace cannot hold, a recording cut off)."""
    line = (f"converted {escape(recording)} -> [bold]{escape(output)}[/]: "
            f"{plural(summary['steps'], 'step')}, {plural(summary['requests'], 'request')}, "
            f"{summary['finished']} finished, {summary['aborted']} aborted, "
            f"{plural(summary['preemptions'], 'preemption')}, "
            f"{plural(summary['prefix_hit_tokens'], 'prefix-hit token')}")
    if summary.get("crashed"):
        return line + f"; ends on vLLM's crash: {escape(summary['crashed'].removeprefix('candidate '))}"
    if incomplete:
        return line + f"; incomplete: {escape(incomplete)}"
    return line
