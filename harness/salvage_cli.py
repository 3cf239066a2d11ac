"""``harness salvage``: turn a killed recording's temporary folder into a trace.

Registered on the CLI's ``main`` group by ``harness/cli.py``; the work is
``harness.trace.salvage.salvage``.
"""

from __future__ import annotations

import sys

import click
from rich.console import Console
from rich.markup import escape

from harness.trace import TraceError
from harness.trace.salvage import salvage
from harness.trace.writer import SEGMENT_GLOB
from reference.words import plural

_err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)


@click.command("salvage")
@click.argument("folder", metavar="TMPDIR")
@click.option("-o", "--output", "output", required=True, metavar="TRACE.parquet",
              help="Where to write the salvaged trace (replaced only once it is whole).")
def salvage_cmd(folder: str, output: str) -> None:
    """Salvage the trace of a `harness record` that was killed (SIGKILL, SIGTERM, a crash of
    the machine): TMPDIR is the temporary folder it left beside its -o path
    (.NAME.XXXX.tmp/), whose complete row groups become TRACE.parquet, marked salvaged
    (check and replay read it up to its last step, with a note). The rows after the last
    complete row group are lost. TMPDIR is then removed (kept, with a warning saying why,
    when a segment could not be salvaged or it holds anything else).

    Exit 0 salvaged, 2 nothing to salvage (not such a folder, no complete row group)."""
    from pathlib import Path

    from harness.paths import OutputPathError, check_output_file

    segments = tuple(str(p) for p in Path(folder).glob("*")) if Path(folder).is_dir() else ()
    try:
        check_output_file(output, segments)
        if any(Path(folder).glob(SEGMENT_GLOB)) and Path(output).resolve().parent == Path(folder).resolve():
            raise OutputPathError(f"{output}: -o is inside the folder being salvaged; choose another path")
    except OutputPathError as exc:
        _err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
    try:
        result = salvage(folder, output)
    except TraceError as exc:
        _err.print(f"[bold red]error:[/] {escape(str(exc))}", soft_wrap=True)
        sys.exit(2)
    except OSError as exc:
        _err.print(f"[bold red]error:[/] {escape(output)}: cannot write ({exc.strerror or exc})", soft_wrap=True)
        sys.exit(2)
    for line in result.skipped:
        _err.print(f"[yellow]warning:[/] {escape(line)}", soft_wrap=True)
    _err.print(f"[yellow]warning:[/] {escape(result.line)}", soft_wrap=True)
    if result.kept is not None:
        _err.print(f"[yellow]warning:[/] kept {escape(folder)}: {escape(result.kept)}; remove it when done "
                   f"(`harness check` of a folder above it reports it)", soft_wrap=True)
    click.echo(f"salvaged {result.out}: {plural(result.steps, 'step')}, {plural(result.events, 'event')} from "
               f"{plural(result.segments, 'row group')}, up to step {result.last_step}"
               + (f"; removed {folder}" if result.removed else ""))
