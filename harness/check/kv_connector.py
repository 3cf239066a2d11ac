"""KV connector: async remote-KV loads (WAITING_FOR_REMOTE_KVS), their
promotion, failures, the blocks reserved for in-flight prefills, and requests
finished while loading.

vLLM 0.33.0 ``Scheduler`` with a KV connector (spec 7.2, 10.2): the model
keeps the kv-holding queue (``TraceModel.kv_queue``), the in-flight prefills
(``inflight``), finished-while-loading requests (``kv_abandoned``) and the
per-request ``kv_done``/``kv_failed`` flags.
"""

from __future__ import annotations

from reference.kv_connector import KV_MATCH_PENDING
from reference.words import plural

from harness.check.model import ReqShadow, StepState, TraceModel, cdiv
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("REMOTE-KV-LOADING", "A request loading remote KV (WAITING_FOR_REMOTE_KVS) is never scheduled, preempted or running, and its loaded blocks are no prefix hit before promotion; it is promoted only after its transfer reported done, to WAITING (PREEMPTED if preempted before) with num_computed_tokens = the loaded prefix (num_tokens - 1 for a whole-sequence load, the valid prefix after a failed one); a failed load under policy 'fail' finishes it with FINISHED_ERROR.", "7.2, 10.2, 8 #37",
              SAFETY, "A request whose KV is still being written by a transfer cannot run or be preempted, and its blocks are not valid prefix hits until the transfer reports done."),
    Invariant("REMOTE-KV-RESERVATION", "An async KV-load admission records, and leaves free, the blocks the in-flight prefills still need for their whole sequence (each plus one spec-decode step) plus one spec-decode step of its own.", "7.2, 8 #37",
              SEMANTICS, "How many blocks an async load leaves for in-flight prefills is 0.33.0's reservation design."),
    Invariant("REMOTE-KV-ABORT-HOLDS", "A request finished while its KV load is in flight keeps its blocks until the transfer reports done, then frees exactly its table.", "7.2, 6 step 6",
              SAFETY, "A transfer in flight still writes the blocks of a request finished meanwhile: they must stay held until it reports done."),
]


# -- a loading request is never scheduled, preempted or skipped once done --------------------
def check_not_loading(m: TraceModel, req: ReqShadow | None, what: str) -> None:
    """REMOTE-KV-LOADING: a loading request is never ``what`` ("scheduled", "preempted")."""
    if req is not None and req.status == "WAITING_FOR_REMOTE_KVS":
        if what == "scheduled":
            m.violate("REMOTE-KV-LOADING", req.request_id, "scheduled while loading remote KV (not yet promoted)")
        else:
            m.violate("REMOTE-KV-LOADING", req.request_id, "preempted while loading remote KV")


def check_skip_loading(m: TraceModel, req: ReqShadow) -> None:
    """REMOTE-KV-LOADING at a ``skip`` row of a loading request: its transfer is not done yet."""
    if req.kv_done:
        m.violate("REMOTE-KV-LOADING", req.request_id,
                  "skipped although its transfer was reported finished (must be promoted)")


# -- the recorded answers, in call order --------------------------------------------------
def take_answer(m: TraceModel, req_id: str, answer: tuple[int | None, bool] | None) -> bool:
    """Use the recorded connector's next answer to ``req_id`` equal to
    ``answer`` (``(external tokens, load_kv_async)``; None: any "cannot tell
    yet" answer, external tokens None): True when one is left at or after the
    first unused one, which then moves past it. vLLM's scheduler asks
    ``get_num_new_matched_tokens`` each time its waiting loop reaches the
    request with nothing computed, and not every call shows in the trace (a
    call before an allocation that fails ends the loop with no row), so the
    events must be a subsequence of the answers, in order: matching each event
    to the earliest answer that fits finds such a subsequence whenever one
    exists (no false alarm), and an answer used once, or one a later call gave,
    excuses nothing earlier (adversarial trial: a frozenset of every answer
    let an admission use an answer of a call already spent)."""
    answers = m.kv_answers.get(req_id, ())
    for j in range(m.kv_next_answer.get(req_id, 0), len(answers)):
        if answers[j] == answer or (answer is None and answers[j][0] is None):
            m.kv_next_answer[req_id] = j + 1
            return True
    return False


