"""Budget: what one step may schedule. Token budget and long-prefill
threshold, max_num_seqs, the LoRA adapters of one batch (max_loras), each
request's scheduled span, and prefill deferral (the DP throttle, the
prefill_schedule_interval cadence, the capacity guard).

vLLM 0.33.0 ``Scheduler.schedule`` (spec 3.5, 7.1, 10.3, 10.4). The expected
deferral is recomputed here from the model (``TraceModel.capacity_bound``,
``last_prefill_step``, ``num_executed``); the handlers store it in
``StepState.defer``.
"""

from __future__ import annotations

from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("BUDGET-TOKENS", "total_num_scheduled_tokens = sum of entries <= token budget; every entry > 0.", "8 #1, 10.3",
              SAFETY, "max_num_batched_tokens bounds the batch the model runner is sized for; every version must keep the step's tokens within it and each entry positive."),
    Invariant("BUDGET-LEFT", "The token_budget a step leaves is max_num_scheduled_tokens (max_num_batched_tokens when unset) minus the tokens it scheduled.", "10.3",
              SEMANTICS, "That the budget left is the configured cap minus the step's tokens is vLLM's own accounting; a fork with a tighter internal cap (a smaller max_num_scheduled_tokens of its own) is correct and leaves less, so it is version design, not safety (issue 23)."),
    Invariant("BUDGET-THRESHOLD", "With more than one eligible request and long_prefill_token_threshold > 0, no entry exceeds the threshold.", "8 #2, 10.3",
              SEMANTICS, "long_prefill_token_threshold is a fairness knob; when it applies (0.33.0: only with more than one eligible request; 0.29.0: always) is version design."),
    Invariant("MAX-NUM-SEQS", "len(running) <= max_num_seqs; a request is admitted only while len(running) < max_num_seqs.", "8 #3, 10.3",
              SAFETY, "max_num_seqs sizes the runner's persistent batch; exceeding it overflows per-request buffers in every version."),
    # MAX-LORAS: the requests one step schedules use at most max_loras distinct
    # adapters. Why every engine: the model runner's LoRA manager has max_loras
    # adapter slots for a batch (vLLM LoRAConfig.max_loras sizes the stacked
    # adapter weights), so a batch needing one more adapter cannot run as
    # scheduled, whatever the version (vLLM 0.33.0 ``Scheduler.schedule``,
    # sched/scheduler.py:1040-1047, asserts ``len(scheduled_loras) <=
    # max_loras`` over every running request's adapter; its waiting loop skips
    # a request whose adapter would make one too many, spec 3.4 step 5, 10.5).
    # The rule checks the batch itself: the scheduled requests, a subset of running.
    Invariant("MAX-LORAS", "With max_loras set, the requests one step schedules use at most max_loras distinct LoRA adapters (lora_int_id > 0; requests without an adapter do not count).", "3.4, 10.5",
              SAFETY, "max_loras is the number of adapter slots the model runner's LoRA manager holds for one batch; a step scheduling more distinct adapters than that cannot be executed as scheduled, in every version (vLLM asserts len(scheduled_loras) <= max_loras)."),
    Invariant("SCHEDULED-SPAN", "computed + scheduled <= num_tokens, and <= max_model_len - 1 for running requests.", "3.5, 8 #17",
              SAFETY, "Scheduling past num_tokens or past max_model_len - 1 writes KV for tokens that do not exist or beyond the positions the model supports, in every version."),
    Invariant("PREFILL-DEFER", "defer_prefills = (throttle_prefills or inside the prefill_schedule_interval cadence) and not prefill_capacity_bound and a decode is running; a deferring step runs no prefill chunk and admits no request with more than one token left; the capacity guard is updated only by a waiting phase that ran without deferring.", "7.1, 10.4, 8 #36",
              SEMANTICS, "Prefill gating (the throttle, the local cadence, the capacity guard) is 0.33.0's design; older releases gate differently or not at all."),
]


# -- tokens ------------------------------------------------------------------------
def check_entry(m: TraceModel, st: StepState, rid: str, n: int | None) -> bool:
    """BUDGET-TOKENS (entry > 0; False when not, nothing more is checked) and
    BUDGET-THRESHOLD (no entry over the threshold with more than one eligible)."""
    if n is None or n <= 0:
        m.violate("BUDGET-TOKENS", rid, f"num_scheduled_tokens {n} is not positive")
        return False
    if 0 < m.threshold < n and st.eligible > 1:
        m.violate("BUDGET-THRESHOLD", rid, f"{n} tokens > long_prefill_token_threshold {m.threshold}")
    return True


def check_totals(m: TraceModel, ev: dict, st: StepState) -> None:
    """BUDGET-TOKENS at ``schedule_end``: the total is the sum of entries, within
    the budget; BUDGET-LEFT: the budget left is the configured cap minus it."""
    total = ev["total_num_scheduled_tokens"]
    if total != st.total or total > m.token_budget:
        m.violate("BUDGET-TOKENS", None, f"total {total} (events sum {st.total}) vs budget {m.token_budget}")
    if ev["token_budget"] != m.token_budget - st.total:
        m.violate("BUDGET-LEFT", None, f"budget left {ev['token_budget']} != {m.token_budget} - {st.total}")


