"""Validate a trace's rows against their kind before anything consumes them.

The reader (``Trace.iter_steps``) runs ``StepValidator.check_step`` on every
step, so ``check``, ``replay`` and ``diff`` see the same usable rows or the
same one-line ``TraceError``. The values are checked column by column first
(``suspect_rows``: pyarrow compute over the stored columns, each once, not
over the rebuilt queues), and row by row only on the rows it flags: what is
refused, and the message, are those of the per-row check (issue 24).

What is refused here is what no engine can record (a recording or editing
artifact), never an engine's decision: an impossible *value* of a decision
(a negative scheduled count, a block id out of the pool) is left to the
invariants, which report it with a witness.

Refused: an unknown or null ``kind``; ``event_index`` not 0, 1, ... within
the step; a null or out-of-range ``rank`` (``0 <= rank <
data_parallel_size``) or ranks out of order; a request-scoped row without a
``request_id``; a non-finite or negative time (``clock_s``,
``arrival_time_s``, ``abort_time_s``); a negative token id (prompt, stop or
output tokens; drafts may hold -1 placeholders); an ``arrival``/``reject`` row that
``RequestSpec`` refuses (so replay can rebuild the workload); an unknown
status, finish reason or ``schedule_kind``; a null inside a list (or inside
one of ``group_block_ids``' lists); a hybrid row whose ``group_block_ids``,
null blocks left out, are not its ``block_ids``; rows out
of the step's documented order (docs/trace-format.md "Row order"); a
``schedule_begin``, ``schedule_end`` or ``update_end`` without
``num_free_blocks`` (the engine's own free count, which the block and
progress rules read: without it a leak would read as free blocks); a
``schedule_begin`` without its ``schedule_end`` or an ``update_begin``
without its ``update_end`` (unless the step ends on ``crash``); rows after
a ``crash``, and steps after a crash step.
"""

from __future__ import annotations

import math
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from reference.request import RequestStatus
from reference.workload import WorkloadError

from harness.trace.rows import spec_from_row
from harness.trace.schema import EVENT_KINDS

Row = dict[str, Any]

# Rows that name a request (request_id must be a non-empty string).
_REQUEST_KINDS = frozenset({"arrival", "reject", "abort", "encoder_plan", "schedule", "withdraw", "preempt",
                            "skip", "kv_load", "kv_promote", "output", "finish", "kv_finished", "kv_free",
                            "draft", "request_state", "skipped_free"})
# Columns holding request ids (printed in witnesses: no control characters).
_ID_COLUMNS = ("request_id", "waiting", "running", "preempted_req_ids", "finished_req_ids", "request_data_ids",
               "waiting_head", "running_head")
# Where each kind may appear inside one rank's rows: the phase it belongs to.
# Phases only move forward (INPUT < DECIDE < SCHEDULED < UPDATE < END); the
# begin/end rows open and close theirs. Inside UPDATE the rows keep the
# update's order: free_drain, kv_invalid, output, finish, kv_finished and
# kv_free, draft, request_state (the sub-rank).
_INPUT, _DECIDE, _SCHEDULED, _UPDATE, _END = range(5)
_INPUT_KINDS = frozenset({"arrival", "reject", "abort", "reset_prefix_cache"})
_DECISION_KINDS = frozenset({"encoder_plan", "schedule", "withdraw", "preempt", "skip", "kv_load",
                             "kv_promote", "skipped_free"})
_UPDATE_ORDER = {"free_drain": 0, "kv_invalid": 1, "output": 2, "finish": 3, "kv_finished": 4, "kv_free": 4,
                 "draft": 5, "request_state": 6}
