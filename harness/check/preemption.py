"""Preemption: who may be preempted, who is the victim, what it gives back, where
it goes, and the PRIORITY give-back (``withdraw`` rows).

vLLM 0.33.0 ``Scheduler.schedule`` running loop (spec 4): FCFS preempts the
tail of running, PRIORITY the max (priority, arrival_time), withdrawing a
request it scheduled earlier in the step if that is the victim.
"""

from __future__ import annotations

from reference.words import plural

from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("PREEMPT-ONLY-RUNNING", "Only RUNNING requests in the running queue are preempted.", "4.3, 8 #5",
              SAFETY, "Only a running request holds KV and a slot to give back; preempting a waiting or finished one corrupts its state in every version (mission invariant 1)."),
    Invariant("NO-ADMIT-AFTER-PREEMPT", "A step that preempted admits nothing from waiting.", "3.1 step 5, 8 #4",
              SEMANTICS, "Gating the waiting loop on no preemption (spec 3.1 step 5: the waiting phase runs only if the running loop preempted nothing) is the v1 scheduler's anti-thrashing design, in every release measured: an admission in such a step takes blocks the preemption freed for running requests, which wastes work but corrupts nothing (a fork may let a higher-priority arrival take them). Re-admitting the step's own victim stays a safety fault: PREEMPT-EFFECTS (it must end the step PREEMPTED with 0 computed tokens)."),
    Invariant("PREEMPT-EFFECTS", "A preempted request gives back every block it holds, leaves running, and resumes from a fresh prefix lookup: after the step's schedule() it is PREEMPTED with 0 computed tokens (num_computed_tokens reset).", "4.3, 8 #5",
              SAFETY, "A preempted request is recomputed from scratch: it must leave running and restart from num_computed_tokens 0 (or the prefix hit it finds on resume), or it reuses KV it gave back."),
    Invariant("PREEMPT-WAITING-HEAD", "FCFS: this step's victims sit at the head of waiting in their former running order; PRIORITY: waiting stays in priority order.", "4.4, 8 #11",
              SEMANTICS, "Where victims go in waiting (the head, in former running order) is the v1 scheduler's design."),
    Invariant("FCFS-VICTIM-TAIL", "FCFS: each victim is the current tail of running.", "4.2, 8 #7",
              SEMANTICS, "FCFS victim choice (the tail of running) is the v1 scheduler's design."),
    Invariant("PRIORITY-VICTIM-MAX", "PRIORITY: each victim has the largest (priority, arrival_time) among the current running requests.", "4.2, 8 #8",
              SEMANTICS, "PRIORITY victim choice (largest (priority, arrival_time)) is the v1 scheduler's design."),
    Invariant("PRIORITY-GIVE-BACK", "Only under PRIORITY is a request scheduled earlier in the step withdrawn, exactly its tokens are given back, and it is then preempted.", "4.2, 8 #9",
              SEMANTICS, "Withdrawing a request scheduled earlier in the step is 0.33.0's PRIORITY design; that a victim is absent from the output is the safety rule SCHEDULED-NOT-PREEMPTED."),
    Invariant("SCHEDULED-NOT-PREEMPTED", "No request that a step's schedule() preempted is in that step's num_scheduled_tokens: a victim scheduled earlier in the step is taken out of the output before it is preempted.", "4.2, 4.5, 8 #9",
              SAFETY, "A victim's blocks are freed in the step: a num_scheduled_tokens entry for it makes the worker run tokens for a request whose KV is gone, in every version."),
    Invariant("PREEMPTED-NO-DRAFTS", "A preempted request holds no draft tokens and none are scheduled for it: after schedule() and after the draft update, no request outside the running queue (PREEMPTED or waiting) holds drafts, and a victim's drafts are not in the step's output.", "4.3, 8 #5",
              SAFETY, "Drafts are proposed for the position after a request's last token; a preempted request recomputes from scratch, so drafts it keeps would be verified against a stale position on resume, in every version (mission invariant 3)."),
    Invariant("RESET-PREEMPTS-RUNNING", "A forced prefix-cache reset (reset_running_requests) preempts exactly the running requests, from the tail of running, before the step's schedule(); those preemptions do not count as the step's (admission proceeds) but are reported in preempted_req_ids.", "vLLM Scheduler.reset_prefix_cache",
              SEMANTICS, "reset_prefix_cache(reset_running_requests=True) and how it preempts are 0.33.0 API design."),
    Invariant("WAITING-NEVER-PREEMPTS", "Admissions from waiting never preempt: no preemption follows an admission in a step.", "3.4 step 11, 8 #33",
              SEMANTICS, "The waiting loop never preempting (only the running loop does) is the v1 scheduler's design."),
]

#: Checks that need schema 6 (a request_state row per victim): id -> (the
#: part a schema-5 trace cannot feed, "" for all of it; what it lacks).
NEEDS_OBSERVED = {
    "PREEMPTED-NO-DRAFTS": ("", "no request_state rows: the drafts a request holds are not recorded"),
    "PREEMPT-EFFECTS": ("a victim's status and computed tokens after schedule()",
                        "no request_state rows; the blocks it gives back are checked"),
}


