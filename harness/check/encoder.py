"""Encoder inputs (multimodal items): the per-step encoder budget, the window
decision and the encoder cache.

vLLM 0.33.0 ``Scheduler._try_schedule_encoder_inputs`` and
``EncoderCacheManager`` (spec 3.2 step 8, 3.3, 4.2, 6 e, 10.5, 10.6). The
shadow cache is the model's (``TraceModel.enc``, a
``harness.check.encoder_cache.ShadowEncoderCache``); this family's hooks both
drive it and check against it, because the decision vLLM must take *is* the
expected value (a contradiction stops the shadow-dependent checks).

Timing follows vLLM: an ``encoder_plan`` row is checked when it occurs
(before the preemptions its request's allocation causes), against the
window the request would get without encoder limits; the request's
``schedule`` row commits it (the budget becomes the plan's budget left,
dropping any give-back in between, as vLLM does); a plan not followed by
its ``schedule`` row failed allocation: a waiting request then releases
its references, a running one keeps them. After a step, each processed
request, in batch order, releases the inputs behind its confirmed
progress (and all of them if it stops).
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.check.encoder_cache import Plan, items_in_window
from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("ENCODER-BUDGET", "The encoder inputs a step encodes (net of PRIORITY give-back) total at most max_num_encoder_input_tokens embeds, and a withdrawn request gives back exactly the inputs it had scheduled.", "3.2 step 8, 3.3, 4.2",
              SAFETY, "max_num_encoder_input_tokens sizes the encoder's batch; every version keeps within it and gives back what a withdrawn request had scheduled."),
    Invariant("ENCODER-INPUTS", "A window's encoder inputs are decided as _try_schedule_encoder_inputs does: every input overlapping a scheduled window is cached (a hit) or encoded in that step, never both; the window stops before the first input that fits neither the encoder budget left (give-back restored) nor the encoder cache (or, with disable_chunked_mm_input, would be split), and only there.", "3.2 step 8, 10.5, 10.6",
              SEMANTICS, "Which encoder inputs a window takes and where it stops is _try_schedule_encoder_inputs' design."),
    Invariant("ENCODER-CACHE", "The encoder cache never holds more than encoder_cache_size embeds, evicts unreferenced entries oldest first (listed in free_encoder_mm_hashes), and a request's reference to an input is dropped once its range ends at or before num_computed_tokens - placeholders, at preemption, and at finish.", "4.3, 6 e, 10.8",
              SEMANTICS, "The encoder cache's capacity accounting and eviction order (unreferenced, oldest first) are 0.33.0's EncoderCacheManager design."),
]


# -- arrivals ---------------------------------------------------------------
def inadmissible(m: TraceModel, positions: Sequence[Sequence[int]] | None) -> str | None:
    """Why an item makes a request inadmissible (the input processor's
    encoder checks), or None."""
    step_tokens = min(m.token_budget, m.max_num_batched_tokens)
    if m.threshold > 0:
        step_tokens = min(step_tokens, m.threshold)
    for i, (_, length) in enumerate(positions or ()):
        if length > m.enc_cache_size:
            return f"encoder input {i} of {length} embeds > encoder cache size {m.enc_cache_size}"
        if length > m.enc_budget:
            return f"encoder input {i} of {length} embeds > encoder compute budget {m.enc_budget}"
        if m.enc_no_chunk and length > step_tokens:
            return (f"encoder input {i} of {length} tokens > {step_tokens} tokens per step with "
                    f"disable_chunked_mm_input")
    return None

def stop(m: TraceModel, invariant: str, rid: str | None, message: str) -> None:
    """Report a contradiction of the shadow cache, after which it is no
    longer inferable: the shadow-dependent checks stop."""
    m.violate(invariant, rid, message + "; the encoder cache can no longer be inferred, so "
                                            "these checks stop here")
    m.enc_known = False

# -- scheduling -------------------------------------------------------------
def before_event(m: TraceModel, ev: dict, st: StepState) -> None:
    """Resolve what the previous rows left open before ``ev`` is handled."""
    kind, enc = ev["kind"], st.enc
    plan = enc.pending
    # The plan's own allocation may write a skipped_free row first (a hybrid
    # model: allocate_slots calls remove_skipped_blocks after
    # _try_schedule_encoder_inputs planned the window; regression, found by
    # `harness fuzz --hybrid`: the plan was dropped there and ENCODER-INPUTS
    # fired on the reference).
    if plan is not None and kind not in ("withdraw", "preempt") \
            and not (kind in ("schedule", "skipped_free") and ev["request_id"] == plan["rid"]):
        enc.pending = None  # its allocation failed
        req = m.reqs.get(plan["rid"])
        if plan["waiting"] and req is not None:
            m.enc.release_all(req.request_id, req.items)
    if not enc.update_done and kind in ("finish", "kv_finished", "kv_free", "draft", "update_end"):
        update_until(m, st, None)
        enc.update_done = True

def expected_window(m: TraceModel, req: ReqShadow, computed: int, st: StepState) -> int:
    """The tokens the request would get before encoder limits (spec 10.3,
    10.6): its remaining tokens (padded for a new decode), the threshold,
    the budgets left and, for running requests, max_model_len."""
    running = req.status == "RUNNING"
    if running:
        n = req.num_tokens + len(req.spec_token_ids) + req.placeholders - computed
    else:
        n = req.num_tokens - computed
        if (m.num_spec > 0 and n == 1 and not st.prefill_scheduled
                and (st.running_scheduled or computed > 0)
                and computed + 2 + m.num_spec <= m.max_model_len):
            n = 1 + m.num_spec
    threshold = m.threshold if st.eligible > 1 else 0
    if 0 < threshold < n:
        n = threshold
    n = min(n, m.token_budget - st.total, m.max_num_batched_tokens - st.total)
    if running:
        n = min(n, m.max_model_len - computed - 1)
    return n

def on_encoder_plan(m: TraceModel, ev: dict, st: StepState) -> None:
    """ENCODER-INPUTS at an ``encoder_plan`` row: the window and inputs are the
    decision ``ShadowEncoderCache.plan`` gives; the plan stays pending until its
    ``schedule`` row (or fails)."""
    rid, computed, n = ev["request_id"], ev["num_computed_tokens"], ev["num_scheduled_tokens"]
    ids = list(ev.get("encoder_input_ids") or [])
    req = m.reqs.get(rid)
    enc = st.enc
    if req is None or not req.items:
        m.violate("ENCODER-INPUTS", rid, "an encoder plan for a request without encoder inputs")
        return
    waiting = req.status != "RUNNING"
    if m.enc_known:
        n_pre = expected_window(m, req, computed, st)
        plan = m.enc.plan(rid, req.items, computed, n_pre, enc.budget_left, m.enc_no_chunk,
                          m.prefill_lookahead)
        if (plan.input_ids, plan.num_tokens) != (ids, n):
            stop(m, "ENCODER-INPUTS", rid, plan_mismatch(m, req, computed, n, ids, n_pre, plan,
                                                                      enc.budget_left))
        duplicates = plan.duplicates
    else:
        duplicates = []
    m.note(req, f"encoder plan: window [{computed}, {computed + n}), encode inputs {ids}")
    if n == 0 or reserve_prefill_lookahead(m, req, computed, n) == 0:
        enc.zero.add(rid)  # (the request is skipped, or not scheduled this step)
        return
    enc.pending = {"rid": rid, "computed": computed, "n": n, "ids": ids, "duplicates": duplicates,
                   "budget": enc.budget_left, "waiting": waiting}

def reserve_prefill_lookahead(m: TraceModel, req: ReqShadow, computed: int, n: int) -> int:
    """The tokens left of an ``n``-token window once the drafter's prefill
    look-ahead is kept out of its end (vLLM 0.33.0
    ``Scheduler._reserve_prefill_lookahead``): a prefill chunk either reaches
    the prefill's end or leaves at least ``m.prefill_lookahead`` tokens."""
    remaining = req.num_tokens - computed - n
    if 0 < remaining < m.prefill_lookahead:
        n -= m.prefill_lookahead - remaining
    return max(n, 0)


