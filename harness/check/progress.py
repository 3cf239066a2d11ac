"""Progress: the engine makes the progress it can. Rules every correct
engine keeps whatever its version (the *progress* layer of the catalogue,
beside safety and semantics; issue 23).

Most scheduler bugs in vLLM's public history corrupt nothing: a runnable
request silently skipped for a step, an admission refused while blocks and
budget are free, a preemption that was not needed or that frees nothing, a
preemption that ends the step for requests that still fit. Each rule here
names the bug class's public report in its ``why`` and its exceptions in
its statement; each is judged from the trace's rows alone, and only where
the rows show the step *surely* had room (a conservative bound: a rule that
cannot tell stays silent), so a release's design (when to defer prefills,
how many blocks to keep, which victim to pick) never fires it.

What a rule reads, all recorded: the queues at ``schedule_begin``, the
step's ``schedule``/``skip``/``preempt`` rows, ``token_budget`` (the budget
the engine says it left), ``num_free_blocks``, ``defer_prefills`` and
``throttle_prefills`` at ``schedule_end``; the shadow model's request state
(tokens, computed, drafts, async placeholders, its table) and free queue.

Exceptions common to the rules (a rule is silent when one holds): the
engine says it left no budget; the step deferred or was throttled
(prefill chunks and prefill admissions only); ``max_num_seqs`` running; KV
pressure (the blocks the request would need, bounded from above, exceed
the blocks free at the end of the step: fenced blocks are not free);
remote KV loads (a KV-connector engine's admissions); encoder inputs (the
encoder budget and cache may cut a window to nothing); nothing to compute
(a pipelined batch in flight, max_model_len, the async max_tokens guard);
chunked prefill off with a prompt over the budget left; a speculative
decode's padding over the budget left.

Checked at ``schedule_begin`` (``snapshot``), at each ``preempt`` and
``schedule`` row (``on_preempt``, ``on_running_scheduled``) and at
``schedule_end`` (``check_step``); the order of a step's ids is the
checker's (``harness.check.checker``): a needless preemption is reported at
its trigger's row, before the step-end rules, so the root cause comes first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.check.hybrid import blocks_needed
from harness.check.model import ReqShadow, StepState, TraceModel, cdiv
from harness.check.queues import walks_in_queue_order
from harness.check.result import PROGRESS, Invariant

INVARIANTS = [
    Invariant("PROGRESS-RUNNING", "In a step that preempts nothing and leaves token budget, every running request with tokens to compute is scheduled, unless it needs more blocks than are free, is a prefill chunk in a deferring or throttled step, has encoder inputs, or is held by max_model_len or the async max_tokens guard.", "3.3, 8 (progress)",
              PROGRESS, "A running request skipped while the step leaves budget and blocks starves for nothing: vllm-project/vllm#53130 (a scheduler that stops serving requests with the KV cache mostly free) and HabanaAI/vllm-fork#2247 (preempted groups left in the running queue: later scheduler passes break at once, starving every remaining decode)."),
    Invariant("PROGRESS-ADMIT", "In a step that preempts nothing, leaves token budget, runs fewer requests than the engine's admission cap (the most it has run at once so far, at most max_num_seqs: a fork may cap lower) and does not defer prefills, the first waiting request the step did not skip is one that does not fit: its blocks (bounded from above: the whole prompt plus lookahead, plus the watermark) exceed the free blocks, chunked prefill is off and its prompt exceeds the budget left, or a speculative decode's padding does; requests with encoder inputs, stale output in flight or a KV connector are not judged.", "3.4, 8 (progress)",
              PROGRESS, "An admission refused while blocks and budget are free leaves the engine idle with work waiting: vllm-project/vllm#53130 (admission stops for good while the KV cache is mostly free) and vllm-project/vllm#33499 (the waiting loop's break leaves usable KV capacity idle behind a blocked head)."),
    Invariant("PROGRESS-PREEMPT-NEEDED", "A preemption in schedule() happens only when the running request that triggered it did not fit: the blocks that request is then given are more than were free before the first preemption it caused.", "3.3 step 6, 8 (progress)",
              PROGRESS, "A preemption while the free blocks sufficed throws away computed KV and recomputes it for nothing: vllm-project/vllm#39375 (preemptions made before knowing they help: lower-priority requests preempted, higher-priority ones skipped) and vllm-project/vllm#37337 (reducing needless preemption)."),
    Invariant("PROGRESS-PREEMPT-FREES", "A preemption in schedule() returns blocks to the free queue now: its victim's free is not fenced (deferred behind a step in flight), so the allocation that triggered it can use them.", "3.3 step 6, 5.10, 8 (progress)",
              PROGRESS, "A preemption whose blocks stay held behind a fence frees nothing usable: the retry fails again and preempts the next victim, a cascade of zero-progress preemptions: vllm-project/vllm#49675 (fixes #49674, 'Stop zero-progress preemption cascades for deferred KV frees')."),
    Invariant("PROGRESS-AFTER-PREEMPT", "In a step that preempts and leaves token budget, the running requests still running after the step that have tokens to compute are scheduled unless they need more blocks than are free (or another PROGRESS-RUNNING exception holds): a preemption never ends the step for requests that fit. Requests after a victim the step had not scheduled (it may have preempted itself, after which a release may end the loop: vLLM 0.29.0 under PRIORITY) are not judged.", "3.3 step 6, 8 (progress)",
              PROGRESS, "Budget and blocks lost after a preemption: the rest of the running queue starves although the preemption made room: HabanaAI/vllm-fork#2247 (after a preemption the scheduler breaks at once, starving the remaining decodes) and vllm-project/vllm-ascend#13423 (a preempted request's budget not restored in a custom scheduler)."),
]


@dataclass
class RunningBefore:
    """What a running request needed at ``schedule_begin``: tokens to compute
    (``need``: tokens + drafts + async placeholders - computed), computed
    tokens, blocks held (a hybrid model: each group's table length), whether
    it was a prefill chunk, and why it is exempt whatever the step does (""
    when it is not)."""

    need: int
    computed: int
    held: int | tuple[int, ...]
    prefill_chunk: bool
    exempt: str


@dataclass
class ProgressStep:
    """A step's progress facts (``StepState.progress``)."""

    running: dict[str, RunningBefore] = field(default_factory=dict)
    #: Free blocks before the first preemption since the last ``schedule``
    #: row (None: none pending), and the victims since then.
    free_before_preempt: int | None = None
    victims: list[str] = field(default_factory=list)
    #: ... of which not scheduled earlier in the step (one of them may have
    #: been the request at hand, preempting itself).
    unscheduled_victims: list[str] = field(default_factory=list)
    #: Every victim of the step not scheduled earlier in it (PROGRESS-AFTER-PREEMPT).
    step_unscheduled_victims: list[str] = field(default_factory=list)
    #: Blocks the shadow's free queue holds over the ``num_free_blocks`` the
    #: ``schedule_begin`` row says (0 when it says as many or more): blocks
    #: the engine never gave back (a leak BLOCK-CONSERVATION reports). The
    #: engine could not use them, so the free counts a rule reads leave them out.
    free_excess: int = 0
    #: Each victim not scheduled earlier in the step: the free blocks before
    #: the first preemption of its run (``may_have_preempted_itself``).
    victim_free: dict[str, int] = field(default_factory=dict)


def watermark_blocks(m: TraceModel) -> int:
    """An upper bound of the blocks an admission leaves free (vLLM
    ``watermark * num_blocks``, rounded up)."""
    return -(-int(m.watermark * 1000) * m.num_gpu_blocks // 1000) if m.watermark > 0 else 0


def async_max_tokens_guard(req: ReqShadow) -> bool:
    """vLLM 0.33.0 ``Scheduler.schedule()``'s async guard in the running loop
    (the same in 0.25.0 and 0.29.0): a request with output placeholders in
    flight is passed over (``continue``) when ``num_computed_tokens + 2 -
    num_output_placeholders >= num_prompt_tokens + max_tokens`` (tokens): the
    steps in flight surely reach max_tokens. Exactly vLLM's condition, never
    wider: a request the guard does not hold goes on to allocate_slots, and a
    failed allocation whose victim's free is fenced ends the running loop
    there, so the requests after it are not reached (a wider guard judged
    them: PROGRESS-RUNNING at step 114 of a shortest-prompt-first fork on
    ``deferred-frees``, r000030 behind r000025 with 9 of 11 outputs and one in
    flight)."""
    return (req.placeholders > 0
            and req.num_computed_tokens + 2 - req.placeholders >= req.num_prompt_tokens + req.max_tokens)


def walk_order_known(m: TraceModel) -> bool:
    """Whether the running loop is known to walk running in the order of the
    ``schedule_begin`` row: under a release's profile (RUNNING-ORDER
    checked: vLLM walks its running queue in order and never reorders it).
    Under ``fork`` the order is the fork's own (decode first, round robin,
    shortest remaining first: a reorder before vLLM's loop, or one undone
    after it, shows in no row), so the rules judge only what holds for every
    walk order the rows allow: the scheduled requests in their ``schedule``
    rows' order, every other request anywhere; a victim not scheduled
    earlier may have been the request at hand only if it did not fit
    (``may_have_preempted_itself``). Regression (two trials): a fork sorting
    running by remaining tokens failed PROGRESS-RUNNING on ``deferred-frees``
    step 3 and PROGRESS-PREEMPT-NEEDED on ``priority-tight`` step 39, the
    start order assumed."""
    return walks_in_queue_order(m)


def may_have_preempted_itself(m: TraceModel, p: ProgressStep, victim: str) -> bool:
    """Whether ``victim`` (preempted, not scheduled earlier in the step) may
    have been the running loop's request at hand, preempting itself: only if
    it did not fit the blocks free when its run of preemptions began
    (``ProgressStep.victim_free``): the blocks its tokens need, bounded from
    above (all its tokens to compute, drafts and lookahead), exceed them. A
    request at hand that fits is allocated, never preempted."""
    before = p.running.get(victim)
    free = p.victim_free.get(victim)
    if before is None or free is None:
        return True
    end = min(before.computed + max(before.need, 0) + m.num_spec, m.max_model_len)
    return blocks_needed(m, before.held, end) > free


def snapshot(m: TraceModel, st: StepState, running: list[str], num_free: int | None = None) -> None:
    """At ``schedule_begin``: what each running request needs this step;
    ``num_free``: the row's ``num_free_blocks`` (blocks; None: not recorded)."""
    p = st.progress = ProgressStep()
    if num_free is not None:
        p.free_excess = max(0, len(m.free_queue) - num_free)
    for rid in running:
        req = m.reqs.get(rid)
        if req is None:
            continue
        need = req.num_tokens + len(req.spec_token_ids) + req.placeholders - req.num_computed_tokens
        exempt = ""
        if need <= 0:
            exempt = "nothing to compute"
        elif req.num_computed_tokens + 1 >= m.max_model_len:
            exempt = "max_model_len"
        elif async_max_tokens_guard(req):
            exempt = "the async max_tokens guard"
        elif req.items:
            exempt = "encoder inputs"
        held = len(req.blocks) if req.groups is None else tuple(len(t) for t in req.groups)
        p.running[rid] = RunningBefore(need, req.num_computed_tokens, held, req.prefill_chunk, exempt)


def on_preempt(m: TraceModel, st: StepState, rid: str, fence: int | None) -> None:
    """At a ``preempt`` row of schedule() (not a forced reset's), before its
    blocks are released: PROGRESS-PREEMPT-FREES; remember the free blocks
    before the first preemption of a run (PROGRESS-PREEMPT-NEEDED)."""
    p = st.progress
    if p is None:
        return
    if p.free_before_preempt is None:
        # The engine's own count, as the rows show it: the shadow's less the
        # blocks it never gave back. Regression (new-user trial): a fork leaking
        # a block on abort got "2 were free" at a step whose row said 1 free.
        p.free_before_preempt = max(0, len(m.free_queue) - p.free_excess)
    p.victims.append(rid)
    if rid not in st.withdrawn and rid not in st.kept_victims:
        p.unscheduled_victims.append(rid)
        p.step_unscheduled_victims.append(rid)
        p.victim_free[rid] = p.free_before_preempt
    if fence is not None:
        m.violate("PROGRESS-PREEMPT-FREES", rid,
                  f"preempted with its free fenced (fence {fence}): its blocks stay held behind a step "
                  f"in flight, so the preemption frees nothing the allocation can use now")


def on_running_scheduled(m: TraceModel, st: StepState, rid: str, new_blocks: int) -> None:
    """At a running request's ``schedule`` row: PROGRESS-PREEMPT-NEEDED for the
    preemptions since the previous ``schedule`` row (this request triggered
    them: the running loop preempts only to allocate for the request at hand)."""
    p = st.progress
    if p is None or p.free_before_preempt is None:
        return
    free, victims, unscheduled = p.free_before_preempt, p.victims, p.unscheduled_victims
    p.free_before_preempt, p.victims, p.unscheduled_victims = None, [], []
    order = list(p.running)
    if rid not in order:
        return
    if not walk_order_known(m):
        if any(may_have_preempted_itself(m, p, v) for v in unscheduled):
            # A victim not scheduled yet, which did not fit, may have come before
            # this request in the fork's walk and been the request at hand.
            return
    elif any(v in order and order.index(v) < order.index(rid) for v in unscheduled):
        # A victim the loop met before this request, not scheduled yet: it may
        # have been the request at hand, preempting itself (PRIORITY: then the
        # loop goes on to this one); the trigger is not known.
        return
    if new_blocks <= free:
        m.violate("PROGRESS-PREEMPT-NEEDED", rid,
                  f"preempted {victims} to schedule it, but it was given {new_blocks} new block(s) "
                  f"and {free} were free before the first preemption")


def check_step(m: TraceModel, ev: dict, st: StepState, running_after: list[str],
               waiting_after: list[str]) -> None:
    """At ``schedule_end``: PROGRESS-RUNNING / PROGRESS-AFTER-PREEMPT and
    PROGRESS-ADMIT."""
    p = st.progress
    if p is None:
        return
    p.free_before_preempt, p.victims, p.unscheduled_victims = None, [], []
    # The budget the engine says it left, never more than the configured cap
    # leaves (a fork with a tighter cap of its own says less; a recording
    # that computes it from a raised cap would say more than vLLM's input
    # budget lets a step use).
    budget_left = ev.get("token_budget")
    if budget_left is None:
        return
    budget_left = min(budget_left, m.token_budget - st.total)
    if budget_left <= 0:
        return  # no budget left
    free = ev.get("num_free_blocks")
    free = len(m.free_queue) if free is None else free
    deferring = bool(ev.get("defer_prefills")) or bool(ev.get("throttle_prefills")) or st.defer
    preempted = bool(st.preempted)
    _check_running(m, st, p, budget_left, free, deferring, preempted, set(running_after))
    if not preempted:
        _check_admission(m, st, budget_left, free, deferring, running_after, waiting_after)


def note_running(m: TraceModel, running_after: list[str]) -> None:
    """At ``schedule_end``, after the checks: the most requests the engine has
    run at once (PROGRESS-ADMIT's admission cap)."""
    m.peak_running = max(m.peak_running, len(running_after))


def _check_running(m: TraceModel, st: StepState, p: ProgressStep, budget_left: int, free: int,
                   deferring: bool, preempted: bool, running_after: set[str]) -> None:
    rule = "PROGRESS-AFTER-PREEMPT" if preempted else "PROGRESS-RUNNING"
    scheduled = set(st.scheduled) | set(st.kept_victims)
    order = list(p.running)
    known = walk_order_known(m)
    # A victim not scheduled earlier in the step may have been the request at
    # hand preempting itself, after which a release may end the running loop
    # (vLLM 0.29.0 breaks there under PRIORITY; 0.33.0 goes on): the requests
    # after it in running order are not judged (in a fork's own order any
    # request not scheduled may have come after it: none is judged, unless no
    # such victim can have been the request at hand: each one fit).
    if not known and any(may_have_preempted_itself(m, p, v) for v in p.step_unscheduled_victims):
        return
    cut = (min((order.index(v) for v in p.step_unscheduled_victims if v in order), default=len(order))
           if known else len(order))
    # (request, witness) of the requests skipped with room, reported unless a
    # request the loop may have met before them stopped it.
    found: list[tuple[str, str]] = []
    for index, (rid, before) in enumerate(p.running.items()):
        if index > cut:
            break
        if rid in scheduled or rid not in running_after or rid in st.aborted:
            continue
        # Encoder inputs may cut the window to nothing (vLLM passes over it) or
        # not (it allocates): not judged, but it may have met KV pressure.
        if before.exempt and before.exempt != "encoder inputs":
            continue
        req = m.reqs.get(rid)
        if req is None:
            continue
        if deferring and before.prefill_chunk:
            continue
        tokens = min(before.need, budget_left, m.max_model_len - before.computed - 1)
        if tokens <= 0:
            continue
        needed = blocks_needed(m, before.held, min(before.computed + tokens + m.num_spec + m.num_lookahead, m.max_model_len))
        if needed > free:
            # KV pressure: from here on the running loop may stop (0.33.0 gives up on a
            # fenced victim; a self-preempting tail ends it), so later requests are not
            # judged; in a fork's own order any request not scheduled may be later.
            if not known:
                return
            break
        if before.exempt:
            continue
        found.append((rid, f"running with {before.need} token(s) to compute but not scheduled, although the "
                           f"step left {budget_left} token(s) of budget and {free} free block(s) "
                           f"(it needed at most {max(needed, 0)})"
                           + (f"; the step preempted {st.preempted}" if preempted else "")))
    for rid, witness in found:
        m.violate(rule, rid, witness)


def _check_admission(m: TraceModel, st: StepState, budget_left: int, free: int, deferring: bool,
                     running_after: list[str], waiting_after: list[str]) -> None:
    # The admission cap: max_num_seqs, or the engine's own lower one (a fork may cap
    # running requests under it, legally): the most it has run at once so far.
    cap = min(m.max_num_seqs, m.peak_running)
    if deferring or m.kv_connector or len(running_after) >= cap:
        return
    skipped = set(st.skipped)
    head = next((r for r in waiting_after if r not in skipped), None)
    req = m.reqs.get(head) if head is not None else None
    if req is None or req.items or req.stale > 0 or req.in_flight > 0 or req.blocks:
        return
    if m.num_spec and budget_left < 1 + m.num_spec:
        return  # a new decode's padding may not fit
    if not m.chunked_prefill and req.num_tokens > budget_left:
        return
    tokens = min(req.num_tokens + m.num_spec + m.num_lookahead, m.max_model_len)
    # Every group's table at most (a Mamba group: its state blocks).
    needed = sum(m.mamba_groups.get(g, cdiv(tokens, m.bs))
                 for g in range(len(m.group_windows or (None,)))) + watermark_blocks(m)
    if needed > free:
        return
    m.violate("PROGRESS-ADMIT", head,
              f"waiting ({req.num_tokens} tokens) and not admitted, although the step left "
              f"{budget_left} token(s) of budget, {free} free block(s) (it needed at most {needed}) "
              f"and {len(running_after)} running (it has run {m.peak_running} at once; "
              f"max_num_seqs {m.max_num_seqs})")
