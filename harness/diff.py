"""Compare two traces of the same workload (``harness diff A B``).

Two engines, or two versions of one, run on the same workload give two traces.
``diff_traces`` streams both side by side, one step at a time
(``Trace.iter_steps``; memory is bounded by a row group plus a few numbers per
request), compares each step's rows with ``harness.replay.first_difference``,
keeps the first divergent step with some context, and reads both traces to
the end to compute per-trace summary statistics (``TraceStats``) and their
difference (B - A).

Two traces are the same workload when their metadata agree on the workload
(source, sha256, params) and the seed (which drives the scripted model's
tokens), and when their ``arrival``/``reject`` rows hold the same requests
(ids, prompts and the other request fields); otherwise ``WorkloadMismatch``
(a ``TraceError``: the CLI exits 2). Different configs are reported
(``config_diff``) but compared anyway.

Recordings of a real engine (workload source ``live``: converted by
``recording_convert.convert``) are matched without what is particular to
one run: the sha256 and params (vLLM's request ids, which carry a random
suffix, and the wall-clock arrival times) are left out, and so are the
requests' ``arrival_time_s``/``abort_time_s`` (the virtual time of the step in
which vLLM saw the request, an outcome of the run, not an input). Requests are
matched by the order they were added (``r000000`` is the first), which is the
workload's order in an offline recording (``harness serve-record --offline``).
"""

from __future__ import annotations

import dataclasses

import hashlib
import json
import math
from array import array
from dataclasses import dataclass, field
from itertools import zip_longest
from collections.abc import Callable
from typing import Any

from deepdiff import DeepDiff
from deepdiff.helper import CannotCompare
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from harness.brief import short, short_repr, short_text
from harness.trace.recorder import Row
from harness.replay import first_difference
from harness.trace import SCHEMA_VERSION, Trace, TraceError
from harness.trace.schema import rows_as_of
from harness.richtext import keep_words_whole

# Decision rows (a "withdraw" row, where the trace format has it, takes back a schedule).
DECISION_KINDS = ("preempt", "encoder_plan", "schedule", "withdraw", "schedule_end", "finish")
# Request fields of arrival/reject rows besides request_id and the prompt.
_REQUEST_FIELDS = ("arrival_time_s", "abort_time_s", "priority", "max_tokens", "min_tokens",
                   "ignore_eos", "eos_token_id", "stop_token_ids", "scripted_output_len", "mm_positions")
#: The request fields that are inputs of a live recording (its times are outcomes).
_LIVE_REQUEST_FIELDS = tuple(k for k in _REQUEST_FIELDS if k not in ("arrival_time_s", "abort_time_s"))
_CONTEXT_ROWS = 24  # rows of the divergent step shown per side in the text report


class WorkloadMismatch(TraceError):
    """The two traces do not record the same workload (nothing to compare)."""


