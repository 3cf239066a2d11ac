"""Check a trace's invariants from the trace alone, in one streaming pass.

The checker keeps a shadow of what the trace says: each live request's tokens,
status, ``num_computed_tokens`` and block table, the owners of every block and
what each full block holds. Memory is bounded by live requests and the pool,
not by trace length. Every violation is a witness a human can check (in the
spirit of Jepsen's Elle): step, request, rule, the contradicting values, and
the request's recent events.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from harness.check.encoder import EncoderChecks, EncoderStep, Item, block_extra_keys, request_items
from harness.check.invariants import INVARIANTS

MAX_PER_INVARIANT = 10
HISTORY = 8


@dataclass
class Violation:
    """One broken invariant, with the evidence."""

    invariant: str
    step: int
    request: str | None
    message: str
    history: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "step": self.step, "request": self.request,
                "message": self.message, "history": self.history}


@dataclass
class _Req:
    request_id: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    token_ids: list[int]
    status: str = "WAITING"
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    chain: list[bytes] = field(default_factory=list)
    registered: int = 0  # leading table blocks whose content is recorded
    spec_token_ids: list[int] = field(default_factory=list)  # drafts pending for the next step
    prefill_chunk: bool = True  # still prefilling after its last scheduling
    placeholders: int = 0  # async: sampled tokens in flight (num_output_placeholders)
    in_flight: int = 0     # tokens scheduled in batches not yet processed
    stale: int = 0         # in-flight tokens scheduled before its preemption
    last_sched_seq: int = 0
    num_preemptions: int = 0
    kv_done: bool = False    # its async KV load was reported finished
    kv_failed: bool = False  # ... with invalid blocks
    items: tuple[Item, ...] = ()  # encoder inputs (multimodal items)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class CheckResult:
    """Outcome of ``check_steps``: counts over the whole trace, recomputed from its rows
    (deliberately not shared with the engine's ``EngineSummary``: the checker trusts
    only the trace, and tests compare the two)."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0  # drafts sent for verification (incl. -1 padding)
    rejected_draft_tokens: int = 0
    deferred_frees: int = 0          # frees held behind a fence (and drained later)
    deferred_prefill_steps: int = 0  # steps that deferred prefill compute
    remote_kv_loads: int = 0         # async KV loads started
    failed_kv_loads: int = 0         # ... reported with invalid blocks
    events: int = 0
    violations: list[Violation] = field(default_factory=list)
    num_violations: int = 0
    by_invariant: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.num_violations == 0