_STATUSES = frozenset(s.name for s in RequestStatus)
_FINISHED_STATUSES = frozenset(s.name for s in RequestStatus if RequestStatus.is_finished(s))
_FINISH_REASONS = frozenset({"stop", "length", "abort", "error", "repetition"})
_SCHEDULE_KINDS = frozenset({"new", "resumed", "running"})
_TIME_COLUMNS = ("clock_s", "arrival_time_s", "abort_time_s")
# Token ids (vocabulary indices: no tokenizer or model produces a negative one).
# Not spec_token_ids: vLLM pads drafts with -1 placeholders (recorded as they are).
_TOKEN_COLUMNS = ("prompt_token_ids", "stop_token_ids", "token_ids", "output_token_ids")
_SPEC_KINDS = frozenset({"arrival", "reject"})


# A control character as _check_values defines it (C0, DEL, C1), for RE2.
_CONTROL_RE = r"[\x{00}-\x{1f}\x{7f}-\x{9f}]"
# Kinds whose value checks are rare enough to run on every such row.
_ALWAYS_CHECKED = frozenset({"reset_prefix_cache", "crash"})
_FINISH_KINDS = frozenset({"finish", "abort"})
_STATUS_KINDS = frozenset({"preempt", "kv_promote", "request_state"})
# Rows that carry the engine's free-block count (docs/trace-format.md): every
# engine records it; the block and progress rules read it.
_FREE_COUNT_KINDS = frozenset({"schedule_begin", "schedule_end", "update_end"})
_VALUE_SETS: dict[frozenset[str], pa.Array] = {}


def _value_set(names: frozenset[str]) -> pa.Array:
    """``names`` as an Arrow string array (built once per set: building one
    costs more than the lookup)."""
    found = _VALUE_SETS.get(names)
    if found is None:
        found = _VALUE_SETS[names] = pa.array(sorted(names), pa.string())
    return found


class RowError(ValueError):
    """A row no engine records: ``str()`` says which row and what is wrong."""


class StepValidator:
    """Checks each step's rows in file order (``check_step``); remembers
    across steps only whether a crash step was seen (O(1) memory).

    ``num_ranks``: the config's ``data_parallel_size`` (ranks are
    ``0 .. num_ranks - 1``)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._crashed_at: int | None = None

    def check_step(self, step: int, rows: list[Row], suspects: list[bool] | None = None) -> None:
        """Raise RowError naming the step and event of the first bad row.

        ``suspects`` (parallel to ``rows``, from ``suspect_rows`` over the
        stored columns): the rows whose own values need the per-row check; the
        others only have their order checked (and an ``arrival``/``reject``
        row its request spec). None checks every row's values.

        The row order is checked through ``_TRANSITIONS`` (the phase machine
        of ``_advance``, one dict lookup a row); a row's place (``step S
        event E``) is formatted only for a message (issue 24)."""
        if self._crashed_at is not None:
            raise RowError(f"step {step} follows the crash at step {self._crashed_at} (a crash ends the run)")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise RowError(f"step {step!r} is not an integer >= 0")
        num_ranks = self.num_ranks
        transitions = _TRANSITIONS
        rank: Any = _NO_RANK
        state = _DONE_STATE  # before a rank's first row: nothing open (never closed)
        for index, row in enumerate(rows):
            if row.get("event_index") != index:
                raise RowError(f"{_where(step, row)}: event_index must count 0, 1, ... within the step "
                               f"(expected {index})")
            kind = row.get("kind")
            r = row.get("rank")
            if kind not in EVENT_KINDS:
                raise RowError(f"{_where(step, row)}: unknown event kind {kind!r}")
            if r != rank or rank is _NO_RANK:
                if not isinstance(r, int) or not 0 <= r < num_ranks:
                    raise RowError(f"{_where(step, row)}: rank {r!r} is not in 0..{num_ranks - 1} "
                                   f"(data_parallel_size {num_ranks})")
                if rank is not _NO_RANK:
                    if r < rank:
                        raise RowError(f"{_where(step, row)}: rank {r} after rank {rank} (each rank's rows "
                                       f"in rank order)")
                    if _STATES[state][3]:
                        _close_state(_where(step, row), state, rows)
                rank, state = r, _INPUT_STATE
            following = transitions[state].get(kind)
            if following is None:
                following = _transition(_where(step, row), state, kind)
            state = following
            if suspects is None or suspects[index]:
                _check_values(_where(step, row), kind, row)
            if row.get("group_block_ids") is not None:
                _check_group_blocks(step, kind, row)
            elif kind in _SPEC_KINDS:
                _check_spec(_where(step, row), kind, row)
            if kind == "crash":
                self._crashed_at = step
        if rank is not _NO_RANK and _STATES[state][3]:
            _close_state(f"step {step}", state, rows)


def _where(step: int, row: Row) -> str:
    """A row's place in a message: ``step S event E``."""
    return f"step {step} event {row.get('event_index')!r}"