def plan_mismatch(m: TraceModel, req: ReqShadow, computed: int, n: int, ids: list[int], n_pre: int, plan: Plan,
                   budget: int) -> str:
    head = (f"encoder plan window [{computed}, {computed + n}) encoding inputs {ids}, but with "
            f"{n_pre} tokens available, {budget} embeds of encoder budget left and the cache "
            f"({m.enc.free} free, {m.enc.reclaimable} reclaimable embeds)")
    cached = [i for i in ids if i in plan.hits]
    if cached:
        return f"{head} input(s) {cached} are cached: they must be hits, not encoded again"
    if n < plan.num_tokens:
        nxt = [i for i in items_in_window(req.items, computed + n, computed + plan.num_tokens)]
        return (f"{head} the window must reach {computed + plan.num_tokens} encoding {plan.input_ids}: "
                f"it was cut before input(s) {nxt} that fit")
    if n > plan.num_tokens:
        what = (f"input {plan.stopped_before} {req.items[plan.stopped_before].offset, req.items[plan.stopped_before].length}"
                if plan.stopped_before is not None else "an input")
        return (f"{head} the window must stop at {computed + plan.num_tokens}, before {what}, which "
                f"fits neither the budget left nor the cache")
    return f"{head} the inputs to encode are {plan.input_ids}"

