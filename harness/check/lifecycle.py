"""Outputs, finishing and liveness: who samples, when a request must stop,
the ids a step reports finished/preempted, that the engine makes progress and
that it does not crash.

vLLM 0.33.0 ``Scheduler.update_from_output`` and ``check_stop`` (spec 6,
10.8), ``SchedulerOutput.finished_req_ids`` (spec 3.9), and the liveness
properties of spec 8.
"""

from __future__ import annotations

from reference.words import plural

from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("OUTPUT-ONLY-COMPLETE", "A request samples exactly one token in a step iff the step reaches the end of its known tokens (none for partial prefill chunks).", "6, 8 #18",
              SAFETY, "A token can only be sampled from the logits of the last known token; a partial prefill chunk has none to sample, in every version."),
    Invariant("STOP-RULES", "Once min_tokens outputs exist, a request finishes exactly when check_stop says so (EOS unless ignore_eos, stop token, length), with that reason.", "6, 10.8, 8 #22",
              SAFETY, "A request stops exactly when its sampling parameters say (EOS unless ignore_eos, stop tokens, max_tokens): stopping early or late returns the wrong output in every version."),
    Invariant("STOP-MIN-TOKENS", "Before min_tokens outputs exist, a request stops as its version's check_stop says: 0.33.0 tests EOS, stop tokens and length first (min_tokens never overrides them); 0.20.2 stops nothing before min_tokens.", "6, 10.8",
              SEMANTICS, "Whether an EOS, a stop token or the length cap can end a request before min_tokens outputs is check_stop's order of tests, which releases changed (0.20.2 tests min_tokens first; 0.33.0 last)."),
    Invariant("SCHEDULED-HAS-DATA", "The ids the step's request data carries (new and cached requests) are exactly the keys of num_scheduled_tokens, each once: every scheduled request reaches the worker, and nothing else does.", "3.9, 8 #13",
              SAFETY, "The worker runs what the request data describes and the budget counts what num_scheduled_tokens lists: a key without data (or data without a key) runs tokens for a request the worker has no state for, or skips one the scheduler advanced, in every version."),
    Invariant("FINISHED-IDS", "preempted_req_ids and finished_req_ids of a step list exactly the requests preempted in it / finished since the previous schedule().", "3.9, 8 #12, #23",
              SAFETY, "The model runner frees a request's state only when told: preempted_req_ids and finished_req_ids must list exactly those requests, or it leaks or uses freed state."),
    Invariant("IDLE-ADMISSION", "With nothing running and requests waiting, a step admits at least one (every accepted request fits an empty engine), unless a waiting request's first chunk may exceed the token budget the step recorded (chunked prefill off and a prompt over it).", "8 (liveness)",
              SAFETY, "Every accepted request fits an empty engine, so with nothing running a step must admit one, or the engine stalls with work waiting."),
    Invariant("NO-PROGRESS", "No two consecutive steps schedule nothing with the same queues and no input in between.", "8 (liveness)",
              SAFETY, "Two identical empty steps with no input between them repeat forever: a livelock in any engine."),
    Invariant("LIVENESS", "Every accepted request finishes (stopped, length-capped or aborted) by the end of the trace.", "8",
              SAFETY, "Every accepted request must end (finish, length cap or abort); one left behind is starved or lost."),
    Invariant("OUTPUT-COUNT", "A finish or abort row's num_output_tokens is the number of tokens the request's own output rows delivered (up to its stop).", "6, 3.9",
              SAFETY, "The count a finished request reports is what the frontend returns and bills: in every version it is len(output_token_ids), the tokens its updates appended; a different count means tokens were lost, invented or double-counted between the model output and the request."),
    Invariant("OUTPUT-ORDER", "A step's output rows come in the processed batch's scheduling order (the keys of its num_scheduled_tokens), at most one per request.", "6, 3.9",
              SAFETY, "update_from_output walks the batch in num_scheduled_tokens order and appends one sampled list per request in every version; the order decides which finished request's blocks reach the free queue first, and a second output for one request in one batch is a token the model never sampled for it."),
    Invariant("ENGINE-CRASH", "The scheduler never raises: no step of the trace ends on a crash (an exception in schedule(), update_from_output() or another scheduler call).", "8",
              SAFETY, "A scheduler that raises kills the engine (vLLM's EngineCore dies with it) and fails every request in flight, whatever the version: no correct engine crashes on its own inputs."),
]