def percentile(sorted_values: list[int], p: float) -> int | None:
    """Nearest-rank percentile of an ascending list: the smallest value with at
    least ``p`` percent of the values at or below it (None for no values)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(p / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class TraceStats:
    """Streaming summary of one trace: feed every step with ``add_step``.

    Counts (all ints):
      ``steps``              engine steps in the trace;
      ``requests``           requests of the workload (``arrival`` + ``reject`` rows);
      ``finished``           ``finish`` rows (requests that stopped: EOS, stop token, length);
      ``rejected``           ``reject`` rows; ``aborted``: ``abort`` rows;
      ``preemptions``        ``preempt`` rows (a request preempted twice counts twice);
      ``prefix_hit_tokens``  tokens, sum of ``num_prefix_hit_tokens`` over ``schedule`` rows
                             (resumed requests re-hitting their own blocks included);
      ``output_tokens``      tokens kept by requests that ended: ``num_output_tokens`` of
                             ``finish`` and ``abort`` rows (tokens sampled past a stop, e.g.
                             accepted drafts after EOS, are not counted)
                             (aborted requests' tokens included).
    Latency of a finished request, in **steps**: the step of its ``finish`` row minus
    the step of its ``arrival`` row (0: arrived and finished in the same step):
      ``latency_steps_mean`` (float), ``latency_steps_p50``, ``latency_steps_p99``
      (ints, nearest-rank percentiles); None when nothing finished.
    Virtual time: ``virtual_time_s``, seconds, the ``clock_s`` of the last step's
    ``schedule_begin`` row (the clock at the *start* of the last step).
    Throughput (floats; None when the divisor is 0):
      ``finished_per_1000_steps``  = finished * 1000 / steps;
      ``output_tokens_per_step``   = output_tokens / steps;
      ``finished_per_s``           = finished / virtual_time_s (requests per virtual second);
      ``output_tokens_per_s``      = output_tokens / virtual_time_s (tokens per virtual second).

    Memory: the arrival step of each unfinished request and one latency per
    finished request (a few ints per request), nothing per step.
    """

    FIELDS = ("steps", "requests", "finished", "rejected", "aborted", "preemptions",
              "prefix_hit_tokens", "output_tokens", "latency_steps_mean", "latency_steps_p50",
              "latency_steps_p99", "virtual_time_s", "finished_per_1000_steps",
              "output_tokens_per_step", "finished_per_s", "output_tokens_per_s")

    def __init__(self) -> None:
        self.steps = 0
        self.requests = 0
        self.finished = 0
        self.rejected = 0
        self.aborted = 0
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        self.output_tokens = 0
        self.virtual_time_s = 0.0
        self._arrival_step: dict[str, int] = {}
        self._latencies: list[int] = []

    def add_step(self, step: int, rows: list[Row]) -> None:
        """Account one step's rows (in trace order)."""
        self.steps += 1
        for row in rows:
            kind = row["kind"]
            if kind == "arrival":
                self.requests += 1
                self._arrival_step[row["request_id"]] = step
            elif kind == "reject":
                self.requests += 1
                self.rejected += 1
            elif kind == "abort":
                self.aborted += 1
                self.output_tokens += row["num_output_tokens"] or 0
                self._arrival_step.pop(row["request_id"], None)
            elif kind == "schedule_begin":
                self.virtual_time_s = row["clock_s"] or 0.0
            elif kind == "preempt":
                self.preemptions += 1
            elif kind == "schedule":
                self.prefix_hit_tokens += row["num_prefix_hit_tokens"] or 0
            elif kind == "finish":
                self.finished += 1
                self.output_tokens += row["num_output_tokens"] or 0
                arrived = self._arrival_step.pop(row["request_id"], None)
                if arrived is not None:
                    self._latencies.append(step - arrived)

    def to_dict(self) -> dict[str, Any]:
        """Every statistic of ``FIELDS`` (see the class docstring for units)."""
        lat = sorted(self._latencies)
        clock = self.virtual_time_s
        return {
            "steps": self.steps, "requests": self.requests, "finished": self.finished,
            "rejected": self.rejected, "aborted": self.aborted, "preemptions": self.preemptions,
            "prefix_hit_tokens": self.prefix_hit_tokens, "output_tokens": self.output_tokens,
            "latency_steps_mean": sum(lat) / len(lat) if lat else None,
            "latency_steps_p50": percentile(lat, 50),
            "latency_steps_p99": percentile(lat, 99),
            "virtual_time_s": clock,
            "finished_per_1000_steps": self.finished * 1000 / self.steps if self.steps else None,
            "output_tokens_per_step": self.output_tokens / self.steps if self.steps else None,
            "finished_per_s": self.finished / clock if clock > 0 else None,
            "output_tokens_per_s": self.output_tokens / clock if clock > 0 else None,
        }


def stats_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """B - A for every statistic; None where either side is None."""
    return {k: (None if a[k] is None or b[k] is None else b[k] - a[k]) for k in a}


class _RequestDigests:
    """request id -> digest of its prompt and of its other request fields,
    from ``arrival`` and ``reject`` rows (a request rejected under one config
    and admitted under another is still the same request)."""

    def __init__(self, fields: tuple[str, ...] = _REQUEST_FIELDS) -> None:
        self.digests: dict[str, tuple[bytes, bytes]] = {}
        self.fields = fields

    def add_step(self, rows: list[Row]) -> None:
        for row in rows:
            if row["kind"] in ("arrival", "reject"):
                prompt = hashlib.blake2b(array("i", row["prompt_token_ids"] or ()).tobytes(),
                                         digest_size=16).digest()
                rest = hashlib.blake2b(json.dumps([row[k] for k in self.fields]).encode(),
                                       digest_size=16).digest()
                self.digests[row["request_id"]] = (prompt, rest)


def _workload_identity(trace: Trace) -> dict[str, Any]:
    w = trace.meta["workload"]
    return {"source": w.get("source"), "sha256": w.get("sha256"), "params": w.get("params"),
            "seed": trace.meta["seed"]}


def is_live(trace: Trace) -> bool:
    """A recording of a real engine (``recording_convert.convert``: workload source ``live``)."""
    return trace.meta["workload"].get("source") == "live"


def check_same_workload_meta(a: Trace, b: Trace) -> None:
    """Raise WorkloadMismatch when the metadata name different workloads or seeds
    (two live recordings: source and seed only; see the module docstring)."""
    wa, wb = _workload_identity(a), _workload_identity(b)
    keys = ("source", "seed") if is_live(a) and is_live(b) else ("source", "sha256", "params", "seed")
    for key in keys:
        if wa[key] != wb[key]:
            what = "workload " + key if key != "seed" else "seed"
            raise WorkloadMismatch(f"{a.path} vs {b.path}: not the same workload "
                                   f"({what}: {_short(wa[key])} vs {_short(wb[key])})")


def _compare_requests(a: Trace, b: Trace, da: _RequestDigests, db: _RequestDigests) -> None:
    if da.digests == db.digests:
        return
    only_a = sorted(set(da.digests) - set(db.digests))
    only_b = sorted(set(db.digests) - set(da.digests))
    if only_a or only_b:
        detail = (f"request ids differ: {len(only_a)} only in A {only_a[:3]}, "
                  f"{len(only_b)} only in B {only_b[:3]}")
    else:
        rid = min(r for r in da.digests if da.digests[r] != db.digests[r])
        what = "prompt" if da.digests[rid][0] != db.digests[rid][0] else "request fields"
        detail = f"request {rid}: {what} differ"
    raise WorkloadMismatch(f"{a.path} vs {b.path}: not the same workload ({detail})")


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[: limit - 1] + "…"


def config_diff(a: Trace, b: Trace) -> dict[str, dict[str, Any]]:
    """{config key: {"a": value in A, "b": value in B}} for every key that differs."""
    # Compare the validated configs: a key left out of the metadata at its
    # default (OMITTED_AT_DEFAULT) reads as that default, not as None.
    ca, cb = dataclasses.asdict(a.config), dataclasses.asdict(b.config)
    return {k: {"a": ca[k], "b": cb[k]} for k in sorted(ca) if ca[k] != cb[k]}


def _strip(row: Row) -> Row:
    return {k: v for k, v in row.items() if v is not None and k not in ("step", "event_index")}


def _same_row(x: Any, y: Any, level: Any = None) -> bool:
    """DeepDiff pairing of rows: the same (kind, request) is the same row, so a
    row that moved shows as moved or changed, not as a cascade of positional
    differences. Other lists (block ids, queues) compare by position."""
    if isinstance(x, dict) and isinstance(y, dict):
        return (x.get("kind"), x.get("request_id")) == (y.get("kind"), y.get("request_id"))
    raise CannotCompare() from None


def decision_diff(rows_a: list[Row], rows_b: list[Row]) -> str:
    """DeepDiff (pretty text) of two steps' decision rows; "" when equal."""
    dec_a, dec_b = decision_rows(rows_a), decision_rows(rows_b)
    if dec_a == dec_b:
        return ""
    return DeepDiff(dec_a, dec_b, verbose_level=2, iterable_compare_func=_same_row).pretty()


def decision_rows(rows: list[Row]) -> list[Row]:
    """The step's decision rows (kinds ``DECISION_KINDS``), without nulls,
    ``step`` and ``event_index``."""
    return [_strip(r) for r in rows if r["kind"] in DECISION_KINDS]


@dataclass
class FirstDivergence:
    """The first step whose rows differ. ``a``/``b``: the differing values
    (for ``field == "event"``, "kind request" of the rows at ``event_index``,
    or "step N"/"end of trace" when one trace has more steps). ``kind`` is
    A's row kind (B's when A has none); ``request`` is A's row's request,
    else B's. ``decision_diff``: DeepDiff text of the step's decision rows;
    ``rows_a``/``rows_b``: the step's rows; ``prev_end_a``/``prev_end_b``:
    the previous step's ``schedule_end`` row (None at step 0)."""

    step: int
    event_index: int
    request: str | None
    field: str
    a: Any
    b: Any
    kind: str | None
    decision_diff: str = ""
    rows_a: list[Row] = field(default_factory=list)
    rows_b: list[Row] = field(default_factory=list)
    prev_end_a: Row | None = None
    prev_end_b: Row | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "event_index": self.event_index, "request": self.request,
                "field": self.field, "a": self.a, "b": self.b, "kind": self.kind}