def check_no_admission_before(m: TraceModel, st: StepState, rid: str) -> None:
    """WAITING-NEVER-PREEMPTS: no preemption follows an admission in a step."""
    if st.admitted:
        m.violate("WAITING-NEVER-PREEMPTS", rid,
                  f"preempted after this step admitted {st.admitted}: admission must never preempt")


def check_victim(m: TraceModel, st: StepState, rid: str, req: ReqShadow | None) -> bool:
    """PREEMPT-ONLY-RUNNING, then the victim rule of the policy (FCFS-VICTIM-TAIL,
    PRIORITY-VICTIM-MAX) over the running queue as simulated so far. False
    when the request is unknown (nothing more can be checked)."""
    if req is None or req.status != "RUNNING" or rid not in st.sim_running:
        status = req.status if req else "unknown"
        m.violate("PREEMPT-ONLY-RUNNING", rid, f"preempted a request with status {status}, running queue {st.sim_running}")
        return req is not None
    if m.policy == "fcfs":
        if st.sim_running[-1] != rid:
            m.violate("FCFS-VICTIM-TAIL", rid, f"victim is not the tail of running {st.sim_running}")
    else:
        def key(r: str) -> tuple:
            q = m.reqs[r]
            return (q.priority, q.arrival_time)
        top = max(st.sim_running, key=key)
        if key(rid) != key(top):
            m.violate("PRIORITY-VICTIM-MAX", rid, f"victim (priority, arrival) {key(rid)} but {top} has {key(top)}")
    return True


def check_scheduled_victim_withdrawn(m: TraceModel, st: StepState, rid: str) -> bool:
    """SCHEDULED-NOT-PREEMPTED at a ``preempt`` row: a victim scheduled
    earlier in the step was withdrawn first (a ``withdraw`` row: it left
    num_scheduled_tokens), else the output schedules a preempted request; and
    PREEMPTED-NO-DRAFTS: drafts scheduled for it stay in the output with it.
    True when it was not withdrawn (the caller drops it from the shadow's
    schedule and keeps it in ``st.kept_victims``, the ids the rows still give
    num_scheduled_tokens)."""
    if rid not in st.scheduled:
        return False
    m.violate("SCHEDULED-NOT-PREEMPTED", rid, f"preempted, but it stays in num_scheduled_tokens with "
                                             f"{st.scheduled_tokens.get(rid)} tokens (no withdraw before)")
    if st.drafts.get(rid):
        m.violate("PREEMPTED-NO-DRAFTS", rid, f"preempted, but the step's output still schedules its "
                                             f"drafts {st.drafts[rid]}")
    return True


def check_state_row(m: TraceModel, st: StepState, ev: dict, after: str) -> None:
    """At a ``request_state`` row (schema 6; ``after``: "schedule()" or "the
    draft update"): PREEMPTED-NO-DRAFTS, a request not RUNNING holds no
    drafts; PREEMPT-EFFECTS, a victim of this step's schedule() is now
    PREEMPTED with 0 computed tokens, and so is a forced reset's victim
    that was not resumed (status PREEMPTED: neither admitted nor loading)."""
    rid, status, computed = ev["request_id"], ev["status"], ev["num_computed_tokens"]
    drafts = list(ev["spec_token_ids"] or [])
    if status != "RUNNING" and drafts:
        m.violate("PREEMPTED-NO-DRAFTS", rid, f"{status} after {after}, but it holds drafts {drafts}")
    if after != "schedule()":
        return
    if rid in st.preempted and status != "PREEMPTED":
        m.violate("PREEMPT-EFFECTS", rid, f"preempted in this step, but its status after schedule() is {status}")
    elif (rid in st.preempted or rid in st.reset_preempted) and status == "PREEMPTED" and computed != 0:
        m.violate("PREEMPT-EFFECTS", rid, f"preempted in this step, but it holds {computed} computed tokens "
                                         f"after schedule() (a resume must start from a fresh prefix lookup)")


def check_state_rows_present(m: TraceModel, st: StepState) -> None:
    """PREEMPT-EFFECTS at the end of a step (schema 6): every victim of its
    schedule() has its ``request_state`` row after ``schedule_end`` (the
    recorder writes one for each); a missing row hides what the victim holds."""
    for rid in st.preempted:
        if rid not in st.state_rows:
            m.violate("PREEMPT-EFFECTS", rid, "preempted in this step, but no request_state row after "
                                              "schedule_end records what it holds (schema 6 always writes one)")


def check_reset_victims_reported(m: TraceModel, ev: dict, st: StepState) -> None:
    """RESET-PREEMPTS-RUNNING at ``schedule_end``: the victims of this step's
    forced prefix-cache reset are listed in preempted_req_ids (vLLM 0.33.0
    ``reset_preempted_req_ids``), though they are not the step's own."""
    missing = [r for r in st.reset_preempted if r not in (ev["preempted_req_ids"] or [])]
    if missing:
        m.violate("RESET-PREEMPTS-RUNNING", None,
                  f"preempted_req_ids {ev['preempted_req_ids']} leaves out {missing}, preempted by this "
                  f"step's forced prefix-cache reset")