def _chain(parent: bytes | None, tokens: list[int], extra: tuple | None = None) -> bytes:
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TraceChecker(EncoderChecks):
    """Feed steps in order with ``check_step``; call ``finish`` at the end."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.bs: int = config["block_size"]
        self.num_gpu_blocks: int = config["num_gpu_blocks"]
        self.max_model_len: int = config["max_model_len"]
        self.max_num_seqs: int = config["max_num_seqs"]
        self.token_budget: int = config.get("max_num_scheduled_tokens") or config["max_num_batched_tokens"]
        self.threshold: int = config.get("long_prefill_token_threshold", 0)
        self.caching: bool = config["enable_prefix_caching"]
        self.policy: str = config["policy"]
        self.num_spec: int = config.get("num_speculative_tokens", 0)
        self.async_scheduling: bool = config.get("async_scheduling", False)
        self.depth: int = config.get("max_concurrent_batches", 1)
        self.defer: bool = config.get("defer_block_free", False)
        # Batches scheduled but not yet processed, oldest first.
        self.batches: deque[_Batch] = deque()
        # Deferred frees (spec 5.10): sequence numbers and the FIFO of
        # (fence, blocks in free order); their blocks stay held until drained.
        self.sched_seq = 0
        self.processed_seq = 0
        self.deferred: deque[tuple[int, list[int], str]] = deque()  # (fence, blocks, holder)
        # Prefill gating (spec 7.1, 10.4), recomputed from the trace.
        self.interval: int = config.get("prefill_schedule_interval", 1)
        self.dp_interval = 1  # the DP coordinator's throttle cadence (set by check_steps)
        self.capacity_bound = False
        self.last_prefill_step = -self.interval
        self.num_executed = 0
        self.deferred_waiting: set[str] = set()  # skipped and still waiting
        # KV connector (spec 7.2, 10.2): which waiting requests sit in the
        # kv-holding queue (examined first), requests still prefilling (the
        # reservation of an async load), and requests finished while their
        # load was in flight (they hold their blocks until it reports done).
        self.kv_connector: bool = config.get("kv_connector", False)
        self.recompute_kv: bool = config.get("kv_load_failure_policy", "recompute") == "recompute"
        self.kv_queue: set[str] = set()
        self.inflight: dict[str, None] = {}
        self.kv_abandoned: dict[str, _Req] = {}
        self.result = CheckResult()
        self.reqs: dict[str, _Req] = {}
        self.owners: dict[int, set[str]] = {}
        # The free queue as the trace implies it, head first (spec 5.2).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_gpu_blocks))
        self.free_queue_known = True  # false after the first ALLOC-FROM-HEAD violation
        self.zero_step_state: tuple | None = None  # queues of the last zero-token step
        # Full blocks: content chain hash per block, and blocks per content.
        self.content: dict[int, bytes] = {}
        self.cached: dict[bytes, set[int]] = {}
        # Blocks the pool still treats as cached (hashed) although their KV
        # was never computed: cached by a chunk that a PRIORITY give-back
        # withdrew (block -> the withdrawn request).
        self.uncomputed: dict[int, str] = {}
        self.finished_since_schedule: set[str] = set()
        self.prev_running: list[str] = []
        self.prev_waiting: list[str] = []
        self.step = -1
        self._init_encoder(config)

    # -- reporting -------------------------------------------------------------
    def _violate(self, invariant: str, request: str | None, message: str) -> None:
        assert invariant in INVARIANTS, invariant
        self.result.num_violations += 1
        counts = self.result.by_invariant
        counts[invariant] = counts.get(invariant, 0) + 1
        # Keep the first few witnesses of *each* invariant, so one noisy rule
        # cannot hide another.
        if counts[invariant] > MAX_PER_INVARIANT:
            return
        req = self.reqs.get(request) if request else None
        history = list(req.history) if req else []
        self.result.violations.append(Violation(invariant, self.step, request, message, history))

    def _note(self, req: _Req, text: str) -> None:
        req.history.append(f"step {self.step}: {text}")

    # -- block bookkeeping ----------------------------------------------------
    def _held(self) -> int:
        return len(self.owners)

    def _conservation(self, where: str, num_free: int | None) -> None:
        if num_free is None:
            return
        usable = self.num_gpu_blocks - 1
        if num_free + self._held() != usable or num_free != len(self.free_queue):
            self._violate("BLOCK-CONSERVATION", None,
                          f"at {where}: {num_free} free + {self._held()} held != {usable} usable blocks "
                          f"(the trace implies {len(self.free_queue)} free)")

    def _acquire(self, req: _Req, block: int, as_hit: bool) -> None:
        holders = self.owners.setdefault(block, set())
        if req.request_id in holders:
            self._violate("BLOCK-EXCLUSIVE", req.request_id, f"block {block} appears twice in its table")
        if holders and not as_hit:
            self._violate("BLOCK-EXCLUSIVE", req.request_id,
                          f"newly allocated block {block} is still held by {sorted(holders)}")
        if block == 0:
            self._violate("BLOCK-EXCLUSIVE", req.request_id, "the null block 0 was allocated")
        if as_hit:
            # Touching a free hit block unlinks it from wherever it sits.
            self.free_queue.pop(block, None)
        else:
            head = next(iter(self.free_queue), None)
            if block != head and self.free_queue_known:
                preview = list(self.free_queue)[:8]
                self._violate("ALLOC-FROM-HEAD", req.request_id,
                              f"allocated block {block} but the free queue starts {preview}; "
                              f"the queue order can no longer be inferred, so this check stops here")
                self.free_queue_known = False
            self.free_queue.pop(block, None)
            # A fresh allocation evicts whatever the block cached before.
            self.uncomputed.pop(block, None)
            old = self.content.pop(block, None)
            if old is not None:
                self.cached[old].discard(block)
                if not self.cached[old]:
                    del self.cached[old]
        holders.add(req.request_id)
        req.blocks.append(block)

    def _release_all(self, req: _Req, freed: list[int], kind: str, fence: int | None = None) -> None:
        """Drop the request's references in ``freed`` order. Blocks reaching
        ref 0 enter the simulated free queue (unhashed or caching off: head,
        in that order; hashed: tail), or, for a deferred free, stay held by
        the fence entry until it is drained."""
        expected = req.blocks[::-1]
        if freed != expected:
            if kind == "preempt":
                self._violate("PREEMPT-EFFECTS", req.request_id,
                              f"preemption freed {freed}, but it must give back its whole table "
                              f"tail first: {expected}")
            else:
                self._violate("FREE-ORDER", req.request_id,
                              f"freed {freed}, expected its table tail first {expected}")
        if self.defer:
            in_flight = req.last_sched_seq > self.processed_seq
            if fence is None and in_flight:
                self._violate("DEFERRED-FREE-FENCED", req.request_id,
                              f"{kind} freed blocks {expected} at once although step seq "
                              f"{req.last_sched_seq} that writes them is in flight "
                              f"(processed_step_seq {self.processed_seq})")
            elif fence is not None and (not in_flight or fence != self.sched_seq):
                self._violate("DEFERRED-FREE-FENCED", req.request_id,
                              f"{kind} deferred with fence {fence}; expected "
                              f"{self.sched_seq if in_flight else 'an immediate free'}")
        elif fence is not None:
            self._violate("DEFERRED-FREE-FENCED", req.request_id,
                          f"{kind} deferred a free (fence {fence}) with defer_block_free off")
        if fence is not None:
            # Each deferred entry keeps its own reference: two entries may
            # share a prefix block, which returns only when both drained.
            holder = f"<deferred free of {req.request_id}, fence {fence}>"
            for block in expected:
                holders = self.owners.setdefault(block, set())
                holders.discard(req.request_id)
                holders.add(holder)
            self.deferred.append((fence, expected, holder))
        else:
            self._return_blocks(expected, req.request_id)
        req.blocks = []
        req.registered = 0

    def _return_blocks(self, ordered: list[int], holder: str) -> None:
        to_head: list[int] = []
        to_tail: list[int] = []
        for block in ordered:
            holders = self.owners.get(block)
            if holders is None:
                continue
            holders.discard(holder)
            if not holders:
                del self.owners[block]
                (to_tail if block in self.content or block in self.uncomputed else to_head).append(block)
        for block in reversed(to_head):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)
        for block in to_tail:
            self.free_queue[block] = None

    def _extend_chain(self, req: _Req, n_blocks: int) -> None:
        """Content hashes of the request's first ``n_blocks`` full blocks."""
        while len(req.chain) < n_blocks:
            i = len(req.chain)
            extra = block_extra_keys(req.items, i * self.bs, (i + 1) * self.bs) if req.items else None
            req.chain.append(_chain(req.chain[-1] if req.chain else None,
                                    req.token_ids[i * self.bs:(i + 1) * self.bs], extra))

    def _register_full_blocks(self, req: _Req, upto_tokens: int) -> None:
        """Record the content of the request's blocks fully covered by
        ``upto_tokens`` (what vLLM caches eagerly at schedule time)."""
        if not self.caching:
            return
        n_full = min(upto_tokens, req.num_tokens, len(req.blocks) * self.bs) // self.bs
        self._extend_chain(req, n_full)
        for i in range(req.registered, n_full):
            block = req.blocks[i]
            if block not in self.content:
                self.content[block] = req.chain[i]
                self.cached.setdefault(req.chain[i], set()).add(block)
        req.registered = max(req.registered, n_full)

    def _longest_cached_prefix(self, req: _Req) -> int:
        """Tokens of the longest prefix whose full blocks are all cached,
        capped at num_tokens - 1 (the last token is always recomputed)."""
        max_blocks = (req.num_tokens - 1) // self.bs
        self._extend_chain(req, max_blocks)
        n = 0
        while n < max_blocks and self.cached.get(req.chain[n]):
            n += 1
        return n * self.bs

    # -- events ---------------------------------------------------------------
    def check_step(self, step: int, events: list[dict[str, Any]]) -> None:
        self.step = step
        self.result.steps += 1
        self.result.events += len(events)
        st = _StepState()
        for ev in events:
            if self.enc_active:
                self._enc_before(ev, st)
            handler = getattr(self, "_on_" + ev["kind"], None)
            if handler is None:
                self._violate("STATE-CONTINUITY", ev.get("request_id"), f"unknown event kind {ev['kind']!r}")
                continue
            handler(ev, st)

    def _on_arrival(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        prompt = list(ev["prompt_token_ids"] or [])
        self.result.requests += 1
        if rid in self.reqs:
            self._violate("STATE-CONTINUITY", rid, "request id arrived twice")
        if not prompt or len(prompt) >= self.max_model_len:
            self._violate("ARRIVAL-ADMISSIBLE", rid,
                          f"accepted a prompt of {len(prompt)} tokens with max_model_len {self.max_model_len}")
        positions = ev.get("mm_positions")
        if positions:
            self.enc_active = True
            why = self._enc_inadmissible(positions)
            if why is not None:
                self._violate("ARRIVAL-ADMISSIBLE", rid, f"accepted a request whose {why}")
        req = _Req(rid, ev["priority"], ev["arrival_time_s"], len(prompt), ev["max_tokens"],
                   ev["min_tokens"], None if ev["ignore_eos"] else ev["eos_token_id"],
                   tuple(ev["stop_token_ids"] or ()), prompt, items=request_items(prompt, positions))
        self._note(req, f"arrived, {len(prompt)} prompt tokens, max_tokens {req.max_tokens}")
        self.reqs[rid] = req
        st.arrived.append(rid)

    def _on_reject(self, ev: dict, st: _StepState) -> None:
        self.result.requests += 1
        self.result.rejected += 1
        n = len(ev["prompt_token_ids"] or [])
        if 0 < n < self.max_model_len and self._enc_inadmissible(ev.get("mm_positions")) is None:
            self._violate("ARRIVAL-ADMISSIBLE", ev["request_id"],
                          f"rejected a {n}-token prompt that fits max_model_len {self.max_model_len}")

    def _finish(self, ev: dict, kind: str) -> _Req | None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if req is None:
            self._violate("STATE-CONTINUITY", rid, f"{kind} of an unknown or finished request")
            return None
        freed = list(ev["block_ids"] or [])
        if req.status == "WAITING_FOR_REMOTE_KVS" and not req.kv_done:
            # Its load may still write the blocks: they stay until it reports.
            if freed:
                self._violate("REMOTE-KV-ABORT-HOLDS", rid,
                              f"{kind} freed {freed} while its KV load was still in flight")
                self._release_all(req, freed, kind, ev.get("fence"))
            else:
                self.kv_abandoned[rid] = req
        else:
            self._release_all(req, freed, kind, ev.get("fence"))
        self.kv_queue.discard(rid)
        self.inflight.pop(rid, None)
        if req.items:
            self._enc_on_finish(req)
        # A finished request leaves whichever queue it was in.
        self.prev_running = [r for r in self.prev_running if r != rid]
        self.prev_waiting = [r for r in self.prev_waiting if r != rid]
        req.status = ev["status"]
        self.finished_since_schedule.add(rid)
        self._note(req, f"{kind}: {ev['status']} ({ev['finish_reason']})")
        del self.reqs[rid]
        return req

    def _on_abort(self, ev: dict, st: _StepState) -> None:
        if self._finish(ev, "abort") is not None:
            self.result.aborted += 1
            st.aborted.add(ev["request_id"])

    def _on_schedule_begin(self, ev: dict, st: _StepState) -> None:
        running, waiting = list(ev["running"]), list(ev["waiting"])
        st.running_before, st.waiting_before = running, waiting
        st.sim_running = list(running)
        st.enc.budget_left = self.enc_budget
        expected_running = [r for r in self.prev_running if r not in st.aborted]
        if running != expected_running:
            self._violate("STATE-CONTINUITY", None,
                          f"running at step start {running} != previous end {expected_running}")
        # A request may arrive and be aborted before the same step starts.
        expected_waiting = [r for r in self.prev_waiting + st.arrived if r not in st.aborted]
        if sorted(waiting) != sorted(expected_waiting) or (self.policy == "fcfs" and waiting != expected_waiting):
            self._violate("STATE-CONTINUITY", None,
                          f"waiting at step start {waiting} != previous end + arrivals {expected_waiting}")
        self._conservation("schedule_begin", ev["num_free_blocks"])
        st.eligible = len(running) + len(waiting)
        has_decode = any(not self.reqs[r].prefill_chunk for r in running if r in self.reqs)
        expected_throttle = self.dp_interval > 1 and self.step % self.dp_interval != 0
        if bool(ev["throttle_prefills"]) != expected_throttle:
            self._violate("PREFILL-DEFER", None,
                          f"throttle_prefills {ev['throttle_prefills']} at step {self.step}, but the "
                          f"coordinator's cadence (every {self.dp_interval} steps) gives {expected_throttle}")
        defer = bool(ev["throttle_prefills"]) and not self.capacity_bound and has_decode
        if (not defer and self.interval > 1 and not self.capacity_bound and has_decode
                and (self.num_executed + 1) - self.last_prefill_step < self.interval):
            defer = True
        st.defer = defer

    def _on_preempt(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        self.result.preemptions += 1
        if st.admitted:
            self._violate("WAITING-NEVER-PREEMPTS", rid,
                          f"preempted after this step admitted {st.admitted}: admission must never preempt")
        req = self.reqs.get(rid)
        if req is not None and req.status == "WAITING_FOR_REMOTE_KVS":
            self._violate("REMOTE-KV-LOADING", rid, "preempted while loading remote KV")
        if req is None or req.status != "RUNNING" or rid not in st.sim_running:
            status = req.status if req else "unknown"
            self._violate("PREEMPT-ONLY-RUNNING", rid,
                          f"preempted a request with status {status}, running queue {st.sim_running}")
            if req is None:
                return
        elif self.policy == "fcfs":
            if st.sim_running[-1] != rid:
                self._violate("FCFS-VICTIM-TAIL", rid,
                              f"victim is not the tail of running {st.sim_running}")
        else:
            def key(r: str) -> tuple:
                q = self.reqs[r]
                return (q.priority, q.arrival_time)
            top = max(st.sim_running, key=key)
            if key(rid) != key(top):
                self._violate("PRIORITY-VICTIM-MAX", rid,
                              f"victim (priority, arrival) {key(rid)} but {top} has {key(top)}")
        if rid in st.scheduled:
            self._violate("PRIORITY-GIVE-BACK", rid,
                          "preempted after being scheduled this step without a withdraw")
            st.scheduled.remove(rid)
        if ev["num_computed_tokens"] != req.num_computed_tokens:
            self._violate("COMPUTED-CONTINUITY", rid,
                          f"preempt says computed {ev['num_computed_tokens']}, expected {req.num_computed_tokens}")
        self._release_all(req, list(ev["block_ids"] or []), "preempt", ev.get("fence"))
        if req.items:
            self._enc_on_preempt(st, req)
        if rid in st.sim_running:
            index = st.sim_running.index(rid)
            st.sim_running.remove(rid)
            if index < st.last_running_index:
                st.last_running_index -= 1
        req.status = "PREEMPTED"
        req.num_preemptions += 1
        self.inflight.pop(rid, None)
        req.num_computed_tokens = 0
        req.spec_token_ids = []  # drafts never survive a preemption
        req.stale = req.in_flight  # output still in flight is stale
        req.placeholders = 0
        st.preempted.append(rid)
        self._note(req, f"preempted with {ev['num_computed_tokens']} computed tokens")

    def _on_withdraw(self, ev: dict, st: _StepState) -> None:
        """PRIORITY give-back: undo this step's scheduling of a victim."""
        rid, n = ev["request_id"], ev["num_scheduled_tokens"]
        req = self.reqs.get(rid)
        if self.policy != "priority":
            self._violate("PRIORITY-GIVE-BACK", rid, "withdrew a scheduled request under FCFS")
        if req is None or rid not in st.scheduled:
            self._violate("PRIORITY-GIVE-BACK", rid, "withdrew a request not scheduled this step")
            return
        if st.scheduled_tokens.get(rid) != n:
            self._violate("PRIORITY-GIVE-BACK", rid,
                          f"gave back {n} tokens but {st.scheduled_tokens.get(rid)} were scheduled")
        st.scheduled.remove(rid)
        st.running_scheduled.discard(rid)
        st.total -= st.scheduled_tokens.pop(rid, 0)
        st.withdrawn.append(rid)
        if self.enc_active:
            self._enc_on_withdraw(ev, st, rid)
        req.num_computed_tokens -= n
        req.in_flight -= n
        req.placeholders -= st.placeholders_added.pop(rid, 0)
        # The withdrawn chunk never runs: blocks its scheduling registered
        # (eagerly, vLLM caches at allocation) hold no computed KV. Forget
        # their content, so a later prefix hit on them is reported.
        registered_before = st.registered_before.pop(rid, req.registered)
        for i in range(registered_before, req.registered):
            block = req.blocks[i]
            if self.content.get(block) == req.chain[i]:
                del self.content[block]
                self.cached[req.chain[i]].discard(block)
                if not self.cached[req.chain[i]]:
                    del self.cached[req.chain[i]]
                self.uncomputed[block] = rid
        req.registered = min(req.registered, registered_before)
        self._note(req, f"withdrawn: {n} tokens given back")

    def _on_schedule(self, ev: dict, st: _StepState) -> None:
        rid, kind = ev["request_id"], ev["schedule_kind"]
        n, computed = ev["num_scheduled_tokens"], ev["num_computed_tokens"]
        hit = ev["num_prefix_hit_tokens"] or 0
        req = self.reqs.get(rid)
        if req is None:
            self._violate("STATE-CONTINUITY", rid, "scheduled an unknown or finished request")
            return
        if rid in st.scheduled:
            self._violate("RUNNING-ORDER", rid, "scheduled twice in one step")
        if req.status == "WAITING_FOR_REMOTE_KVS":
            self._violate("REMOTE-KV-LOADING", rid, "scheduled while loading remote KV (not yet promoted)")
        st.scheduled.append(rid)
        st.total += n
        st.scheduled_tokens[rid] = n
        if n is None or n <= 0:
            self._violate("BUDGET-TOKENS", rid, f"num_scheduled_tokens {n} is not positive")
            return
        if 0 < self.threshold < n and st.eligible > 1:
            self._violate("BUDGET-THRESHOLD", rid,
                          f"{n} tokens > long_prefill_token_threshold {self.threshold}")
        drafts = list(ev["spec_token_ids"] or [])
        st.drafts[rid] = drafts
        blocks_before = len(req.blocks)
        if kind == "running":
            if req.placeholders > 0 and computed + 2 - req.placeholders >= req.num_prompt_tokens + req.max_tokens:
                self._violate("ASYNC-PLACEHOLDERS", rid,
                              f"scheduled with {req.placeholders} tokens in flight that already reach "
                              f"max_tokens {req.max_tokens} (computed {computed})")
            self._check_running_drafts(req, computed, n, drafts)
            if req.prefill_chunk:
                st.prefill_scheduled = True
                if st.defer:
                    self._violate("PREFILL-DEFER", rid,
                                  f"a prefill chunk ({computed} of {req.num_tokens} tokens computed) "
                                  f"ran in a step that defers prefills")
            if req.status != "RUNNING" or rid not in st.sim_running:
                self._violate("RUNNING-ORDER", rid, f"scheduled as running but status {req.status}")
            else:
                idx = st.sim_running.index(rid)
                if idx < st.last_running_index:
                    self._violate("RUNNING-ORDER", rid,
                                  f"scheduled out of running order {st.sim_running}")
                st.last_running_index = idx
            if computed != req.num_computed_tokens:
                self._violate("COMPUTED-CONTINUITY", rid,
                              f"num_computed_tokens {computed}, expected {req.num_computed_tokens}")
            if computed + n > self.max_model_len - 1:
                self._violate("SCHEDULED-SPAN", rid,
                              f"{computed} + {n} tokens passes max_model_len - 1 = {self.max_model_len - 1}")
            for block in ev["block_ids"] or []:
                self._acquire(req, block, as_hit=False)
        else:
            self._check_admission_drafts(req, computed, n, drafts)
            self._on_admission(ev, st, req, kind, hit, computed, n)
        if computed + n > req.num_tokens + len(drafts) + req.placeholders:
            self._violate("SCHEDULED-SPAN", rid,
                          f"{computed} computed + {n} scheduled > {req.num_tokens} tokens "
                          f"+ {len(drafts)} drafts + {req.placeholders} placeholders")
        # Rejected drafts can leave blocks past the need; tables never shrink.
        need = max(blocks_before, _cdiv(computed + n, self.bs))
        if len(req.blocks) != need:
            self._violate("BLOCKS-COVER", rid,
                          f"table has {len(req.blocks)} blocks for {computed + n} tokens, needs {need}")
        req.num_computed_tokens = computed + n
        req.in_flight += n
        req.prefill_chunk = computed + n < req.num_tokens + req.placeholders
        if self.async_scheduling and not req.prefill_chunk:
            st.placeholders_added[rid] = 1 + len(drafts)
            req.placeholders += 1 + len(drafts)
        st.ends[rid] = computed + n
        st.registered_before[rid] = req.registered
        self._register_full_blocks(req, computed + n)
        self._note(req, f"scheduled {kind}: computed {computed} + {n}"
                        + (f", prefix hit {hit}" if kind != "running" else "")
                        + f", new blocks {list(ev['block_ids'] or [])}")
        if kind == "running":
            st.running_scheduled.add(rid)
        if req.items or ev.get("encoder_input_ids"):
            self._enc_on_schedule(ev, st, req, computed, n)

    def _check_running_drafts(self, req: _Req, computed: int, n: int, drafts: list[int]) -> None:
        """Drafts ride on the tokens past num_tokens: exactly the first k of
        the pending drafts, none for a prefill chunk; the rest are dropped."""
        k = computed + n - req.num_tokens - req.placeholders
        expected = req.spec_token_ids[:k] if k > 0 else []
        if drafts != expected:
            self._violate("SPEC-TOKENS", req.request_id,
                          f"scheduled drafts {drafts} but its pending drafts were {req.spec_token_ids} "
                          f"and {max(k, 0)} draft positions were scheduled")
        req.spec_token_ids = []

    def _check_admission_drafts(self, req: _Req, computed: int, n: int, drafts: list[int]) -> None:
        """Admissions carry no drafts, except the -1 padding of a new decode."""
        if not drafts:
            return
        hit = computed
        padded = (self.num_spec > 0 and n == 1 + self.num_spec and hit + 1 == req.num_tokens
                  and drafts == [-1] * self.num_spec)
        if not padded:
            self._violate("SPEC-TOKENS", req.request_id,
                          f"admitted with drafts {drafts} ({n} tokens, hit {hit} of {req.num_tokens}); "
                          f"only a new decode may be padded with {self.num_spec} x -1")
        req.spec_token_ids = []

    def _check_prefix_hit(self, req: _Req, hit: int, block_ids: list[int]) -> None:
        """A lookup's hit (admission or async load): whole blocks, at most
        num_tokens - 1, the longest cached prefix, blocks holding this
        request's prefix, none of them never computed."""
        rid = req.request_id
        if hit % self.bs or hit > req.num_tokens - 1 or (hit and not self.caching):
            self._violate("PREFIX-HIT-RULES", rid,
                          f"hit of {hit} tokens (block_size {self.bs}, {req.num_tokens} tokens, "
                          f"caching {'on' if self.caching else 'off'})")
        n_hit = hit // self.bs
        if not self.caching:
            return
        longest = self._longest_cached_prefix(req)
        uncomputed = [b for b in block_ids[:n_hit] if b in self.uncomputed]
        if uncomputed:
            block = uncomputed[0]
            self._violate("HIT-UNCOMPUTED-BLOCK", rid,
                          f"prefix hit on block {block}, whose KV was never computed: a chunk of "
                          f"{self.uncomputed[block]} cached it at allocation and was then withdrawn "
                          f"by a PRIORITY give-back")
        elif hit != longest:
            self._violate("PREFIX-HIT-RULES", rid,
                          f"hit of {hit} tokens but {longest} tokens of its prefix are cached")
        for i, block in enumerate(block_ids[:n_hit]):
            if i < len(req.chain) and block not in self.uncomputed and self.content.get(block) != req.chain[i]:
                self._violate("PREFIX-HIT-RULES", rid,
                              f"hit block {block} (#{i}) does not hold this request's prefix block")
                break

    def _on_admission(self, ev: dict, st: _StepState, req: _Req, kind: str, hit: int,
                      computed: int, n: int) -> None:
        rid = req.request_id
        if st.preempted:
            self._violate("NO-ADMIT-AFTER-PREEMPT", rid,
                          f"admitted ({kind}) in a step that preempted {st.preempted}")
        expected_status = {"new": "WAITING", "resumed": "PREEMPTED"}.get(kind)
        if req.status != expected_status:
            self._violate("ADMISSION-ORDER", rid, f"admitted as {kind} but its status was {req.status}")
        if req.stale > 0:
            self._violate("STALE-OUTPUT", rid,
                          f"admitted ({kind}) with {req.stale} tokens of stale output still in flight")
        position = len(st.admitted) + len(st.skipped)
        if position >= len(st.waiting_before) or st.waiting_before[position] != rid:
            self._violate("ADMISSION-ORDER", rid,
                          f"admission #{position + 1} of the step, but waiting was {st.waiting_before[:position + 3]}...")
        if len(st.sim_running) >= self.max_num_seqs:
            self._violate("MAX-NUM-SEQS", rid,
                          f"admitted with {len(st.sim_running)} running = max_num_seqs {self.max_num_seqs}")
        st.admitted.append(rid)
        st.sim_running.append(rid)
        self.deferred_waiting.discard(rid)
        self.kv_queue.discard(rid)
        if computed + n < req.num_tokens:
            self.inflight[rid] = None
        if computed < req.num_tokens - 1:
            st.prefill_admitted = True
            if st.defer:
                self._violate("PREFILL-DEFER", rid,
                              f"admitted with {req.num_tokens - computed} tokens to prefill in a step that "
                              f"defers prefills")
        if req.num_computed_tokens > 0:
            # A finished async load: no lookup; it keeps its table and grows it.
            if hit:
                self._violate("PREFIX-HIT-RULES", rid,
                              f"a request holding loaded KV looked up a prefix hit of {hit} tokens")
            if computed != req.num_computed_tokens:
                self._violate("COMPUTED-CONTINUITY", rid,
                              f"admitted with num_computed_tokens {computed}, but its load left "
                              f"{req.num_computed_tokens}")
            block_ids = list(ev["block_ids"] or [])
            if block_ids[:len(req.blocks)] != req.blocks:
                self._violate("BLOCKS-COVER", rid,
                              f"admitted with table {block_ids}, but it held {req.blocks}")
            for block in block_ids[len(req.blocks):]:
                self._acquire(req, block, as_hit=False)
            req.status = "RUNNING"
            return
        if req.blocks:
            self._violate("PREEMPT-EFFECTS", rid, f"admitted while still holding blocks {req.blocks}")
            self._release_all(req, req.blocks[::-1], "finish")
        if computed != hit:
            self._violate("COMPUTED-CONTINUITY", rid,
                          f"admitted with num_computed_tokens {computed} != prefix hit {hit}")
        block_ids = list(ev["block_ids"] or [])
        n_hit = hit // self.bs
        self._check_prefix_hit(req, hit, block_ids)
        for i, block in enumerate(block_ids):
            self._acquire(req, block, as_hit=i < n_hit)
        req.status = "RUNNING"
        self.result.prefix_hit_tokens += hit

    def _on_schedule_end(self, ev: dict, st: _StepState) -> None:
        total = ev["total_num_scheduled_tokens"]
        if total != st.total or total > self.token_budget:
            self._violate("BUDGET-TOKENS", None,
                          f"total {total} (events sum {st.total}) vs budget {self.token_budget}")
        if ev["token_budget"] != self.token_budget - st.total:
            self._violate("BUDGET-TOKENS", None,
                          f"budget left {ev['token_budget']} != {self.token_budget} - {st.total}")
        if self.defer and st.total > 0:
            self.sched_seq += 1
            for rid in st.scheduled:
                self.reqs[rid].last_sched_seq = self.sched_seq
        self.batches.append(_Batch(self.step, list(st.scheduled), dict(st.scheduled_tokens),
                                   dict(st.drafts), dict(st.ends), st.total))
        if len(self.batches) > self.depth:
            self._violate("STATE-CONTINUITY", None,
                          f"{len(self.batches)} batches in flight > max_concurrent_batches {self.depth}")
        running = list(ev["running"])
        if running != st.sim_running:
            self._violate("STATE-CONTINUITY", None, f"running after schedule {running} != expected {st.sim_running}")
        if len(running) > self.max_num_seqs:
            self._violate("MAX-NUM-SEQS", None, f"{len(running)} running > max_num_seqs {self.max_num_seqs}")
        waiting = list(ev["waiting"])
        # Two queues, examined kv-holding first (spec 10.2): a skipped request
        # returns to the head of the queue it now belongs to, in the order met.
        rest = [r for r in st.waiting_before if r not in st.admitted and r not in st.skipped]
        skipped_kv = [r for r in st.skipped if self._holds_kv(r)]
        kv_after = skipped_kv + [r for r in rest if r in self.kv_queue]
        wait_after = ([r for r in st.skipped if r not in skipped_kv]
                      + [r for r in rest if r not in self.kv_queue])
        self.kv_queue = set(kv_after)
        num_kv = len(kv_after)
        if self.policy == "fcfs":
            # Victims go to the head of waiting in their old running order.
            expected = kv_after + st.preempted[::-1] + wait_after
            if waiting[num_kv:num_kv + len(st.preempted)] != st.preempted[::-1]:
                self._violate("PREEMPT-WAITING-HEAD", st.preempted[0] if st.preempted else None,
                              f"victims {st.preempted} are not at the head of waiting {waiting[:5]}...")
            elif waiting != expected:
                self._violate("STATE-CONTINUITY", None, f"waiting after schedule {waiting} != expected {expected}")
        else:
            for part in (waiting[:num_kv], waiting[num_kv:]):
                keys = [(self.reqs[r].priority, self.reqs[r].arrival_time, r) for r in part if r in self.reqs]
                if keys != sorted(keys):
                    self._violate("PREEMPT-WAITING-HEAD", None, f"waiting not in priority order: {waiting[:8]}...")
            if (sorted(waiting[:num_kv]) != sorted(kv_after)
                    or sorted(waiting[num_kv:]) != sorted(st.preempted + wait_after)):
                self._violate("STATE-CONTINUITY", None,
                              f"waiting after schedule {waiting} != {kv_after} + {st.preempted + wait_after}")
        for rid in st.scheduled:
            req = self.reqs.get(rid)
            if req is not None and not req.prefill_chunk:
                self.inflight.pop(rid, None)
        never_preempted = [r for r in st.withdrawn if r not in st.preempted]
        if never_preempted:
            self._violate("PRIORITY-GIVE-BACK", never_preempted[0],
                          f"withdrawn but not preempted in the step: {never_preempted}")
        if set(ev["preempted_req_ids"] or []) != set(st.preempted):
            self._violate("FINISHED-IDS", None,
                          f"preempted_req_ids {ev['preempted_req_ids']} != preempted {st.preempted}")
        if set(ev["finished_req_ids"] or []) != self.finished_since_schedule:
            self._violate("FINISHED-IDS", None,
                          f"finished_req_ids {ev['finished_req_ids']} != finished since last schedule "
                          f"{sorted(self.finished_since_schedule)}")
        self.finished_since_schedule = set()
        if self.enc_active:
            self._enc_on_schedule_end(ev, st)
        self._conservation("schedule_end", ev["num_free_blocks"])
        # (Blocks still behind a deferred-free fence, or held by the load of a
        # request finished while loading, may legitimately block it.)
        if (not st.running_before and st.waiting_before and not st.preempted and not st.admitted
                and not st.skipped and not self.deferred and not self.kv_abandoned):
            self._violate("IDLE-ADMISSION", st.waiting_before[0],
                          f"nothing running, {len(st.waiting_before)} waiting, and nothing admitted: "
                          f"a request that fits an empty engine must be admitted")
        state = (tuple(st.waiting_before), tuple(st.running_before))
        # Waiting on outputs in flight is not a lack of progress.
        loading = self.kv_abandoned or any(r.status == "WAITING_FOR_REMOTE_KVS" for r in self.reqs.values())
        if (st.total == 0 and (st.waiting_before or st.running_before) and len(self.batches) <= 1
                and not loading):
            if self.zero_step_state == state and not st.arrived and not st.aborted:
                self._violate("NO-PROGRESS", None,
                              f"a second step with no tokens scheduled and unchanged queues "
                              f"(waiting {list(state[0])[:5]}, running {list(state[1])[:5]})")
            self.zero_step_state = state
        else:
            self.zero_step_state = None
        self.result.deferred_prefill_steps += bool(ev["defer_prefills"])
        if bool(ev["defer_prefills"]) != st.defer:
            self._violate("PREFILL-DEFER", None,
                          f"defer_prefills {ev['defer_prefills']} but the throttle, the capacity guard "
                          f"({self.capacity_bound}) and the cadence (last prefill at executed step "
                          f"{self.last_prefill_step}, now {self.num_executed + 1}) give {st.defer}")
        if not st.preempted and not st.defer:
            self.capacity_bound = len(waiting) > len(self.deferred_waiting & set(waiting))
        if bool(ev["prefill_capacity_bound"]) != self.capacity_bound:
            self._violate("PREFILL-DEFER", None,
                          f"prefill_capacity_bound {ev['prefill_capacity_bound']} but "
                          f"{len(waiting)} waiting with {len(self.deferred_waiting & set(waiting))} "
                          f"skipped gives {self.capacity_bound}")
        if st.total > 0:
            self.num_executed += 1
        if self.interval > 1 and (st.prefill_scheduled or st.prefill_admitted):
            self.last_prefill_step = self.num_executed
        self.prev_running, self.prev_waiting = running, waiting
        st.sim_running = running

    def _on_skip(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        position = len(st.admitted) + len(st.skipped)
        if position >= len(st.waiting_before) or st.waiting_before[position] != rid:
            self._violate("ADMISSION-ORDER", rid, f"skipped a request that is not next in waiting "
                                                  f"{st.waiting_before[:position + 3]}")
        if req is not None and req.status == "WAITING_FOR_REMOTE_KVS":
            if req.kv_done:
                self._violate("REMOTE-KV-LOADING", rid,
                              "skipped although its transfer was reported finished (must be promoted)")
        elif rid in st.enc.zero:
            pass  # its encoder plan cut the window to 0 tokens
        elif req is None or req.stale == 0:
            self._violate("STALE-OUTPUT", rid, f"skipped ({ev['message']}) without stale output in flight")
        st.skipped.append(rid)
        self.deferred_waiting.add(rid)
        if req is not None:
            self._note(req, f"skipped: {ev['message']}")

    # -- KV connector (spec 7.2) ------------------------------------------------
    def _holds_kv(self, rid: str) -> bool:
        req = self.reqs.get(rid)
        return req is not None and (req.status == "WAITING_FOR_REMOTE_KVS" or req.num_computed_tokens > 0)

    def _remaining_blocks(self, req: _Req) -> int:
        """Blocks an in-flight prefill still needs for its whole sequence
        (plus one spec-decode step): vLLM ``_request_remaining_blocks``."""
        num_tokens = min(req.num_tokens, self.max_model_len) + (1 + self.num_spec if self.num_spec else 0)
        return max(_cdiv(num_tokens, self.bs) - len(req.blocks), 0)

    def _on_kv_load(self, ev: dict, st: _StepState) -> None:
        """An async KV-load admission: local hit + blocks for the external
        tokens, WAITING_FOR_REMOTE_KVS, nothing scheduled; it left the
        reservation of in-flight prefills free."""
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        self.result.remote_kv_loads += 1
        if req is None:
            self._violate("STATE-CONTINUITY", rid, "KV load for an unknown or finished request")
            return
        hit, ext = ev["num_prefix_hit_tokens"] or 0, ev["num_external_tokens"] or 0
        if not self.kv_connector:
            self._violate("REMOTE-KV-LOADING", rid, "an async KV load without a KV connector")
        if st.preempted:
            self._violate("NO-ADMIT-AFTER-PREEMPT", rid,
                          f"started a KV load in a step that preempted {st.preempted}")
        position = len(st.admitted) + len(st.skipped)
        if position >= len(st.waiting_before) or st.waiting_before[position] != rid:
            self._violate("ADMISSION-ORDER", rid, f"KV load for a request that is not next in waiting "
                                                  f"{st.waiting_before[:position + 3]}")
        if len(st.sim_running) >= self.max_num_seqs:
            self._violate("MAX-NUM-SEQS", rid, f"examined with {len(st.sim_running)} running = max_num_seqs")
        if req.status not in ("WAITING", "PREEMPTED") or req.blocks or req.num_computed_tokens:
            self._violate("REMOTE-KV-LOADING", rid,
                          f"started a load for a request with status {req.status}, "
                          f"{req.num_computed_tokens} computed tokens and blocks {req.blocks}")
        # A request that still holds blocks keeps them (its table only
        # grows), so the shadow pool stays in step after the witness.
        held = len(req.blocks) if list(ev["block_ids"] or [])[:len(req.blocks)] == req.blocks else 0
        if ext <= 0 or hit + ext > req.num_tokens:
            self._violate("REMOTE-KV-LOADING", rid,
                          f"loads {ext} external tokens after a {hit}-token hit of {req.num_tokens} tokens")
        block_ids = list(ev["block_ids"] or [])
        n_hit = hit // self.bs
        self._check_prefix_hit(req, hit, block_ids)
        reserved = sum(self._remaining_blocks(self.reqs[r]) for r in self.inflight if r in self.reqs)
        reserved += _cdiv(1 + self.num_spec, self.bs) if self.num_spec else 0
        if (ev["reserved_blocks"] or 0) != reserved:
            self._violate("REMOTE-KV-RESERVATION", rid,
                          f"reserved {ev['reserved_blocks']} blocks, but in-flight prefills "
                          f"{list(self.inflight)} still need {reserved}")
        for i, block in enumerate(block_ids[held:], held):
            self._acquire(req, block, as_hit=i < n_hit)
        if len(req.blocks) != _cdiv(hit + ext, self.bs):
            self._violate("BLOCKS-COVER", rid,
                          f"table has {len(req.blocks)} blocks for {hit + ext} loaded tokens")
        if len(self.free_queue) < reserved:
            self._violate("REMOTE-KV-RESERVATION", rid,
                          f"the load left {len(self.free_queue)} free blocks, but in-flight prefills "
                          f"still need {reserved}")
        # Hit blocks keep their content; loaded blocks are cached only at promotion.
        req.registered = n_hit
        req.status = "WAITING_FOR_REMOTE_KVS"
        req.num_computed_tokens = hit + ext
        req.kv_done = req.kv_failed = False
        self.inflight[rid] = None
        self.result.prefix_hit_tokens += hit
        st.skipped.append(rid)
        self.deferred_waiting.add(rid)
        self._note(req, f"KV load: hit {hit} + {ext} external tokens into {block_ids}")

    def _on_kv_promote(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if req is None:
            self._violate("STATE-CONTINUITY", rid, "promoted an unknown or finished request")
            return
        position = len(st.admitted) + len(st.skipped)
        if position >= len(st.waiting_before) or st.waiting_before[position] != rid:
            self._violate("ADMISSION-ORDER", rid, f"promoted a request that is not next in waiting "
                                                  f"{st.waiting_before[:position + 3]}")
        if req.status != "WAITING_FOR_REMOTE_KVS" or not req.kv_done:
            self._violate("REMOTE-KV-LOADING", rid,
                          f"promoted with status {req.status} before its transfer was reported finished")
        computed = req.num_computed_tokens
        freed = list(ev["block_ids"] or [])
        if req.kv_failed and computed == 0:
            # Nothing valid arrived: every block goes back (no fence: vLLM
            # frees through the KV manager directly).
            if freed != req.blocks[::-1]:
                self._violate("FREE-ORDER", rid, f"freed {freed}, expected its table tail first "
                                                 f"{req.blocks[::-1]}")
            self._return_blocks(req.blocks[::-1], rid)
            req.blocks, req.registered = [], 0
        else:
            if freed:
                self._violate("REMOTE-KV-LOADING", rid, f"promotion freed {freed} after a valid load")
            self._register_full_blocks(req, computed)
        if computed == req.num_tokens:
            computed = req.num_tokens - 1  # the last token is recomputed to sample the next
        status = "PREEMPTED" if req.num_preemptions else "WAITING"
        if ev["num_computed_tokens"] != computed or ev["status"] != status:
            self._violate("REMOTE-KV-LOADING", rid,
                          f"promoted to {ev['status']} with {ev['num_computed_tokens']} computed tokens; "
                          f"expected {status} with {computed}")
        req.status, req.num_computed_tokens = status, computed
        req.kv_done = req.kv_failed = False
        self._note(req, f"promoted ({ev['message']}): {computed} computed tokens")

    def _on_kv_invalid(self, ev: dict, st: _StepState) -> None:
        """Failed loads: each loading request's computed count drops to the
        blocks before its first invalid block."""
        invalid = set(ev["block_ids"] or [])
        hit_blocks: set[int] = set()
        for rid, req in self.reqs.items():
            if req.status != "WAITING_FOR_REMOTE_KVS":
                continue
            for index, block in enumerate(req.blocks[:_cdiv(req.num_computed_tokens, self.bs)]):
                if block in invalid:
                    hit_blocks.add(block)
                    req.num_computed_tokens = index * self.bs
                    req.kv_failed = True
                    st.kv_failed.append(rid)
                    self.result.failed_kv_loads += 1
                    self._note(req, f"KV load failed at block {block}: {req.num_computed_tokens} valid tokens")
                    break
        # A load whose request finished while loading may fail too; its
        # request is gone from the queues, so nothing changes (vLLM scans
        # only the waiting requests).
        for req in self.kv_abandoned.values():
            hit_blocks.update(b for b in req.blocks if b in invalid)
        if invalid - hit_blocks:
            self._violate("REMOTE-KV-LOADING", None,
                          f"invalid blocks {sorted(invalid - hit_blocks)} belong to no KV load in flight")

    def _on_kv_finished(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        if rid in self.kv_abandoned:
            st.kv_free_due.add(rid)
            return
        req = self.reqs.get(rid)
        if req is None or req.status != "WAITING_FOR_REMOTE_KVS" or req.kv_done:
            self._violate("REMOTE-KV-LOADING", rid, "transfer reported finished for a request not loading")
            return
        req.kv_done = True

    def _on_kv_free(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        req = self.kv_abandoned.pop(rid, None)
        if req is None or rid not in st.kv_free_due:
            self._violate("REMOTE-KV-ABORT-HOLDS", rid,
                          "freed the blocks of a finished request whose transfer was not reported done")
            if req is None:
                return
        st.kv_free_due.discard(rid)
        self._release_all(req, list(ev["block_ids"] or []), "finish", ev.get("fence"))

    def _on_update_begin(self, ev: dict, st: _StepState) -> None:
        """The oldest batch in flight is processed: its tokens leave flight."""
        if not self.batches:
            self._violate("STATE-CONTINUITY", None, "update of a batch that was never scheduled")
            st.batch = _Batch(-1, [], {}, {}, {}, 0)
            return
        batch = st.batch = self.batches.popleft()
        st.enc.cursor, st.enc.update_done = 0, not self.enc_active
        if ev["batch_step"] != batch.step:
            self._violate("STATE-CONTINUITY", None,
                          f"update of the batch of step {ev['batch_step']}, but the oldest in flight "
                          f"is from step {batch.step}")
        for rid in batch.scheduled:
            req = self.reqs.get(rid)
            if req is None:
                continue
            req.in_flight -= batch.tokens[rid]
            if req.stale > 0:
                st.stale.add(rid)
                req.stale -= batch.tokens[rid]
        if self.defer and batch.total > 0:
            self.processed_seq += 1
            st.expected_drains = 0
            for fence, _, _ in self.deferred:
                if fence > self.processed_seq:
                    break
                st.expected_drains += 1

    def _on_free_drain(self, ev: dict, st: _StepState) -> None:
        blocks, fence = list(ev["block_ids"] or []), ev["fence"]
        if not self.deferred or st.drains >= st.expected_drains:
            self._violate("DEFERRED-FREE-FENCED", None,
                          f"drained blocks {blocks} (fence {fence}) before processed_step_seq "
                          f"{self.processed_seq} reached a pending fence")
            return
        head_fence, head_blocks, holder = self.deferred.popleft()
        st.drains += 1
        self.result.deferred_frees += 1
        if (fence, blocks) != (head_fence, head_blocks):
            self._violate("DEFERRED-FREE-FENCED", None,
                          f"drained (fence {fence}, {blocks}); the oldest deferred free is "
                          f"(fence {head_fence}, {head_blocks})")
        self._return_blocks(head_blocks, holder)

    def _on_output(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        tokens = list(ev["token_ids"] or [])
        if rid not in st.batch.scheduled:
            self._violate("OUTPUT-ONLY-COMPLETE", rid, "output for a request not in the processed batch")
            return
        if self.enc_active:
            self._enc_update_until(st, rid)
        if req is None:
            return  # finished (e.g. stopped by an earlier batch) while in flight: ignored
        st.outputs.add(rid)
        drafts = st.batch.drafts.get(rid, [])
        end = st.batch.ends[rid]
        if end - len(drafts) < req.num_tokens or not 1 <= len(tokens) <= 1 + len(drafts):
            self._violate("OUTPUT-ONLY-COMPLETE", rid,
                          f"{len(tokens)} token(s) sampled by a step reaching {end} of "
                          f"{req.num_tokens} tokens + {len(drafts)} drafts")
        stale = rid in st.stale
        accepted = len(tokens) - 1
        if tokens[:accepted] != drafts[:accepted]:
            self._violate("SPEC-ACCEPTANCE", rid,
                          f"sampled {tokens} does not start with the accepted drafts {drafts[:accepted]}")
        if not stale:
            # Rejected drafts roll back (placeholders with them).
            rejected = max(len(drafts) - accepted, 0)
            if req.num_computed_tokens > 0:
                req.num_computed_tokens -= rejected
            if req.placeholders > 0:
                req.placeholders -= rejected
        self.result.draft_tokens += len(drafts)
        self.result.rejected_draft_tokens += max(len(drafts) - accepted, 0)
        if req.items:
            self._enc_free_passed(req)  # after the rollback, before the new tokens
        had_placeholders = req.placeholders > 0
        stop = None
        for i, token in enumerate(tokens):
            req.token_ids.append(token)
            if token == req.eos_token_id or token in req.stop_token_ids:
                stop = "stop"
            elif req.num_tokens >= self.max_model_len or req.num_output_tokens >= req.max_tokens:
                stop = "length"
            if stop:
                if not stale:
                    req.num_computed_tokens -= len(tokens) - 1 - i
                break
        if not stale and req.placeholders > 0:
            req.placeholders -= len(tokens)
            if req.placeholders < 0:
                self._violate("ASYNC-PLACEHOLDERS", rid, f"num_output_placeholders fell to {req.placeholders}")
                req.placeholders = 0
        st.expected_stop[rid] = stop
        if stop and req.items:
            self._enc_on_finish(req)  # freed when it stops, before later requests' frees
        if not stale and req.status == "RUNNING" and (had_placeholders or self.num_spec > 0):
            # 0.33.0 caches at update too (blocks completed by accepted tokens).
            self._register_full_blocks(req, req.num_computed_tokens - req.in_flight)
        self._note(req, f"sampled {tokens}" + (f" (drafts {drafts})" if drafts else "")
                        + (" [stale, delivered]" if stale else "")
                        + (f" -> must stop ({stop})" if stop else ""))

    def _on_draft(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        drafts = list(ev["spec_token_ids"] or [])
        if req is None:
            self._violate("SPEC-TOKENS", rid, "drafts stored for an unknown or finished request")
            return
        if req.prefill_chunk or len(drafts) != self.num_spec:
            self._violate("SPEC-TOKENS", rid,
                          f"stored {len(drafts)} drafts (num_speculative_tokens {self.num_spec}) "
                          f"while {'prefilling' if req.prefill_chunk else 'decoding'}")
        req.spec_token_ids = drafts

    def _on_finish(self, ev: dict, st: _StepState) -> None:
        rid = ev["request_id"]
        expected = st.expected_stop.get(rid)
        req = self.reqs.get(rid)
        if ev["status"] == "FINISHED_ERROR":
            if rid not in st.kv_failed or self.recompute_kv:
                self._violate("REMOTE-KV-LOADING", rid,
                              "finished with FINISHED_ERROR without a failed KV load under policy 'fail'")
        elif req is not None and expected != ev["finish_reason"]:
            self._violate("STOP-RULES", rid,
                          f"finished with {ev['finish_reason']!r} but check_stop gives {expected!r} "
                          f"({req.num_output_tokens} outputs, max_tokens {req.max_tokens})")
        if self._finish(ev, "finish") is not None:
            self.result.finished += 1
            st.finished.add(rid)

    def _on_update_end(self, ev: dict, st: _StepState) -> None:
        for rid, stop in st.expected_stop.items():
            if stop is not None and rid not in st.finished:
                self._violate("STOP-RULES", rid, f"check_stop gives {stop!r} but the request did not finish")
        for rid in st.batch.scheduled:
            req = self.reqs.get(rid)
            if req is None or rid in st.outputs:
                continue
            end = st.batch.ends[rid] - len(st.batch.drafts.get(rid, []))
            if end >= req.num_tokens:
                self._violate("OUTPUT-ONLY-COMPLETE", rid,
                              f"its step reached {end} of {req.num_tokens} tokens but sampled nothing")
        if not self.recompute_kv:
            for rid in st.kv_failed:
                if rid not in st.finished:
                    self._violate("REMOTE-KV-LOADING", rid,
                                  "its KV load failed under kv_load_failure_policy 'fail' but it did not "
                                  "finish with FINISHED_ERROR")
        for rid in st.kv_free_due:
            self._violate("REMOTE-KV-ABORT-HOLDS", rid,
                          "its transfer finished after it was finished, but its blocks were not freed")
        if st.drains < st.expected_drains:
            self._violate("DEFERRED-FREE-FENCED", None,
                          f"{st.expected_drains - st.drains} deferred frees whose fence passed "
                          f"(processed_step_seq {self.processed_seq}) were not drained")
        self.prev_running = [r for r in self.prev_running if r not in st.finished]
        self._conservation("update_end", ev["num_free_blocks"])

    def finish(self) -> CheckResult:
        """Close the pass: liveness over the whole trace."""
        for rid, req in self.reqs.items():
            self._violate("LIVENESS", rid, f"still {req.status} with {req.num_output_tokens} outputs "
                                           f"at the end of the trace")
        for rid, req in self.kv_abandoned.items():
            self._violate("REMOTE-KV-ABORT-HOLDS", rid,
                          f"finished while loading; its blocks {req.blocks} were never freed")
        return self.result


@dataclass
class _StepState:
    arrived: list[str] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    running_before: list[str] = field(default_factory=list)
    waiting_before: list[str] = field(default_factory=list)
    sim_running: list[str] = field(default_factory=list)
    eligible: int = 0
    preempted: list[str] = field(default_factory=list)
    scheduled: list[str] = field(default_factory=list)
    scheduled_tokens: dict[str, int] = field(default_factory=dict)
    withdrawn: list[str] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    last_running_index: int = -1
    total: int = 0
    outputs: set[str] = field(default_factory=set)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    expected_stop: dict[str, str | None] = field(default_factory=dict)
    finished: set[str] = field(default_factory=set)
    skipped: list[str] = field(default_factory=list)
    ends: dict[str, int] = field(default_factory=dict)  # computed + scheduled, per request
    placeholders_added: dict[str, int] = field(default_factory=dict)
    registered_before: dict[str, int] = field(default_factory=dict)  # req.registered before its schedule
    batch: _Batch | None = None  # the batch this step's update processes
    stale: set[str] = field(default_factory=set)
    expected_drains: int = 0
    drains: int = 0
    defer: bool = False  # this step must defer prefill compute
    prefill_scheduled: bool = False
    prefill_admitted: bool = False
    kv_failed: list[str] = field(default_factory=list)  # loads reported failed in this update
    kv_free_due: set[str] = field(default_factory=set)  # finished-while-loading, transfer now done
    running_scheduled: set[str] = field(default_factory=set)  # running-loop requests scheduled (kept)
    enc: EncoderStep = field(default_factory=EncoderStep)  # encoder inputs (harness.check.encoder)


@dataclass
class _Batch:
    """A scheduled batch waiting for its output (FIFO, up to max_concurrent_batches)."""

    step: int
    scheduled: list[str]
    tokens: dict[str, int]
    drafts: dict[str, list[int]]
    ends: dict[str, int]
    total: int


def check_steps(config: dict[str, Any], steps: Iterable[tuple[int, list[dict[str, Any]]]]) -> CheckResult:
    """Run every invariant over ``steps`` (as yielded by ``Trace.iter_steps``).

    With data parallelism each rank's rows go to its own checker (its own
    scheduler and KV pool), and the coordinator's routing is checked across
    ranks; the results are merged.
    """
    dp = config.get("data_parallel_size", 1)
    if dp == 1:
        checker = TraceChecker(config)
        for step, events in steps:
            checker.check_step(step, events)
        return checker.finish()
    checkers = [TraceChecker(config) for _ in range(dp)]
    for checker in checkers:
        checker.interval = 1  # the cadence is the coordinator's throttle flag
        checker.dp_interval = config.get("prefill_schedule_interval", 1)
    routing = TraceChecker(config)  # collects coordinator violations only
    num_steps = 0
    for step, events in steps:
        num_steps += 1
        routing.step = step
        _check_routing(routing, checkers, events)
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for ev in events:
            by_rank.setdefault(ev.get("rank") or 0, []).append(ev)
        for rank, rank_events in sorted(by_rank.items()):
            if not 0 <= rank < dp:
                routing._violate("DP-ROUTING", None, f"row for rank {rank} with data_parallel_size {dp}")
                continue
            checkers[rank].check_step(step, rank_events)
    results = [c.finish() for c in checkers] + [routing.result]
    merged = CheckResult(steps=num_steps)
    for r in results:
        for name in ("requests", "finished", "rejected", "aborted", "preemptions", "prefix_hit_tokens",
                     "draft_tokens", "rejected_draft_tokens", "deferred_frees",
                     "deferred_prefill_steps", "remote_kv_loads", "failed_kv_loads", "events",
                     "num_violations"):
            setattr(merged, name, getattr(merged, name) + getattr(r, name))
        merged.violations += r.violations
        for inv, count in r.by_invariant.items():
            merged.by_invariant[inv] = merged.by_invariant.get(inv, 0) + count
    return merged


def _check_routing(routing: TraceChecker, checkers: list[TraceChecker], events: list[dict]) -> None:
    """The coordinator routes each arrival, in (arrival_time, id) order, to the
    rank with the fewest unfinished requests (ties: the lowest rank)."""
    load = [len(c.reqs) for c in checkers]
    arrivals = sorted((ev for ev in events if ev["kind"] == "arrival"),
                      key=lambda ev: (ev["arrival_time_s"], ev["request_id"]))
    for ev in arrivals:
        rank = ev.get("rank") or 0
        expected = min(range(len(load)), key=lambda i: (load[i], i))
        if rank != expected:
            routing._violate("DP-ROUTING", ev["request_id"],
                             f"routed to rank {rank}, but rank {expected} had the fewest unfinished "
                             f"requests (loads {load})")
        if 0 <= rank < len(load):
            load[rank] += 1
