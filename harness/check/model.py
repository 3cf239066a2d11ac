"""The checker's model: what the trace implies, rebuilt from its rows alone.

``TraceModel`` holds the shadow state that every invariant family reads and
that the event handlers (``harness.check.checker``) update:

- per request (``ReqShadow``): status, tokens, ``num_computed_tokens``, block
  table, chained block hashes, pending drafts, async placeholders and tokens
  in flight, stale output, KV-load flags, encoder inputs, recent history;
- blocks: owners (ref counts are the owner sets), the free queue in the order
  the frees imply (spec 5.2), what each full block caches (registered at
  vLLM 0.33.0's moments, ``content``), what KV each full block holds
  whenever an engine might register it (``written``), blocks cached but
  never computed (PRIORITY give-back), blocks whose content a prefix-cache
  reset forgot;
- batches in flight (``Batch``, FIFO), deferred-free fences and their FIFO;
- prefill gating (capacity guard, cadence), KV-connector queues and loads;
- the encoder cache (``harness.check.encoder_cache.ShadowEncoderCache``);
- per step (``StepState``): what this step's rows said so far.

The model's methods only update state (and ``violate`` records a witness);
they judge nothing. Memory is bounded by live requests and the pool, not by
trace length.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, MutableSequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from harness.check.encoder_cache import EncoderStep, Item, ShadowEncoderCache, block_extra_keys
from harness.check.result import MAX_PER_INVARIANT, CheckResult, Violation

if TYPE_CHECKING:
    from harness.check.profiles import Profile

HISTORY = 8  # events kept per request for a witness


@dataclass
class ReqShadow:
    """A live request as the trace implies it (vLLM ``Request``); tokens in tokens."""

    request_id: str
    priority: int
    arrival_time: float
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    # Prompt then outputs: array("i") from arrival (``compact_tokens``: 4 bytes a token,
    # what a backlog of thousands of waiting prompts holds), array("q") from the
    # first block hash or output on (``wide_tokens``).
    token_ids: MutableSequence[int]
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
    # A hybrid model (harness.check.hybrid): each KV-cache group's table (the
    # null block as 0) and its leading blocks whose content is recorded.
    groups: list[list[int]] | None = None
    group_registered: list[int] = field(default_factory=list)
    # Bounded replay (vLLM 0.33.0 swa_bounded_replay), from the latest fresh
    # admission: the bounded-replay groups' leading null slots (wholly before
    # the replay's start: hybrid.replay_null_slots) and the hit's end in tokens, whose blocks
    # the request holds while it recomputes the hit's last window.
    replay_nulls: int = 0
    replay_end: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class Batch:
    """A scheduled batch waiting for its output (FIFO, up to max_concurrent_batches)."""

    step: int
    scheduled: list[str]
    tokens: dict[str, int]
    drafts: dict[str, list[int]]
    ends: dict[str, int]
    total: int


@dataclass
class StepState:
    """What the current step's rows said so far (reset every step)."""

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
    # Victims the rows leave in num_scheduled_tokens (no withdraw before
    # their preempt row): out of ``scheduled`` in the shadow, kept here.
    kept_victims: list[str] = field(default_factory=list)
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
    batch: Batch | None = None  # the batch this step's update processes
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
    # A reset_prefix_cache action of this step (before schedule_begin):
    # (succeeded, forced) until resolved, the victims a forced reset still
    # has to preempt (tail of running first), and those it preempted.
    reset: tuple[bool, bool] | None = None
    reset_victims: list[str] = field(default_factory=list)
    reset_preempted: list[str] = field(default_factory=list)
    # The progress layer's facts of this step (harness.check.progress.ProgressStep).
    progress: Any = None
    # OUTPUT-ORDER: requests with an output row in this update, and the
    # highest scheduling index of the processed batch seen so far.
    output_seen: set[str] = field(default_factory=set)
    output_index: int = -1
    batch_positions: dict[str, int] | None = None  # request -> index in batch.scheduled (built once)
    # PREEMPT-EFFECTS (schema 6): victims with a request_state row after schedule_end.
    state_rows: set[str] = field(default_factory=set)