def check_preempt_frees(m: TraceModel, req: ReqShadow, freed: list[int], expected: list[int]) -> bool:
    """PREEMPT-EFFECTS: a preemption gives back exactly the blocks of its
    table (``expected``), each once. True when it does."""
    if sorted(freed) != sorted(expected):
        m.violate("PREEMPT-EFFECTS", req.request_id,
                  f"preemption freed {freed}, but it must give back its whole table {req.blocks}")
        return False
    return True


def check_withdraw(m: TraceModel, st: StepState, rid: str, n: int, req: ReqShadow | None) -> bool:
    """PRIORITY-GIVE-BACK at a ``withdraw`` row: only under PRIORITY, only a
    request scheduled this step, exactly its tokens. False when it was not
    scheduled (nothing to undo)."""
    if m.policy != "priority":
        m.violate("PRIORITY-GIVE-BACK", rid, "withdrew a scheduled request under FCFS")
    if req is None or rid not in st.scheduled:
        m.violate("PRIORITY-GIVE-BACK", rid, "withdrew a request not scheduled this step")
        return False
    if st.scheduled_tokens.get(rid) != n:
        m.violate("PRIORITY-GIVE-BACK", rid, f"gave back {plural(n, 'token')} but {st.scheduled_tokens.get(rid)} were scheduled")
    return True


def check_withdrawn_preempted(m: TraceModel, st: StepState) -> None:
    """PRIORITY-GIVE-BACK at schedule end: every withdrawn request was then preempted."""
    never_preempted = [r for r in st.withdrawn if r not in st.preempted]
    if never_preempted:
        m.violate("PRIORITY-GIVE-BACK", never_preempted[0], f"withdrawn but not preempted in the step: {never_preempted}")


def check_no_admit_after_preempt(m: TraceModel, st: StepState, rid: str, what: str) -> None:
    """NO-ADMIT-AFTER-PREEMPT: a step that preempted admits (or starts a KV load
    for) nothing; ``what`` names the row ("admitted (new)", "started a KV load")."""
    if st.preempted:
        m.violate("NO-ADMIT-AFTER-PREEMPT", rid, f"{what} in a step that preempted {st.preempted}")


def check_still_holding(m: TraceModel, req: ReqShadow) -> bool:
    """PREEMPT-EFFECTS at admission: a request without loaded KV holds no
    blocks. True when it still does (the caller frees them to resync)."""
    if req.blocks:
        m.violate("PREEMPT-EFFECTS", req.request_id, f"admitted while still holding blocks {req.blocks}")
        return True
    return False


def check_fcfs_victims_at_head(m: TraceModel, st: StepState, waiting: list[str], num_ahead: int) -> bool:
    """PREEMPT-WAITING-HEAD (FCFS): this step's victims sit at the head of the
    waiting queue in their old running order, after the ``num_ahead``
    requests served before it (the kv-holding queue; under a profile with
    ``victims_behind_skipped`` also the skipped ones). True when they do."""
    if waiting[num_ahead:num_ahead + len(st.preempted)] != st.preempted[::-1]:
        m.violate("PREEMPT-WAITING-HEAD", st.preempted[0] if st.preempted else None,
                  f"victims {st.preempted} are not at the head of waiting {waiting[:5]}...")
        return False
    return True


def check_priority_waiting_order(m: TraceModel, waiting: list[str], num_kv: int) -> None:
    """PREEMPT-WAITING-HEAD (PRIORITY): each waiting queue stays in
    (priority, arrival_time, id) order."""
    for part in (waiting[:num_kv], waiting[num_kv:]):
        keys = [(m.reqs[r].priority, m.reqs[r].arrival_time, r) for r in part if r in m.reqs]
        if keys != sorted(keys):
            m.violate("PREEMPT-WAITING-HEAD", None, f"waiting not in priority order: {waiting[:8]}...")


def check_reset_victim(m: TraceModel, rid: str, expected: str | None, req: ReqShadow | None) -> bool:
    """RESET-PREEMPTS-RUNNING (the next victim is the tail of what still
    runs) and PREEMPT-ONLY-RUNNING. False when the request is unknown."""
    if req is None or req.status != "RUNNING":
        m.violate("PREEMPT-ONLY-RUNNING", rid,
                  f"forced reset preempted a request with status {req.status if req else 'unknown'}")
        return req is not None
    if rid != expected:
        m.violate("RESET-PREEMPTS-RUNNING", rid,
                  f"forced reset preempted {rid}, but the tail of running is {expected}")
    return True


def check_reset_done(m: TraceModel, left: list[str]) -> None:
    """RESET-PREEMPTS-RUNNING: a forced reset left no request running."""
    if left:
        m.violate("RESET-PREEMPTS-RUNNING", left[-1],
                  f"forced prefix-cache reset left {left} running (it must preempt every running request)")