@dataclass
class DiffResult:
    """Outcome of ``diff_traces``; ``to_dict`` is the ``--json`` object."""

    a: Trace
    b: Trace
    config_diff: dict[str, dict[str, Any]]
    first_divergence: FirstDivergence | None
    stats_a: dict[str, Any]
    stats_b: dict[str, Any]

    @property
    def same(self) -> bool:
        return self.first_divergence is None

    @property
    def config_differs(self) -> bool:
        return self.a.meta["config_fingerprint"] != self.b.meta["config_fingerprint"]

    @property
    def delta(self) -> dict[str, Any]:
        return stats_delta(self.stats_a, self.stats_b)

    def to_dict(self) -> dict[str, Any]:
        return {"same": self.same, "config_differs": self.config_differs,
                "config_diff": self.config_diff,
                "first_divergence": self.first_divergence.to_dict() if self.first_divergence else None,
                "a": self.stats_a, "b": self.stats_b, "delta": self.delta}


def _as_of(version: int, item: tuple[int, list[Row]] | None) -> tuple[int, list[Row]] | None:
    return None if item is None else (item[0], rows_as_of(version, item[1]))


def _schedule_end(rows: list[Row] | None) -> Row | None:
    return next((r for r in rows or () if r["kind"] == "schedule_end"), None)