# The phase machine of ``_advance`` as a table: a state is (phase, sub,
# open rows, the open rows a step cannot end with), numbered in _STATES;
# _TRANSITIONS[state][kind] is the state after a ``kind`` row, filled on
# first use (a kind that cannot come in a state is never cached: it raises).
_STATES: list[tuple[int, int, tuple[str, ...], tuple[str, ...]]] = []
_STATE_IDS: dict[tuple[int, int, tuple[str, ...]], int] = {}
_TRANSITIONS: list[dict[str, int]] = []
_NO_RANK = object()


def _state_id(phase: int, sub: int, open_rows: tuple[str, ...]) -> int:
    key = (phase, sub, open_rows)
    found = _STATE_IDS.get(key)
    if found is None:
        missing = tuple(name for name in open_rows if name in ("schedule_end", "update_end"))
        found = _STATE_IDS[key] = len(_STATES)
        _STATES.append((phase, sub, open_rows, missing))
        _TRANSITIONS.append({})
    return found


_INPUT_STATE = _state_id(_INPUT, 0, ())  # a rank's rows begin in the input phase
_DONE_STATE = _state_id(_END, 0, ())


def _transition(where: str, state: int, kind: str) -> int:
    """The state after a ``kind`` row in ``state`` (``_advance``), cached;
    RowError (``where``: the row's place) if it cannot come there."""
    phase, sub, open_rows, _ = _STATES[state]
    opened = list(open_rows)
    phase, sub = _advance(where, kind, phase, sub, opened)
    following = _state_id(phase, sub, tuple(opened))
    _TRANSITIONS[state][kind] = following
    return following


def _close_state(where: str, state: int, rows: list[Row]) -> None:
    """``_close`` of a rank's rows in ``state``: RowError for a schedule or
    update left open, unless the step has a crash row."""
    crashed = any(row.get("kind") == "crash" for row in rows)
    _close(where, list(_STATES[state][2]), crashed)


