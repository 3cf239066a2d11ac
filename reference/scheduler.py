"""The scheduler: which requests run each step, with how many tokens.

Mirrors ``vllm/v1/core/sched/scheduler.py::Scheduler`` of vLLM 0.33.0 (spec
sections 3, 4, 6 and the 0.33.0 deltas of section 10) for one full-attention
KV-cache group and no LoRA, with speculative decoding (n-gram style, no
lookahead), async scheduling, deferred frees, prefill gating, an optional
simulated KV-consumer connector (spec 7.2) and encoder inputs (multimodal
items: encoder compute budget and encoder cache, spec 3.2 step 8, 3.3;
``reference.encoder_cache_manager``).

There is no prefill or decode phase: each request has ``num_computed_tokens``
and a target (``num_tokens_with_spec`` + placeholders); every step gives
requests tokens so the computed count catches up, first to ``running`` (in
order, preempting on KV shortage), then, only if nobody was preempted, to
``waiting`` (admissions).

One file over ~500 lines on purpose: it mirrors vLLM's single
``scheduler.py`` method for method (same names, same order of the phases),
so a reader can hold it next to the upstream file and a vLLM change maps to
one place here; what vLLM keeps in other modules (queues, block pool,
KV-cache manager, encoder cache, connector) is in other modules here too.
"""

from __future__ import annotations

from reference.config import EngineConfig
from reference.kv.kv_cache_manager import HybridKVCacheManager
from reference.kv_cache_manager import KVCacheManager
from collections import deque
from operator import attrgetter

from reference.encoder_cache_manager import (EncoderCacheManager, mm_items_in_window,
                                             try_schedule_encoder_inputs)
from reference.kv_cache_utils import KVCacheBlock
from reference.kv_connector import KV_MATCH_PENDING, KVConnectorOutput, make_kv_connector
from reference.output import (EncoderPlan, FinishedRequest, KVTransferFree, Preemption, PrefixCacheReset, Promotion,
                              RemoteLoad, RequestState, ScheduledRequest, SchedulerOutput, SchedulerSnapshot,
                              Skip, SkippedFree, UpdateResult, Withdrawal)
from reference.request import Request, RequestStatus, check_stop
from reference.request_queue import create_request_queue

#: The skip reason of a waiting request whose LoRA adapter would exceed max_loras
#: (vLLM 0.33.0 ``Scheduler.schedule``: "Scheduling would exceed max_loras, skip").
MAX_LORAS_REACHED = "max_loras adapters scheduled"
#: The skip reason of a waiting request whose encoder inputs cut its window to 0 tokens.
ENCODER_INPUT_UNAVAILABLE = "encoder input unavailable"
#: The skip reason of a streaming-input session parked in WAITING_FOR_STREAMING_REQ
#: (vLLM 0.33.0 ``Scheduler._handle_blocked_waiting_request``: it waits for its next chunk).
STREAMING_INPUT_PENDING = "waiting for streaming input"
#: The skip reason of a waiting request whose whole window lies within the drafter's prefill
#: look-ahead of its prefill end (vLLM 0.33.0 ``Scheduler._reserve_prefill_lookahead`` cut it to 0).
PREFILL_LOOKAHEAD_RESERVED = "prefill look-ahead reserved"

_REQUEST_ID = attrgetter("request_id")
#: ``Request.is_finished()`` is ``status > PREEMPTED`` (the hot loops compare inline).
_PREEMPTED = RequestStatus.PREEMPTED
_RUNNING = RequestStatus.RUNNING
_SPEC_TOKEN_IDS = attrgetter("spec_token_ids")


class _QueueIds:
    """The request ids of a queue, snapshot after snapshot (``Scheduler.snapshot``):
    ``of(requests)`` is ``tuple(r.request_id for r in requests)``, computed
    from the previous call's ids for the part of the queue that is the
    previous queue less some requests popped from its head (admissions),
    with some appended (arrivals): a compare of the request objects at C
    speed, no attribute read per request. A request's id never changes."""

    __slots__ = ("requests", "ids")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.ids: tuple[str, ...] = ()

    def of(self, requests: list[Request]) -> tuple[str, ...]:
        previous, ids = self.requests, self.ids
        if requests == previous:
            return ids
        requests = list(requests)
        self.requests = requests
        if previous and requests:
            try:
                popped = previous.index(requests[0])
            except ValueError:
                popped = -1
            kept = len(previous) - popped
            if popped >= 0 and kept <= len(requests) and requests[:kept] == previous[popped:]:
                self.ids = ids[popped:] + tuple(map(_REQUEST_ID, requests[kept:]))
                return self.ids
        self.ids = tuple(map(_REQUEST_ID, requests))
        return self.ids