def diff_traces(a: Trace, b: Trace, on_step: Callable[[int], object] | None = None) -> DiffResult:
    """Stream both traces step by step; see the module docstring
    (``on_step(i)`` after the i-th pair of steps: progress).

    Raises WorkloadMismatch (not the same workload) or TraceError (a trace
    turned out unreadable while streaming).
    """
    check_same_workload_meta(a, b)
    stats_a, stats_b = TraceStats(), TraceStats()
    fields = _LIVE_REQUEST_FIELDS if is_live(a) and is_live(b) else _REQUEST_FIELDS
    req_a, req_b = _RequestDigests(fields), _RequestDigests(fields)
    found: FirstDivergence | None = None
    prev_a: list[Row] | None = None
    prev_b: list[Row] | None = None
    # Traces of two schema versions compare in what the older one records.
    version = min(t.meta.get("schema_version", SCHEMA_VERSION) for t in (a, b))
    for i, (item_a, item_b) in enumerate(zip_longest(a.iter_steps(), b.iter_steps())):
        if on_step is not None:
            on_step(i)
        if item_a is not None:
            stats_a.add_step(*item_a)
            req_a.add_step(item_a[1])
        if item_b is not None:
            stats_b.add_step(*item_b)
            req_b.add_step(item_b[1])
        if found is None:
            found = _compare_step(_as_of(version, item_a), _as_of(version, item_b), prev_a, prev_b)
            prev_a = item_a[1] if item_a is not None else None
            prev_b = item_b[1] if item_b is not None else None
    _compare_requests(a, b, req_a, req_b)
    return DiffResult(a, b, config_diff(a, b), found, stats_a.to_dict(), stats_b.to_dict())


def _compare_step(item_a: tuple[int, list[Row]] | None, item_b: tuple[int, list[Row]] | None,
                  prev_a: list[Row] | None, prev_b: list[Row] | None) -> FirstDivergence | None:
    context = {"prev_end_a": _schedule_end(prev_a), "prev_end_b": _schedule_end(prev_b)}
    if item_a is None or item_b is None:
        step, rows = item_a or item_b  # type: ignore[misc]
        a_val, b_val = (f"step {step}", "end of trace") if item_b is None else ("end of trace", f"step {step}")
        return FirstDivergence(step, 0, None, "event", a_val, b_val, None,
                               rows_a=item_a[1] if item_a else [], rows_b=item_b[1] if item_b else [],
                               **context)
    (step_a, rows_a), (step_b, rows_b) = item_a, item_b
    if step_a != step_b:  # cannot happen with the writer's gap-free numbering
        return FirstDivergence(min(step_a, step_b), 0, None, "step", step_a, step_b, None,
                               rows_a=rows_a, rows_b=rows_b, **context)
    d = first_difference(step_a, rows_a, rows_b)
    if d is None:
        return None
    request = d.request
    if request is None and d.event_index < len(rows_b):  # A's row has no request (e.g. schedule_end)
        request = rows_b[d.event_index].get("request_id")
    return FirstDivergence(d.step, d.event_index, request, d.field, d.expected, d.actual, d.kind,
                           decision_diff(rows_a, rows_b), rows_a, rows_b, **context)