# -- a skip while the connector cannot tell ----------------------------------------------
def match_pending(m: TraceModel, ev: dict) -> bool:
    """At a ``skip`` row: True when it is vLLM 0.33.0's skip of a request whose
    connector answered None ("cannot tell yet", ``Scheduler.schedule``'s
    ``ext_tokens is None`` branch) and the recorded connector has such an
    answer left for it (``take_answer``); any other skip needs its own
    reason (STALE-OUTPUT, ``harness.check.fences.check_skip_reason``)."""
    return (m.kv_connector and ev["message"] == KV_MATCH_PENDING
            and take_answer(m, ev["request_id"], None))


# -- the load ----------------------------------------------------------------------
def check_load_start(m: TraceModel, rid: str) -> None:
    """REMOTE-KV-LOADING: a ``kv_load`` row needs a KV connector."""
    if not m.kv_connector:
        m.violate("REMOTE-KV-LOADING", rid, "an async KV load without a KV connector")


def check_load_request(m: TraceModel, req: ReqShadow) -> None:
    """REMOTE-KV-LOADING: a load starts for a WAITING or PREEMPTED request
    holding nothing."""
    if req.status not in ("WAITING", "PREEMPTED") or req.blocks or req.num_computed_tokens:
        m.violate("REMOTE-KV-LOADING", req.request_id,
                  f"started a load for a request with status {req.status}, "
                  f"{req.num_computed_tokens} computed tokens and blocks {req.blocks}")


def check_load_size(m: TraceModel, req: ReqShadow, hit: int, ext: int) -> None:
    """REMOTE-KV-LOADING: 0 < ext and hit + ext <= num_tokens."""
    if ext <= 0 or hit + ext > req.num_tokens:
        m.violate("REMOTE-KV-LOADING", req.request_id,
                  f"loads {plural(ext, 'external token')} after a {hit}-token hit of {req.num_tokens} tokens")


def expected_reservation(m: TraceModel, ev: dict, rid: str) -> int:
    """REMOTE-KV-RESERVATION at a ``kv_load`` row: the recorded reservation is
    what the in-flight prefills still need (plus one spec-decode step); returns it."""
    reserved = sum(m.remaining_blocks(m.reqs[r]) for r in m.inflight if r in m.reqs)
    reserved += cdiv(1 + m.num_spec, m.bs) if m.num_spec else 0
    if (ev["reserved_blocks"] or 0) != reserved:
        m.violate("REMOTE-KV-RESERVATION", rid,
                  f"reserved {plural(ev['reserved_blocks'] or 0, 'block')}, but in-flight prefills "
                  f"{list(m.inflight)} still need {reserved}")
    return reserved


def check_reservation_left_free(m: TraceModel, rid: str, reserved: int) -> None:
    """REMOTE-KV-RESERVATION after the load's allocation: the reservation stays free."""
    if len(m.free_queue) < reserved:
        m.violate("REMOTE-KV-RESERVATION", rid,
                  f"the load left {len(m.free_queue)} free blocks, but in-flight prefills "
                  f"still need {reserved}")


# -- transfer reports ---------------------------------------------------------------
def check_transfer_done(m: TraceModel, rid: str, req: ReqShadow | None) -> bool:
    """REMOTE-KV-LOADING at ``kv_finished``: for a request still loading. False when not."""
    if req is None or req.status != "WAITING_FOR_REMOTE_KVS" or req.kv_done:
        m.violate("REMOTE-KV-LOADING", rid, "transfer reported finished for a request not loading")
        return False
    return True