#: Checks that need schema 6 (``request_data_ids``): id -> (part, what an older trace lacks).
NEEDS_OBSERVED = {
    "SCHEDULED-HAS-DATA": ("", "no request_data_ids: the ids the step's request data carried are not recorded"),
}


# -- outputs -----------------------------------------------------------------------
def check_output_in_batch(m: TraceModel, st: StepState, rid: str) -> bool:
    """OUTPUT-ONLY-COMPLETE: an output is for a request of the processed batch.
    False when not (the row is ignored)."""
    if rid not in st.batch.scheduled:
        m.violate("OUTPUT-ONLY-COMPLETE", rid, "output for a request not in the processed batch")
        return False
    return True


def check_output_order(m: TraceModel, st: StepState, rid: str) -> bool:
    """OUTPUT-ORDER at an ``output`` row of the processed batch: its request
    comes after the previous output's in the batch's scheduling order, and has
    no earlier output in this batch. False for a second output (the row is then
    ignored: the shadow keeps the first)."""
    if st.batch_positions is None:
        st.batch_positions = {r: i for i, r in enumerate(st.batch.scheduled)}
    index = st.batch_positions[rid]
    if rid in st.output_seen:
        m.violate("OUTPUT-ORDER", rid, "a second output row for this request in the processed batch "
                                       f"(of step {st.batch.step})")
        return False
    st.output_seen.add(rid)
    if index < st.output_index:
        before = st.batch.scheduled[st.output_index]
        m.violate("OUTPUT-ORDER", rid, f"output after {before}'s, but it was scheduled before it "
                                       f"(batch of step {st.batch.step}: {st.batch.scheduled[:8]})")
    st.output_index = max(st.output_index, index)
    return True


def check_output_count(m: TraceModel, ev: dict, req: ReqShadow) -> None:
    """OUTPUT-COUNT at a ``finish`` or ``abort`` row: its num_output_tokens
    against the tokens the request's output rows delivered (the shadow's)."""
    reported = ev.get("num_output_tokens")
    if reported is not None and reported != req.num_output_tokens:
        m.violate("OUTPUT-COUNT", req.request_id,
                  f"{ev['kind']} row says {reported} output tokens, its output rows delivered "
                  f"{req.num_output_tokens}")


def check_output_complete(m: TraceModel, req: ReqShadow, end: int, drafts: list[int], tokens: list[int]) -> None:
    """OUTPUT-ONLY-COMPLETE: a request samples only when its step (scheduled up
    to ``end``) reached its known tokens; 1 to 1 + drafts tokens."""
    if end - len(drafts) < req.num_tokens or not 1 <= len(tokens) <= 1 + len(drafts):
        m.violate("OUTPUT-ONLY-COMPLETE", req.request_id,
                  f"{plural(len(tokens), 'token')} sampled by a step reaching {end} of "
                  f"{plural(req.num_tokens, 'token')} + {plural(len(drafts), 'draft')}")


def check_outputs_present(m: TraceModel, st: StepState) -> None:
    """OUTPUT-ONLY-COMPLETE at ``update_end``: every processed request whose step
    reached the end of its tokens sampled."""
    for rid in st.batch.scheduled:
        req = m.reqs.get(rid)
        # No end: its entry was not positive, reported as BUDGET-TOKENS at schedule.
        if req is None or rid in st.outputs or rid not in st.batch.ends:
            continue
        end = st.batch.ends[rid] - len(st.batch.drafts.get(rid, []))
        if end >= req.num_tokens:
            m.violate("OUTPUT-ONLY-COMPLETE", rid, f"its step reached {end} of {req.num_tokens} tokens but sampled nothing")


# -- stopping ----------------------------------------------------------------------
def stop_reason(m: TraceModel, req: ReqShadow, token: int) -> str | None:
    """vLLM ``check_stop`` after ``token`` was appended: "stop" (EOS unless
    ignore_eos, or a stop token), "length" (max_model_len or max_tokens), or
    None. min_tokens never overrides (0.33.0), unless the profile tests it
    first (0.20.2: nothing stops before min_tokens outputs)."""
    if m.profile.min_tokens_first and req.num_output_tokens < req.min_tokens:
        return None
    if token == req.eos_token_id or token in req.stop_token_ids:
        return "stop"
    if req.num_tokens >= m.max_model_len or req.num_output_tokens >= req.max_tokens:
        return "length"
    return None