# -- LoRA adapters -----------------------------------------------------------------
def check_loras(m: TraceModel, st: StepState) -> None:
    """MAX-LORAS at ``schedule_end``: the distinct adapters (config
    ``lora_int_ids``, > 0) of the requests the step scheduled (less the
    withdrawn ones) are at most ``max_loras``. The witness names each
    adapter with its first scheduled request (in schedule order) and
    max_loras. Silent without a LoRA config."""
    if m.max_loras is None or not m.lora_int_ids:
        return
    first: dict[int, str] = {}
    for rid in st.scheduled:
        lora = m.lora_int_ids.get(rid, 0)
        if lora > 0 and lora not in first:
            first[lora] = rid
    if len(first) > m.max_loras:
        named = ", ".join(f"{lora} ({rid})" for lora, rid in sorted(first.items()))
        m.violate("MAX-LORAS", None,
                  f"{len(first)} LoRA adapters scheduled: {named}; max_loras {m.max_loras}")


# -- sequences ---------------------------------------------------------------------
def check_room_to_admit(m: TraceModel, st: StepState, rid: str, what: str) -> None:
    """MAX-NUM-SEQS: a request is admitted (``what`` "admission") or examined for
    a KV load ("kv_load") only while len(running) < max_num_seqs."""
    if len(st.sim_running) >= m.max_num_seqs:
        if what == "admission":
            m.violate("MAX-NUM-SEQS", rid,
                      f"admitted with {len(st.sim_running)} running = max_num_seqs {m.max_num_seqs}")
        else:
            m.violate("MAX-NUM-SEQS", rid, f"examined with {len(st.sim_running)} running = max_num_seqs")


def check_running_size(m: TraceModel, running: list[str]) -> None:
    """MAX-NUM-SEQS at ``schedule_end``."""
    if len(running) > m.max_num_seqs:
        m.violate("MAX-NUM-SEQS", None, f"{len(running)} running > max_num_seqs {m.max_num_seqs}")


# -- span --------------------------------------------------------------------------
def check_span_model_len(m: TraceModel, rid: str, computed: int, n: int) -> None:
    """SCHEDULED-SPAN: a running request stays within max_model_len - 1."""
    if computed + n > m.max_model_len - 1:
        m.violate("SCHEDULED-SPAN", rid, f"{computed} + {n} tokens passes max_model_len - 1 = {m.max_model_len - 1}")


def check_span_tokens(m: TraceModel, req: ReqShadow, computed: int, n: int, drafts: list[int]) -> None:
    """SCHEDULED-SPAN: computed + scheduled <= num_tokens + drafts + placeholders."""
    if computed + n > req.num_tokens + len(drafts) + req.placeholders:
        m.violate("SCHEDULED-SPAN", req.request_id,
                  f"{computed} computed + {n} scheduled > {req.num_tokens} tokens "
                  f"+ {len(drafts)} drafts + {req.placeholders} placeholders")


# -- prefill deferral (spec 7.1, 10.4) ---------------------------------------------------
def expected_defer(m: TraceModel, ev: dict, running: list[str]) -> bool:
    """At ``schedule_begin``: check the DP throttle flag (PREFILL-DEFER) and
    return whether this step must defer prefills."""
    has_decode = any(not m.reqs[r].prefill_chunk for r in running if r in m.reqs)
    expected_throttle = m.dp_interval > 1 and m.step % m.dp_interval != 0
    if bool(ev["throttle_prefills"]) != expected_throttle:
        m.violate("PREFILL-DEFER", None,
                  f"throttle_prefills {ev['throttle_prefills']} at step {m.step}, but the "
                  f"coordinator's cadence (every {m.dp_interval} steps) gives {expected_throttle}")
    defer = bool(ev["throttle_prefills"]) and not m.capacity_bound and has_decode
    if (not defer and m.interval > 1 and not m.capacity_bound and has_decode
            and (m.num_executed + 1) - m.last_prefill_step < m.interval):
        defer = True
    return defer


def check_chunk_not_deferred(m: TraceModel, st: StepState, req: ReqShadow, computed: int) -> None:
    """PREFILL-DEFER: a deferring step runs no prefill chunk."""
    if st.defer:
        m.violate("PREFILL-DEFER", req.request_id,
                  f"a prefill chunk ({computed} of {req.num_tokens} tokens computed) "
                  f"ran in a step that defers prefills")


def check_admission_not_deferred(m: TraceModel, st: StepState, req: ReqShadow, computed: int) -> None:
    """PREFILL-DEFER: a deferring step admits no request with more than one token left."""
    if st.defer:
        m.violate("PREFILL-DEFER", req.request_id,
                  f"admitted with {req.num_tokens - computed} tokens to prefill in a step that "
                  f"defers prefills")


def check_defer_flag(m: TraceModel, ev: dict, st: StepState) -> None:
    """PREFILL-DEFER at ``schedule_end``: defer_prefills is the expected decision."""
    if bool(ev["defer_prefills"]) != st.defer:
        m.violate("PREFILL-DEFER", None,
                  f"defer_prefills {ev['defer_prefills']} but the throttle, the capacity guard "
                  f"({m.capacity_bound}) and the cadence (last prefill at executed step "
                  f"{m.last_prefill_step}, now {m.num_executed + 1}) give {st.defer}")


def check_capacity_flag(m: TraceModel, ev: dict, waiting: list[str]) -> None:
    """PREFILL-DEFER at ``schedule_end``: prefill_capacity_bound is the guard as
    updated by this step (only by a waiting phase that ran without deferring)."""
    if bool(ev["prefill_capacity_bound"]) != m.capacity_bound:
        m.violate("PREFILL-DEFER", None,
                  f"prefill_capacity_bound {ev['prefill_capacity_bound']} but "
                  f"{len(waiting)} waiting with {len(m.deferred_waiting & set(waiting))} "
                  f"skipped gives {m.capacity_bound}")
