"""What a scheduler step decides, in normalised form.

Mirrors ``vllm/v1/core/sched/output.py`` (``SchedulerOutput``) and the
per-request results of ``update_from_output``, reduced to what decisions and
the trace need. Every candidate (reference, mutant, user code, real vLLM)
reports in these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reference.request import RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step, as the worker is told.

    ``kind``: "new" (first admission), "resumed" (admitted after preemption) or
    "running". ``num_computed_tokens`` is the value *before* this step (after
    the prefix lookup for admissions). ``new_block_ids``: blocks added to its
    table this step; for admissions the whole table, prefix hits first.
    ``encoder_input_ids``: its encoder inputs (indices into its
    ``mm_positions``) encoded this step (vLLM ``scheduled_encoder_inputs``).
    """

    request_id: str
    kind: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_prefix_hit_tokens: int
    new_block_ids: list[int]
    spec_token_ids: list[int] = field(default_factory=list)
    encoder_input_ids: list[int] = field(default_factory=list)
    # A hybrid model's (several KV-cache groups): each group's new blocks
    # (an admission: each group's whole table, null blocks as 0); None with
    # one group. ``new_block_ids`` is then every group's blocks in the order
    # they left the free queue, null blocks left out.
    group_block_ids: list[list[int]] | None = None


@dataclass
class EncoderPlan:
    """What ``_try_schedule_encoder_inputs`` decided for a request whose token
    window overlaps one of its encoder inputs, taken before KV allocation (so
    before any preemption that allocation causes): the window
    ``[num_computed_tokens, + num_scheduled_tokens)`` after it was cut (0:
    the request is skipped this step) and the inputs chosen to encode
    (``encoder_input_ids``). Cache hits were referenced and evictions done
    already. The request's ``ScheduledRequest`` follows if its allocation
    succeeds; otherwise a waiting request releases its encoder-cache
    references (vLLM ``encoder_cache_manager.free``) and a running one keeps
    them (it preempts itself, or the loop gives up)."""

    request_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    encoder_input_ids: list[int]


@dataclass
class Preemption:
    """A victim of the preemption loop: its computed count before, and the
    blocks it gave back in free order (tail first). ``fence`` is set when the
    free was deferred (spec 5.10): the blocks return to the pool only once
    ``processed_step_seq >= fence``."""

    request_id: str
    num_computed_tokens: int
    freed_block_ids: list[int]
    fence: int | None = None
    group_block_ids: list[list[int]] | None = None  # hybrid: each group's freed ids


@dataclass
class SkippedFree:
    """A hybrid model's sliding-window groups freed the blocks wholly before
    the window of the request's processed tokens (vLLM
    ``KVCacheManager.remove_skipped_blocks``, called by ``allocate_slots``
    before it allocates, whether or not the allocation then fits).
    ``group_block_ids``: each group's freed ids, last block first (their
    table slots now hold the null block); ``freed_block_ids``: them all, in
    group order (the order they entered the free queue)."""

    request_id: str
    freed_block_ids: list[int]
    group_block_ids: list[list[int]]


@dataclass
class Skip:
    """The waiting loop passed over a request (it stays at the head of its
    queue): ``reason`` says why, e.g. its stale output is still in flight."""

    request_id: str
    reason: str


@dataclass
class RemoteLoad:
    """An async KV-load admission (spec 7.2): the request took its local
    prefix hit (``num_prefix_hit_tokens``) plus blocks for
    ``num_external_tokens`` the connector will load, and entered
    WAITING_FOR_REMOTE_KVS; nothing is scheduled for it. ``block_ids`` is its
    whole table (hits first); ``reserved_blocks`` the free blocks the
    allocation had to leave for in-flight prefills. ``group_block_ids``: a
    hybrid model's (several KV-cache groups) whole table of each group, null
    blocks as 0 (None with one group); ``block_ids`` is then every group's
    non-null hit blocks, then every group's new blocks, as an admission's."""

    request_id: str
    num_prefix_hit_tokens: int
    num_external_tokens: int
    block_ids: list[int]
    reserved_blocks: int
    group_block_ids: list[list[int]] | None = None


@dataclass
class Promotion:
    """A finished async load promoted back to WAITING (or PREEMPTED): the
    loaded blocks are cached and ``num_computed_tokens`` is what the request
    resumes from (num_tokens - 1 for a whole-sequence load; the valid prefix
    after a failed load, whose blocks are all freed, ``freed_block_ids``, if
    nothing is valid). ``group_block_ids``: a hybrid model's freed blocks
    per group, each tail first (None with one group)."""

    request_id: str
    status: RequestStatus
    num_computed_tokens: int
    load_failed: bool
    freed_block_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] | None = None


@dataclass
class KVTransferFree:
    """Blocks of a request that finished while its KV load was in flight,
    freed once the transfer reported done (vLLM ``_free_blocks`` from
    ``_update_from_kv_xfer_finished``). ``group_block_ids``: a hybrid
    model's freed blocks per group, each tail first (None with one group)."""

    request_id: str
    freed_block_ids: list[int]
    fence: int | None = None
    group_block_ids: list[list[int]] | None = None


@dataclass
class Withdrawal:
    """PRIORITY give-back (spec 4.2): a request scheduled earlier in this step
    was chosen as a preemption victim; its ``num_scheduled_tokens`` return to
    the budget and it leaves the step's output. ``block_ids`` are the blocks
    that scheduling had added (they are freed by the preemption that follows).
    ``encoder_input_ids``: the encoder inputs it had scheduled, whose embeds
    return to the encoder compute budget.
    """

    request_id: str
    num_scheduled_tokens: int
    block_ids: list[int]
    encoder_input_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] | None = None  # hybrid: each group's blocks