def suspect_rows(batch: pa.RecordBatch) -> list[bool]:
    """Which rows of ``batch`` (as stored: queue snapshots as changes) may fail
    ``_check_values``: one bool per row, computed column by column with
    pyarrow compute (no Python loop over values).

    A superset of the rows ``_check_values`` refuses, so ``check_step`` runs
    the per-row check on these alone and still refuses exactly what it
    refused before, with the same message. A rebuilt snapshot queue holds its
    stored ids (``<queue>``, ``<queue>_head``) and a slice of the previous
    snapshot of the same queue, whose ids were checked on their own row: an
    id with a control character or a null is flagged on the first row that
    stores it, the first row whose rebuilt queue holds it."""
    n = batch.num_rows
    names = set(batch.schema.names)
    flagged: list[pa.Array] = []  # row indices (int64 arrays)

    def rows_where(mask: Any) -> None:
        flagged.append(pc.indices_nonzero(pc.fill_null(mask, True)))

    def elements_where(column: str, element_mask: Any) -> None:
        values = batch.column(column)
        flat = pc.list_flatten(values)
        mask = pc.fill_null(element_mask(flat), True)
        if pc.any(mask).as_py():
            flagged.append(pc.filter(pc.list_parent_indices(values), mask))

    kind = batch.column("kind")

    def kind_in(kinds: frozenset[str]) -> Any:
        return pc.is_in(kind, value_set=_value_set(kinds))

    def not_in(column: str, allowed: frozenset[str]) -> Any:
        return pc.invert(pc.is_in(batch.column(column), value_set=_value_set(allowed)))

    def not_in_values(values: Any, allowed: frozenset[str]) -> Any:
        return pc.invert(pc.is_in(values, value_set=_value_set(allowed)))

    for column in names:
        # "null inside <column>"; the child array's null count (which may count
        # values outside the slice: a superset) skips the clean columns cheaply.
        values = batch.column(column)
        if pa.types.is_list(values.type) and values.values.null_count:
            elements_where(column, pc.is_null)
        if pa.types.is_list(values.type) and pa.types.is_list(values.values.type) \
                and values.values.values.null_count:
            # A null id inside an inner list (group_block_ids): the row of that list.
            inner = pc.list_flatten(values)
            mask = pc.fill_null(pc.is_null(pc.list_flatten(inner)), True)
            if pc.any(mask).as_py():
                lists = pc.filter(pc.list_parent_indices(inner), mask)
                flagged.append(pc.take(pc.list_parent_indices(values), lists))
    for column in _ID_COLUMNS:
        if column not in names:
            continue
        if pa.types.is_list(batch.schema.field(column).type):
            elements_where(column, lambda flat: pc.match_substring_regex(flat, _CONTROL_RE))
        else:
            rows_where(pc.fill_null(pc.match_substring_regex(batch.column(column), _CONTROL_RE), False))
    rid = batch.column("request_id")
    rows_where(pc.and_(kind_in(_REQUEST_KINDS), pc.fill_null(pc.equal(pc.utf8_length(rid), 0), True)))
    for column in _TIME_COLUMNS:
        if column in names:
            values = batch.column(column)
            ok = pc.and_(pc.is_finite(values), pc.greater_equal(values, 0))
            rows_where(pc.and_(pc.is_valid(values), pc.invert(pc.fill_null(ok, False))))
    for column in _TOKEN_COLUMNS:
        if column in names:
            lowest = pc.min(batch.column(column).values).as_py()
            if lowest is not None and lowest < 0:
                elements_where(column, lambda flat: pc.less(flat, 0))
    rows_where(pc.and_(pc.equal(kind, "schedule_begin"), pc.is_null(batch.column("clock_s"))))
    rows_where(pc.and_(kind_in(_FREE_COUNT_KINDS), pc.is_null(batch.column("num_free_blocks"))))
    bad_finish = pc.or_(not_in("status", _FINISHED_STATUSES),
                        pc.and_(pc.is_valid(batch.column("finish_reason")),
                                not_in("finish_reason", _FINISH_REASONS)))
    rows_where(pc.and_(kind_in(_FINISH_KINDS), bad_finish))
    # A finish reason that is not its status's (_check_reason_of_status): the
    # (status, reason) pair outside the pairs the statuses report.
    pair = pc.binary_join_element_wise(batch.column("status"), batch.column("finish_reason"), "\x1f")
    reported = frozenset(f"{status}\x1f{reason}" for status, reason in _REASON_OF_STATUS.items())
    rows_where(pc.and_(pc.and_(kind_in(_FINISH_KINDS), pc.is_valid(batch.column("finish_reason"))),
                       not_in_values(pair, reported)))
    rows_where(pc.and_(kind_in(_STATUS_KINDS), not_in("status", _STATUSES)))
    rows_where(kind_in(_ALWAYS_CHECKED))
    bad_schedule = pc.or_(not_in("schedule_kind", _SCHEDULE_KINDS),
                          pc.or_(pc.is_null(batch.column("num_computed_tokens")),
                                 pc.is_null(batch.column("num_scheduled_tokens"))))
    rows_where(pc.and_(pc.equal(kind, "schedule"), bad_schedule))
    suspects = [False] * n
    for indices in flagged:
        if len(indices):
            for i in indices.to_pylist():
                suspects[i] = True
    return suspects


