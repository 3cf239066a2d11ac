"""Queue snapshots stored as changes (schema 8): what keeps a trace's size and
its reader's memory flat however long the backlog grows.

Every ``schedule_begin`` and ``schedule_end`` row records the rank's
``waiting`` and ``running`` queues. Written whole, a backlog of thousands of
waiting requests is repeated in every row (the issue 17 finding: 11.2 GB RSS
to check the whole Azure code trace). From schema 8 each such list is stored
relative to the previous snapshot of the same queue on the same rank (the
previous ``schedule_begin`` or ``schedule_end`` row, in file order):

    queue = <queue>_head + previous[start : start + length] + <queue>

with ``<queue>_kept = [start, length]``; a null ``<queue>_kept`` means the
row holds the whole list in ``<queue>`` (the first snapshot, or when no
slice of the previous one is kept). Admissions pop the head, preemptions
push a few ids in front, arrivals append: each row stores only those.

``QueueEncoder`` (the writer) and ``QueueDecoder`` (the reader) keep the
previous lists of each (rank, queue); both cost a few C-speed list scans per
row, no Python loop over the backlog. Rows of other kinds (a
``reset_prefix_cache`` row's ``running``) are stored whole and are not part
of the chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

#: The snapshot columns stored as changes, and the kinds whose rows chain.
QUEUE_COLUMNS = ("waiting", "running")
SNAPSHOT_KINDS = frozenset({"schedule_begin", "schedule_end"})
#: The columns a schema-8 row adds per queue (``waiting_kept``, ``waiting_head``, ...).
DELTA_COLUMNS = tuple(f"{q}_{part}" for q in QUEUE_COLUMNS for part in ("kept", "head"))
# Ids pushed in front of the kept slice that the encoder looks past (a step
# preempts at most a few); beyond that the list is stored whole.
_MAX_HEAD = 64

Row = dict[str, Any]


def _common_prefix(a: list[str], b: list[str]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (binary search
    over C-speed slice comparisons: O(n log n) element compares at C speed)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi:  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def encode(previous: list[str] | None, queue: list[str]) -> tuple[list[int] | None, list[str] | None, list[str]]:
    """(kept, head, tail) such that ``queue == head + previous[kept[0]:
    kept[0] + kept[1]] + tail``; (None, None, queue) to store it whole."""
    if not previous or not queue:
        return None, None, queue
    for h in range(min(len(queue), _MAX_HEAD)):
        try:
            start = previous.index(queue[h])
        except ValueError:
            continue  # pushed in front (a preempted request): part of the head
        most = min(len(queue) - h, len(previous) - start)
        if queue[h:h + most] == previous[start:start + most]:  # the usual case: one compare
            length = most
        else:
            length = _common_prefix(queue[h:], previous[start:])
        tail = queue[h + length:]
        if len(tail) + h >= len(queue):
            break
        return [start, length], queue[:h], tail
    return None, None, queue


class QueueEncoder:
    """Rewrites each snapshot row's queues as changes (``encode_row``), in
    file order; keeps the previous full lists per (rank, queue)."""

    def __init__(self) -> None:
        self._previous: dict[tuple[int, str], list[str]] = {}

    def encode_row(self, row: Row) -> Row:
        """The row to store: ``row`` itself for other kinds, else a copy with
        ``<queue>``, ``<queue>_kept`` and ``<queue>_head`` set."""
        if row.get("kind") not in SNAPSHOT_KINDS:
            return row
        out = dict(row)
        rank = row.get("rank") or 0
        previous = self._previous
        for name, kept_key, head_key in _ROW_KEYS:
            queue = row.get(name)
            if queue is None:
                continue
            queue = list(queue)
            key = (rank, name)
            before = previous.get(key)
            if queue and before == queue:
                # Unchanged (most snapshots of a step, C-speed compare): what
                # ``encode`` finds, the whole previous list kept, nothing around it.
                out[name], out[kept_key], out[head_key] = [], [0, len(queue)], []
            else:
                kept, head, tail = encode(before, queue)
                out[name], out[kept_key], out[head_key] = tail, kept, head
            previous[key] = queue
        return out


#: Per queue column: (the column, its ``_kept`` and ``_head`` columns).
_ROW_KEYS = tuple((name, f"{name}_kept", f"{name}_head") for name in QUEUE_COLUMNS)


class QueueChange(NamedTuple):
    """How the decoder rebuilt one snapshot row's queue: ``queue == head +
    base[start:start + length] + queue[len(queue) - tail:]``, ``base`` the
    previous snapshot's list of the same (rank, queue) (the very object;
    ``queue is base`` when the row kept it whole and added nothing)."""

    queue: list[str]
    base: list[str]
    start: int
    length: int
    head: Sequence[str]
    tail: int


class QueueDecoder:
    """Rebuilds the full queues of snapshot rows (``decode_row``), in file
    order. Raises ValueError for a kept slice outside the previous list or a
    change with no previous list to apply to. A row's rebuilt list is also
    the decoder's previous list, and a row whose queue is unchanged (the
    previous list kept whole, nothing in front or after) gets that very list,
    shared with the rows before it: read it, never edit it in place."""

    def __init__(self, changes: dict[int, QueueChange] | None = None) -> None:
        self._previous: dict[tuple[int, str], list[str]] = {}
        #: When given, each rebuilt ``waiting`` list's change, by ``id`` of that
        #: list (``QueueChange``): what lets the checker follow the backlog
        #: by its changes (issue 24). The consumer pops its entries. An
        #: unchanged queue (the previous list itself) adds none: its consumer
        #: knows that very list already.
        self.changes = changes

    def decode_row(self, row: Row, changes: Row | None = None) -> None:
        """Replace the row's stored changes by the full lists, in place; the
        ``*_kept`` and ``*_head`` keys are removed (rows read as the recorder
        made them). ``changes``: those keys' values when the caller read them
        apart from the row (then ``row`` lacks them)."""
        if changes is None:
            changes = {column: row.pop(column, None) for column in DELTA_COLUMNS}
        snapshot = row.get("kind") in SNAPSHOT_KINDS
        rank = row.get("rank") or 0
        for name in QUEUE_COLUMNS:
            kept = changes.get(f"{name}_kept")
            head = changes.get(f"{name}_head")
            if not snapshot:
                if kept is not None or head is not None:
                    raise ValueError(f"{row.get('kind')} row stores {name} as a change (only snapshots do)")
                continue
            tail = row.get(name)
            if tail is None:
                if kept is not None or head is not None:
                    raise ValueError(f"{name}_kept/{name}_head without {name}")
                continue
            if kept is not None:
                previous = self._previous.get((rank, name))
                if previous is None or len(kept) != 2 or kept[0] < 0 or kept[1] < 0 \
                        or kept[0] + kept[1] > len(previous):
                    had = "there is none" if previous is None else f"{len(previous)} ids"
                    shown = kept if len(kept) <= 4 else f"[{', '.join(map(str, kept[:4]))}, ... ({len(kept)} values)]"
                    raise ValueError(f"{name}_kept {shown} is not a slice of the previous {name} ({had})")
                if not head and not tail and kept[0] == 0 and kept[1] == len(previous):
                    # Unchanged (most snapshots: 95 % on the whole Azure code trace):
                    # the previous list itself, no copy of the backlog (issue 24:
                    # the copy, its freeing and the young collections walking it
                    # made reading grow with the backlog).
                    # No change recorded: ``changes`` keys lists by ``id`` and
                    # this one's entry, if any, is its own row's.
                    kept_slice = previous
                else:
                    kept_slice = previous[kept[0]:kept[0] + kept[1]]  # one copy, extended in place
                    if head:
                        kept_slice[:0] = head
                    kept_slice += tail
                    if self.changes is not None and name == "waiting":
                        self.changes[id(kept_slice)] = QueueChange(kept_slice, previous, kept[0], kept[1],
                                                                   head or (), len(tail))
                tail = kept_slice
            elif head is not None:
                raise ValueError(f"{name}_head without {name}_kept")
            row[name] = tail
            # Shared with the row, not copied (issue 24: a copy of the backlog per
            # snapshot row grew with the trace): a consumer never edits a row's
            # queue in place (the checker copies what it edits).
            self._previous[(rank, name)] = tail