# -- text report -------------------------------------------------------------

def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}" if value != int(value) or abs(value) >= 1e6 else f"{value:g}"
    return str(value)


def _fmt_delta(value: Any) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return ("+" if value > 0 else "") + _fmt(value)


_BRIEF_KEYS = ("kind", "request_id", "schedule_kind", "num_computed_tokens", "num_scheduled_tokens",
               "num_prefix_hit_tokens", "block_ids", "token_ids", "status", "finish_reason",
               "num_output_tokens", "clock_s", "num_free_blocks", "token_budget",
               "preempted_req_ids", "finished_req_ids", "waiting", "running")


def brief_row(row: Row) -> str:
    """One line per row: its non-null decision/state columns (no prompts),
    long lists elided and floats rounded, at most ``brief.MAX_LINE`` characters."""
    return short_text(" ".join(f"{k}={short(row[k])}" if k != "kind" else str(row[k])
                               for k in _BRIEF_KEYS if row.get(k) not in (None, [])))


def render_report(result: DiffResult, console: Console) -> None:
    """Print the comparison: traces, config differences, stats table, divergence."""
    for side, trace in (("A", result.a), ("B", result.b)):
        console.print(f"[bold]{side}[/] {escape(str(trace.path))}  engine "
                      f"{escape(str(trace.meta.get('engine')))}  config "
                      f"{trace.meta['config_fingerprint'][:12]}")
    if result.config_differs:
        console.print("[bold yellow]CONFIG DIFFERS[/] (decisions compared anyway):")
        for key, values in result.config_diff.items():
            console.print(f"  {escape(key)}: A {escape(short_repr(values['a']))}, B {escape(short_repr(values['b']))}")
    table = Table("statistic", "A", "B", "delta (B - A)")
    delta = result.delta
    for key in TraceStats.FIELDS:
        table.add_row(key, _fmt(result.stats_a[key]), _fmt(result.stats_b[key]), _fmt_delta(delta[key]))
    console.print(keep_words_whole(table))
    d = result.first_divergence
    if d is None:
        steps = result.stats_a["steps"]
        console.print("[bold green]same[/]: identical events on " + ("the only step" if steps == 1
                                                                        else f"all {steps} steps"))
        return
    console.print(f"[bold red]DIVERGENCE at step {d.step}[/], event #{d.event_index} ({escape(d.kind or '-')}), "
                  f"request {escape(d.request or '-')}, field {escape(d.field)}: "
                  f"A {escape(short_repr(d.a))}, B {escape(short_repr(d.b))}")
    if d.decision_diff:
        console.print(f"  decision rows ({'/'.join(DECISION_KINDS)}), DeepDiff A -> B:")
        for line in d.decision_diff.splitlines():
            if line.strip():
                console.print("    " + escape(short_text(line)))
    end_a, end_b = d.prev_end_a, d.prev_end_b
    if end_a is not None or end_b is not None:
        if end_a == end_b or end_b is None or end_a is None:
            end = end_a or end_b
            console.print(f"  step {d.step - 1} schedule_end" + (" (same in A and B)" if end_a == end_b else "")
                          + f": waiting {escape(short(end['waiting']))} running {escape(short(end['running']))}")
        else:
            for side, end in (("A", end_a), ("B", end_b)):
                console.print(f"  {side} step {d.step - 1} schedule_end: waiting "
                              f"{escape(short(end['waiting']))} running {escape(short(end['running']))}")
    for side, rows in (("A", d.rows_a), ("B", d.rows_b)):
        console.print(f"  {side} step {d.step}:" + ("" if rows else " (none)"))
        for row in rows[:_CONTEXT_ROWS]:
            marker = ">" if row["event_index"] == d.event_index else " "
            console.print(f"   {marker}#{row['event_index']} " + escape(brief_row(row)))
        if len(rows) > _CONTEXT_ROWS:
            console.print(f"    ... {len(rows) - _CONTEXT_ROWS} more rows")
    console.print(f"[bold red]different[/]: first divergence at step {d.step}")