def compact_tokens(tokens: Iterable[int]) -> array:
    """A new request's prompt as array("i") (4 bytes a token: a trace stores
    token ids as int32), or array("q") when one does not fit (rows built in
    memory, never read from a trace)."""
    try:
        return array("i", tokens)
    except OverflowError:
        return array("q", tokens)


def wide_tokens(req: ReqShadow) -> MutableSequence[int]:
    """``req.token_ids`` as array("q"), converted once (a request being
    scheduled, hashed or given outputs: ``chain_hash`` hashes int64 slices
    without a conversion, and any output token fits)."""
    tokens = req.token_ids
    if tokens.typecode != "q":
        tokens = req.token_ids = array("q", tokens)
    return tokens


def chain_hash(parent: bytes | None, tokens: list[int], extra: tuple | None = None) -> bytes:
    """A full block's content hash, chained on its parent's (vLLM ``hash_block_tokens``)."""
    h = hashlib.sha256(parent or b"root")
    h.update(array("q", tokens).tobytes())
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TraceModel:
    """The shadow state of one rank's scheduler and KV pool (see the module
    docstring); ``config`` is the trace's engine config dict."""

    def __init__(self, config: dict[str, Any], profile: Profile | None = None, *,
                 observed: bool = False) -> None:
        # The trace is known to record what each step leaves behind (schema
        # 6 read from a file): a missing observation is then a violation.
        self.observed = observed
        # The semantics profile: which version-design rules count, and how
        # the free queue takes freed blocks (harness.check.profiles).
        if profile is None:
            from harness.check.profiles import reference_profile  # the profiles import the catalogue

            profile = reference_profile()
        self.profile = profile
        self.checked = frozenset(self.profile.checked)
        self.free_unhashed_to_head = self.profile.free_unhashed_to_head
        self.bs: int = config["block_size"]
        # A hybrid model's KV-cache groups: each one's window (None: full
        # attention); None for one full-attention group (harness.check.hybrid).
        from harness.check.hybrid import group_windows_of, mamba_groups_of

        self.group_windows: list[int | None] | None = group_windows_of(config)
        # Mamba groups: group -> state blocks per request (harness.check.hybrid).
        self.mamba_groups: dict[int, int] = mamba_groups_of(config) if self.group_windows is not None else {}
        # Bounded-replay groups (vLLM 0.33.0 swa_bounded_replay: no prefix cache,
        # a hit's last prefix_replay_tokens recomputed at admission).
        from harness.check.hybrid import replay_groups_of

        self.replay_groups, self.prefix_replay_tokens = (
            replay_groups_of(config) if self.group_windows is not None else (frozenset(), 0))
        # Each group's admission cap in blocks (a sliding window's; None: none).
        from harness.check.hybrid import group_caps_of

        self.group_caps: list[int | None] = group_caps_of(config) if self.group_windows is not None else []
        # Requests whose recorded connector's load restored the window groups
        # (config kv_connector_window_loads: some answer True): no replay.
        self.window_loaded: frozenset[str] = frozenset(
            r for r, answers in config.get("kv_connector_window_loads") or () if any(answers))
        self.num_gpu_blocks: int = config["num_gpu_blocks"]
        self.max_model_len: int = config["max_model_len"]
        self.max_num_seqs: int = config["max_num_seqs"]
        self.token_budget: int = config.get("max_num_scheduled_tokens") or config["max_num_batched_tokens"]
        self.threshold: int = config.get("long_prefill_token_threshold", 0)
        self.caching: bool = config["enable_prefix_caching"]
        self.policy: str = config["policy"]
        self.num_spec: int = config.get("num_speculative_tokens", 0)
        # A drafter's look-ahead KV slots past each step's tokens (config
        # num_lookahead_tokens, vLLM 0.33.0 Scheduler.num_lookahead_tokens).
        self.num_lookahead: int = config.get("num_lookahead_tokens", 0) or 0
        self.async_scheduling: bool = config.get("async_scheduling", False)
        self.depth: int = config.get("max_concurrent_batches", 1)
        self.defer: bool = config.get("defer_block_free", False)
        # Batches scheduled but not yet processed, oldest first.
        self.batches: deque[Batch] = deque()
        # Deferred frees (spec 5.10): sequence numbers and the FIFO of
        # (fence, blocks in free order); their blocks stay held until drained.
        self.sched_seq = 0
        self.processed_seq = 0
        self.deferred: deque[tuple[int, list[int], str]] = deque()  # (fence, blocks, holder)
        # Prefill gating (spec 7.1, 10.4), recomputed from the trace.
        self.interval: int = (config.get("prefill_schedule_interval", 1)
                              if self.profile.local_prefill_cadence else 1)
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
        # Recorded encoder-input identifiers per request (config mm_identifiers;
        # absent: derived from the prompt tokens, harness.check.encoder_cache).
        self.mm_identifiers: dict[str, list[str]] = {r: ids for r, ids in config.get("mm_identifiers") or ()}
        # LoRA (config max_loras, lora_int_ids): a waiting request may be skipped
        # because its adapter would exceed max_loras (harness.check.fences).
        self.max_loras: int | None = config.get("max_loras")
        self.lora_int_ids: dict[str, int] = {r: i for r, i in config.get("lora_int_ids") or ()}
        # The request ids those two keys name that no arrival or reject row has
        # shown yet, by key (empty without them): what is left at the end of the
        # whole trace names no request of it (``unknown_config_ids_notes``).
        self.unseen_config_ids: dict[str, set[str]] = {
            key: set(ids) for key, ids in (("mm_identifiers", self.mm_identifiers),
                                           ("lora_int_ids", self.lora_int_ids)) if ids}
        self.watermark: float = config.get("watermark", 0.0)  # admissions' reserve (harness.check.progress)
        self.peak_running = 0  # the most requests running after a step so far (harness.check.progress)
        self.recompute_kv: bool = config.get("kv_load_failure_policy", "recompute") == "recompute"
        # A recorded connector's answers (config ``kv_connector_matches``):
        # request id -> its answers in call order, ``(external tokens or None,
        # load_kv_async)``, and the index of the first one no event has used
        # yet (harness.check.kv_connector.take_answer: admissions and "cannot
        # tell yet" skips use them in order; the simulated connector has none).
        self.kv_answers: dict[str, tuple[tuple[int | None, bool], ...]] = {
            req_id: tuple((ext, bool(load_async)) for ext, load_async in answers)
            for req_id, answers in config.get("kv_connector_matches") or ()}
        self.kv_next_answer: dict[str, int] = {}
        self.kv_queue: set[str] = set()
        self.inflight: dict[str, None] = {}
        self.kv_abandoned: dict[str, ReqShadow] = {}
        self.result = CheckResult()
        self.reqs: dict[str, ReqShadow] = {}
        self.owners: dict[int, set[str]] = {}
        # The free queue as the trace implies it, head first (spec 5.2).
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, self.num_gpu_blocks))
        self.free_queue_known = True  # false after the first ALLOC-FROM-HEAD violation
        # BLOCK-CONSERVATION's witness: the last row that carried num_free_blocks
        # (where, step, count), and what changed the free queue since, in order:
        # {(what, request id): [blocks named, change of the free count]}.
        self.free_seen: tuple[str, int, int] | None = None
        self.free_changes: dict[tuple[str, str], list[int]] = {}
        # (engine's free count - the inferred one, the row where it appeared) while it lasts.
        self.free_gap: tuple[int, str] | None = None
        self.zero_step_state: tuple | None = None  # queues of the last zero-token step
        # Full blocks: content chain hash per block, and blocks per content.
        self.content: dict[int, bytes] = {}
        self.cached: dict[bytes, set[int]] = {}
        # Full blocks whose KV holds a request's prefix block (its chain hash)
        # although the model has not registered them at a vLLM moment: the
        # tokens are known and their KV scheduled by a step that ran or runs
        # before any later one (``note_written``). A hit on such a block is
        # safe (PREFIX-HIT-RULES); vLLM's registration timing is
        # PREFIX-HIT-LONGEST's (semantics), which reads ``cached`` only.
        self.written: dict[int, bytes] = {}
        # Blocks the pool still treats as cached (hashed) although their KV
        # was never computed: cached by a chunk that a PRIORITY give-back
        # withdrew (block -> the withdrawn request).
        self.uncomputed: dict[int, str] = {}
        # Blocks whose cached content a successful prefix-cache reset forgot
        # (block -> the step of that reset), until a fresh allocation.
        self.reset_forgotten: dict[int, int] = {}
        self.finished_since_schedule: set[str] = set()
        self.prev_running: list[str] = []
        self.prev_waiting: list[str] = []
        # Following the backlog by its stored changes (issue 24; ``harness.check.queues.follow_waiting``):
        # the reader's changes of each rebuilt waiting list (``harness.trace.queues.QueueChange``, by id
        # of the list; None: rows without them, every rule then reads the whole lists), and how many
        # times each id occurs in ``waiting_indexed``, the last snapshot's waiting list.
        self.queue_changes: dict[int, Any] | None = None
        self.waiting_counts: dict[str, int] | None = None
        self.waiting_indexed: list[str] | None = None
        self.step = -1
        self.step_rows: list[dict[str, Any]] = []  # the current step's rows (a crash's witness)
        self.crashed = False  # a crash row was seen: the run ended there
        # Encoder inputs (spec 3.2 step 8, 10.5); sizes in embeds.
        mnbt = config["max_num_batched_tokens"]
        self.max_num_batched_tokens: int = mnbt
        self.chunked_prefill: bool = config.get("enable_chunked_prefill", True)
        self.enc_budget: int = config.get("max_num_encoder_input_tokens") or mnbt
        self.enc_cache_size: int = config.get("encoder_cache_size") or mnbt
        self.enc_no_chunk: bool = config.get("disable_chunked_mm_input", False)
        # A drafter's prefill look-ahead, tokens (config num_prefill_lookahead; vLLM
        # 0.33.0): the encoder window reaches this far past a step's tokens and a
        # prefill chunk never ends within it of the prefill's end.
        self.prefill_lookahead: int = config.get("num_prefill_lookahead", 0) or 0
        self.enc = ShadowEncoderCache(self.enc_cache_size)
        self.enc_active = False  # some request carried encoder inputs
        self.enc_known = True    # false after the shadow stopped matching the trace

    # -- reporting -------------------------------------------------------------
    def violate(self, invariant: str, request: str | None, message: str,
                history: list[str] | None = None) -> None:
        """Record a witness of ``invariant`` (an id of the catalogue) at the
        current step; ``history``: its context lines (default: the request's
        last events)."""
        from harness.check.invariants import INVARIANTS  # the catalogue imports the families

        assert invariant in INVARIANTS, invariant
        if invariant not in self.checked:
            return  # a semantics rule the profile does not hold this engine to
        self.result.num_violations += 1
        counts = self.result.by_invariant
        counts[invariant] = counts.get(invariant, 0) + 1
        # Keep the first few witnesses of *each* invariant, so one noisy rule
        # cannot hide another.
        if counts[invariant] > MAX_PER_INVARIANT:
            return
        if history is None:
            req = self.reqs.get(request) if request else None
            history = list(req.history) if req else []
        self.result.violations.append(Violation(invariant, self.step, request, message, history))

    def note(self, req: ReqShadow, text: str) -> None:
        req.history.append(f"step {self.step}: {text}")

    # -- blocks (updates only) -------------------------------------------------
    def held(self) -> int:
        """Distinct blocks held by a request or a deferred-free entry."""
        return len(self.owners)

    def take_block(self, req: ReqShadow, block: int, as_hit: bool) -> None:
        """``req`` takes ``block``: a hit unlinks it from the free queue; a fresh
        allocation also evicts whatever the block cached before."""
        holders = self.owners.setdefault(block, set())
        if block in self.free_queue:
            del self.free_queue[block]
            self._free_changed("take", req.request_id, 1, -1)
        if not as_hit:
            self.uncomputed.pop(block, None)
            self.reset_forgotten.pop(block, None)
            self.written.pop(block, None)
            old = self.content.pop(block, None)
            if old is not None:
                self.cached[old].discard(block)
                if not self.cached[old]:
                    del self.cached[old]
        holders.add(req.request_id)
        req.blocks.append(block)

    def defer_blocks(self, req: ReqShadow, ordered: list[int], fence: int) -> None:
        """A deferred free: the fence entry takes the request's references.
        Each entry keeps its own reference: two entries may share a prefix
        block, which returns only when both drained."""
        holder = f"<deferred free of {req.request_id}, fence {fence}>"
        for block in ordered:
            holders = self.owners.setdefault(block, set())
            holders.discard(req.request_id)
            holders.add(holder)
        self.deferred.append((fence, ordered, holder))

    def _free_changed(self, what: str, rid: str, named: int, change: int) -> None:
        """Log for BLOCK-CONSERVATION's witness: ``what`` of request ``rid``
        named ``named`` blocks and changed the free count by ``change``."""
        entry = self.free_changes.setdefault((what, rid), [0, 0])
        entry[0] += named
        entry[1] += change

    def return_blocks(self, ordered: list[int], holder: str, what: str = "free") -> None:
        """Drop ``holder``'s references in ``ordered`` order; blocks reaching
        ref 0 enter the free queue: unhashed (or caching off) to the head, in
        that order; hashed to the tail (spec 5.2). Under a profile without
        ``free_unhashed_to_head`` (vLLM 0.20.2) every block goes to the tail.
        ``what`` (finish, abort, preempt, ...) names the free in BLOCK-CONSERVATION's
        witness."""
        free_before = len(self.free_queue)
        to_head: list[int] = []
        to_tail: list[int] = []
        for block in ordered:
            holders = self.owners.get(block)
            if holders is None:
                continue
            holders.discard(holder)
            if not holders:
                del self.owners[block]
                hashed = block in self.content or block in self.uncomputed
                (to_head if self.free_unhashed_to_head and not hashed else to_tail).append(block)
        for block in reversed(to_head):
            self.free_queue[block] = None
            self.free_queue.move_to_end(block, last=False)
        for block in to_tail:
            self.free_queue[block] = None
        self._free_changed(what, holder, len(ordered), len(self.free_queue) - free_before)

    def forget_cache(self) -> None:
        """A successful prefix-cache reset (vLLM ``BlockPool.reset_prefix_cache``):
        every block's hash is cleared, so nothing cached stays reusable.
        The free queue keeps its order (vLLM leaves it untouched); a block
        freed later, now unhashed, goes to the head. A request's registered
        count stays (vLLM's ``num_cached_block`` does): only a faulty reset
        leaves a request holding blocks, whose full blocks stay unhashed."""
        for block in list(self.content) + list(self.uncomputed):
            self.reset_forgotten[block] = self.step
        self.content.clear()
        self.cached.clear()
        self.uncomputed.clear()
        self.written.clear()

    def extend_chain(self, req: ReqShadow, n_blocks: int) -> None:
        """Content hashes of the request's first ``n_blocks`` full blocks."""
        tokens = wide_tokens(req) if len(req.chain) < n_blocks else req.token_ids
        while len(req.chain) < n_blocks:
            i = len(req.chain)
            extra = block_extra_keys(req.items, i * self.bs, (i + 1) * self.bs) if req.items else None
            req.chain.append(chain_hash(req.chain[-1] if req.chain else None,
                                        tokens[i * self.bs:(i + 1) * self.bs], extra))

    def register_full_blocks(self, req: ReqShadow, upto_tokens: int) -> None:
        """Record the content of the request's blocks fully covered by
        ``upto_tokens`` (what vLLM caches eagerly at schedule time)."""
        if not self.caching:
            return
        if self.group_windows is not None:
            from harness.check.hybrid import register_full_blocks

            register_full_blocks(self, req, upto_tokens)
            return
        n_full = min(upto_tokens, req.num_tokens, len(req.blocks) * self.bs) // self.bs
        self.extend_chain(req, n_full)
        for i in range(req.registered, n_full):
            block = req.blocks[i]
            if block not in self.content:
                self.content[block] = req.chain[i]
                self.cached.setdefault(req.chain[i], set()).add(block)
        req.registered = max(req.registered, n_full)

    def note_written(self, req: ReqShadow, upto_tokens: int) -> None:
        """Record in ``written`` the KV content (chain hash) of the request's
        full blocks covered by ``upto_tokens`` (a token count: KV scheduled,
        not withdrawn) whose tokens are all known, beyond those registered
        (``req.registered``). The moment an engine registers such a block in
        its prefix cache is its own (vLLM 0.33.0 caches at allocation and at
        update, a fork may cache only after the output: adversarial trial,
        finding 3); any of them is safe, since the block holds that KV until
        it is allocated afresh. A one-group full-attention model only (a
        hybrid model's groups register as ``harness.check.hybrid`` says)."""
        if not self.caching or self.group_windows is not None:
            return
        n_full = min(upto_tokens, req.num_tokens, len(req.blocks) * self.bs) // self.bs
        self.extend_chain(req, n_full)
        for i in range(req.registered, n_full):
            block = req.blocks[i]
            if self.content.get(block) != req.chain[i]:
                self.written[block] = req.chain[i]

    def unregister_withdrawn(self, req: ReqShadow, registered_before: int) -> None:
        """The withdrawn chunk never runs: blocks its scheduling registered
        (eagerly, vLLM caches at allocation) hold no computed KV. Forget their
        content and mark them uncomputed, so a later prefix hit on them is seen."""
        if self.group_windows is not None:
            from harness.check.hybrid import unregister_withdrawn

            unregister_withdrawn(self, req, registered_before)
            return
        for i in range(registered_before, req.registered):
            block = req.blocks[i]
            if self.content.get(block) == req.chain[i]:
                del self.content[block]
                self.cached[req.chain[i]].discard(block)
                if not self.cached[req.chain[i]]:
                    del self.cached[req.chain[i]]
                self.uncomputed[block] = req.request_id
                self.written.pop(block, None)
        req.registered = min(req.registered, registered_before)

    def longest_cached_prefix(self, req: ReqShadow) -> int:
        """Tokens of the longest prefix whose full blocks are all cached,
        capped at num_tokens - 1 (the last token is always recomputed)."""
        max_blocks = (req.num_tokens - 1) // self.bs
        self.extend_chain(req, max_blocks)
        n = 0
        while n < max_blocks and self.cached.get(req.chain[n]):
            n += 1
        return n * self.bs

    # -- KV connector (spec 7.2) -----------------------------------------------
    def holds_kv(self, rid: str) -> bool:
        """The request sits in the kv-holding waiting queue (loading, or loaded)."""
        req = self.reqs.get(rid)
        return req is not None and (req.status == "WAITING_FOR_REMOTE_KVS" or req.num_computed_tokens > 0)

    def remaining_blocks(self, req: ReqShadow) -> int:
        """Blocks an in-flight prefill still needs for its whole sequence
        (plus one spec-decode step and its look-ahead): vLLM ``_request_remaining_blocks``."""
        num_tokens = min(req.num_tokens, self.max_model_len) + (1 + self.num_spec + self.num_lookahead
                                                                if self.num_spec else 0)
        if self.group_windows is not None:  # every group's table, a window's capped
            from harness.check.hybrid import remaining_blocks

            return remaining_blocks(self, req, num_tokens)
        return max(cdiv(num_tokens, self.bs) - len(req.blocks), 0)