def _stop_rule(req: ReqShadow) -> str:
    """The id a stop decision is judged under: STOP-MIN-TOKENS while fewer than
    min_tokens outputs exist (whether EOS, a stop token or the length cap
    may end it then is version design), else STOP-RULES."""
    return "STOP-MIN-TOKENS" if req.num_output_tokens < req.min_tokens else "STOP-RULES"


def check_finish_reason(m: TraceModel, ev: dict, req: ReqShadow, expected: str | None) -> None:
    """STOP-RULES (STOP-MIN-TOKENS below min_tokens) at a ``finish`` row: the
    reason is check_stop's."""
    if expected != ev["finish_reason"]:
        m.violate(_stop_rule(req), req.request_id,
                  f"finished with {ev['finish_reason']!r} but check_stop gives {expected!r} "
                  f"({req.num_output_tokens} outputs, max_tokens {req.max_tokens})")


def check_finish_within_max_tokens(m: TraceModel, ev: dict, req: ReqShadow) -> None:
    """STOP-RULES at a ``finish`` row, from the arrival's sampling parameters
    and the row alone (issue 26): no request finishes with more than
    max_tokens outputs, and one capped by "length" has exactly max_tokens
    outputs or reached max_model_len."""
    n = ev.get("num_output_tokens")
    if n is None or ev["status"] == "FINISHED_ERROR":
        return
    capped = ev["finish_reason"] == "length"
    if n > req.max_tokens or (capped and n != req.max_tokens and req.num_prompt_tokens + n < m.max_model_len):
        m.violate("STOP-RULES", req.request_id,
                  f"finished ({ev['finish_reason']!r}) with {n} outputs, but its arrival says max_tokens "
                  f"{req.max_tokens} (prompt {req.num_prompt_tokens}, max_model_len {m.max_model_len})")


def check_stopped_finished(m: TraceModel, st: StepState) -> None:
    """STOP-RULES (STOP-MIN-TOKENS below min_tokens) at ``update_end``: a
    request check_stop stops did finish."""
    for rid, stop in st.expected_stop.items():
        if stop is not None and rid not in st.finished:
            req = m.reqs.get(rid)
            m.violate(_stop_rule(req) if req is not None else "STOP-RULES", rid,
                      f"check_stop gives {stop!r} but the request did not finish")


# -- reported ids ------------------------------------------------------------------
def check_reported_ids(m: TraceModel, ev: dict, st: StepState) -> None:
    """FINISHED-IDS at ``schedule_end``: preempted_req_ids / finished_req_ids.
    Whether a forced prefix-cache reset's victims (preempted before
    schedule()) are listed too is RESET-PREEMPTS-RUNNING's (version design:
    0.33.0 lists them, 0.20.2 does not), so they are left out here."""
    reported = [r for r in ev["preempted_req_ids"] or [] if r not in st.reset_preempted]
    if set(reported) != set(st.preempted):
        m.violate("FINISHED-IDS", None,
                  f"preempted_req_ids {ev['preempted_req_ids']} != preempted {st.reset_preempted + st.preempted}")
    if set(ev["finished_req_ids"] or []) != m.finished_since_schedule:
        m.violate("FINISHED-IDS", None,
                  f"finished_req_ids {ev['finished_req_ids']} != finished since last schedule "
                  f"{sorted(m.finished_since_schedule)}")


def check_request_data(m: TraceModel, ev: dict, scheduled: list[str]) -> None:
    """SCHEDULED-HAS-DATA at ``schedule_end`` (schema 6; ``request_data_ids``
    null, an older trace, is not checkable): the request data's ids against
    ``scheduled``, the keys of num_scheduled_tokens as the step's rows give
    them (schedule rows less withdrawn ones), each once."""
    data = ev.get("request_data_ids")
    if data is None:
        if m.observed:  # schema 6 always records it: a null hides the request data
            m.violate("SCHEDULED-HAS-DATA", None, "schedule_end has no request_data_ids, which schema 6 "
                                                  "always records: the step's request data is unobserved")
        return
    twice = sorted({r for r in data if data.count(r) > 1})
    missing = [r for r in scheduled if r not in data]
    extra = [r for r in data if r not in scheduled]
    if twice:
        m.violate("SCHEDULED-HAS-DATA", twice[0], f"request data carries {twice} more than once")
    if missing:
        m.violate("SCHEDULED-HAS-DATA", missing[0], f"in num_scheduled_tokens without request data: {missing} "
                                                    f"(request data {data})")
    if extra:
        m.violate("SCHEDULED-HAS-DATA", extra[0], f"request data for {extra}, absent from num_scheduled_tokens "
                                                  f"{scheduled}")