def on_schedule(m: TraceModel, ev: dict, st: StepState, req: ReqShadow, computed: int, n: int) -> None:
    """Commit the request's plan; check the window's coverage and the budget."""
    rid, enc = req.request_id, st.enc
    ids = list(ev.get("encoder_input_ids") or [])
    overlapping = items_in_window(req.items, computed, computed + n)
    plan = enc.pending if enc.pending is not None and enc.pending["rid"] == rid else None
    duplicates: list[int] = []
    planned = n  # the window the plan looked at (before the look-ahead cut)
    if plan is not None:
        enc.pending = None
        duplicates = plan["duplicates"]
        planned = plan["n"]
        if (plan["computed"], reserve_prefill_lookahead(m, req, plan["computed"], plan["n"]),
                plan["ids"]) != (computed, n, ids):
            m.violate("ENCODER-INPUTS", rid,
                          f"scheduled window [{computed}, {computed + n}) encoding {ids}, but its "
                          f"encoder plan was [{plan['computed']}, {plan['computed'] + plan['n']}) "
                          f"encoding {plan['ids']}")
        if ids:
            # vLLM commits the budget computed before the allocation loop.
            enc.budget_left = plan["budget"] - sum(req.items[i].length for i in ids)
    else:
        # (With a drafter's look-ahead the plan looks that much further.)
        looked = items_in_window(req.items, computed, computed + n + m.prefill_lookahead) \
            if m.prefill_lookahead else overlapping
        if looked:
            m.violate("ENCODER-INPUTS", rid,
                          f"window [{computed}, {computed + n}) overlaps encoder input(s) {looked} "
                          f"without an encoder plan"
                          + (f" (its look-ahead of {m.prefill_lookahead} tokens included)"
                             if m.prefill_lookahead else ""))
        enc.budget_left -= sum(req.items[i].length for i in ids if i < len(req.items))
    looked_at = items_in_window(req.items, computed, computed + planned + m.prefill_lookahead) \
        if m.prefill_lookahead else overlapping
    stray = [i for i in ids if i not in looked_at]
    if stray:
        m.violate("ENCODER-INPUTS", rid,
                      f"encodes input(s) {stray} outside its window [{computed}, {computed + n})"
                      + (f" and its look-ahead of {m.prefill_lookahead} tokens" if m.prefill_lookahead else ""))
        ids = [i for i in ids if i in looked_at]
    if ids:
        enc.committed[rid] = ids
    total = sum(sum(m.reqs[r].items[i].length for i in i_s)
                for r, i_s in enc.committed.items() if r in m.reqs)
    if total > m.enc_budget:
        m.violate("ENCODER-BUDGET", rid,
                      f"this step encodes {total} embeds (requests {sorted(enc.committed)}) > "
                      f"max_num_encoder_input_tokens {m.enc_budget}")
    if not m.enc_known:
        return
    for i in ids:
        if not m.enc.allocate(rid, req.items, i):
            stop(m, "ENCODER-CACHE", rid,
                           f"encodes input {i} ({req.items[i].length} embeds) but the cache has only "
                           f"{m.enc.free} free embeds after this step's evictions "
                           f"(size {m.enc_cache_size})")
            return
    for i in duplicates:
        m.enc.hit(rid, req.items, i)
    missing = [i for i in overlapping if not m.enc.is_cached(req.items, i)]
    if missing:
        stop(m, "ENCODER-INPUTS", rid,
                       f"window [{computed}, {computed + n}) runs over encoder input(s) "
                       f"{[(i, req.items[i].offset, req.items[i].length) for i in missing]} that are "
                       f"neither cached nor encoded this step")

