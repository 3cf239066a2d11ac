"""The queue rules followed by the stored changes (issue 24) give exactly the
verdicts of the whole-list rules.

``check_trace`` hands the checker the reader's change of each rebuilt waiting
list (``Trace.iter_steps(queue_changes=...)``, ``harness.check.queues.follow_waiting``):
STATE-CONTINUITY at step start and PREEMPT-WAITING-HEAD / STATE-CONTINUITY at
step end are then shown from the change alone, and membership in the backlog
is a dict lookup. Without the changes (``_Plain``: not a ``Trace``, so
``check_trace`` reads the rows as any iterable of steps) every rule walks the
whole lists, as before. Both must give the same violations, in the same
order, with the same messages: on every committed trace, and on traces whose
stored queue changes were doctored at random (seeded), the tamper tests' way.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from harness.check.checker import check_trace
from harness.check.model import TraceModel
from harness.check.queues import follow_waiting
from harness.trace import SUMMARY_KEY, TraceError, open_trace
from harness.trace.queues import QueueChange
from harness.trace.writer import reseal

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted(p for folder in ("golden", "traces") for p in (ROOT / folder).rglob("*.parquet"))
SOURCE = ROOT / "traces" / "preemption-heavy.parquet"


class _Plain:
    """A trace seen through its rows alone: no queue changes reach the checker."""

    def __init__(self, trace: Any) -> None:
        self.meta, self.summary, self._trace = trace.meta, trace.summary, trace

    def iter_steps(self):
        return self._trace.iter_steps()


def _outcome(path: Path, plain: bool) -> tuple[Any, ...]:
    try:
        trace = open_trace(path)
        result = check_trace(_Plain(trace) if plain else trace)
    except TraceError as exc:
        return ("refused", str(exc))
    return ("checked", result.num_violations, result.by_invariant,
            [json.dumps(v.to_dict(), sort_keys=True, default=str) for v in result.violations], result.notes)


def test_the_committed_traces_cover_the_changes() -> None:
    assert len(TRACES) >= 25


@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(ROOT)))
def test_committed_trace_same_verdict_with_and_without_changes(path: Path) -> None:
    assert _outcome(path, plain=False) == _outcome(path, plain=True)


def _doctor(rows: list[dict[str, Any]], rng: random.Random) -> None:
    """One random edit of a snapshot row's stored waiting change."""
    snapshots = [r for r in rows if r["kind"] in ("schedule_begin", "schedule_end") and r["waiting"] is not None]
    row = rng.choice([r for r in snapshots if r["waiting_kept"] is not None] or snapshots)
    ids = sorted({rid for r in snapshots for rid in (r["waiting"] or [])} | {"zz-unknown"})
    kept, head, tail = row["waiting_kept"], list(row["waiting_head"] or []), list(row["waiting"])
    what = rng.randrange(7)
    if what == 0 and kept is not None:
        row["waiting_kept"] = [max(kept[0] + rng.choice((-1, 1)), 0), kept[1]]
    elif what == 1 and kept is not None:
        row["waiting_kept"] = [kept[0], max(kept[1] + rng.choice((-1, 1)), 0)]
    elif what == 2:
        tail.insert(rng.randrange(len(tail) + 1), rng.choice(ids))
    elif what == 3 and tail:
        del tail[rng.randrange(len(tail))]
    elif what == 4 and kept is not None:
        head.insert(rng.randrange(len(head) + 1), rng.choice(ids))
        row["waiting_head"] = head
    elif what == 5 and len(tail) > 1:
        i = rng.randrange(len(tail) - 1)
        tail[i], tail[i + 1] = tail[i + 1], tail[i]
    elif kept is not None and head:
        row["waiting_head"] = head[::-1] if len(head) > 1 else []
    else:
        tail.append(rng.choice(ids))
    row["waiting"] = tail


@pytest.mark.parametrize("seed", range(40))
def test_doctored_changes_same_verdict_with_and_without_changes(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    table = pq.read_table(SOURCE)
    rows = table.to_pylist()
    for _ in range(rng.randint(1, 3)):
        _doctor(rows, rng)
    kv = dict(pq.ParquetFile(SOURCE).metadata.metadata)
    summary = json.loads(kv[SUMMARY_KEY])
    kv[SUMMARY_KEY] = json.dumps(summary, sort_keys=True).encode()
    out = tmp_path / f"doctored-{seed}.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema).replace_schema_metadata(kv), out)
    reseal(out, out)
    with_changes, plain = _outcome(out, plain=False), _outcome(out, plain=True)
    assert with_changes == plain


def test_follow_waiting_counts_the_ids_of_each_list() -> None:
    """The counts follow each list by its change alone: removed head and
    tail, pushed head, appended tail (duplicates counted)."""
    m = TraceModel.__new__(TraceModel)
    m.queue_changes, m.waiting_counts, m.waiting_indexed = {}, None, None
    first = ["a", "b", "c", "d"]
    assert follow_waiting(m, first) is None  # stored whole: counted whole
    assert m.waiting_counts == {"a": 1, "b": 1, "c": 1, "d": 1} and m.waiting_indexed is first
    second = ["p", "c", "d", "e", "e"]  # head [p] + first[2:4] + tail [e, e]
    change = QueueChange(second, first, 2, 2, ["p"], 2)
    m.queue_changes[id(second)] = change
    assert follow_waiting(m, second) is change
    assert m.waiting_counts == {"p": 1, "c": 1, "d": 1, "e": 2} and m.queue_changes == {}
    third = ["c"]  # first[1:2] of second, nothing added
    m.queue_changes[id(third)] = QueueChange(third, second, 1, 1, (), 0)
    follow_waiting(m, third)
    assert m.waiting_counts == {"c": 1}
    unrelated = ["x", "y"]  # a change from another list than the one followed: counted whole
    m.queue_changes[id(unrelated)] = QueueChange(unrelated, first, 0, 1, (), 1)
    follow_waiting(m, unrelated)
    assert m.waiting_counts == {"x": 1, "y": 1} and m.waiting_indexed is unrelated