def check_invalid_blocks(m: TraceModel, invalid: set[int], hit_blocks: set[int]) -> None:
    """REMOTE-KV-LOADING at ``kv_invalid``: every invalid block belongs to a load in flight."""
    if invalid - hit_blocks:
        m.violate("REMOTE-KV-LOADING", None,
                  f"invalid blocks {sorted(invalid - hit_blocks)} belong to no KV load in flight")


# -- promotion ---------------------------------------------------------------------
def check_promotable(m: TraceModel, req: ReqShadow) -> None:
    """REMOTE-KV-LOADING at ``kv_promote``: only after the transfer reported done."""
    if req.status != "WAITING_FOR_REMOTE_KVS" or not req.kv_done:
        m.violate("REMOTE-KV-LOADING", req.request_id,
                  f"promoted with status {req.status} before its transfer was reported finished")


def check_valid_load_keeps_blocks(m: TraceModel, rid: str, freed: list[int]) -> None:
    """REMOTE-KV-LOADING: a promotion after a (partly) valid load frees nothing."""
    if freed:
        m.violate("REMOTE-KV-LOADING", rid, f"promotion freed {freed} after a valid load")


def check_promotion(m: TraceModel, ev: dict, req: ReqShadow, status: str, computed: int) -> None:
    """REMOTE-KV-LOADING: promoted to ``status`` with ``computed`` tokens (the
    loaded prefix, num_tokens - 1 for a whole-sequence load)."""
    if ev["num_computed_tokens"] != computed or ev["status"] != status:
        m.violate("REMOTE-KV-LOADING", req.request_id,
                  f"promoted to {ev['status']} with {ev['num_computed_tokens']} computed tokens; "
                  f"expected {status} with {computed}")


# -- failures under policy 'fail' -------------------------------------------------------
def check_finished_error(m: TraceModel, st: StepState, rid: str) -> None:
    """REMOTE-KV-LOADING: FINISHED_ERROR only for a failed load under policy 'fail'."""
    if rid not in st.kv_failed or m.recompute_kv:
        m.violate("REMOTE-KV-LOADING", rid, "finished with FINISHED_ERROR without a failed KV load under policy 'fail'")


def check_failed_loads_finished(m: TraceModel, st: StepState) -> None:
    """REMOTE-KV-LOADING at ``update_end``: under policy 'fail' each failed load finished."""
    if not m.recompute_kv:
        for rid in st.kv_failed:
            if rid not in st.finished:
                m.violate("REMOTE-KV-LOADING", rid,
                          "its KV load failed under kv_load_failure_policy 'fail' but it did not "
                          "finish with FINISHED_ERROR")


# -- finished while loading ------------------------------------------------------------
def check_finish_frees_nothing(m: TraceModel, rid: str, kind: str, freed: list[int]) -> None:
    """REMOTE-KV-ABORT-HOLDS: a request finished while loading frees nothing yet."""
    m.violate("REMOTE-KV-ABORT-HOLDS", rid, f"{kind} freed {freed} while its KV load was still in flight")


def check_abandoned_free(m: TraceModel, st: StepState, rid: str, req: ReqShadow | None) -> None:
    """REMOTE-KV-ABORT-HOLDS at ``kv_free``: the blocks of a request finished
    while loading, after its transfer reported done."""
    if req is None or rid not in st.kv_free_due:
        m.violate("REMOTE-KV-ABORT-HOLDS", rid,
                  "freed the blocks of a finished request whose transfer was not reported done")


def check_abandoned_freed(m: TraceModel, st: StepState) -> None:
    """REMOTE-KV-ABORT-HOLDS at ``update_end``: a transfer done in this update freed its blocks."""
    for rid in st.kv_free_due:
        m.violate("REMOTE-KV-ABORT-HOLDS", rid, "its transfer finished after it was finished, but its blocks were not freed")


def check_end_of_trace(m: TraceModel) -> None:
    """REMOTE-KV-ABORT-HOLDS at the end: nothing is held by a finished load."""
    for rid, req in m.kv_abandoned.items():
        m.violate("REMOTE-KV-ABORT-HOLDS", rid, f"finished while loading; its blocks {req.blocks} were never freed")