# -- liveness ----------------------------------------------------------------------
def check_idle_admission(m: TraceModel, ev: dict, st: StepState) -> None:
    """IDLE-ADMISSION at ``schedule_end``: with nothing running and requests
    waiting, something is admitted. (Blocks still behind a deferred-free
    fence, or held by the load of a request finished while loading, may
    legitimately block it.) Its premise, every accepted request fits an empty
    engine, is vLLM's engine start-up check (the KV cache holds one
    ``max_model_len`` request); a pool smaller than that (a unit test's
    scheduler, built without the engine: vLLM 0.33.0's
    ``test_priority_preemption_bug.py`` runs a 200-token request on 6 blocks of
    16) voids it for a waiting request longer than the pool: not judged then
    (``_longer_than_the_pool``).

    The premise is about blocks; the step's tokens are its token budget, read
    from the step itself (``_idle_budget``): a step whose budget cannot take
    a waiting request's first chunk may admit nothing (vLLM 0.33.0
    ``Scheduler.schedule``: with chunked prefill off, a prompt over the budget
    left ends the waiting loop; a fork may lower its budget on some steps, a
    trial finding). Raises nothing."""
    if (not st.running_before and st.waiting_before and not st.preempted and not st.admitted
            and not st.skipped and not m.deferred and not m.kv_abandoned
            and not _longer_than_the_pool(m, st.waiting_before)):
        budget = _idle_budget(m, ev, st)
        if _over_the_budget(m, budget, st.waiting_before):
            return  # a waiting request's first chunk may not fit the step's budget: not judged
        m.violate("IDLE-ADMISSION", st.waiting_before[0],
                  f"nothing running, {len(st.waiting_before)} waiting, and nothing admitted, although the "
                  f"step's token budget ({budget}) fits every waiting request: a request that fits an "
                  f"empty engine must be admitted")


def _idle_budget(m: TraceModel, ev: dict, st: StepState) -> int:
    """The tokens a step could give its admissions: the ``token_budget`` its
    ``schedule_end`` row says it left (a step that ran nothing left its whole
    budget, so a fork with a tighter cap on that step says less), never more
    than the configured cap (``max_num_scheduled_tokens``, else
    ``max_num_batched_tokens``) less the step's tokens; the configured cap
    when the row records none (an older trace). Tokens."""
    cap = m.token_budget - st.total
    left = ev.get("token_budget")
    return cap if left is None else min(left, cap)


def _over_the_budget(m: TraceModel, budget: int, waiting: list[str]) -> bool:
    """Whether some waiting request's first chunk may exceed ``budget``
    tokens, so the engine (whichever request it takes first) may rightly admit
    nothing: no budget at all; a speculative decode's padding (``1 +
    num_spec_tokens``, vLLM 0.33.0 pads a resumed request's lone token) over
    it; or, with chunked prefill off, a request's tokens to compute (bounded
    from above by ``num_tokens``: a prefix hit only lowers it) over it. The
    order the engine takes waiting requests in is its policy, so any such
    request exempts the step. A request not in the shadow is not counted."""
    if budget <= 0 or (m.num_spec and budget < 1 + m.num_spec):
        return True
    if m.chunked_prefill:
        return False
    return any((req := m.reqs.get(rid)) is not None and req.num_tokens > budget for rid in waiting)


def _longer_than_the_pool(m: TraceModel, waiting: list[str]) -> bool:
    """Whether, on a one-group full-attention model, a waiting request holds
    more tokens than the whole KV pool (``num_gpu_blocks`` less vLLM's null
    block, of ``block_size`` tokens) can hold: it fits no engine, and vLLM
    allocates a lone request's whole prefill at once (0.33.0
    ``Scheduler.schedule``: ``long_prefill_token_threshold`` is 0 when one
    request is eligible), so an empty engine may admit nothing. A windowed or
    hybrid model (``group_windows``) needs fewer blocks than its tokens: never
    claimed there (the rule stays judged)."""
    capacity = (m.num_gpu_blocks - 1) * m.bs
    if m.group_windows is not None or capacity >= m.max_model_len:
        return False  # vLLM's start-up guarantee holds (every request fits), or not full attention
    return any((req := m.reqs.get(rid)) is not None and req.num_tokens > capacity for rid in waiting)