def _advance(where: str, kind: str, phase: int, sub: int, open_rows: list[str]) -> tuple[int, int]:
    """The phase after a ``kind`` row in ``phase``; RowError if it cannot come there."""
    if kind == "crash":
        if phase == _END and open_rows == ["done"]:
            raise RowError(f"{where}: crash row after update_end")
        open_rows.clear()
        open_rows.append("crashed")
        return _END, 0
    if open_rows == ["crashed"] or (phase == _END and open_rows == ["done"]):
        raise RowError(f"{where}: {kind} row after the rank's last row")
    if kind in _INPUT_KINDS or (kind == "preempt" and phase == _INPUT):
        if phase != _INPUT:
            raise RowError(f"{where}: input row {kind} after the step's scheduling began")
        return _INPUT, 0
    if kind == "schedule_begin":
        if phase != _INPUT:
            raise RowError(f"{where}: second schedule_begin or schedule_begin after the update began")
        open_rows.append("schedule_end")
        return _DECIDE, 0
    if kind in _DECISION_KINDS:
        if phase != _DECIDE:
            raise RowError(f"{where}: decision row {kind} outside schedule_begin .. schedule_end")
        return _DECIDE, 0
    if kind == "schedule_end":
        if phase != _DECIDE:
            raise RowError(f"{where}: schedule_end without schedule_begin")
        open_rows.remove("schedule_end")
        return _SCHEDULED, 0
    if kind == "update_begin":
        if phase not in (_INPUT, _SCHEDULED) or "schedule_end" in open_rows:
            raise RowError(f"{where}: update_begin out of place (second one, or before schedule_end)")
        open_rows.append("update_end")
        return _UPDATE, 0
    if kind == "update_end":
        if phase != _UPDATE:
            raise RowError(f"{where}: update_end without update_begin")
        open_rows.clear()
        open_rows.append("done")
        return _END, 0
    if kind == "request_state" and phase == _SCHEDULED:
        return _SCHEDULED, 0
    rank = _UPDATE_ORDER.get(kind)
    if rank is None or phase != _UPDATE:
        raise RowError(f"{where}: {kind} row outside update_begin .. update_end")
    if rank < sub:
        raise RowError(f"{where}: {kind} row out of the update's order (free_drain, kv_invalid, output, "
                       f"finish, kv_finished/kv_free, draft, request_state)")
    return _UPDATE, rank


def _close(where: str, open_rows: list[str], crashed: bool) -> None:
    """RowError if a rank's rows opened a schedule or update they never
    closed, in a step without a crash."""
    if crashed:
        return
    missing = [name for name in open_rows if name in ("schedule_end", "update_end")]
    if missing:
        raise RowError(f"{where}: the rank's rows lack their {missing[0]} (and the step did not crash)")


# The finish reason each finished status reports (vLLM ``RequestStatus.get_finished_reason``).
_REASON_OF_STATUS = {s.name: RequestStatus.get_finished_reason(s) for s in RequestStatus if RequestStatus.is_finished(s)}


def _check_reason_of_status(where: str, kind: str, row: Row) -> None:
    """A ``finish``/``abort`` row's finish_reason is its status's (issue 26):
    every recorder derives the reason from the status, so FINISHED_STOPPED
    with "length" is an edit, not a decision."""
    status, reason = row.get("status"), row.get("finish_reason")
    if reason is not None and reason != _REASON_OF_STATUS[status]:
        raise RowError(f"{where}: {kind} status {status} with finish_reason {reason!r} (that status "
                       f"reports {_REASON_OF_STATUS[status]!r})")


