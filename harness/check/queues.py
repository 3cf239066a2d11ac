"""Queues and admission: arrivals, the waiting and running queues step to step,
the order requests are scheduled and admitted in, and their computed tokens.

vLLM 0.33.0 engine input processor (admissibility) and ``Scheduler.schedule``
(spec 3): the running loop walks running in order; the waiting loop takes
the head of waiting (kv-holding queue first, spec 10.2).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from harness.check import encoder
from harness.check.kv_connector import take_answer
from harness.check.model import ReqShadow, StepState, TraceModel
from harness.check.result import SAFETY, SEMANTICS, Invariant

from harness.trace.queues import QueueChange

INVARIANTS = [
    Invariant("ARRIVAL-ADMISSIBLE", "An accepted request has a non-empty prompt shorter than max_model_len (room for one output token) and encoder inputs that fit the encoder cache and compute budget (and, with disable_chunked_mm_input, one step's tokens); a rejected one does not.", "2.3, engine input processor",
              SEMANTICS, "Which prompts the input processor accepts (the room left for one output token, how encoder inputs must fit) is a front-end design choice that releases change; a wrong admission is caught by SCHEDULED-SPAN when it matters."),
    Invariant("STATE-CONTINUITY", "Queues and counters seen at step start/end follow from the previous step's state and this step's events (running, and waiting after an FCFS step: the same requests, each once; their order is RUNNING-ORDER's and ADMISSION-ORDER's).", "3.1",
              SAFETY, "A trace's rows describe one scheduler: queues at step start follow from the previous step's end and this step's arrivals and aborts in any engine; otherwise the trace (or the engine's bookkeeping) contradicts itself."),
    Invariant("RUNNING-ORDER", "Running requests are scheduled in running-queue order, and the running queue keeps its order: from one step's end to the next step's start, and through schedule() (victims removed, admissions appended).", "3.2, 8 #13",
              SEMANTICS, "Walking running in queue order, and never reordering that queue, is the v1 scheduler's design; another order (decode first, round robin, shortest remaining first) is still safe."),
    Invariant("SCHEDULED-ONCE", "A request is scheduled at most once per step, and as running only while it is RUNNING in the running queue.", "3.2, 8 #13",
              SAFETY, "A request has one entry in num_scheduled_tokens and is scheduled as running only while it is RUNNING in the running queue: anything else runs tokens for a request whose KV is not in place, in every version."),
    Invariant("ADMISSION-ORDER", "Admissions follow waiting-queue order: the admitted requests are the head of waiting, as new (WAITING) or resumed (PREEMPTED); under FCFS waiting keeps arrival order (the previous end, then this step's arrivals) and, after the step, the order its rows imply (skipped requests back at the head in the order met, the kv-holding queue first).", "3.4, 8 #13-14",
              SEMANTICS, "Taking the head of waiting (kv-holding queue first), in arrival order under FCFS, is the v1 scheduler's design; a policy that reorders waiting (shortest prompt first) is still safe."),
    Invariant("COMPUTED-CONTINUITY", "num_computed_tokens before a step equals the previous value plus the tokens scheduled since (prefix-hit length at admission).", "3.8, 8 #16",
              SAFETY, "num_computed_tokens is the length of the KV written; it can only grow by what was scheduled (or a prefix hit at admission), or the model attends to KV that was never written."),
]


# -- arrivals -------------------------------------------------------------------
def check_arrival(m: TraceModel, rid: str, prompt: list[int], positions: Any) -> None:
    """STATE-CONTINUITY (a fresh id) and ARRIVAL-ADMISSIBLE for an accepted request."""
    if rid in m.reqs:
        m.violate("STATE-CONTINUITY", rid, "request id arrived twice")
    if not prompt or len(prompt) >= m.max_model_len:
        m.violate("ARRIVAL-ADMISSIBLE", rid,
                  f"accepted a prompt of {len(prompt)} tokens with max_model_len {m.max_model_len}")
    if positions:
        why = encoder.inadmissible(m, positions)
        if why is not None:
            m.violate("ARRIVAL-ADMISSIBLE", rid, f"accepted a request whose {why}")


def check_reject(m: TraceModel, ev: dict) -> None:
    """ARRIVAL-ADMISSIBLE for a rejected request: it must not have fit."""
    n = len(ev["prompt_token_ids"] or [])
    if 0 < n < m.max_model_len and encoder.inadmissible(m, ev.get("mm_positions")) is None:
        m.violate("ARRIVAL-ADMISSIBLE", ev["request_id"],
                  f"rejected a {n}-token prompt that fits max_model_len {m.max_model_len}")


# -- state continuity -------------------------------------------------------------
def check_known(m: TraceModel, rid: str | None, req: ReqShadow | None, what: str) -> bool:
    """STATE-CONTINUITY: a row about a live request names one; ``what`` says
    which row ("scheduled", "promoted", "abort of", ...). False when unknown."""
    if req is None:
        m.violate("STATE-CONTINUITY", rid, what)
        return False
    return True


def check_unknown_kind(m: TraceModel, ev: dict) -> None:
    """STATE-CONTINUITY: every row kind is one the schema defines."""
    m.violate("STATE-CONTINUITY", ev.get("request_id"), f"unknown event kind {ev['kind']!r}")


def check_queues_at_start(m: TraceModel, st: StepState, running: list[str], waiting: list[str],
                          change: QueueChange | None = None) -> None:
    """STATE-CONTINUITY at ``schedule_begin``: running and waiting follow from the
    previous step's end, this step's arrivals and aborts (the same requests);
    ADMISSION-ORDER: under FCFS, waiting keeps that order. ``change``: the
    row's waiting as the reader rebuilt it (``follow_waiting``), which shows
    the common case without a walk over the backlog."""
    expected_running = [r for r in m.prev_running if r not in st.aborted]
    if running != expected_running:
        check_running_queue(m, running, expected_running, "running at step start", "previous end")
    if waiting_at_start_follows(m, st, waiting, change):
        return
    # A request may arrive and be aborted before the same step starts.
    expected_waiting = m.prev_waiting + st.arrived if st.arrived else m.prev_waiting  # never edited in place
    if st.aborted:
        expected_waiting = [r for r in expected_waiting if r not in st.aborted]
    # Equal lists need no sort (the common case: C-speed, whatever the backlog).
    if waiting != expected_waiting:
        if sorted(waiting) != sorted(expected_waiting):
            m.violate("STATE-CONTINUITY", None,
                      f"waiting at step start {waiting} != previous end + arrivals {expected_waiting}")
        elif m.policy == "fcfs":
            # The same requests in another order: a policy that sorts its waiting
            # queue (shortest prompt first, ...) is correct, only not vLLM's FCFS
            # design. Regression (new-user trial): reported as STATE-CONTINUITY,
            # a safety rule, it failed the fork gate of a correct scheduler.
            m.violate("ADMISSION-ORDER", None,
                      f"waiting at step start {waiting} is not FCFS order: previous end + arrivals "
                      f"{expected_waiting}")


# -- the backlog by its changes (issue 24) ----------------------------------------------
def follow_waiting(m: TraceModel, waiting: list[str]) -> QueueChange | None:
    """Take the reader's change for a snapshot row's ``waiting`` list (the
    ``QueueChange`` it was rebuilt from; None when the row stored it whole or
    the rows carry no changes) and bring ``m.waiting_counts`` to that list:
    O(ids changed), not O(backlog), per row. A list stored whole is counted
    whole (as many ids as the file stores)."""
    changes = m.queue_changes
    if changes is None:
        return None
    change = changes.pop(id(waiting), None)
    if change is not None and change.queue is not waiting:
        change = None  # (not this list: the entry keeps its own list alive, so never)
    counts = m.waiting_counts
    if change is None and counts is not None and waiting is m.waiting_indexed:
        # The very list followed last (the reader hands an unchanged queue on
        # as the same list and records no change for it): nothing to count.
        return QueueChange(waiting, waiting, 0, len(waiting), (), 0)
    if change is not None and counts is not None and m.waiting_indexed is change.base:
        base = change.base
        end = change.start + change.length
        for rid in (base[:change.start] if change.start else ()):
            _uncount(counts, rid)
        for rid in (base[end:] if end < len(base) else ()):
            _uncount(counts, rid)
        for rid in change.head:
            counts[rid] = counts.get(rid, 0) + 1
        for rid in (waiting[len(waiting) - change.tail:] if change.tail else ()):
            counts[rid] = counts.get(rid, 0) + 1
    else:
        m.waiting_counts = Counter(waiting)
    m.waiting_indexed = waiting
    return change


def _uncount(counts: dict[str, int], rid: str) -> None:
    left = counts[rid] - 1
    if left:
        counts[rid] = left
    else:
        del counts[rid]


def counts_of(m: TraceModel, queue: list[str]) -> dict[str, int] | None:
    """How many times each id occurs in ``queue``, when ``m`` follows that
    very list (``follow_waiting``); else None."""
    return m.waiting_counts if queue is m.waiting_indexed else None


def in_waiting(m: TraceModel, rid: str, queue: list[str]) -> bool:
    """``rid in queue``: a dict lookup when ``m`` follows that list, else
    a C-speed scan."""
    counts = counts_of(m, queue)
    return rid in counts if counts is not None else rid in queue


def waiting_at_start_follows(m: TraceModel, st: StepState, waiting: list[str],
                             change: QueueChange | None) -> bool:
    """Whether waiting at step start is exactly the previous end + this step's
    arrivals less its aborts, from the row's change alone: the whole previous
    end kept (the very list ``m.prev_waiting``: a finish or reset that removed
    an id from it replaced it), the stored tail the arrivals. False: not
    shown so (``check_queues_at_start`` compares the whole lists)."""
    if change is None or change.base is not m.prev_waiting or change.head or change.start \
            or change.length != len(change.base):
        return False
    arrived = [r for r in st.arrived if r not in st.aborted] if st.aborted else st.arrived
    return len(waiting) == change.length + len(arrived) and waiting[change.length:] == arrived


def head_taken(queue: list[str], admitted: list[str], skipped: list[str],
               counts: dict[str, int] | None) -> int | None:
    """k when ``remaining(queue, admitted, skipped) == queue[k:]`` is shown
    by the ids taken alone (they are exactly ``queue``'s head, each once in
    ``queue``: ``counts``, the ids' occurrences in it); None otherwise or
    without ``counts`` (``remaining`` then walks the list)."""
    if counts is None:
        return None
    k = len(admitted) + len(skipped)
    if not k:
        return 0
    gone = set(admitted) | set(skipped)
    if len(gone) != k or k > len(queue):
        return None
    for rid in queue[:k]:
        if rid not in gone or counts.get(rid) != 1:
            return None
    return k


def waiting_at_end_follows(m: TraceModel, st: StepState, waiting: list[str], change: QueueChange | None,
                           k: int | None) -> bool:
    """Whether waiting after an FCFS step is exactly this step's victims
    (reversed) + the waiting queue at its start less its taken head ``k``
    (``head_taken``), from the row's change alone; the caller has made sure
    nothing else goes in front (no skipped or kv-holding request). False: not
    shown so (the whole lists are compared)."""
    if k is None or change is None or change.base is not st.waiting_before or change.tail \
            or change.start != k or change.start + change.length != len(change.base):
        return False
    return list(change.head) == st.preempted[::-1]


def remaining(queue: list[str], admitted: list[str], skipped: list[str]) -> list[str]:
    """``queue`` less the ``admitted`` and ``skipped`` ids, order kept
    (``[r for r in queue if r not in admitted and r not in skipped]``). When
    they are exactly its head (the common case: the waiting loop takes the
    head), a C-speed slice instead of a walk over the whole backlog."""
    gone = set(admitted) | set(skipped)
    if not gone:
        return queue  # no copy of the backlog: the caller never edits it in place
    k = 0
    while k < len(queue) and k < len(gone) and queue[k] in gone:
        k += 1
    if k == len(gone) and len(set(queue[:k])) == k and not _any_from(queue, k, gone):
        return queue[k:]
    return [r for r in queue if r not in gone]


#: Ids looked up one by one (``list.index``: pointer and length compares at C
#: speed) rather than by hashing every id of the backlog: up to this many.
_SCAN_IDS = 8


def _any_from(queue: list[str], start: int, ids: set[str]) -> bool:
    """Whether any of ``ids`` occurs in ``queue[start:]`` (``not
    ids.isdisjoint(queue[start:])``). A few ids: one ``list.index`` scan each,
    no slice and no hash of each backlog id (the set lookup costs ~50x a
    compare); more: the set walk."""
    if len(ids) > _SCAN_IDS:
        return not ids.isdisjoint(queue[start:])
    for rid in ids:
        try:
            queue.index(rid, start)
        except ValueError:
            continue
        return True
    return False


def check_reset_running(m: TraceModel, running: list[str], expected: list[str]) -> None:
    """STATE-CONTINUITY on a ``reset_prefix_cache`` row: its running queue is
    the previous step's end less this step's aborts."""
    if running != expected:
        check_running_queue(m, running, expected, "running at prefix-cache reset", "expected")


def check_batches_in_flight(m: TraceModel) -> None:
    """STATE-CONTINUITY: at most max_concurrent_batches batches in flight."""
    if len(m.batches) > m.depth:
        m.violate("STATE-CONTINUITY", None,
                  f"{len(m.batches)} batches in flight > max_concurrent_batches {m.depth}")


def check_running_after(m: TraceModel, st: StepState, running: list[str]) -> None:
    """STATE-CONTINUITY and RUNNING-ORDER at ``schedule_end``: running is what
    the rows imply (``check_running_queue``)."""
    if running != st.sim_running:
        check_running_queue(m, running, st.sim_running, "running after schedule", "expected")


def check_running_queue(m: TraceModel, running: list[str], expected: list[str], seen: str, implied: str) -> None:
    """A running queue a row shows (``seen``: which row) that is not the
    ``expected`` one (``implied``: what the rows imply, in vLLM's order).
    STATE-CONTINUITY (safety) when it does not hold the same requests, each
    once: a request lost or doubled corrupts any engine. RUNNING-ORDER
    (semantics) when only the order differs: a correct fork may reorder its
    running queue (decode first, round robin, shortest remaining first).
    Regression (two trials): a fork sorting ``self.running`` before vLLM
    0.33.0's ``Scheduler.schedule`` failed the fork gate with
    STATE-CONTINUITY on 20 of 20 goldens, as the waiting queue's order did
    before it (``check_waiting_after_fcfs``)."""
    if sorted(running) != sorted(expected) or len(set(running)) != len(running):
        m.violate("STATE-CONTINUITY", None, f"{seen} {running} != {implied} {expected}")
    else:
        m.violate("RUNNING-ORDER", None, f"{seen} {running} is not in running-queue order: {implied} {expected}")


def check_waiting_after_fcfs(m: TraceModel, waiting: list[str], expected: list[str]) -> None:
    """Waiting after an FCFS step against ``expected`` (what the step's rows
    imply, in FCFS's order). STATE-CONTINUITY (safety): it holds the same
    requests, each once: a request lost or doubled corrupts any engine.
    ADMISSION-ORDER (semantics): in that order. The order is a release's
    design: a correct fork keeping its waiting queues shortest-prompt-first
    (as vLLM's own priority queue re-sorts a skipped request) failed the fork
    gate with STATE-CONTINUITY ×6 on golden kv-connector (new-user trial)."""
    if waiting != expected:
        if sorted(waiting) != sorted(expected):
            m.violate("STATE-CONTINUITY", None, f"waiting after schedule {waiting} != expected {expected}")
        else:
            m.violate("ADMISSION-ORDER", None,
                      f"waiting after schedule {waiting} is not in FCFS order {expected}")


def check_waiting_after_priority(m: TraceModel, st: StepState, waiting: list[str], kv_after: list[str],
                                 wait_after: list[str]) -> None:
    """STATE-CONTINUITY (PRIORITY): each waiting queue holds the expected requests."""
    num_kv = len(kv_after)
    if (sorted(waiting[:num_kv]) != sorted(kv_after)
            or sorted(waiting[num_kv:]) != sorted(st.preempted + wait_after)):
        m.violate("STATE-CONTINUITY", None,
                  f"waiting after schedule {waiting} != {kv_after} + {st.preempted + wait_after}")


def check_update_begin(m: TraceModel, ev: dict) -> bool:
    """STATE-CONTINUITY at ``update_begin``: a batch is in flight and it is the
    oldest one. False when none is (the caller processes an empty batch)."""
    if not m.batches:
        m.violate("STATE-CONTINUITY", None, "update of a batch that was never scheduled")
        return False
    if ev["batch_step"] != m.batches[0].step:
        m.violate("STATE-CONTINUITY", None,
                  f"update of the batch of step {ev['batch_step']}, but the oldest in flight "
                  f"is from step {m.batches[0].step}")
    return True


# -- order ------------------------------------------------------------------------
def walks_in_queue_order(m: TraceModel) -> bool:
    """Whether the profile holds the engine to RUNNING-ORDER: the running loop
    walks running in the ``schedule_begin`` row's order (every release's
    profile), which the progress rules may then assume
    (``harness.check.progress.walk_order_known``)."""
    return "RUNNING-ORDER" in m.checked


def check_scheduled_once(m: TraceModel, st: StepState, rid: str) -> None:
    """SCHEDULED-ONCE: a request is scheduled at most once per step."""
    if rid in st.scheduled:
        m.violate("SCHEDULED-ONCE", rid, "scheduled twice in one step")


def check_running_order(m: TraceModel, st: StepState, req: ReqShadow) -> None:
    """A ``running`` schedule row: SCHEDULED-ONCE (for a RUNNING request in the
    running queue) and RUNNING-ORDER (after the previous one in running
    order; advances ``st.last_running_index``)."""
    rid = req.request_id
    if req.status != "RUNNING" or rid not in st.sim_running:
        m.violate("SCHEDULED-ONCE", rid, f"scheduled as running but status {req.status}"
                  + ("" if rid in st.sim_running else ", not in the running queue"))
    else:
        idx = st.sim_running.index(rid)
        if idx < st.last_running_index:
            m.violate("RUNNING-ORDER", rid, f"scheduled out of running order {st.sim_running}")
        st.last_running_index = idx


_NOT_NEXT = {
    "skip": "skipped a request that is not next in waiting",
    "kv_load": "KV load for a request that is not next in waiting",
    "kv_promote": "promoted a request that is not next in waiting",
}


def check_next_in_waiting(m: TraceModel, st: StepState, rid: str, kind: str) -> None:
    """ADMISSION-ORDER: the waiting loop examines waiting in order; an admission,
    skip, KV load or promotion (``kind``: "admission", "skip", "kv_load",
    "kv_promote") is for the next request in it."""
    position = len(st.admitted) + len(st.skipped)
    if position >= len(st.waiting_before) or st.waiting_before[position] != rid:
        if kind == "admission":
            m.violate("ADMISSION-ORDER", rid,
                      f"admission #{position + 1} of the step, but waiting was {st.waiting_before[:position + 3]}...")
        else:
            m.violate("ADMISSION-ORDER", rid, f"{_NOT_NEXT[kind]} {st.waiting_before[:position + 3]}")


def check_admission_status(m: TraceModel, req: ReqShadow, kind: str) -> None:
    """ADMISSION-ORDER: a ``new`` admission is WAITING, a ``resumed`` one PREEMPTED."""
    expected_status = {"new": "WAITING", "resumed": "PREEMPTED"}.get(kind)
    if req.status != expected_status:
        m.violate("ADMISSION-ORDER", req.request_id, f"admitted as {kind} but its status was {req.status}")


# -- computed tokens --------------------------------------------------------------
def check_computed(m: TraceModel, req: ReqShadow, computed: int, what: str) -> None:
    """COMPUTED-CONTINUITY: the row's num_computed_tokens is the shadow's
    (``what``: "running" schedule row, "preempt" row or "loaded" admission)."""
    if computed == req.num_computed_tokens:
        return
    if what == "running":
        message = f"num_computed_tokens {computed}, expected {req.num_computed_tokens}"
    elif what == "preempt":
        message = f"preempt says computed {computed}, expected {req.num_computed_tokens}"
    else:
        message = (f"admitted with num_computed_tokens {computed}, but its load left "
                   f"{req.num_computed_tokens}")
    m.violate("COMPUTED-CONTINUITY", req.request_id, message)


def admission_computed(m: TraceModel, req: ReqShadow, computed: int, hit: int) -> int:
    """COMPUTED-CONTINUITY at a fresh admission (a prefix lookup; not after a
    finished async load): it starts at its prefix hit, or with a KV connector
    (``harness.check.kv_connector``) as vLLM 0.33.0
    ``Scheduler.schedule`` starts it at ``num_new_local_computed_tokens +
    num_external_computed_tokens``, the local hit plus what the connector's
    ``get_num_new_matched_tokens`` answered for a synchronous load
    (``load_kv_async`` False: the tokens count as computed at once, their
    blocks are allocated with the new ones by ``allocate_slots``). Without a
    connector, or for an answer it did not give at that call (the answers are
    used in order: ``harness.check.kv_connector.take_answer``), the admission
    starts at its hit. With bounded replay (``TraceModel.prefix_replay_tokens``,
    vLLM 0.33.0 ``Scheduler._mark_prefix_replay``) it starts that many tokens
    before the end of its local and external hit (whose total is then more
    than that: a shorter one is not taken, and the admission starts at 0),
    unless the connector's load restored the window (``window_loaded``).
    Returns the external tokens counted (tokens)."""
    replayed = (m.prefix_replay_tokens if m.prefix_replay_tokens and (computed or hit)
                and req.request_id not in m.window_loaded else 0)
    external = computed + replayed - hit
    if external == 0:
        return 0
    if not m.kv_connector or computed > req.num_tokens or not take_answer(m, req.request_id, (external, False)):
        answers = [list(a) for a in m.kv_answers.get(req.request_id, ())]
        used = m.kv_next_answer.get(req.request_id, 0)
        said = ("" if not m.kv_connector
                else f"; its connector's answers [external tokens, load_kv_async] in call order {answers}"
                     f"{f' (the first {used} used before)' if used else ''} give no {external} synchronous "
                     f"external tokens" if any(ext and not load_async for ext, load_async in answers)
                else "; its connector answered no synchronous external tokens")
        replay = f" less the {replayed} replayed tokens" if replayed else ""
        m.violate("COMPUTED-CONTINUITY", req.request_id,
                  f"admitted with num_computed_tokens {computed} != prefix hit {hit}{replay}{said}")
        return 0
    return external
