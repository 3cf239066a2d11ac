"""Every figure the views show, derived from a trace in one pass: per-step
series, per-request records and state spans, scheduled chunks, violations.

``derive(trace)`` reads the trace once (``Trace.iter_steps``), running the
invariant checker over the same steps (``harness.check.check_trace`` with an
observer), so the HTML report (``harness.view.html``), the Perfetto export
(``harness.view.perfetto``) and the SQL tables (``harness.view.tables``) all
show the same numbers, and the block figures come from the checker's shadow
of the KV pool (``harness.check.model.TraceModel``: block owners, what each
full block caches), not from a second model of our own.

Units: ``step`` is the engine step number (from 0); ``*_s`` are seconds of
the trace's virtual clock; token counts are tokens; block counts are KV
blocks (the null block 0 excluded). With data parallelism every per-step
figure is summed over the ranks. Memory grows with the trace (one record
per step, per ``schedule`` row, per request and per span), unlike
``harness check``'s, which a view needs whole to draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.check import CheckResult, check_trace
from harness.check.result import Violation
from harness.trace import Trace

#: The request states a span can have (vLLM ``RequestStatus``, folded):
#: waiting (WAITING, after arrival or a finished remote load), running (in the
#: running queue, scheduled or not that step), preempted (PREEMPTED, back in
#: waiting) and loading (WAITING_FOR_REMOTE_KVS: an async KV-connector load).
STATES = ("waiting", "running", "preempted", "loading")


@dataclass
class StepPoint:
    """One engine step's figures (summed over data-parallel ranks).

    ``clock_s``: the virtual clock at the step's start (``schedule_begin``, or
    ``update_begin`` in a step that scheduled nothing, else the previous
    step's); ``end_s``: after the step's cost (``step_fixed_s +
    step_per_token_s * scheduled_tokens``). Queues are as ``schedule_end``
    leaves them (0 in a step without a schedule part). ``free_blocks`` is the
    pool's count after the update (``update_end``); ``held_blocks`` the
    blocks some request or deferred free references and ``cached_blocks``
    the free blocks that still cache a full block's content (prefix-cache
    hits can revive them), both from the checker's shadow pool.
    ``prefill_tokens + decode_tokens + draft_tokens == scheduled_tokens``: a
    chunk's drafts are its ``spec_token_ids``; of the rest, one token of a
    request past its prompt scheduled alone (or with drafts) is a decode,
    anything else (prompt chunks, recomputation after a preemption) prefill.
    ``accepted_drafts`` / ``verified_drafts``: drafts whose verification
    came back in this step's update (vLLM rejection sampling: the output's
    tokens minus one were accepted), as the checker counts them (an output
    discarded because its request already ended verifies nothing, so under
    async scheduling fewer drafts are verified than scheduled). ``prefix_hit_tokens`` over
    ``lookup_tokens``: tokens found in the prefix cache over the tokens the
    admissions looked up (the request's known tokens at admission).
    """

    step: int
    clock_s: float
    end_s: float
    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    held_blocks: int = 0
    cached_blocks: int = 0
    token_budget: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    draft_tokens: int = 0
    accepted_drafts: int = 0
    verified_drafts: int = 0
    victims: list[str] = field(default_factory=list)
    admitted: int = 0
    prefix_hit_tokens: int = 0
    lookup_tokens: int = 0
    kv_loads: int = 0
    failed_kv_loads: int = 0
    finished: int = 0
    violations: int = 0

    @property
    def preemptions(self) -> int:
        """Preemptions this step (``preempt`` rows)."""
        return len(self.victims)


@dataclass
class Scheduled:
    """One ``schedule`` row: ``request_id`` got ``num_scheduled_tokens`` at
    ``step`` (split prefill / decode / draft as in ``StepPoint``),
    ``schedule_kind`` new / resumed / running (vLLM's request-data lists),
    ``num_blocks_added``: blocks the row adds to its table (an admission: the
    whole table, prefix hits included)."""

    step: int
    rank: int
    request_id: str
    schedule_kind: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    prefill_tokens: int
    decode_tokens: int
    draft_tokens: int
    num_prefix_hit_tokens: int
    num_blocks_added: int


@dataclass
class RequestInfo:
    """One request's life: arrival, first scheduling and first sampled token,
    its end (``end_kind`` finish / abort / reject, None while unfinished when
    the trace ended), preemptions, prefix-hit tokens and remote KV loads."""

    request_id: str
    rank: int
    arrival_step: int
    arrival_time_s: float | None
    num_prompt_tokens: int
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    first_token_s: float | None = None
    end_step: int | None = None
    end_s: float | None = None
    end_kind: str | None = None
    finish_reason: str | None = None
    num_output_tokens: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    remote_loads: int = 0
    scheduled_tokens: int = 0


@dataclass
class Span:
    """A request in one of ``STATES`` from ``start_step`` up to (not
    including) ``end_step``; ``start_s``/``end_s`` the virtual clock there;
    ``scheduled_tokens`` and ``chunks``: what it was given meanwhile."""

    request_id: str
    state: str
    start_step: int
    end_step: int
    start_s: float
    end_s: float
    scheduled_tokens: int = 0
    chunks: int = 0


@dataclass
class Series:
    """Everything ``derive`` found: the trace's identity (``path``,
    ``engine``, ``config``), ``steps`` (step order), ``scheduled`` (row
    order), ``requests`` (arrival order), ``spans`` (request, then time),
    the check's ``result`` (its ``violations`` are the kept witnesses)."""

    path: str
    engine: str
    config: dict[str, Any]
    steps: list[StepPoint]
    scheduled: list[Scheduled]
    requests: list[RequestInfo]
    spans: list[Span]
    result: CheckResult

    @property
    def violations(self) -> list[Violation]:
        """The witnesses the check kept (the first few of each invariant)."""
        return self.result.violations

    def step_dicts(self) -> list[dict[str, Any]]:
        """``steps`` as plain dicts (``victims`` a list; ``preemptions`` added)."""
        return [{**asdict(p), "preemptions": p.preemptions} for p in self.steps]


class _Deriver:
    """The one pass: fed each step's rows and the checkers after it."""

    def __init__(self, trace: Trace) -> None:
        cfg = trace.meta["config"]
        self.trace = trace
        self.fixed = float(cfg.get("step_fixed_s", 0.005))
        self.per_token = float(cfg.get("step_per_token_s", 0.0001))
        budget = cfg.get("max_num_scheduled_tokens") or cfg["max_num_batched_tokens"]
        self.budget = budget * cfg.get("data_parallel_size", 1)
        self.steps: list[StepPoint] = []
        self.scheduled: list[Scheduled] = []
        self.requests: dict[str, RequestInfo] = {}
        self.num_tokens: dict[str, int] = {}     # known tokens (prompt + sampled)
        self.open: dict[str, Span] = {}          # each live request's current span
        self.spans: list[Span] = []
        self.clock = 0.0
        self.free = cfg["num_gpu_blocks"] - 1
        self._pending_finish: list[tuple[Span, RequestInfo]] = []  # finished this step
        # Each rank's pool after its last update (a rank not yet stepped: all free).
        self.free_by_rank = dict.fromkeys(range(cfg.get("data_parallel_size", 1)), cfg["num_gpu_blocks"] - 1)
        self.totals = (0, 0, 0)  # the checkers' drafts verified, rejected, failed loads so far

    def __call__(self, step: int, rows: list[dict[str, Any]], checkers: list[Any]) -> None:
        begin = next((r["clock_s"] for r in rows if r["kind"] == "schedule_begin"), None)
        if begin is None:
            begin = next((r["clock_s"] for r in rows if r["kind"] == "update_begin"
                          and r["clock_s"] is not None), None)
        if begin is not None:
            self.clock = begin
        point = StepPoint(step, self.clock, self.clock, token_budget=self.budget)
        # The span transitions of this step close at its start; a finish closes after it.
        free_after: dict[int, int] = {}
        for row in rows:
            kind, rid, rank = row["kind"], row["request_id"], row["rank"] or 0
            if kind in ("arrival", "reject"):
                self._arrive(row, step, rank, point)
            elif kind == "abort":
                self._end(rid, step, step, "abort", row)
            elif kind == "schedule":
                self._schedule(row, step, rank, point)
            elif kind == "preempt":
                point.victims.append(rid)
                if rid in self.requests:
                    self.requests[rid].preemptions += 1
                self._enter(rid, "preempted", step)
            elif kind == "kv_load":
                point.kv_loads += 1
                hit = row["num_prefix_hit_tokens"] or 0
                point.prefix_hit_tokens += hit
                point.lookup_tokens += self.num_tokens.get(rid, 0)
                point.admitted += 1
                if rid in self.requests:
                    self.requests[rid].remote_loads += 1
                    self.requests[rid].prefix_hit_tokens += hit
                self._enter(rid, "loading", step)
            elif kind == "kv_promote":
                self._enter(rid, "preempted" if row["status"] == "PREEMPTED" else "waiting", step)
            elif kind == "withdraw":
                self._withdraw(row, point)
            elif kind == "schedule_end":
                point.waiting += len(row["waiting"] or ())
                point.running += len(row["running"] or ())
                point.scheduled_tokens += row["total_num_scheduled_tokens"] or 0
                free_after.setdefault(rank, row["num_free_blocks"])
            elif kind == "output":
                self._output(row, step)
            elif kind == "finish":
                point.finished += 1
                self._end(rid, step, step + 1, "finish", row)
            elif kind == "update_end":
                free_after[rank] = row["num_free_blocks"]
        point.end_s = self.clock + self.fixed + self.per_token * point.scheduled_tokens
        self.free_by_rank.update(free_after)
        if self.free_by_rank:
            self.free = sum(self.free_by_rank.values())
        point.free_blocks = self.free
        # Drafts verified and loads failed: the checker's own counts (its
        # CheckResult), step by step, so the series add up to the summary.
        totals = tuple(sum(getattr(c.result, name) for c in checkers)
                       for name in ("draft_tokens", "rejected_draft_tokens", "failed_kv_loads"))
        verified, rejected, failed = (now - before for now, before in zip(totals, self.totals))
        self.totals = totals
        point.verified_drafts, point.accepted_drafts, point.failed_kv_loads = verified, verified - rejected, failed
        point.held_blocks = sum(c.held() for c in checkers)
        point.cached_blocks = sum(sum(1 for b in c.content if b not in c.owners) for c in checkers)
        self.steps.append(point)
        self.clock = point.end_s if begin is not None else self.clock

    def _arrive(self, row: dict[str, Any], step: int, rank: int, point: StepPoint) -> None:
        rid = row["request_id"]
        prompt = len(row["prompt_token_ids"] or ())
        info = RequestInfo(rid, rank, step, row["arrival_time_s"], prompt)
        self.requests[rid] = info
        self.num_tokens[rid] = prompt
        if row["kind"] == "reject":
            info.end_step, info.end_s, info.end_kind = step, self.clock, "reject"
        else:
            self._enter(rid, "waiting", step)

    def _schedule(self, row: dict[str, Any], step: int, rank: int, point: StepPoint) -> None:
        rid = row["request_id"]
        info = self.requests.get(rid)
        sched = row["num_scheduled_tokens"] or 0
        computed = row["num_computed_tokens"] or 0
        drafts = len(row["spec_token_ids"] or ())
        plain = sched - drafts
        prompt = info.num_prompt_tokens if info else 0
        decode = 1 if plain == 1 and computed >= prompt else 0
        hit = row["num_prefix_hit_tokens"] or 0
        kind = row["schedule_kind"] or "running"
        blocks = len(row["block_ids"] or ())
        self.scheduled.append(Scheduled(step, rank, rid, kind, computed, sched, plain - decode, decode,
                                        drafts, hit, blocks))
        point.prefill_tokens += plain - decode
        point.decode_tokens += decode
        point.draft_tokens += drafts
        if kind in ("new", "resumed"):
            point.admitted += 1
            point.prefix_hit_tokens += hit
            point.lookup_tokens += self.num_tokens.get(rid, 0)
        if info is not None:
            info.prefix_hit_tokens += hit if kind in ("new", "resumed") else 0
            info.scheduled_tokens += sched
            if info.first_scheduled_step is None:
                info.first_scheduled_step = step
        span = self._enter(rid, "running", step)
        if span is not None:
            span.scheduled_tokens += sched
            span.chunks += 1

    def _withdraw(self, row: dict[str, Any], point: StepPoint) -> None:
        """PRIORITY give-back: the request's chunk of this step is taken back
        (never run): its row leaves ``scheduled`` and its tokens the split."""
        rid = row["request_id"]
        for i in range(len(self.scheduled) - 1, -1, -1):
            c = self.scheduled[i]
            if c.request_id == rid and c.step == point.step:
                del self.scheduled[i]
                point.prefill_tokens -= c.prefill_tokens
                point.decode_tokens -= c.decode_tokens
                point.draft_tokens -= c.draft_tokens
                info = self.requests.get(rid)
                if info is not None:
                    info.scheduled_tokens -= c.num_scheduled_tokens
                span = self.open.get(rid)
                if span is not None and span.state == "running":
                    span.scheduled_tokens -= c.num_scheduled_tokens
                    span.chunks -= 1
                return

    def _output(self, row: dict[str, Any], step: int) -> None:
        rid = row["request_id"]
        tokens = len(row["token_ids"] or ())
        self.num_tokens[rid] = self.num_tokens.get(rid, 0) + tokens
        info = self.requests.get(rid)
        if info is not None and info.first_token_step is None and tokens:
            info.first_token_step = step  # its clock, the step's end, is set once the step is read

    def _enter(self, rid: str, state: str, step: int) -> Span | None:
        """``rid`` is in ``state`` from ``step`` on; returns its open span."""
        span = self.open.get(rid)
        if span is not None and span.state == state:
            return span
        if rid not in self.requests:
            return None
        if span is not None:
            self._close(span, step)
        span = Span(rid, state, step, step, self.clock, self.clock)
        self.open[rid] = span
        return span

    def _close(self, span: Span, end_step: int) -> None:
        """End ``span`` at the start of ``end_step`` (the step being read)."""
        span.end_step = end_step
        span.end_s = self.clock
        if span.end_step > span.start_step:  # a state entered and left within one step is no span
            self.spans.append(span)

    def _end(self, rid: str, step: int, end_step: int, end_kind: str, row: dict[str, Any]) -> None:
        info = self.requests.get(rid)
        if info is None or info.end_kind is not None:
            return
        info.end_step, info.end_kind = step, end_kind
        info.finish_reason = row["finish_reason"]
        info.num_output_tokens = row["num_output_tokens"] or 0
        span = self.open.pop(rid, None)
        # A finish happens in the step's update: the request held its state through the step.
        info.end_s = self.clock if end_kind == "abort" else None
        if span is not None:
            span.end_step = end_step
            span.end_s = self.clock
            if end_kind == "finish":
                self._pending_finish.append((span, info))
            elif span.end_step > span.start_step:
                self.spans.append(span)

    def finish_step(self) -> None:
        """Close the spans of requests that finished in the step just recorded
        (their end is the step's end, known only after all its rows)."""
        end = self.steps[-1].end_s
        for span, info in self._pending_finish:
            span.end_s = end
            info.end_s = end
            self.spans.append(span)
        self._pending_finish = []

    def close(self) -> None:
        """The trace ended: spans still open end with the last step."""
        last = self.steps[-1] if self.steps else None
        for span in self.open.values():
            span.end_step = (last.step + 1) if last else span.start_step
            span.end_s = last.end_s if last else span.start_s
            if span.end_step > span.start_step:
                self.spans.append(span)
        self.open = {}
        self.spans.sort(key=lambda s: (s.request_id, s.start_step, STATES.index(s.state)))


def derive(trace: Trace, semantics: str = "auto",
           on_step: Callable[[int], None] | None = None) -> Series:
    """Read ``trace`` once, checking it under ``semantics`` (as ``harness
    check``: ProfileError for an unknown profile, TraceError for an
    unreadable trace), and return its ``Series``. ``on_step(step)`` is
    called after each step (progress)."""
    deriver = _Deriver(trace)

    def observe(step: int, rows: list[dict[str, Any]], checkers: list[Any]) -> None:
        deriver(step, rows, checkers)
        deriver.finish_step()
        if on_step is not None:
            on_step(step)

    result = check_trace(trace, semantics, observe=observe)
    deriver.close()
    by_step = {p.step: p for p in deriver.steps}
    for info in deriver.requests.values():
        if info.first_token_step is not None:
            info.first_token_s = by_step[info.first_token_step].end_s
    for v in result.violations:
        if v.step in by_step:
            by_step[v.step].violations += 1
    requests = sorted(deriver.requests.values(), key=lambda r: (r.arrival_step, r.request_id))
    return Series(str(trace.path), trace.meta.get("engine", "?"), trace.meta["config"], deriver.steps,
                  deriver.scheduled, requests, deriver.spans, result)
