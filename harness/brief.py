"""Short one-line renderings of trace values for context lines (``diff``, ``replay``).

A divergent step's rows and DeepDiff's text hold whole block-id lists,
request queues and floats as Python prints them: a 700-character line with
``0.41960000000000003`` in it (issue 27). Here:

* ``short(value)``: a list of more than ``LIST_ITEMS_SHOWN`` + 2 items shows its first
  ``LIST_ITEMS_SHOWN`` and a count (``[3, 4, 5, … +120 more]``), recursively;
  a float is rounded to ``FLOAT_DIGITS`` significant digits (``0.4196``);
  anything else is ``str``.
* ``short_text(line)``: the same for text already printed (DeepDiff's
  report): long runs of numbers in brackets elided, long floats rounded, and
  the line cut at ``MAX_LINE`` characters with a count of what was cut.

Values shown only: comparisons and ``--json`` keep the exact values.
"""

from __future__ import annotations

import re
from typing import Any

#: Items of a long list shown before the count.
LIST_ITEMS_SHOWN = 3
#: Significant digits of a float.
FLOAT_DIGITS = 6
#: Characters of a context line (the indent not counted), counts included.
MAX_LINE = 160


def short(value: Any) -> str:
    """``value`` for a context line: long lists elided with a count, floats rounded."""
    if isinstance(value, float):
        return f"{value:.{FLOAT_DIGITS}g}"
    if isinstance(value, (list, tuple)):
        items = list(value)
        if len(items) > LIST_ITEMS_SHOWN + 2:
            shown = ", ".join(short_repr(v) for v in items[:LIST_ITEMS_SHOWN])
            return f"[{shown}, … +{len(items) - LIST_ITEMS_SHOWN} more]"
        return "[" + ", ".join(short_repr(v) for v in items) + "]"
    return str(value)


def short_repr(value: Any) -> str:
    """``short(value)``, a string quoted (``'r000001'``)."""
    return repr(value) if isinstance(value, str) else short(value)


_LONG_FLOAT = re.compile(r"(?<![\w.])-?\d+\.\d{7,}(?:e[+-]?\d+)?")
# A bracketed run of more than LIST_ITEMS_SHOWN + 2 comma-separated numbers or quoted ids.
_ITEM = r"(?:-?\d+(?:\.\d+)?|'[^'\[\]]*')"
_LONG_LIST = re.compile(rf"\[({_ITEM}(?:, {_ITEM}){{{LIST_ITEMS_SHOWN + 2},}})\]")


def short_text(line: str, limit: int = MAX_LINE) -> str:
    """``line`` (already rendered text) with long floats rounded, long
    bracketed lists elided with a count and at most ``limit`` characters
    (a cut line ends ``… +N chars``)."""
    line = _LONG_FLOAT.sub(lambda m: f"{float(m.group(0)):.{FLOAT_DIGITS}g}", line)

    def elide(m: re.Match[str]) -> str:
        items = re.findall(_ITEM, m.group(1))
        return f"[{', '.join(items[:LIST_ITEMS_SHOWN])}, … +{len(items) - LIST_ITEMS_SHOWN} more]"
    line = _LONG_LIST.sub(elide, line)
    if len(line) <= limit:
        return line
    tail = f" … +{len(line) - limit} chars"
    keep = limit - len(tail)
    return line[:keep] + f" … +{len(line) - keep} chars"
