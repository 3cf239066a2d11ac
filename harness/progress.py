"""Progress for the commands that can take more than about 2 s: a rich bar on
stderr, shown only when stderr is a terminal (never in piped output, a log or
a test), and off under ``--json``; it disappears when done, so the command's
last line stays its verdict.

``progress(description, total)`` is a context manager yielding
``update(completed=None, *, advance=0, description=None)``; with ``total``
None the bar is a spinner with the elapsed time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: Where progress goes: stderr, so stdout (reports, --json) is never mixed with it.
err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)

Update = Callable[..., None]


@contextmanager
def progress(description: str, total: int | None, *, enabled: bool = True,
             console: Console | None = None) -> Iterator[Update]:
    """Show a transient bar (``total`` units, e.g. steps or scenarios) or a
    spinner (``total`` None) on ``console`` (default stderr) while the block
    runs, if ``enabled`` and that console is a terminal."""
    out = console or err
    columns = [SpinnerColumn(), TextColumn("{task.description}")]
    # The bar takes what the description leaves of the line: rich's default 40
    # columns cut "replaying NAME on vllm@X" short on an 80-column terminal.
    # 32 = spinner, "12345/12345", elapsed time and the separating spaces.
    bar_width = max(5, min(40, out.width - len(description) - 32))
    columns += [BarColumn(bar_width=bar_width), MofNCompleteColumn()] if total else []
    columns.append(TimeElapsedColumn())
    with Progress(*columns, console=out, transient=True,
                  disable=not (enabled and out.is_terminal)) as bar:
        task = bar.add_task(description, total=total)

        def update(completed: int | None = None, *, advance: int = 0, description: str | None = None) -> None:
            fields = {"description": description} if description is not None else {}
            if completed is not None:
                fields["completed"] = completed
            bar.update(task, advance=advance, **fields)
        yield update


def every_steps(update: Update, n: int = 64) -> Callable[..., None]:
    """A per-step callback that moves the bar to ``step`` every ``n`` steps
    (redrawing on each of thousands of steps would cost more than the work).
    Takes ``(step, *ignored)``, so it serves as a check observer too."""
    def on_step(step: int, *_: object) -> None:
        if step % n == 0:
            update(step)
    return on_step