def on_withdraw(m: TraceModel, ev: dict, st: StepState, rid: str) -> None:
    """PRIORITY give-back: the victim's inputs return to the budget."""
    given = list(ev.get("encoder_input_ids") or [])
    committed = st.enc.committed.pop(rid, [])
    if given != committed:
        m.violate("ENCODER-BUDGET", rid,
                      f"withdrawn giving back encoder inputs {given}, but it had scheduled {committed}")
    req = m.reqs.get(rid)
    if req is not None:
        st.enc.budget_left += sum(req.items[i].length for i in committed)

def on_preempt(m: TraceModel, st: StepState, req: ReqShadow) -> None:
    """A preempted request drops its pending plan and all its input references."""
    pending = st.enc.pending
    if pending is not None and pending["rid"] == req.request_id:
        st.enc.pending = None  # it preempted itself: the plan fails
    if m.enc_known:
        m.enc.release_all(req.request_id, req.items)

def on_finish(m: TraceModel, req: ReqShadow) -> None:
    """A finished (or stopped) request drops all its input references."""
    if m.enc_known:
        m.enc.release_all(req.request_id, req.items)

def on_schedule_end(m: TraceModel, ev: dict, st: StepState) -> None:
    """ENCODER-CACHE at ``schedule_end``: free_encoder_mm_hashes lists exactly
    this step's evictions (unreferenced entries, oldest first)."""
    if not m.enc_known:
        return
    expected = m.enc.take_evicted()
    reported = list(ev.get("free_encoder_mm_hashes") or [])
    if reported != expected:
        stop(m, "ENCODER-CACHE", None,
                       f"free_encoder_mm_hashes {reported}, but evicting unreferenced entries oldest "
                       f"first gives {expected}")

# -- update -----------------------------------------------------------------
def update_until(m: TraceModel, st: StepState, rid: str | None) -> None:
    """Release passed inputs of the processed batch's requests, in batch
    order, up to (not including) ``rid`` (None: all the rest)."""
    scheduled = st.batch.scheduled if st.batch is not None else []
    while st.enc.cursor < len(scheduled):
        current = scheduled[st.enc.cursor]
        st.enc.cursor += 1
        if current == rid:
            return
        req = m.reqs.get(current)
        if req is not None:
            free_passed(m, req)

def free_passed(m: TraceModel, req: ReqShadow) -> None:
    """Release the request's inputs behind num_computed_tokens - placeholders."""
    if m.enc_known and req.items:
        m.enc.release_passed(req.request_id, req.items, req.num_computed_tokens - req.placeholders)
