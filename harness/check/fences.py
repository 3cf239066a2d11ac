"""Async scheduling and fences: output placeholders, stale output of preempted
requests, and deferred block frees behind a step fence.

vLLM 0.33.0 ``AsyncScheduler`` (num_output_placeholders, spec 7.3) and the
deferred-free path of the KV manager (spec 5.10): the model keeps batches in
flight (``TraceModel.batches``), ``sched_seq``/``processed_seq`` and the FIFO
of deferred frees (``TraceModel.deferred``).
"""

from __future__ import annotations

from reference.words import plural

from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, Invariant

INVARIANTS = [
    Invariant("ASYNC-PLACEHOLDERS", "Async scheduling: num_output_placeholders never goes negative, and a request whose in-flight tokens already reach max_tokens is not scheduled again.", "3.2 step 1, 7.3, 8 #38",
              SAFETY, "num_output_placeholders counts sampled tokens in flight; a negative count or scheduling past max_tokens with tokens in flight produces tokens the request may not have."),
    Invariant("STALE-OUTPUT", "A preempted request whose pre-preemption output is still in flight is skipped, not re-admitted, until that output is delivered; a skip needs that reason (or, with max_loras, an adapter that would exceed it: max_loras adapters running and its own not among them).", "10.2, 7.3",
              SAFETY, "Output computed before a preemption belongs to KV that was given back: recomputing the request while that output is in flight races with it, in every version with batches in flight."),
    Invariant("DEFERRED-FREE-FENCED", "With deferred frees, a request's blocks are freed at once only if no step that writes them is in flight; otherwise they wait behind fence = sched_step_seq, stay unallocatable, and are drained FIFO once processed_step_seq reaches the fence.", "5.10, 8 #34-35",
              SAFETY, "A block freed while a step in flight still writes it must not be reused until that step is processed, or the next owner's KV is overwritten (mission invariant 4)."),
]


# -- placeholders ------------------------------------------------------------------
def check_not_past_max_tokens(m: TraceModel, req: ReqShadow, computed: int) -> None:
    """ASYNC-PLACEHOLDERS: a request whose in-flight tokens already reach
    max_tokens is not scheduled again."""
    if req.placeholders > 0 and computed + 2 - req.placeholders >= req.num_prompt_tokens + req.max_tokens:
        m.violate("ASYNC-PLACEHOLDERS", req.request_id,
                  f"scheduled with {plural(req.placeholders, 'token')} in flight that already reach "
                  f"max_tokens {req.max_tokens} (computed {computed})")


def check_placeholders_left(m: TraceModel, req: ReqShadow) -> None:
    """ASYNC-PLACEHOLDERS after an output: num_output_placeholders never goes
    negative (clamped to 0 after the witness)."""
    if req.placeholders < 0:
        m.violate("ASYNC-PLACEHOLDERS", req.request_id, f"num_output_placeholders fell to {req.placeholders}")
        req.placeholders = 0


# -- stale output ------------------------------------------------------------------
def check_no_stale_at_admission(m: TraceModel, req: ReqShadow, kind: str) -> None:
    """STALE-OUTPUT: no request is admitted while its pre-preemption output is in flight."""
    if req.stale > 0:
        m.violate("STALE-OUTPUT", req.request_id,
                  f"admitted ({kind}) with {plural(req.stale, 'token')} of stale output still in flight")


def lora_limit_reached(m: TraceModel, request_id: str) -> bool:
    """Whether ``request_id``'s LoRA adapter would exceed ``max_loras`` now
    (vLLM 0.33.0 ``Scheduler.schedule``'s waiting loop): ``max_loras``
    distinct adapters are held by running requests (admissions of this step
    included) and its own is not among them."""
    lora = m.lora_int_ids.get(request_id, 0)
    if m.max_loras is None or lora <= 0:
        return False
    held = {m.lora_int_ids.get(r, 0) for r, q in m.reqs.items() if q.status == "RUNNING"} - {0}
    return len(held) == m.max_loras and lora not in held


def check_skip_reason(m: TraceModel, ev: dict, req: ReqShadow | None) -> None:
    """STALE-OUTPUT at a ``skip`` row (not a KV load, not an encoder cut): the
    skip needs stale output in flight, or (LoRA) an adapter that would exceed
    ``max_loras`` (``lora_limit_reached``)."""
    if lora_limit_reached(m, ev["request_id"]):
        return
    if req is None or req.stale == 0:
        m.violate("STALE-OUTPUT", ev["request_id"], f"skipped ({ev['message']}) without stale output in flight")


# -- deferred frees (spec 5.10) ----------------------------------------------------------
def check_free_fence(m: TraceModel, req: ReqShadow, kind: str, expected: list[int], fence: int | None) -> None:
    """DEFERRED-FREE-FENCED at a free (``kind``: preempt, finish, abort): freed
    at once only if no step writing the blocks is in flight, else behind
    fence = sched_step_seq; never deferred with defer_block_free off."""
    if m.defer:
        in_flight = req.last_sched_seq > m.processed_seq
        if fence is None and in_flight:
            m.violate("DEFERRED-FREE-FENCED", req.request_id,
                      f"{kind} freed blocks {expected} at once although step seq "
                      f"{req.last_sched_seq} that writes them is in flight "
                      f"(processed_step_seq {m.processed_seq})")
        elif fence is not None and (not in_flight or fence != m.sched_seq):
            m.violate("DEFERRED-FREE-FENCED", req.request_id,
                      f"{kind} deferred with fence {fence}; expected "
                      f"{m.sched_seq if in_flight else 'an immediate free'}")
    elif fence is not None:
        m.violate("DEFERRED-FREE-FENCED", req.request_id,
                  f"{kind} deferred a free (fence {fence}) with defer_block_free off")


def check_drain_due(m: TraceModel, st: StepState, blocks: list[int], fence: int) -> bool:
    """DEFERRED-FREE-FENCED at a ``free_drain`` row: a fence has passed. False
    when none has (nothing is drained)."""
    if not m.deferred or st.drains >= st.expected_drains:
        m.violate("DEFERRED-FREE-FENCED", None,
                  f"drained blocks {blocks} (fence {fence}) before processed_step_seq "
                  f"{m.processed_seq} reached a pending fence")
        return False
    return True


def check_drain_is_oldest(m: TraceModel, fence: int, blocks: list[int], head_fence: int,
                          head_blocks: list[int]) -> None:
    """DEFERRED-FREE-FENCED: drains are FIFO, each exactly its entry."""
    if (fence, blocks) != (head_fence, head_blocks):
        m.violate("DEFERRED-FREE-FENCED", None,
                  f"drained (fence {fence}, {blocks}); the oldest deferred free is "
                  f"(fence {head_fence}, {head_blocks})")


def check_all_due_drained(m: TraceModel, st: StepState) -> None:
    """DEFERRED-FREE-FENCED at ``update_end``: every free whose fence passed was drained."""
    if st.drains < st.expected_drains:
        m.violate("DEFERRED-FREE-FENCED", None,
                  f"{st.expected_drains - st.drains} deferred frees whose fence passed "
                  f"(processed_step_seq {m.processed_seq}) were not drained")