@dataclass
class FinishedRequest:
    """A request that left the engine: why, and the blocks it freed (tail first)."""

    request_id: str
    status: RequestStatus
    finish_reason: str | None
    stop_reason: int | str | None
    num_output_tokens: int
    freed_block_ids: list[int]
    fence: int | None = None
    group_block_ids: list[list[int]] | None = None  # hybrid: each group's freed ids


@dataclass
class SchedulerOutput:
    """What ``schedule()`` decided (vLLM ``SchedulerOutput``, normalised).

    ``events`` keeps the order in which decisions were taken: ScheduledRequest,
    Withdrawal and Preemption items interleaved. A PRIORITY victim scheduled
    earlier in the step keeps its ScheduledRequest in ``events`` followed by a
    Withdrawal; it is absent from ``num_scheduled_tokens`` and ``scheduled``
    (what the worker is told). ``num_scheduled_tokens`` maps id -> tokens in
    scheduling order. ``token_budget`` is the budget left.
    """

    events: list[ScheduledRequest | Withdrawal | Preemption | Skip | RemoteLoad | Promotion
                 | EncoderPlan | SkippedFree]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]
    finished_req_ids: set[str]
    token_budget: int
    # Prefill gating (spec 7.1, 10.4): the throttle input, whether this step
    # deferred prefill compute, and the capacity guard after the step.
    throttle_prefills: bool = False
    defer_prefills: bool = False
    prefill_capacity_bound: bool = False
    # Encoder-cache entries evicted this step (vLLM free_encoder_mm_hashes:
    # identifiers, eviction order): the worker may drop their outputs.
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    # The ids the step's request data carries (vLLM: scheduled_new_reqs'
    # ids, then scheduled_cached_reqs.req_ids), kept apart from the keys of
    # num_scheduled_tokens: a correct scheduler gives both the same ids, each
    # once. None: the candidate does not say; ``data_ids`` derives them.
    request_data_ids: list[str] | None = None

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """The requests the worker runs this step, in scheduling order."""
        return [e for e in self.events
                if isinstance(e, ScheduledRequest) and e.request_id in self.num_scheduled_tokens]

    @property
    def data_ids(self) -> list[str]:
        """``request_data_ids``, or when the candidate left it None the ids
        of ``scheduled`` as vLLM's V1 model-runner layout orders its request
        data: new requests, then running, then resumed
        (``Scheduler._make_cached_request_data(running, resumed)``)."""
        if self.request_data_ids is not None:
            return list(self.request_data_ids)
        order = {"new": 0, "running": 1, "resumed": 2}
        return [e.request_id for e in sorted(self.scheduled, key=lambda e: order.get(e.kind, 1))]

    @property
    def scheduled_spec_decode_tokens(self) -> dict[str, list[int]]:
        """Drafts to verify per scheduled request (absent: none)."""
        return {e.request_id: e.spec_token_ids for e in self.scheduled if e.spec_token_ids}

    @property
    def scheduled_encoder_inputs(self) -> dict[str, list[int]]:
        """Encoder inputs to run per scheduled request (absent: none)."""
        return {e.request_id: e.encoder_input_ids for e in self.scheduled if e.encoder_input_ids}

    @property
    def preemptions(self) -> list[Preemption]:
        return [e for e in self.events if isinstance(e, Preemption)]

    @property
    def remote_loads(self) -> list[RemoteLoad]:
        """Async KV loads started this step (the connector metadata)."""
        return [e for e in self.events if isinstance(e, RemoteLoad)]


@dataclass
class UpdateResult:
    """What ``update_from_output`` did: tokens appended per request (after stop
    truncation) and the requests that finished, in processing order."""

    new_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished: list[FinishedRequest] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_rejected_draft_tokens: int = 0
    # Deferred frees drained at the start of this update: (fence, block ids
    # in free order), FIFO.
    drained: list[tuple[int, list[int]]] = field(default_factory=list)
    # KV connector: the transfers reported done (processing order) and the
    # frees of requests that had finished while loading.
    finished_recving: list[str] = field(default_factory=list)
    invalid_block_ids: list[int] = field(default_factory=list)
    kv_freed: list[KVTransferFree] = field(default_factory=list)



@dataclass
class PrefixCacheReset:
    """The outcome of ``reset_prefix_cache`` (a scenario ``[[actions]]`` kind).

    ``reset_running_requests``: the caller asked to preempt every running
    request first; ``running_before``: the running queue before (ids, queue
    order); ``preemptions``: the victims, in the order taken (the running
    queue from its tail, vLLM's reverse order); ``succeeded``: whether the
    cache was reset (False while a block stayed held)."""

    reset_running_requests: bool
    running_before: list[str]
    preemptions: list[Preemption]
    succeeded: bool


@dataclass(frozen=True)
class RequestState:
    """What a request holds at one instant (vLLM ``Request``): its status, its
    ``num_computed_tokens`` (tokens) and the draft tokens it holds for its
    next step (``spec_token_ids``, token ids; empty: none)."""

    request_id: str
    status: RequestStatus
    num_computed_tokens: int
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Queue orders (request ids) and the free KV block count at one instant.

    ``waiting`` is in the order requests would be examined (FCFS: queue
    order; PRIORITY: pop order). ``request_states``: the state of each
    unfinished request that is not RUNNING and holds draft tokens, and of
    each request the latest ``schedule()`` preempted or reported preempted
    (its ``preempted_req_ids``), each once, in request-id order; the trace
    records them (``request_state`` rows). None: the candidate does not
    report them (then the trace holds no such rows).
    """

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    num_free_blocks: int
    request_states: tuple[RequestState, ...] | None = None
