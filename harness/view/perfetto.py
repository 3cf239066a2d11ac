"""The Perfetto export (``harness export --perfetto``): the Chrome trace
event format (JSON object form) that ui.perfetto.dev and chrome://tracing open.

Time is the trace's virtual clock in microseconds (``ts``, ``dur``).
Process 1 "requests" has one thread (track) per request, named by its id, in
arrival order: a complete event (``ph: X``) per span (waiting / running /
preempted / loading, ``harness.view.series.STATES``) whose args give the
steps it covers and the tokens scheduled in it, and inside a running span
one slice per scheduled chunk (args: step, kind, computed, scheduled,
prefill / decode / draft tokens, prefix hits). Process 2 "engine" has the
counters (``ph: C``): KV blocks (free, held, cached), queues (waiting,
running), tokens per step (prefill, decode, drafts); a slice per step; and
instant events (``ph: i``) for preemptions (victims in args) and every
violation witness (invariant, message, history). Events come sorted by
(pid, tid, ts) so the same trace gives the same bytes.
"""

from __future__ import annotations

import json
from typing import Any

from harness.view.series import Series

_US = 1e6  # microseconds per second of virtual clock
REQUESTS_PID, ENGINE_PID = 1, 2


def _us(seconds: float) -> float:
    return round(seconds * _US, 3)


def trace_events(series: Series) -> dict[str, Any]:
    """The export as a dict: ``{"traceEvents": [...], "displayTimeUnit": "ms",
    "otherData": {trace, engine}}``."""
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": REQUESTS_PID, "tid": 0, "name": "process_name", "args": {"name": "requests"}},
        {"ph": "M", "pid": ENGINE_PID, "tid": 0, "name": "process_name", "args": {"name": "engine"}},
        {"ph": "M", "pid": ENGINE_PID, "tid": 1, "name": "thread_name", "args": {"name": "steps"}},
        {"ph": "M", "pid": ENGINE_PID, "tid": 2, "name": "thread_name", "args": {"name": "events"}},
    ]
    tid = {r.request_id: i + 1 for i, r in enumerate(series.requests)}
    for r in series.requests:
        events.append({"ph": "M", "pid": REQUESTS_PID, "tid": tid[r.request_id], "name": "thread_name",
                       "args": {"name": r.request_id}})
        events.append({"ph": "M", "pid": REQUESTS_PID, "tid": tid[r.request_id], "name": "thread_sort_index",
                       "args": {"sort_index": tid[r.request_id]}})
    points = {p.step: p for p in series.steps}
    for s in series.spans:
        events.append({"ph": "X", "pid": REQUESTS_PID, "tid": tid[s.request_id], "name": s.state,
                       "cat": "state", "ts": _us(s.start_s), "dur": round(_us(s.end_s) - _us(s.start_s), 3),
                       "args": {"steps": f"{s.start_step}..{s.end_step - 1}", "scheduled_tokens":
                                s.scheduled_tokens, "chunks": s.chunks}})
    for c in series.scheduled:
        p = points[c.step]
        events.append({"ph": "X", "pid": REQUESTS_PID, "tid": tid.get(c.request_id, 0),
                       "name": f"{c.schedule_kind} {c.num_scheduled_tokens}", "cat": "schedule",
                       "ts": _us(p.clock_s), "dur": round(_us(p.end_s) - _us(p.clock_s), 3),
                       "args": {"step": c.step, "schedule_kind": c.schedule_kind,
                                "num_computed_tokens": c.num_computed_tokens,
                                "num_scheduled_tokens": c.num_scheduled_tokens,
                                "prefill_tokens": c.prefill_tokens, "decode_tokens": c.decode_tokens,
                                "draft_tokens": c.draft_tokens,
                                "num_prefix_hit_tokens": c.num_prefix_hit_tokens}})
    for p in series.steps:
        ts = _us(p.clock_s)
        events.append({"ph": "X", "pid": ENGINE_PID, "tid": 1, "name": f"step {p.step}", "cat": "step",
                       "ts": ts, "dur": round(_us(p.end_s) - ts, 3),
                       "args": {"scheduled_tokens": p.scheduled_tokens, "token_budget": p.token_budget}})
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "name": "KV blocks", "ts": ts,
                       "args": {"free": p.free_blocks, "held": p.held_blocks, "cached": p.cached_blocks}})
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "name": "queues", "ts": ts,
                       "args": {"waiting": p.waiting, "running": p.running}})
        events.append({"ph": "C", "pid": ENGINE_PID, "tid": 0, "name": "tokens per step", "ts": ts,
                       "args": {"prefill": p.prefill_tokens, "decode": p.decode_tokens,
                                "drafts": p.draft_tokens}})
        if p.victims:
            events.append({"ph": "i", "s": "p", "pid": ENGINE_PID, "tid": 2, "name": "preemption",
                           "cat": "preempt", "ts": ts, "args": {"step": p.step, "victims": p.victims}})
    for v in series.violations:
        p = points.get(v.step)
        events.append({"ph": "i", "s": "g", "pid": ENGINE_PID, "tid": 2, "name": f"violation {v.invariant}",
                       "cat": "violation", "ts": _us(p.clock_s) if p else 0.0,
                       "args": {"step": v.step, "request": v.request, "message": v.message,
                                "history": v.history}})
    meta = [e for e in events if e["ph"] == "M"]
    timed = sorted((e for e in events if e["ph"] != "M"),
                   key=lambda e: (e["pid"], e["tid"], e["ts"], e["ph"] != "X", -e.get("dur", 0)))
    return {"traceEvents": meta + timed, "displayTimeUnit": "ms",
            "otherData": {"trace": series.path, "engine": series.engine}}


def render(series: Series) -> bytes:
    """The export as compact JSON bytes (UTF-8, newline-terminated)."""
    return (json.dumps(trace_events(series), separators=(",", ":"), ensure_ascii=False) + "\n").encode()