def check_progress(m: TraceModel, st: StepState) -> None:
    """NO-PROGRESS at ``schedule_end``: no two consecutive zero-token steps with
    unchanged queues and no input between (updates ``zero_step_state``).
    Waiting on outputs in flight or on a KV load is not a lack of progress."""
    # Walked only for a zero-token step (the live requests are the whole backlog).
    if (st.total == 0 and (st.waiting_before or st.running_before) and len(m.batches) <= 1
            and not (m.kv_abandoned or any(r.status == "WAITING_FOR_REMOTE_KVS" for r in m.reqs.values()))):
        state = (tuple(st.waiting_before), tuple(st.running_before))
        if m.zero_step_state == state and not st.arrived and not st.aborted:
            m.violate("NO-PROGRESS", None,
                      f"a second step with no tokens scheduled and unchanged queues "
                      f"(waiting {list(state[0])[:5]}, running {list(state[1])[:5]})")
        m.zero_step_state = state
    else:
        m.zero_step_state = None


def check_liveness(m: TraceModel) -> None:
    """LIVENESS at the end of the trace: no request is left unfinished.

    Not after a crash (``m.crashed``): the run ended there, every request
    still live was cut off by it, and the one ENGINE-CRASH violation is the
    finding (a LIVENESS witness per request would bury it). The crash itself
    keeps the trace from passing."""
    if m.crashed:
        return
    for rid, req in m.reqs.items():
        m.violate("LIVENESS", rid, f"still {req.status} with {req.num_output_tokens} outputs at the end of the trace")


# -- crashes -----------------------------------------------------------------------
def check_crash(m: TraceModel, ev: dict, before: list[dict]) -> None:
    """ENGINE-CRASH at a ``crash`` row: always a violation (a correct engine of
    any version never raises inside a scheduler call, so this is a safety
    rule). The witness: the exception, the call and the frame that raised it,
    and the step's rows before it (``before``): the inputs, the queues at step
    start and the decisions taken before the crash. Sets ``m.crashed``."""
    m.crashed = True
    call, where = ev.get("status") or "?", ev.get("stop_reason")
    history = [f"step {m.step}: {line}" for line in _crash_context(before, call)]
    m.violate("ENGINE-CRASH", None, f"{call}() raised {ev.get('message') or '?'}"
              + (f" at {where}" if where else ""), history)


def _ids(ids: list[str], limit: int = 8) -> str:
    return f"{ids[:limit]}" + (f" ... ({len(ids)} in all)" if len(ids) > limit else "")


def _crash_context(before: list[dict], call: str) -> list[str]:
    """What the crashed step did before the crash, one line per part."""
    kinds = [r["kind"] for r in before]
    lines = []
    inputs = [f"{k} {r['request_id']}" for r, k in zip(before, kinds) if k in ("arrival", "reject", "abort")]
    if inputs:
        lines.append(f"inputs: {', '.join(inputs[:8])}" + (f", ... ({len(inputs)} in all)" if len(inputs) > 8 else ""))
    begin = next((r for r in before if r["kind"] == "schedule_begin"), None)
    if begin is not None:
        lines.append(f"queues at step start: waiting {_ids(begin['waiting'] or [])}, running "
                     f"{_ids(begin['running'] or [])}, {begin['num_free_blocks']} free blocks")
        decisions = []
        for r in before:
            if r["kind"] == "schedule":
                decisions.append(f"scheduled {r['request_id']} ({r['schedule_kind']}, "
                                 f"{r['num_scheduled_tokens']} token{'s' * (r['num_scheduled_tokens'] != 1)})")
            elif r["kind"] in ("preempt", "withdraw", "skip", "kv_load", "kv_promote"):
                decisions.append(f"{r['kind']} {r['request_id']}")
        done = "schedule_end" in kinds
        what = "decisions of the step" if done else "decisions before the crash"
        lines.append(f"{what}: " + ("; ".join(decisions[:12]) + (f"; ... ({len(decisions)} in all)"
                                                                  if len(decisions) > 12 else "")
                                    if decisions else "none")
                     + ("" if done or decisions else f" recorded ({call}() raised before returning them)"))
    update = next((r for r in before if r["kind"] == "update_begin"), None)
    if update is not None:
        outputs = [f"{r['request_id']} {r['token_ids']}" for r in before if r["kind"] == "output"]
        finished = [r["request_id"] for r in before if r["kind"] == "finish"]
        lines.append(f"update of the batch of step {update['batch_step']}: outputs "
                     + (", ".join(outputs[:8]) if outputs else "none")
                     + (f"; finished {_ids(finished)}" if finished else ""))
    if not lines:
        lines.append("nothing recorded in this step before the crash")
    return lines