def _check_values(where: str, kind: str, row: Row) -> None:
    """The row's own fields: ids, times, statuses, nulls in lists, request specs."""
    if kind in _REQUEST_KINDS:
        rid = row.get("request_id")
        if not isinstance(rid, str) or not rid:
            raise RowError(f"{where}: {kind} row without a request_id")
    for column in _ID_COLUMNS:
        value = row.get(column)
        for rid in (value if isinstance(value, list) else [value]):
            if isinstance(rid, str) and any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in rid):
                raise RowError(f"{where}: {column} {rid[:40]!r} holds a control character (ESC, newline, ...)")
    for column in _TIME_COLUMNS:
        value = row.get(column)
        if value is not None and (not math.isfinite(value) or value < 0):
            raise RowError(f"{where}: {column} {value!r} is not a finite number >= 0")
    for column in _TOKEN_COLUMNS:
        value = row.get(column)
        if isinstance(value, list) and any(isinstance(t, int) and t < 0 for t in value):
            raise RowError(f"{where}: {column} holds a negative token id ({min(t for t in value if t is not None)})")
    if kind == "schedule_begin" and row.get("clock_s") is None:
        raise RowError(f"{where}: schedule_begin without clock_s")
    if kind in _FREE_COUNT_KINDS and row.get("num_free_blocks") is None:
        raise RowError(f"{where}: {kind} without num_free_blocks")
    for column, value in row.items():
        if isinstance(value, list) and (None in value or any(isinstance(v, list) and None in v for v in value)):
            raise RowError(f"{where}: null inside {column}")
    status = row.get("status")
    if kind in ("finish", "abort"):
        if status not in _FINISHED_STATUSES:
            raise RowError(f"{where}: {kind} status {status!r} is not a finished request status")
        if row.get("finish_reason") not in _FINISH_REASONS and row.get("finish_reason") is not None:
            raise RowError(f"{where}: unknown finish_reason {row.get('finish_reason')!r}")
        _check_reason_of_status(where, kind, row)
    elif kind in ("preempt", "kv_promote", "request_state"):
        if status not in _STATUSES:
            raise RowError(f"{where}: unknown request status {status!r}")
    elif kind == "reset_prefix_cache" and status not in ("succeeded", "refused"):
        raise RowError(f"{where}: reset_prefix_cache status {status!r} is not succeeded or refused")
    elif kind == "crash" and (not isinstance(status, str) or not row.get("message")):
        raise RowError(f"{where}: crash row without its call (status) or message")
    if kind == "schedule":
        if row.get("schedule_kind") not in _SCHEDULE_KINDS:
            raise RowError(f"{where}: schedule_kind {row.get('schedule_kind')!r} is not new, resumed or running")
        for column in ("num_computed_tokens", "num_scheduled_tokens"):
            if row.get(column) is None:
                raise RowError(f"{where}: schedule row without {column}")
    if kind in _SPEC_KINDS:
        _check_spec(where, kind, row)


def _check_group_blocks(step: int, kind: str, row: Row) -> None:
    """A hybrid row's ``group_block_ids`` hold its ``block_ids``: the same
    ids, each as often, once the null blocks (0, an admission's slots before
    the window) are left out (docs/trace-format.md "Hybrid models"). Every
    recorder writes both from the same blocks, so a row whose two columns
    disagree is an edit; the checker follows the groups and would otherwise
    never look at ``block_ids``. Regression: a preempt row's groups cut to
    one list passed ``check`` as conformant."""
    groups = row["group_block_ids"]
    if any(not isinstance(g, list) for g in groups):
        return  # a null list: "null inside group_block_ids" (_check_values)
    held = [b for g in groups for b in g if b != 0]
    pool = row.get("block_ids") or []
    if held == pool:  # every row but an admission with a hit: the groups in order
        return
    if None in held or None in pool:
        return  # "null inside ..." (_check_values)
    if sorted(held) != sorted(pool):
        raise RowError(f"{_where(step, row)}: {kind} block_ids {_short(row.get('block_ids'))} are not the blocks of its "
                       f"group_block_ids {_short(groups)} (null blocks left out)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_spec(where: str, kind: str, row: Row) -> None:
    """RowError unless an ``arrival``/``reject`` row rebuilds a RequestSpec."""
    try:
        spec_from_row(row)
    except (WorkloadError, ValueError, TypeError, KeyError) as exc:
        raise RowError(f"{where}: {kind} row is not a valid request ({' '.join(str(exc).split())[:160]})") \
            from None
