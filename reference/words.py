"""Wording shared by every message the harness prints: "did you mean" and plurals.

In ``reference`` (which imports nothing of the harness) so that the config's
own errors, the workload loaders and the harness's commands word a bad name
and a count the same way. No vLLM counterpart: message text only.

* ``did_you_mean(name, choices)``: the close matches of a mistyped key or
  name (``difflib.get_close_matches``), never the whole list of a long one:
  ``"; did you mean 'max_num_seqs'?"``; a short list (8 or fewer) with no
  close match is given whole (``"; known: fcfs, priority"``); else ``""``.
* ``missing_file_hint(path)``: the same for a file name not found, among
  the names in its folder.
* ``plural(n, noun)``: ``"1 preemption"``, ``"2 preemptions"``.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterable
from pathlib import Path

_VERSION = re.compile(r"\d+(\.\d+)+")
#: A list of at most this many names is given whole when nothing is close.
LIST_WHOLE_UP_TO = 8
#: difflib's similarity cut-off (0..1): 0.6 finds one- or two-letter slips in
#: names of 5+ characters (``max_num_seq``, ``fcsf``) and little else.
CUTOFF = 0.6


def close_matches(name: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``choices`` close to ``name``, best first; a match
    ignoring case comes first (``FCFS`` -> ``fcfs``). A version number
    (``0.33.1``) is close only to versions of its series (``0.33.0``, not
    ``0.30.0``: every version string looks alike to difflib)."""
    pool = [str(c) for c in choices]
    if _VERSION.fullmatch(str(name)):
        series = str(name).split(".")[:2]
        pool = [c for c in pool if _VERSION.fullmatch(c) and c.split(".")[:2] == series]
    folded = [c for c in pool if c.lower() == str(name).lower()]
    # difflib ranks by its ratio alone and breaks ties on the larger string: for
    # ``r00004`` (a dropped zero) it offered r000034, r000024, r000014 and never
    # r000004 (new-user trial). A name one slip away (a character dropped, added
    # or replaced) comes first, the longest common start + end first among those
    # (a zero dropped from a run of 0000 before a 3 missing at its edge); the
    # rest in difflib's order.
    close = difflib.get_close_matches(str(name), pool, n=max(len(pool), 1), cutoff=CUTOFF)
    rest = sorted(close, key=lambda c: (-_common_ends(str(name), c) if edit_distance(str(name), c) <= 1
                                        else 0))
    return (folded + [c for c in rest if c not in folded])[:n]


def _common_ends(a: str, b: str) -> int:
    """Characters ``a`` and ``b`` share at their start plus at their end."""
    return len(os.path.commonprefix([a, b])) + len(os.path.commonprefix([a[::-1], b[::-1]]))


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest characters inserted, deleted or
    replaced to turn ``a`` into ``b`` (``r00004`` -> ``r000004``: 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def did_you_mean(name: str, choices: Iterable[str], *, quote: bool = True, list_whole: bool = True) -> str:
    """The suffix for "unknown NAME" messages: ``"; did you mean 'a' or 'b'?"``
    (close matches), ``"; known: a, b"`` (a list of at most
    ``LIST_WHOLE_UP_TO`` names, none close), or ``""`` (a long list, none
    close: the caller says where the list is). ``quote``: names as ``'a'``
    (repr) or bare; ``list_whole=False``: close matches only."""
    pool = list(dict.fromkeys(str(c) for c in choices))
    close = close_matches(name, pool)
    show = (lambda s: repr(s)) if quote else (lambda s: s)
    if close:
        shown = [show(c) for c in close]
        either = shown[0] if len(shown) == 1 else f"{', '.join(shown[:-1])} or {shown[-1]}"
        return f"; did you mean {either}?"
    if list_whole and 0 < len(pool) <= LIST_WHOLE_UP_TO:
        return f"; known: {', '.join(pool)}"
    return ""


def missing_file_hint(path: str | os.PathLike[str]) -> str:
    """For a file that does not exist: ``"; did you mean 'fcfs-tight.toml'?"``
    when its folder holds close names (a name with the same suffix: close
    stems), else ``""`` (no folder, nothing close)."""
    p = Path(path)
    try:
        siblings = [e.name for e in p.parent.iterdir()] if p.parent.is_dir() else []
    except OSError:
        return ""
    # Names of the same suffix are compared by their stems: a shared ".parquet" made
    # "missing.parquet" look like "cut.parquet" to difflib.
    stem, suffix = os.path.splitext(p.name)
    if not suffix:
        return did_you_mean(p.name, close_matches(p.name, siblings), list_whole=False)
    same = {os.path.splitext(s)[0]: s for s in siblings if os.path.splitext(s)[1] == suffix}
    close = [same[c] for c in close_matches(stem, same)]
    close += close_matches(p.name, [s for s in siblings if os.path.splitext(s)[1] != suffix])
    return did_you_mean(p.name, close[:3], list_whole=False)


def plural(n: int, noun: str, plural_form: str | None = None) -> str:
    """``"1 preemption"``, ``"0 preemptions"``; ``plural_form`` for an
    irregular noun (``plural(2, "witness", "witnesses")``). Nouns ending in
    s, x, ch or sh take ``es`` by default."""
    if n == 1:
        return f"{n} {noun}"
    if plural_form is None:
        plural_form = noun + ("es" if noun.endswith(("s", "x", "ch", "sh")) else "s")
    return f"{n} {plural_form}"