class Scheduler:
    """The reference scheduler. One instance per engine (per DP rank).

    State: ``requests`` (id -> Request, unfinished only), ``waiting`` (policy
    queue), ``kv_holding_waiting`` (policy queue of waiting requests that
    hold KV blocks: async loads in flight or promoted), ``running`` (list,
    admission order), ``kv_cache_manager``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.token_budget
        kv_cache_groups = config.kv_cache_groups
        self.hybrid = bool(kv_cache_groups)  # block ids recorded per KV-cache group too
        if kv_cache_groups:  # a hybrid model (sliding_window / layer_types): reference.kv
            self.kv_cache_manager = HybridKVCacheManager(
                kv_cache_groups,
                num_gpu_blocks=config.num_gpu_blocks,
                max_model_len=config.max_model_len,
                max_in_flight_tokens=config.max_concurrent_batches * config.max_num_batched_tokens,
                enable_caching=config.enable_prefix_caching,
                watermark=config.watermark,
            )
        else:
            self.kv_cache_manager = KVCacheManager(
                num_gpu_blocks=config.num_gpu_blocks,
                block_size=config.block_size,
                max_model_len=config.max_model_len,
                enable_caching=config.enable_prefix_caching,
                watermark=config.watermark,
            )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Ids finished / preempted since the previous schedule(): the next
        # SchedulerOutput carries them so the worker drops their state.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        # The latest SchedulerOutput's preempted_req_ids (snapshot() reports
        # their states after schedule()).
        self._last_preempted_ids: set[str] = set()
        # Tokens the model samples per scheduled step (0 only for diffusion).
        self.num_sampled_tokens_per_step = 1
        self.num_spec_tokens = config.num_speculative_tokens
        # Whether update_draft_token_ids ever stored drafts: without them and
        # without speculative decoding no request holds any (snapshot skips the scan).
        self._drafts_stored = False
        self.async_scheduling = config.async_scheduling
        # Deferred block frees (spec 5.10): a request's blocks may still be
        # written by a step in flight; they return to the pool only after the
        # output of the newest step that scheduled it has been processed.
        self.defer_block_free = config.defer_block_free
        self.sched_step_seq = 0       # +1 per schedule() that scheduled tokens
        self.processed_step_seq = 0   # +1 per update_from_output of such a step
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()
        # Prefill gating (spec 7.1, 10.4).
        # With data parallelism the interval drives the coordinator's throttle
        # flag instead (spec 10.4).
        self.local_prefill_interval = (config.prefill_schedule_interval
                                       if config.data_parallel_size == 1 else 1)
        self.prefill_capacity_bound = False
        self.last_prefill_step = -self.local_prefill_interval
        self.num_executed_steps = 0
        # Requests skipped by the waiting loop or enqueued blocked (vLLM's
        # deferred_waiting); it only feeds prefill_capacity_bound.
        self.deferred_waiting: set[str] = set()
        # KV connector (spec 7.2, 10.2): requests holding KV wait in their own
        # queue, examined first; loads reported done / failed by the worker;
        # requests that finished while loading keep their blocks until the
        # transfer is done (a load may still be writing them).
        self.connector = make_kv_connector(config)
        # Bounded replay (vLLM 0.33.0 ``Scheduler.__init__``'s
        # ``prefix_replay_group_ids`` / ``prefix_replay_tokens``): the groups
        # that keep no prefix cache and are rebuilt after a hit by recomputing
        # its last ``prefix_replay_tokens`` tokens (DeepSeek-V4.1's
        # bounded-replay sliding window; one window for all of them).
        self.prefix_replay_group_ids = tuple(
            i for i, g in enumerate(kv_cache_groups) if g.kv_cache_spec.prefix_replay_tokens > 0)
        windows = {kv_cache_groups[i].kv_cache_spec.prefix_replay_tokens for i in self.prefix_replay_group_ids}
        assert len(windows) <= 1, f"prefix replay windows differ: {sorted(windows)}"
        self.prefix_replay_tokens = windows.pop() if windows else 0
        self.kv_holding_waiting = create_request_queue(config.policy)
        self.finished_recving_kv_req_ids: set[str] = set()
        self.failed_recving_kv_req_ids: set[str] = set()
        self.kv_pending_free: dict[str, Request] = {}
        self.recompute_kv_load_failures = config.kv_load_failure_policy == "recompute"
        # Requests still prefilling (async loads and admitted prefill chunks):
        # an async load must leave the blocks they still need (insertion
        # ordered; only the sum is used).
        self._inflight_prefills: dict[str, Request] = {}
        # KV slots a drafter writes past the scheduled tokens, tokens (vLLM
        # 0.33.0 Scheduler.num_lookahead_tokens: every allocate_slots gets them,
        # but an async KV load's admission).
        self.num_lookahead_tokens = config.num_lookahead_tokens
        # (Passed only when set, so a fork wrapping allocate_slots that
        # passes its own num_lookahead_tokens keeps working.)
        self._lookahead_kwargs = ({"num_lookahead_tokens": self.num_lookahead_tokens}
                                  if self.num_lookahead_tokens else {})
        self._spec_decode_step_blocks = (-(-(1 + self.num_spec_tokens + self.num_lookahead_tokens)
                                           // self.block_size)
                                         if self.num_spec_tokens else 0)
        # Encoder inputs (multimodal items): the per-step encoder compute
        # budget and the encoder cache, both in embeds.
        self.max_num_encoder_input_tokens = config.encoder_compute_budget
        # A multi-module MTP drafter's prefill look-ahead, tokens (0: none).
        self.num_prefill_lookahead = config.num_prefill_lookahead
        # LoRA: distinct adapters a step may schedule (None: no LoRA config).
        self.max_loras = config.max_loras
        self.encoder_cache_manager = EncoderCacheManager(config.encoder_cache_capacity)
        # Streaming-input sessions parked in WAITING_FOR_STREAMING_REQ: out of
        # ``running`` but still holding a worker slot (vLLM 0.33.0
        # ``num_waiting_for_streaming_input``), so they count toward max_num_seqs.
        self.num_waiting_for_streaming_input = 0
        # The ids of the queues at the previous snapshot, reused for what did not move.
        self._waiting_ids = _QueueIds()
        # (the waiting queues and their ``mutations`` at the last snapshot: _waiting_queue_ids)
        self._waiting_stamp: tuple = ()
        self._running_ids = _QueueIds()

    # -- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Enqueue a new request in ``waiting``. ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], finished_status: RequestStatus) -> list[FinishedRequest]:
        """Finish requests from outside (client abort). Unknown or already
        finished ids are ignored. Returns what was finished, in the given order."""
        assert RequestStatus.is_finished(finished_status)
        valid = [self.requests[i] for i in request_ids
                 if i in self.requests and not self.requests[i].is_finished()]
        gone = set(map(id, valid))
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_requests(valid)
        self.kv_holding_waiting.remove_requests(valid)
        finished = []
        for request in valid:
            delay_free_blocks = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # The load may still write its blocks: keep them until the
                # transfer reports done (spec 7.2).
                delay_free_blocks = request.request_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(request.request_id)
                self.failed_recving_kv_req_ids.discard(request.request_id)
            if request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                self.num_waiting_for_streaming_input -= 1  # a parked session aborted
            request.status = finished_status
            finished.append(self._free_request(request, delay_free_blocks))
        return finished

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> PrefixCacheReset:
        """Reset the prefix cache (vLLM 0.33.0 ``Scheduler.reset_prefix_cache``,
        ``vllm/v1/core/sched/scheduler.py``; no connector, so its
        ``reset_connector`` has nothing to reset).

        Without ``reset_running_requests`` the reset only succeeds when no
        request holds a block (``BlockPool.reset_prefix_cache`` refuses
        otherwise, changing nothing). With it, every running request is
        preempted first, popping the running queue from its tail (so that,
        prepended to waiting one by one, they come back in their old running
        order) with their in-flight output marked to be dropped (vLLM's
        ``drop_stale_output``, as its same-step resume would otherwise
        deliver tokens out of order); then the reset must succeed. vLLM
        raises RuntimeError when it still fails (a request waiting for a
        remote KV load keeps its blocks); so does this.

        vLLM also clears ``prev_step_scheduled_req_ids`` (the worker's
        persistent batch): the reference has no such set, the victims come
        back as resumed requests either way.
        """
        running_before = [r.request_id for r in self.running]
        preemptions: list[Preemption] = []
        if reset_running_requests:
            while self.running:
                victim = self.running.pop()
                preemptions.append(self._preempt_request(victim))
                victim.drop_stale_output = True
        succeeded = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not succeeded:
            raise RuntimeError("prefix-cache reset failed although every running request was preempted "
                               "(a request waiting for a remote KV load still holds blocks)")
        return PrefixCacheReset(reset_running_requests, running_before, preemptions, succeeded)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> FinishedRequest:
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        self.deferred_waiting.discard(request.request_id)
        self._inflight_prefills.pop(request.request_id, None)
        if self.connector is not None:
            self.connector.request_finished(request.request_id)
        self.encoder_cache_manager.free(request)
        freed, fence, groups = [], None, None
        if delay_free_blocks:
            self.kv_pending_free[request.request_id] = request
        else:
            freed, fence, groups = self._free_request_blocks(request)
        del self.requests[request.request_id]
        return FinishedRequest(request.request_id, request.status, request.get_finished_reason(),
                               request.stop_reason, request.num_output_tokens, freed, fence, groups)

    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        # An in-flight step may still write the request's blocks.
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, request: Request) -> tuple[list[int], int | None, list[list[int]] | None]:
        """Free now, or defer behind the fence ``sched_step_seq`` (spec 5.10).
        Returns (block ids in free order, fence or None, and for a hybrid
        model each group's ids tail first, else None)."""
        if self._request_blocks_can_be_freed(request):
            if self.hybrid:
                groups = self.kv_cache_manager.free_per_group(request)
                return [b for ids in groups for b in ids], None, groups
            return self.kv_cache_manager.free(request), None, None
        groups = None
        if self.hybrid:
            groups = [[b for b in ids[::-1] if b]
                      for ids in self.kv_cache_manager.get_block_ids_per_group(request.request_id)]
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))
        return [b.block_id for b in reversed(blocks)], self.sched_step_seq, groups

    def _skipped_frees(self) -> list[SkippedFree]:
        """The window frees of the last ``allocate_slots`` (hybrid models)."""
        if not self.hybrid:
            return []
        return [SkippedFree(rid, [b for ids in groups for b in ids], groups)
                for rid, groups in self.kv_cache_manager.take_skipped_frees()]

    def _drain_deferred_frees(self) -> list[tuple[int, list[int]]]:
        """Return deferred blocks whose fence has passed, FIFO, stopping at
        the first pending fence; each entry is freed tail first."""
        drained = []
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            fence, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
            drained.append((fence, [b.block_id for b in reversed(blocks)]))
        return drained

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def snapshot(self) -> SchedulerSnapshot:
        """Queue orders, free blocks and the request states the trace
        records (the candidate protocol's state view, ``SchedulerSnapshot``):
        waiting requests holding drafts, and the latest schedule()'s
        preempted ids (``_last_preempted_ids``), wherever they are now."""
        shown: dict[str, Request] = {}
        if self.num_spec_tokens or self._drafts_stored:
            # filter with attrgetter: a C-speed pass over a backlog of thousands (issue 24).
            shown = {r.request_id: r for r in filter(_SPEC_TOKEN_IDS, self._waiting_requests())}
        for req_id in self._last_preempted_ids:
            request = self.requests.get(req_id)
            if request is not None:
                shown[req_id] = request
        states = tuple(RequestState(i, shown[i].status, shown[i].num_computed_tokens,
                                    tuple(shown[i].spec_token_ids)) for i in sorted(shown))
        return SchedulerSnapshot(self._waiting_queue_ids(), self._running_ids.of(self.running),
                                 self.kv_cache_manager.num_free_blocks, states)

    def _waiting_requests(self) -> list[Request]:
        """The waiting requests in snapshot order: those holding KV blocks first."""
        return [*self.kv_holding_waiting, *self.waiting]

    def _waiting_queue_ids(self) -> tuple[str, ...]:
        """``snapshot``'s waiting ids. Both queues unchanged since the last
        call (the same objects, the same ``mutations`` counts: most snapshots
        of a step, e.g. after update_from_output) give the same ids without a
        pass over the backlog; otherwise ``_QueueIds.of`` (a queue without
        the counter, a subclass's own, is always walked)."""
        held, waiting = self.kv_holding_waiting, self.waiting
        stamp = (held, getattr(held, "mutations", None), waiting, getattr(waiting, "mutations", None))
        if stamp == self._waiting_stamp and stamp[1] is not None and stamp[3] is not None:
            return self._waiting_ids.ids
        self._waiting_stamp = stamp
        return self._waiting_ids.of(self._waiting_requests())

    # -- schedule --------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Decide one step. See the module docstring and spec 3, 4, 10.3-10.6.

        ``throttle_prefills`` is the data-parallel coordinator's flag for a
        step off its prefill cadence (spec 7.1).
        """
        events: list[ScheduledRequest | Withdrawal | Preemption] = []
        scheduled_running: dict[str, ScheduledRequest] = {}
        # Admissions by kind, in order: with scheduled_running, the request
        # data of the output (vLLM scheduled_new_reqs, then the cached
        # requests: running, then resumed).
        scheduled_new: list[str] = []
        scheduled_resumed: list[str] = []
        preempted: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        # 0.33.0 input budget; draft slots are 0 without a draft-model proposer.
        draft_slots = 0
        input_budget = self.config.max_num_batched_tokens
        # 0.33.0: the long-prefill cap applies only when someone could starve.
        num_eligible = len(self.running) + len(self.waiting) + len(self.kv_holding_waiting)
        threshold = self.config.long_prefill_token_threshold if num_eligible > 1 else 0

        # A running-loop request that was still prefilling before this step
        # (then new decodes are not padded with placeholder drafts).
        prefill_scheduled = False
        # An admission with prompt left to compute (stamps the cadence).
        prefill_admitted = False
        # Encoder embeds still computable this step.
        encoder_compute_budget = self.max_num_encoder_input_tokens

        # Prefill gating: on a throttled step, or inside the local cadence
        # interval, defer prefill compute while decodes are running, unless
        # the last release step could not drain the waiting queue.
        # (has_decode is a pass over running: evaluated only when gating can apply.)
        defer_prefills = False
        if throttle_prefills or self.local_prefill_interval > 1:
            has_decode = any(not r.is_prefill_chunk for r in self.running)
            defer_prefills = throttle_prefills and not self.prefill_capacity_bound and has_decode
            if (not defer_prefills and self.local_prefill_interval > 1
                    and not self.prefill_capacity_bound
                    and (self.num_executed_steps + 1) - self.last_prefill_step < self.local_prefill_interval
                    and has_decode):
                defer_prefills = True

        # 1. RUNNING requests, in order.
        kv_cache_manager = self.kv_cache_manager
        allocate_slots = kv_cache_manager.allocate_slots
        hybrid = self.hybrid
        # The last position a step may schedule to, less the sampled token's.
        last_position = self.max_model_len - self.num_sampled_tokens_per_step
        running = self.running
        lookahead_kwargs = self._lookahead_kwargs
        num_prefill_lookahead = self.num_prefill_lookahead
        req_index = 0
        # (The loop runs once per running request per step: a pure-decode step
        # of N requests is N passes, so it reads fields rather than calling
        # the properties and helpers named in the comments.)
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            if input_budget <= draft_slots:
                break
            num_computed_tokens = request.num_computed_tokens
            num_output_placeholders = request.num_output_placeholders
            # Async: enough is in flight to reach max_tokens even if every
            # draft is rejected; do not schedule past it.
            if (num_output_placeholders > 0
                    and num_computed_tokens + 2 - num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                req_index += 1
                continue
            # num_tokens_with_spec + placeholders - computed
            num_new_tokens = (len(request.all_token_ids) + len(request.spec_token_ids)
                              + num_output_placeholders - num_computed_tokens)
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            # min(num_new_tokens, token_budget, input_budget - draft_slots)
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            if num_new_tokens > input_budget - draft_slots:
                num_new_tokens = input_budget - draft_slots
            # Keep the sampled token's position inside max_model_len.
            if num_new_tokens > last_position - num_computed_tokens:
                num_new_tokens = last_position - num_computed_tokens
            if defer_prefills and request.is_prefill_chunk:
                req_index += 1  # a prefill chunk waits for a cadence-aligned step
                continue
            # Encoder inputs may cut the window (to 0: skipped this step).
            encoder_ids = encoder_duplicates = ()
            new_encoder_budget = encoder_compute_budget
            if request.mm_positions and num_new_tokens > 0:  # has_encoder_inputs
                encoder_ids, num_new_tokens, new_encoder_budget, encoder_duplicates = \
                    self._plan_encoder_inputs(request, num_computed_tokens, num_new_tokens,
                                              encoder_compute_budget, events)
            if num_prefill_lookahead:  # (without one it changes nothing: the test below)
                num_new_tokens = self._reserve_prefill_lookahead(request, num_computed_tokens,
                                                                 num_new_tokens)
            if num_new_tokens <= 0:
                # Skip, not break: lower-priority requests may still run.
                req_index += 1
                continue

            num_computed_before = num_computed_tokens
            while True:
                # (the ** call only when there is something to pass: it is the slow call path)
                new_blocks = (allocate_slots(request, num_new_tokens, **lookahead_kwargs) if lookahead_kwargs
                              else allocate_slots(request, num_new_tokens))
                if hybrid:
                    events.extend(self._skipped_frees())
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority running request.
                victim = self._select_victim()
                if not self._request_blocks_can_be_freed(victim):
                    break  # 0.33.0: a deferred free would not help now; give up
                victim_index = running.index(victim)
                del running[victim_index]
                # 0.33.0: decrement whenever the victim sat before the cursor
                # (only possible under PRIORITY: the FCFS tail never does).
                if victim_index < req_index:
                    req_index -= 1
                given_back = scheduled_running.pop(victim.request_id, None)
                if given_back is not None:
                    # PRIORITY give-back of a victim scheduled earlier this step.
                    restored = num_scheduled_tokens.pop(victim.request_id)
                    events.append(Withdrawal(victim.request_id, restored, given_back.new_block_ids,
                                             list(given_back.encoder_input_ids), given_back.group_block_ids))
                    token_budget += restored
                    input_budget += restored + draft_slots
                    encoder_compute_budget += self._encoder_embeds_to_restore(
                        victim, given_back.encoder_input_ids)
                events.append(self._preempt_request(victim))
                preempted.append(victim)
                if victim is request:
                    break

            if new_blocks is None:
                if self.config.policy == "priority" and request.status == RequestStatus.PREEMPTED:
                    # 0.33.0: it preempted itself; `req_index` already points at
                    # the next (higher-priority) request, which may still fit.
                    continue
                break

            # (A decode that filled no block got none: no ids to list.)
            record = ScheduledRequest(request.request_id, "running", num_computed_before,
                                      num_new_tokens, 0,
                                      kv_cache_manager.new_block_ids(new_blocks) if new_blocks else [],
                                      encoder_input_ids=list(encoder_ids) if encoder_ids else [],
                                      group_block_ids=(kv_cache_manager.new_group_block_ids(new_blocks)
                                                       if hybrid else None))
            events.append(record)
            scheduled_running[request.request_id] = record
            prefill_scheduled |= request.is_prefill_chunk
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            input_budget -= num_new_tokens + draft_slots
            req_index += 1
            # Drafts ride along only on the tokens past num_tokens, so never
            # on a prefill chunk; whatever is not scheduled is dropped.
            if request.spec_token_ids:
                k = (num_new_tokens + request.num_computed_tokens - request.num_tokens
                     - request.num_output_placeholders)
                if k > 0:
                    record.spec_token_ids = request.spec_token_ids[:k]
                request.spec_token_ids = []
            # Encoder: commit the budget (this drops a give-back made while
            # allocating for this request, as vLLM does) and allocate.
            if encoder_ids:
                encoder_compute_budget = new_encoder_budget
                self._allocate_encoder_inputs(request, encoder_ids, encoder_duplicates)

        # LoRA (vLLM 0.33.0): the adapters of every running request, scheduled
        # this step or not (they can join a later batch); admissions add theirs.
        scheduled_loras: set[int] = set()
        if self.max_loras is not None:
            scheduled_loras = {r.lora_int_id for r in self.running if r.lora_int_id > 0}

        # 2. WAITING requests, only if nobody was preempted this step.
        if not preempted:
            # Skipped requests, per queue, in the order met (vLLM 0.33.0
            # skip_request): the queue is decided after the skip, so an
            # async-load admission lands in the kv-holding list.
            skipped_waiting: list[Request] = []
            skipped_kv_holding: list[Request] = []

            def skip_request(queue, request: Request) -> None:
                queue.pop_request()
                self.deferred_waiting.add(request.request_id)
                (skipped_kv_holding if self._holds_kv_blocks(request) else skipped_waiting).append(request)

            while token_budget > 0:
                # Requests holding KV blocks are always drained first.
                queue = self.kv_holding_waiting if self.kv_holding_waiting else self.waiting
                if not queue or input_budget <= draft_slots:
                    break
                # Parked streaming sessions keep their worker slot (vLLM 0.33.0).
                if len(self.running) + self.num_waiting_for_streaming_input >= self.max_num_running_reqs:
                    break
                request = queue.peek_request()
                if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    if request.request_id not in self.finished_recving_kv_req_ids:
                        skip_request(queue, request)
                        events.append(Skip(request.request_id, "waiting for remote KV"))
                        continue
                    events.append(self._promote(request))
                elif request.status == RequestStatus.WAITING_FOR_STREAMING_REQ:
                    # A session waiting for its next input chunk cannot run.
                    skip_request(queue, request)
                    events.append(Skip(request.request_id, STREAMING_INPUT_PENDING))
                    continue
                if request.num_stale_output_tokens and not request.drop_stale_output:
                    # Deliverable stale output still in flight: resuming now could
                    # resample a position that output will deliver.
                    skip_request(queue, request)
                    events.append(Skip(request.request_id, "stale output in flight"))
                    continue
                if (self.max_loras is not None and request.lora_int_id > 0
                        and len(scheduled_loras) == self.max_loras
                        and request.lora_int_id not in scheduled_loras):
                    # Its adapter would exceed max_loras this step: skipped.
                    skip_request(queue, request)
                    events.append(Skip(request.request_id, MAX_LORAS_REACHED))
                    continue
                external, load_kv_async = 0, False
                window_loaded = False
                did_prefix_cache_lookup = request.num_computed_tokens == 0
                if did_prefix_cache_lookup:
                    # Prefix lookup: preempted requests were reset to 0 and
                    # re-match; then the connector offers what it holds past
                    # the local hit.
                    hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                    if self.connector is not None:
                        external, load_kv_async = self.connector.get_num_new_matched_tokens(
                            request, num_hit_tokens)
                        if external is None:
                            # The connector cannot tell yet (vLLM: the request
                            # cannot be scheduled this step): skipped.
                            skip_request(queue, request)
                            events.append(Skip(request.request_id, KV_MATCH_PENDING))
                            continue
                        if self.prefix_replay_tokens and not (
                                external and self._load_restores_replay_window(request)):
                            # A replayed hit starts in whole blocks: the external
                            # part is cut back to a block boundary.
                            external -= external % self.block_size
                            load_kv_async = load_kv_async and external > 0
                    num_computed = num_hit_tokens + external
                    window_loaded = bool(external) and self._load_restores_replay_window(request)
                    if not window_loaded and 0 < num_computed <= self.prefix_replay_tokens:
                        # A hit no longer than the replayed window would be
                        # recomputed whole: it is not taken (no load started).
                        hit_blocks = tuple([] for _ in hit_blocks) if self.hybrid else []
                        num_hit_tokens, external, num_computed, load_kv_async = 0, 0, 0, False
                else:
                    # A finished async load: no new lookup (a hybrid model: no
                    # hit in any group).
                    hit_blocks = tuple([] for _ in range(self.kv_cache_manager.num_kv_cache_groups)) \
                        if self.hybrid else []
                    num_hit_tokens = 0
                    num_computed = request.num_computed_tokens
                pad_spec_decode = False
                encoder_ids, encoder_duplicates = [], []
                new_encoder_budget = encoder_compute_budget
                num_replay_tokens = 0
                if load_kv_async:
                    num_new_tokens = 0  # allocation only; nothing runs while it loads
                elif defer_prefills and num_computed < request.num_tokens - 1:
                    break  # local prefill deferred to a cadence-aligned step
                else:
                    request_budget = min(token_budget, input_budget - draft_slots)
                    if did_prefix_cache_lookup:
                        # Bounded replay: the hit's last window is recomputed.
                        num_replay_tokens = self._mark_prefix_replay(request, num_computed, window_loaded)
                        num_computed -= num_replay_tokens
                    num_new_tokens = request.num_tokens - num_computed
                    # 0.33.0 (spec 10.6): a new decode (one token left) is padded to
                    # 1 + K with -1 drafts so the batch stays uniform.
                    if (self.num_spec_tokens > 0 and self.num_sampled_tokens_per_step > 0
                            and num_new_tokens == 1 and not prefill_scheduled
                            and (scheduled_running or num_computed > 0)):
                        padded = 1 + self.num_spec_tokens
                        if num_computed + padded + self.num_sampled_tokens_per_step <= self.max_model_len:
                            if padded > request_budget:
                                break  # rather not schedule than schedule unpadded
                            num_new_tokens = padded
                            pad_spec_decode = True
                    if 0 < threshold < num_new_tokens:
                        num_new_tokens = threshold
                    if not self.config.enable_chunked_prefill and num_new_tokens > request_budget:
                        break  # no skipping ahead to shorter requests
                    num_new_tokens = min(num_new_tokens, request_budget)
                    assert num_new_tokens > 0
                    if request.mm_positions:  # has_encoder_inputs
                        encoder_ids, num_new_tokens, new_encoder_budget, encoder_duplicates = \
                            self._plan_encoder_inputs(request, num_computed, num_new_tokens,
                                                      encoder_compute_budget, events)
                        if num_new_tokens == 0:
                            # 0.33.0: skip (not break), so requests behind it may run.
                            skip_request(queue, request)
                            events.append(Skip(request.request_id, ENCODER_INPUT_UNAVAILABLE))
                            continue
                    if num_prefill_lookahead:  # (without one it changes nothing)
                        num_new_tokens = self._reserve_prefill_lookahead(request, num_computed, num_new_tokens)
                    if num_new_tokens == 0:
                        skip_request(queue, request)
                        events.append(Skip(request.request_id, PREFILL_LOOKAHEAD_RESERVED))
                        continue
                # An async load holds its blocks with no forward progress: it
                # must leave what in-flight prefills still need (no wedge).
                # (vLLM adds one spec-decode step of blocks for the load itself.)
                reserved = (self._inflight_prefill_reserved_blocks() + self._spec_decode_step_blocks
                            if load_kv_async else 0)
                # Replayed tokens already have their slots (the adopted hit):
                # a chunk ending inside the replayed range needs no new ones.
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, max(num_new_tokens - num_replay_tokens, 0),
                    num_new_computed_tokens=num_hit_tokens,
                    new_computed_blocks=hit_blocks,
                    num_external_computed_tokens=external,
                    # (An async load runs no forward pass yet: its look-ahead
                    # slots come with its first scheduled step.)
                    **({} if load_kv_async else self._lookahead_kwargs),
                    delay_cache_blocks=load_kv_async,
                    full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
                    reserved_blocks=reserved,
                    has_scheduled_reqs=bool(self.running),
                )
                if hybrid:
                    events.extend(self._skipped_frees())
                if new_blocks is None:
                    if request.mm_positions:  # has_encoder_inputs
                        # Release the cache references taken while planning.
                        self.encoder_cache_manager.free(request)
                    break  # admission never preempts

                if load_kv_async:
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    request.num_computed_tokens = num_computed
                    self._inflight_prefills[request.request_id] = request
                    block_ids, group_block_ids = (
                        self.kv_cache_manager.admission_block_ids(request.request_id, hit_blocks)
                        if self.hybrid else (self.kv_cache_manager.get_block_ids(request.request_id), None))
                    events.append(RemoteLoad(request.request_id, num_hit_tokens, external, block_ids,
                                             reserved, group_block_ids))
                    skip_request(queue, request)
                    continue

                queue.pop_request()
                self.running.append(request)
                if self.max_loras is not None and request.lora_int_id > 0:
                    scheduled_loras.add(request.lora_int_id)
                if request.status == RequestStatus.WAITING:
                    kind = "new"
                    scheduled_new.append(request.request_id)
                elif request.status == RequestStatus.PREEMPTED:
                    kind = "resumed"
                    scheduled_resumed.append(request.request_id)
                else:
                    raise RuntimeError(f"invalid status {request.status.name} in waiting")
                block_ids, group_block_ids = (
                    self.kv_cache_manager.admission_block_ids(request.request_id, hit_blocks) if self.hybrid
                    else (self.kv_cache_manager.get_block_ids(request.request_id), None))
                events.append(ScheduledRequest(
                    request.request_id, kind, num_computed, num_new_tokens, num_hit_tokens, block_ids,
                    [-1] * self.num_spec_tokens if pad_spec_decode else [],
                    list(encoder_ids), group_block_ids))
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                input_budget -= num_new_tokens + draft_slots
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_computed
                self.deferred_waiting.discard(request.request_id)
                prefill_admitted |= num_computed < request.num_tokens - 1
                if num_computed + num_new_tokens < request.num_tokens:
                    self._inflight_prefills[request.request_id] = request
                if encoder_ids:
                    encoder_compute_budget = new_encoder_budget
                    self._allocate_encoder_inputs(request, encoder_ids, encoder_duplicates)
            # Skipped requests go back to the head of their queue, in the order met.
            for request in reversed(skipped_waiting):
                self.waiting.prepend_request(request)
            for request in reversed(skipped_kv_holding):
                self.kv_holding_waiting.prepend_request(request)
            if not defer_prefills:
                # Saturation guard: a release step that could not drain the
                # never-skipped waiting requests stops the gating.
                self.prefill_capacity_bound = (len(self.waiting) + len(self.kv_holding_waiting)
                                               > len(self.deferred_waiting))

        total = sum(num_scheduled_tokens.values())
        if total > 0:
            self.num_executed_steps += 1
        if self.local_prefill_interval > 1 and (prefill_scheduled or prefill_admitted):
            self.last_prefill_step = self.num_executed_steps
        assert total <= self.max_num_scheduled_tokens
        assert token_budget >= 0 and input_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        output = SchedulerOutput(
            events=events,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            token_budget=token_budget,
            throttle_prefills=throttle_prefills,
            defer_prefills=defer_prefills,
            prefill_capacity_bound=self.prefill_capacity_bound,
            free_encoder_mm_hashes=self.encoder_cache_manager.get_freed_mm_hashes(),
            request_data_ids=scheduled_new + list(scheduled_running) + scheduled_resumed,
        )
        self._last_preempted_ids = output.preempted_req_ids  # (the output's own set)
        if self.defer_block_free and total > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(output)
        return output

    # -- encoder inputs ----------------------------------------------------------
    def _try_schedule_encoder_inputs(self, request: Request, num_computed_tokens: int,
                                     num_new_tokens: int, encoder_compute_budget: int
                                     ) -> tuple[list[int], int, int, list[int]]:
        """vLLM ``_try_schedule_encoder_inputs`` (see
        ``reference.encoder_cache_manager.try_schedule_encoder_inputs``):
        (input ids to encode, tokens, embeds of budget left, duplicates)."""
        return try_schedule_encoder_inputs(self.encoder_cache_manager, request, num_computed_tokens,
                                           num_new_tokens, encoder_compute_budget,
                                           self.config.disable_chunked_mm_input,
                                           shift_computed_tokens=self.num_prefill_lookahead)

    def _reserve_prefill_lookahead(self, request: Request, num_computed_tokens: int,
                                   num_new_tokens: int) -> int:
        """Tokens the step may give ``request`` so that its prefill chunk does
        not end within ``num_prefill_lookahead`` tokens of the prefill's end
        (vLLM 0.33.0 ``Scheduler._reserve_prefill_lookahead``: a multi-module
        MTP drafter reads that many known prompt tokens past a chunk's end):
        either the chunk reaches the end, or it leaves at least the look-ahead
        for the next one; never below 0. Tokens."""
        remaining = request.num_tokens - num_computed_tokens - num_new_tokens
        if 0 < remaining < self.num_prefill_lookahead:
            num_new_tokens -= self.num_prefill_lookahead - remaining
        return max(num_new_tokens, 0)

    def _plan_encoder_inputs(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                             encoder_compute_budget: int, events: list
                             ) -> tuple[list[int], int, int, list[int]]:
        """``_try_schedule_encoder_inputs`` for the window ``[num_computed_tokens,
        + num_new_tokens)``, recorded as an ``EncoderPlan`` when the window
        (reaching ``num_prefill_lookahead`` further) overlaps one of the request's encoder inputs (then the call may have
        referenced cache hits, evicted entries or cut the window)."""
        lo, hi = mm_items_in_window(request.mm_positions, num_computed_tokens,
                                    num_computed_tokens + num_new_tokens + self.num_prefill_lookahead)
        ids, n, budget, duplicates = self._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, encoder_compute_budget)
        if lo < hi:
            events.append(EncoderPlan(request.request_id, num_computed_tokens, n, list(ids)))
        return ids, n, budget, duplicates

    def _allocate_encoder_inputs(self, request: Request, input_ids: list[int],
                                 duplicate_input_ids: list[int]) -> None:
        """vLLM ``_allocate_encoder_inputs``: cache room for each input to
        encode, then references for its same-step duplicates."""
        for input_id in input_ids:
            self.encoder_cache_manager.allocate(request, input_id)
        for input_id in duplicate_input_ids:
            self.encoder_cache_manager.check_and_update_cache(request, input_id)

    def _encoder_embeds_to_restore(self, victim: Request, input_ids: list[int]) -> int:
        """PRIORITY give-back (spec 4.2): embeds a withdrawn victim returns to
        the step's encoder compute budget."""
        return sum(victim.get_num_encoder_embeds(i) for i in input_ids)

    def _free_encoder_inputs(self, request: Request) -> None:
        """vLLM ``_free_encoder_inputs`` (spec 6 e, 10.8): after a step's
        output, drop the request's reference to each cached input whose range
        ends at or before ``num_computed_tokens - num_output_placeholders``
        (tokens confirmed computed)."""
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        for input_id in list(self.encoder_cache_manager.get_cached_input_ids(request)):
            start, length = request.mm_positions[input_id]
            if start + length <= confirmed:
                self.encoder_cache_manager.free_encoder_input(request, input_id)

    def _select_victim(self) -> Request:
        """Spec 4.2: PRIORITY takes the running request with the largest
        (priority, arrival_time), the first such in running order; FCFS the
        tail of running (the most recently admitted)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    @staticmethod
    def _holds_kv_blocks(request: Request) -> bool:
        """vLLM 0.33.0: a waiting request holds KV if it has computed tokens
        (a finished load) or is loading."""
        return request.num_computed_tokens > 0 or request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _request_remaining_blocks(self, request: Request) -> int:
        """Blocks ``request`` still needs to hold its whole sequence (plus one
        spec-decode step): vLLM ``_request_remaining_blocks``."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        if self.num_spec_tokens:
            num_tokens += 1 + self.num_spec_tokens + self.num_lookahead_tokens
        return self.kv_cache_manager.get_num_blocks_to_hold(request, num_tokens)

    def _inflight_prefill_reserved_blocks(self) -> int:
        """Blocks in-flight prefills still need (an async load's reservation)."""
        return sum(self._request_remaining_blocks(r) for r in self._inflight_prefills.values())

    def _load_restores_replay_window(self, request: Request) -> bool:
        """Whether the connector's load for ``request`` restores every
        bounded-replay group (vLLM 0.33.0 ``Scheduler._load_restores_replay_window``:
        a P/D transfer of the request's own blocks does, a prefix store does
        not). False without bounded-replay groups; asks the connector
        (``loads_replay_window``) otherwise."""
        if not self.prefix_replay_group_ids:
            return False
        return self.connector.loads_replay_window(request, self.prefix_replay_group_ids)

    def _mark_prefix_replay(self, request: Request, num_hit_tokens: int, window_loaded: bool) -> int:
        """Tokens of a prefix hit of ``num_hit_tokens`` tokens to recompute
        (vLLM 0.33.0 ``Scheduler._mark_prefix_replay``): the hit's last
        ``prefix_replay_tokens`` (all of a shorter hit), none without bounded
        replay or when the load carried the window. The caller rewinds
        ``num_computed_tokens`` by it."""
        if not self.prefix_replay_tokens or window_loaded:
            return 0
        return min(self.prefix_replay_tokens, num_hit_tokens)

    def _promote(self, request: Request) -> Promotion:
        """A finished async load returns to WAITING (PREEMPTED if it had been
        preempted before): vLLM ``_update_waiting_for_remote_kv``. The loaded
        blocks are cached now; a failed load keeps its valid prefix (or frees
        everything if none is valid); a whole-sequence load recomputes the
        last token so the next one can be sampled."""
        req_id = request.request_id
        freed: list[int] = []
        groups: list[list[int]] | None = (
            [[] for _ in range(self.kv_cache_manager.num_kv_cache_groups)] if self.hybrid else None)
        load_failed = req_id in self.failed_recving_kv_req_ids
        if load_failed:
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            elif self.hybrid:
                groups = self.kv_cache_manager.free_per_group(request)
                freed = [b for ids in groups for b in ids]
            else:
                freed = self.kv_cache_manager.free(request)
            self.failed_recving_kv_req_ids.remove(req_id)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        # Bounded replay: a load that did not carry the window (or failed) is
        # replayed over its last window, which covers the last token.
        num_replay_tokens = self._mark_prefix_replay(
            request, request.num_computed_tokens,
            window_loaded=not load_failed and self._load_restores_replay_window(request))
        if num_replay_tokens > 0:
            request.num_computed_tokens -= num_replay_tokens
        elif request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(req_id)
        request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        return Promotion(req_id, request.status, request.num_computed_tokens, load_failed, freed, groups)

    def _preempt_request(self, request: Request) -> Preemption:
        """Spec 4.3: free blocks, reset progress, back to the head of waiting.

        The caller has already removed ``request`` from ``running``.
        """
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        num_computed_before = request.num_computed_tokens
        freed, fence, groups = self._free_request_blocks(request)
        # Its encoder-cache entries become freeable, not evicted.
        self.encoder_cache_manager.free(request)
        self._inflight_prefills.pop(request.request_id, None)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.drop_stale_output = False
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)
        return Preemption(request.request_id, num_computed_before, freed, fence, groups)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance computed counts now, so the next schedule() can continue a
        # chunked prefill before this step's output returns.
        requests = self.requests
        defer_block_free, sched_step_seq = self.defer_block_free, self.sched_step_seq
        async_scheduling = self.async_scheduling
        inflight_prefills = self._inflight_prefills
        spec_tokens = output.scheduled_spec_decode_tokens if async_scheduling else None
        for req_id, n in output.num_scheduled_tokens.items():
            request = requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            if defer_block_free:
                request.last_sched_seq = sched_step_seq
            # (len(all_token_ids): num_tokens)
            is_prefill_chunk = request.is_prefill_chunk = request.num_computed_tokens < (
                len(request.all_token_ids) + request.num_output_placeholders)
            if not is_prefill_chunk:
                if inflight_prefills:
                    inflight_prefills.pop(req_id, None)
                if async_scheduling:
                    # AsyncScheduler: the sampled token (and drafts) are in flight.
                    request.num_output_placeholders += (
                        self.num_sampled_tokens_per_step + len(spec_tokens.get(req_id, ())))
                    # Its next drafts are K placeholders -1 (_spec_token_placeholders):
                    # the worker fills them, the scheduler never sees the real ids
                    # (reference.async_spec).
                    request.spec_token_ids = [-1] * self.num_spec_tokens
        # Fresh sets: the output keeps the old objects.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    # -- update ----------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]],
                           kv_connector_output: KVConnectorOutput | None = None) -> UpdateResult:
        """Apply the model's sampled tokens for ``output`` (spec 6, 10.8).

        ``sampled_token_ids[id]`` is empty for a partial prefill chunk. Tokens
        are appended one at a time with ``check_stop`` after each; a stop
        truncates the rest. Finished requests leave ``running`` and free
        their blocks (tail first). ``kv_connector_output`` (KV connector
        only): failed blocks are handled first, finished transfers last
        (vLLM order), see ``_handle_invalid_blocks`` and
        ``_update_from_kv_xfer_finished``.
        """
        result = UpdateResult()
        stopped: set[int] = set()
        # Stopped streaming-input sessions that go on (parked), in output order:
        # enqueued after the loop, once every stopped request left its queue.
        continuing: list[Request] = []
        failed_kv_load_req_ids: list[str] = []
        if kv_connector_output is not None and kv_connector_output.invalid_block_ids:
            result.invalid_block_ids = sorted(kv_connector_output.invalid_block_ids)
            failed_kv_load_req_ids = self._handle_invalid_blocks(kv_connector_output.invalid_block_ids)
        if self.defer_block_free and output.total_num_scheduled_tokens > 0:
            # Every write of this and earlier steps has completed.
            self.processed_step_seq += 1
            result.drained = self._drain_deferred_frees()
        # Drafts exist only with speculative decoding or once the proposer
        # stored some (update_draft_token_ids): otherwise no event holds any.
        spec_tokens = (output.scheduled_spec_decode_tokens if self.num_spec_tokens or self._drafts_stored
                       else {})
        requests = self.requests
        max_model_len = self.max_model_len
        cache_accepted = self.num_spec_tokens > 0
        appended = result.new_token_ids
        for req_id, n in output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= n
                if request.num_stale_output_tokens > 0:
                    is_stale = True
                    request.num_stale_output_tokens -= n
            if request is None or request.status > _PREEMPTED:  # is_finished(), inlined
                continue  # aborted while in flight
            new_token_ids = list(sampled_token_ids.get(req_id, ()))
            drafts = spec_tokens.get(req_id)
            if drafts and new_token_ids:
                # Greedy verification: the model returns the accepted drafts
                # plus one token; roll back the rejected positions. A stale
                # output's rejections predate its preemption's reset and change
                # nothing (its drafts are still counted, as vLLM's stats do).
                accepted = max(len(new_token_ids) - self.num_sampled_tokens_per_step, 0)
                rejected = len(drafts) - accepted
                if not is_stale:
                    self._roll_back_rejected(request, rejected)
                result.num_draft_tokens += len(drafts)
                result.num_rejected_draft_tokens += rejected
            if request.mm_positions:  # has_encoder_inputs
                # Only after the step ran: items now behind confirmed progress.
                self._free_encoder_inputs(request)
            if not new_token_ids:
                continue
            status_before = request.status
            had_placeholders = request.num_output_placeholders > 0
            for num_new, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids(token_id)
                if check_stop(request, max_model_len):
                    if not is_stale:
                        request.num_computed_tokens -= len(new_token_ids) - num_new
                    del new_token_ids[num_new:]
                    break
            if not is_stale and request.num_output_placeholders > 0:
                request.num_output_placeholders -= len(sampled_token_ids[req_id])
            # 0.33.0 (spec 10.8): with drafts or placeholders, blocks completed
            # by accepted tokens are cached now, before a stopped request frees.
            if (not is_stale and status_before == _RUNNING
                    and (had_placeholders or cache_accepted)):
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_in_flight_tokens)
            appended[req_id] = new_token_ids
            if request.status > _PREEMPTED:  # is_finished()
                if status_before == _RUNNING:
                    stopped.add(id(request))
                else:
                    self.waiting.remove_requests([request])
                    self.kv_holding_waiting.remove_requests([request])
                    self.deferred_waiting.discard(request.request_id)
                if self._handle_stopped_request(request):
                    result.finished.append(self._free_request(request))
                else:
                    continuing.append(request)
        if stopped:
            self.running = [r for r in self.running if id(r) not in stopped]
        for request in continuing:
            self._enqueue_waiting_request(request)
        if failed_kv_load_req_ids and not self.recompute_kv_load_failures:
            result.finished += self.finish_requests(failed_kv_load_req_ids, RequestStatus.FINISHED_ERROR)
        if kv_connector_output is not None:
            self._update_from_kv_xfer_finished(kv_connector_output, result)
        return result

    def _handle_stopped_request(self, request: Request) -> bool:
        """Whether a request that just stopped is finished (vLLM 0.33.0
        ``Scheduler._handle_stopped_request``, ``vllm/v1/core/sched/scheduler.py``).

        Every request but a streaming-input session (``resumable``) is. A
        session is parked instead: its in-flight work is dropped (computed
        tokens back to those materialized, ``num_computed_tokens -
        num_output_placeholders``; drafts and placeholders cleared; output
        still in flight marked stale, to be dropped), it keeps its blocks and
        waits in ``WAITING_FOR_STREAMING_REQ`` for its next input chunk,
        counted in ``num_waiting_for_streaming_input``. (vLLM continues it at
        once with a chunk queued by ``add_request`` while it ran; a streaming
        update is not modelled: the trace has no row for one.)"""
        if not request.resumable:
            return True
        request.num_computed_tokens -= request.num_output_placeholders
        assert request.num_computed_tokens >= 0
        request.spec_token_ids = []
        request.drop_stale_output = True
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        self.num_waiting_for_streaming_input += 1
        return False

    def _enqueue_waiting_request(self, request: Request) -> None:
        """Put a request back in the waiting queues (vLLM 0.33.0
        ``_enqueue_waiting_request``): ``kv_holding_waiting`` when it holds KV
        blocks, else ``waiting``; a blocked status (here a parked session)
        counts as deferred for the prefill-capacity guard."""
        if request.status in (RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING_FOR_STREAMING_REQ):
            self.deferred_waiting.add(request.request_id)
        (self.kv_holding_waiting if self._holds_kv_blocks(request) else self.waiting).add_request(request)

    @staticmethod
    def _roll_back_rejected(request: Request, rejected: int) -> None:
        """Rejected drafts roll back the computed count and (async) the
        placeholders that covered them (vLLM ``update_from_output``)."""
        if request.num_computed_tokens > 0:
            request.num_computed_tokens -= rejected
        if request.num_output_placeholders > 0:
            request.num_output_placeholders -= rejected

    def _handle_invalid_blocks(self, invalid_block_ids: frozenset[int]) -> list[str]:
        """A failed async load (vLLM ``_update_requests_with_invalid_blocks``
        for requests in WAITING_FOR_REMOTE_KVS): its computed count drops to
        the blocks before the first invalid one. Recompute policy: the request
        is marked to promote with that prefix; fail policy: returned, to be
        finished with FINISHED_ERROR. Returns the affected ids in queue order."""
        affected = []
        for request in self.kv_holding_waiting:
            if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            num_blocks = -(-request.num_computed_tokens // self.block_size)
            block_ids = self.kv_cache_manager.get_block_ids(request.request_id)[:num_blocks]
            for index, block_id in enumerate(block_ids):
                if block_id in invalid_block_ids:
                    request.num_computed_tokens = index * self.block_size
                    affected.append(request.request_id)
                    break
        if self.recompute_kv_load_failures:
            self.failed_recving_kv_req_ids.update(affected)
            return []
        return affected

    def _update_from_kv_xfer_finished(self, kv_connector_output: KVConnectorOutput,
                                      result: UpdateResult) -> None:
        """Finished transfers: a loading request becomes promotable at the
        next schedule(); one that finished while loading frees its blocks now
        (vLLM ``_update_from_kv_xfer_finished``)."""
        for req_id in kv_connector_output.finished_recving:
            result.finished_recving.append(req_id)
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)
                continue
            request = self.kv_pending_free.pop(req_id)
            freed, fence, groups = self._free_request_blocks(request)
            result.kv_freed.append(KVTransferFree(req_id, freed, fence, groups))

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Store the proposer's drafts for the next step (vLLM
        ``update_draft_token_ids``): finished or unknown requests are ignored,
        a request still prefilling gets none. Returns what was stored."""
        stored: dict[str, list[int]] = {}
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = [] if request.is_prefill_chunk else list(drafts)
            if request.spec_token_ids:
                stored[req_id] = request.spec_token_ids
                self._drafts_stored = True
        return stored
