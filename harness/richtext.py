"""Rich tables that never cut a name: ``keep_words_whole(table)`` gives each
column the width of its longest word, so a narrow or piped console (rich
assumes 80 columns when stdout is not a terminal) wraps cells between words
but never truncates one to "preempt-kee…" (regression, issue 16); the table
grows wider than the console instead when it must (printed on a
``soft_wrap`` console, as the CLI's are, the lines are not cropped)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text


def _words(cell: object) -> list[str]:
    if isinstance(cell, Text):
        plain = cell.plain
    elif isinstance(cell, str):
        plain = Text.from_markup(cell).plain
    else:
        return []
    return plain.split()


def keep_words_whole(table: Table) -> Table:
    """Set each column's ``min_width`` to its longest word (header included)
    and returns ``table``."""
    for column in table.columns:
        cells = [column.header, *column._cells]
        longest = max((len(w) for cell in cells for w in _words(cell)), default=0)
        column.min_width = max(column.min_width or 0, longest)
    return table
