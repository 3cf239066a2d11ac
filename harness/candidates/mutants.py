"""Deliberately broken schedulers: each proves that an invariant checker fires.

Every mutant changes one rule of the reference ``Scheduler`` and names the
invariant that must catch it. Select one with ``--engine mutant:NAME`` or
``--candidate mutant:NAME``.
"""

from __future__ import annotations

import dataclasses

from reference.block_pool import BlockPool
from reference.encoder_cache_manager import EncoderCacheManager
from reference.kv_cache_manager import KVCacheManager
from reference.kv_connector import KVConnectorOutput
from reference.request import Request, RequestStatus
from reference.output import Preemption, ScheduledRequest, SchedulerOutput, Withdrawal
from reference.scheduler import Scheduler


def _kv_manager(cls: type[KVCacheManager], config) -> KVCacheManager:
    """A KV-cache manager of the (broken) class ``cls`` built like the reference's."""
    return cls(num_gpu_blocks=config.num_gpu_blocks, block_size=config.block_size,
               max_model_len=config.max_model_len, enable_caching=config.enable_prefix_caching,
               watermark=config.watermark)


class AdmitAfterPreempt(Scheduler):
    """Runs the waiting phase even in a step that preempted (NO-ADMIT-AFTER-PREEMPT)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        if not output.preemptions or not self.waiting:
            return output
        # Admit the head of waiting anyway if it fits (the bug).
        request = self.waiting.peek_request()
        budget = output.token_budget
        n = min(request.num_tokens, budget)
        if n <= 0 or len(self.running) >= self.max_num_running_reqs:
            return output
        blocks = self.kv_cache_manager.allocate_slots(request, n)
        if blocks is None:
            return output
        self.waiting.pop_request()
        self.running.append(request)
        kind = "new" if request.status == RequestStatus.WAITING else "resumed"
        output.events.append(ScheduledRequest(request.request_id, kind, 0, n, 0,
                                              self.kv_cache_manager.get_block_ids(request.request_id)))
        output.num_scheduled_tokens[request.request_id] = n
        output.total_num_scheduled_tokens += n
        output.token_budget -= n
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = n
        request.is_prefill_chunk = n < request.num_tokens
        return output


class PreemptHead(Scheduler):
    """FCFS victim is the head of running, not the tail (FCFS-VICTIM-TAIL)."""

    def _select_victim(self) -> Request:
        return self.running[0]


class _LeakyKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.is_finished():
            # Forget the table without returning the blocks (the leak).
            blocks = self.req_to_blocks.pop(request.request_id, [])
            self.num_cached_block.pop(request.request_id, None)
            return [b.block_id for b in blocks[::-1]]
        return super().free(request)


class LeakOnFinish(Scheduler):
    """Finished requests never return their blocks (BLOCK-CONSERVATION)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_LeakyKVCacheManager, config)


class _NoEvictBlockPool(BlockPool):
    def _maybe_evict_cached_block(self, block) -> None:
        pass  # the bug: a reallocated block keeps its old hash in the map


class HitEvictedBlock(Scheduler):
    """Reallocating a free cached block does not evict its hash, so a later
    prefix hit can land on a block that now holds other tokens
    (PREFIX-HIT-RULES)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _NoEvictBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class IgnoreMaxNumSeqs(Scheduler):
    """Admits past max_num_seqs (MAX-NUM-SEQS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.max_num_running_reqs = config.max_num_seqs + 4


class NoStopOnMaxTokens(Scheduler):
    """Keeps generating past max_tokens (STOP-RULES)."""

    def update_from_output(self, output, sampled_token_ids):
        for request in self.requests.values():
            request.max_tokens = request.sampling_params.max_tokens + 1
        return super().update_from_output(output, sampled_token_ids)


class PreemptWaiting(Scheduler):
    """When it preempts, also marks the head of waiting PREEMPTED although it
    never ran (PREEMPT-ONLY-RUNNING)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        if output.preemptions:
            for request in self.waiting:
                if request.status == RequestStatus.WAITING:
                    request.status = RequestStatus.PREEMPTED
                    request.num_preemptions += 1
                    output.events.append(Preemption(request.request_id, 0, []))
                    output.preempted_req_ids.add(request.request_id)
                    break
        return output


class LifoPriorityVictim(Scheduler):
    """Under PRIORITY picks the running tail, as FCFS would
    (PRIORITY-VICTIM-MAX)."""

    def _select_victim(self) -> Request:
        return self.running[-1]


class NoGiveBack(Scheduler):
    """PRIORITY victim scheduled earlier in the step keeps its tokens in the
    output: the worker runs a preempted request (PRIORITY-GIVE-BACK)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        for event in [e for e in output.events if isinstance(e, Withdrawal)]:
            output.events.remove(event)
            output.num_scheduled_tokens[event.request_id] = event.num_scheduled_tokens
            output.total_num_scheduled_tokens += event.num_scheduled_tokens
            output.token_budget -= event.num_scheduled_tokens
        return output


class _AbortLeakKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.req_to_blocks.pop(request.request_id, None)
            self.num_cached_block.pop(request.request_id, None)
            return []  # the blocks never return to the pool
        return super().free(request)


class LeakOnAbort(Scheduler):
    """An aborted request's blocks are forgotten, not freed (FREE-ORDER)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_AbortLeakKVCacheManager, config)


class _DoubleFreeKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        blocks = list(self.req_to_blocks.get(request.request_id, ()))
        freed = super().free(request)
        # The bug: a block still shared with another request is released a
        # second time, so it enters the free queue while still referenced.
        shared = [b for b in blocks if b.ref_cnt > 0]
        self.block_pool.free_blocks(shared[:1])
        return freed


class _TolerantBlockPool(BlockPool):
    def free_blocks(self, ordered_blocks) -> None:
        # Ignore frees of blocks already at ref 0 instead of asserting, so the
        # double free shows up in the trace rather than as a crash.
        super().free_blocks([b for b in ordered_blocks if b.ref_cnt > 0])


class DoubleFreeShared(Scheduler):
    """Frees a prefix-shared block twice; it is then handed to a new owner
    while the other request still holds it (BLOCK-CONSERVATION)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_DoubleFreeKVCacheManager, config)
        self.kv_cache_manager.block_pool = _TolerantBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class _TailFreeBlockPool(BlockPool):
    def free_blocks(self, ordered_blocks) -> None:
        ordered = list(ordered_blocks)
        for block in ordered:
            block.ref_cnt -= 1
        # The bug: every block goes to the tail, unhashed ones included.
        self.free_block_queue.append_n([b for b in ordered if b.ref_cnt == 0])


class FreeUnhashedToTail(Scheduler):
    """Unhashed (partial) blocks are freed to the tail instead of the head
    (ALLOC-FROM-HEAD: the next allocation does not take the expected block)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _TailFreeBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class BudgetOverrun(Scheduler):
    """Schedules up to 16 tokens more per step than the budget (BUDGET-TOKENS)."""

    def __init__(self, config) -> None:
        super().__init__(dataclasses.replace(
            config, max_num_batched_tokens=config.max_num_batched_tokens + 16,
            max_num_scheduled_tokens=None))


class IgnoreThreshold(Scheduler):
    """Ignores long_prefill_token_threshold (BUDGET-THRESHOLD)."""

    def __init__(self, config) -> None:
        super().__init__(dataclasses.replace(config, long_prefill_token_threshold=0))


class _PreemptLeakKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.status != RequestStatus.RUNNING:
            return super().free(request)
        # Preemption (the request is still RUNNING here): the first block is
        # dropped from the table but never returned to the pool.
        blocks = self.req_to_blocks.get(request.request_id, [])
        if blocks:
            blocks.pop(0)
            self.num_cached_block.pop(request.request_id, None)
        return super().free(request)


class PreemptKeepsBlock(Scheduler):
    """A preempted request does not give back its first block (PREEMPT-EFFECTS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_PreemptLeakKVCacheManager, config)


class ReverseRunningOrder(Scheduler):
    """Serves running requests newest first (RUNNING-ORDER)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        before = list(self.running)
        self.running.reverse()
        output = super().schedule(throttle_prefills)
        kept = [r for r in before if r in self.running]
        self.running = kept + [r for r in self.running if r not in before]
        return output


class _OverAllocKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, **kwargs):
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            kwargs["num_lookahead_tokens"] = self.block_size  # one block too many
        return super().allocate_slots(request, num_new_tokens, **kwargs)


class OverAllocate(Scheduler):
    """Admissions get one block more than their tokens need (BLOCKS-COVER)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_OverAllocKVCacheManager, config)


class _ReuseHeldBlockPool(BlockPool):
    def get_new_blocks(self, num_blocks: int):
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        if blocks and blocks[-1].ref_cnt == 1:
            # The bug: the last block stays at the head, to be handed out again.
            self.free_block_queue.prepend_n([blocks[-1]])
        return blocks


class ReuseHeldBlock(Scheduler):
    """Hands a block still held by one request to another (BLOCK-EXCLUSIVE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _ReuseHeldBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class ForgetFinishedIds(Scheduler):
    """Never tells the worker which requests finished (FINISHED-IDS)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        output.finished_req_ids = set()
        return output


class AdmissionPreempts(Scheduler):
    """When admission stops with requests still waiting, preempts the request
    it just admitted, as if the waiting loop could preempt
    (WAITING-NEVER-PREEMPTS)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        admitted = [e for e in output.scheduled if e.kind != "running"]
        if not admitted or output.preemptions or not self.waiting:
            return output
        last = admitted[-1]
        request = self.requests[last.request_id]
        n = output.num_scheduled_tokens.pop(last.request_id)
        output.total_num_scheduled_tokens -= n
        output.token_budget += n
        request.num_computed_tokens -= n
        request.num_in_flight_tokens -= n
        self.running.remove(request)
        output.events.append(Withdrawal(request.request_id, n, last.new_block_ids))
        output.events.append(self._preempt_request(request))
        output.preempted_req_ids.add(request.request_id)
        self.reset_preempted_req_ids.discard(request.request_id)
        return output


class DraftsOnPrefill(Scheduler):
    """Stores drafts for requests still prefilling (SPEC-TOKENS)."""

    def update_draft_token_ids(self, draft_token_ids):
        for request in self.requests.values():
            if request.is_prefill_chunk and request.status == RequestStatus.RUNNING:
                draft_token_ids.setdefault(request.request_id, [11] * self.num_spec_tokens)
        stored = {}
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is not None and not request.is_finished():
                request.spec_token_ids = list(drafts)
                stored[req_id] = request.spec_token_ids
        return stored


class NoDraftRollback(Scheduler):
    """Rejected drafts are not rolled back: num_computed_tokens runs ahead of
    the tokens that exist (COMPUTED-CONTINUITY)."""

    def update_from_output(self, output, sampled_token_ids):
        result = super().update_from_output(output, sampled_token_ids)
        for req_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(req_id)
            sampled = sampled_token_ids.get(req_id, [])
            if request is not None and sampled:
                request.num_computed_tokens += len(drafts) - (len(sampled) - 1)
        return result


class FreeBeforeFence(Scheduler):
    """Frees a request's blocks at once although a step in flight may still
    write them (DEFERRED-FREE-FENCED)."""

    def _free_request_blocks(self, request: Request):
        return self.kv_cache_manager.free(request), None


class NoStaleSkip(Scheduler):
    """Re-admits a preempted request while its old output is still in flight
    (STALE-OUTPUT)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        saved = {r.request_id: r.num_stale_output_tokens for r in self.waiting}
        for request in self.waiting:
            request.num_stale_output_tokens = 0
        try:
            return super().schedule(throttle_prefills)
        finally:
            for req_id, stale in saved.items():
                if req_id in self.requests:
                    self.requests[req_id].num_stale_output_tokens = stale


class NoAsyncMaxTokensGuard(Scheduler):
    """Async: keeps scheduling a request whose in-flight tokens already reach
    max_tokens (ASYNC-PLACEHOLDERS)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        for request in self.running:
            request.max_tokens = 10**9
        try:
            return super().schedule(throttle_prefills)
        finally:
            for request in self.requests.values():
                request.max_tokens = request.sampling_params.max_tokens


class IgnorePrefillCadence(Scheduler):
    """Reports the cadence's deferral but schedules prefills anyway
    (PREFILL-DEFER)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.interval_for_report = config.prefill_schedule_interval

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self.local_prefill_interval = 1  # the bug: no local cadence
        output = super().schedule(throttle_prefills)
        self.local_prefill_interval = self.interval_for_report
        return output


class IgnoreThrottle(Scheduler):
    """Ignores the data-parallel coordinator's throttle_prefills flag
    (PREFILL-DEFER)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        return super().schedule(False)


class _TolerantKVUpdates(Scheduler):
    """Ignores transfer reports for requests the (broken) scheduler no longer
    considers loading, so the mutant runs on instead of failing vLLM's assert."""

    def _update_from_kv_xfer_finished(self, kv_connector_output, result) -> None:
        known = tuple(i for i in kv_connector_output.finished_recving
                      if i in self.kv_pending_free or (
                          i in self.requests
                          and self.requests[i].status == RequestStatus.WAITING_FOR_REMOTE_KVS))
        super()._update_from_kv_xfer_finished(
            KVConnectorOutput(known, kv_connector_output.invalid_block_ids), result)


class FreeWhileLoading(_TolerantKVUpdates):
    """Frees an aborted request's blocks at once although its KV load may
    still write them (REMOTE-KV-ABORT-HOLDS)."""

    def finish_requests(self, request_ids, finished_status):
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(req_id)  # the bug: as if the load were done
        return super().finish_requests(request_ids, finished_status)


class _EagerCachingKVManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, **kwargs):
        kwargs["delay_cache_blocks"] = False  # the bug: caches blocks still being loaded
        return super().allocate_slots(request, num_new_tokens, **kwargs)


class CacheBeforeLoad(Scheduler):
    """Registers an async load's blocks in the prefix cache at admission, so
    others hit blocks whose KV has not arrived (PREFIX-HIT-RULES)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = _kv_manager(_EagerCachingKVManager, config)


class NoLoadReservation(Scheduler):
    """Admits async loads without leaving the blocks in-flight prefills still
    need (REMOTE-KV-RESERVATION)."""

    def _inflight_prefill_reserved_blocks(self) -> int:
        return 0


class PromoteEarly(_TolerantKVUpdates):
    """Promotes a loading request before its transfer reported done
    (REMOTE-KV-LOADING)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        for request in self.kv_holding_waiting:
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving_kv_req_ids.add(request.request_id)
        return super().schedule(throttle_prefills)


class IgnoreEncoderBudget(Scheduler):
    """Encodes every input a window needs, whatever the encoder compute budget
    left; the budget goes negative (ENCODER-BUDGET)."""

    def _try_schedule_encoder_inputs(self, request, num_computed_tokens, num_new_tokens,
                                     encoder_compute_budget):
        ids, n, _, duplicates = super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, 1 << 30)
        return ids, n, encoder_compute_budget - sum(request.get_num_encoder_embeds(i) for i in ids), \
            duplicates


class _NoHitEncoderCache(EncoderCacheManager):
    def check_and_update_cache(self, request, input_id) -> bool:
        return False  # the bug: never a hit, so cached inputs are encoded again

    def allocate(self, request, input_id) -> None:
        if request.mm_hashes[input_id] in self.cached:
            # Keep the bookkeeping consistent: reference the existing entry.
            super().check_and_update_cache(request, input_id)
            return
        super().allocate(request, input_id)


class NoEncoderCacheCheck(Scheduler):
    """Never looks an encoder input up in the encoder cache: inputs cached by
    an earlier step or another request are encoded again (ENCODER-INPUTS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.encoder_cache_manager = _NoHitEncoderCache(config.encoder_cache_capacity)


class _NewestFirstEncoderCache(EncoderCacheManager):
    def _pop_eviction_victim(self) -> tuple[str, int]:
        return self.freeable.popitem(last=True)  # the bug: newest first


class EvictNewestFirst(Scheduler):
    """Evicts the most recently freed encoder-cache entry first instead of
    the oldest (ENCODER-CACHE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.encoder_cache_manager = _NewestFirstEncoderCache(config.encoder_cache_capacity)


class NoEncoderGiveBack(Scheduler):
    """PRIORITY give-back returns a withdrawn victim's tokens but not its
    encoder embeds: later windows are cut for want of budget
    (ENCODER-INPUTS)."""

    def _encoder_embeds_to_restore(self, victim, input_ids) -> int:
        return 0


# Mutant name -> (class, the invariant that must catch it).
MUTANTS_AND_TARGETS: dict[str, tuple[type[Scheduler], str]] = {
    "admit-after-preempt": (AdmitAfterPreempt, "NO-ADMIT-AFTER-PREEMPT"),
    "preempt-head": (PreemptHead, "FCFS-VICTIM-TAIL"),
    "preempt-waiting": (PreemptWaiting, "PREEMPT-ONLY-RUNNING"),
    "lifo-priority-victim": (LifoPriorityVictim, "PRIORITY-VICTIM-MAX"),
    "no-give-back": (NoGiveBack, "PRIORITY-GIVE-BACK"),
    "leak-on-finish": (LeakOnFinish, "BLOCK-CONSERVATION"),
    "leak-on-abort": (LeakOnAbort, "FREE-ORDER"),
    "double-free-shared": (DoubleFreeShared, "BLOCK-CONSERVATION"),
    "free-unhashed-to-tail": (FreeUnhashedToTail, "ALLOC-FROM-HEAD"),
    "hit-evicted-block": (HitEvictedBlock, "PREFIX-HIT-RULES"),
    "budget-overrun": (BudgetOverrun, "BUDGET-TOKENS"),
    "ignore-threshold": (IgnoreThreshold, "BUDGET-THRESHOLD"),
    "preempt-keeps-block": (PreemptKeepsBlock, "PREEMPT-EFFECTS"),
    "reverse-running-order": (ReverseRunningOrder, "RUNNING-ORDER"),
    "over-allocate": (OverAllocate, "BLOCKS-COVER"),
    "reuse-held-block": (ReuseHeldBlock, "BLOCK-EXCLUSIVE"),
    "forget-finished-ids": (ForgetFinishedIds, "FINISHED-IDS"),
    "admission-preempts": (AdmissionPreempts, "WAITING-NEVER-PREEMPTS"),
    "drafts-on-prefill": (DraftsOnPrefill, "SPEC-TOKENS"),
    "no-draft-rollback": (NoDraftRollback, "COMPUTED-CONTINUITY"),
    "free-before-fence": (FreeBeforeFence, "DEFERRED-FREE-FENCED"),
    "no-stale-skip": (NoStaleSkip, "STALE-OUTPUT"),
    "no-async-max-tokens-guard": (NoAsyncMaxTokensGuard, "ASYNC-PLACEHOLDERS"),
    "ignore-prefill-cadence": (IgnorePrefillCadence, "PREFILL-DEFER"),
    "ignore-throttle": (IgnoreThrottle, "PREFILL-DEFER"),
    "ignore-max-num-seqs": (IgnoreMaxNumSeqs, "MAX-NUM-SEQS"),
    "no-stop-on-max-tokens": (NoStopOnMaxTokens, "STOP-RULES"),
    "free-while-loading": (FreeWhileLoading, "REMOTE-KV-ABORT-HOLDS"),
    "cache-before-load": (CacheBeforeLoad, "PREFIX-HIT-RULES"),
    "no-load-reservation": (NoLoadReservation, "REMOTE-KV-RESERVATION"),
    "promote-early": (PromoteEarly, "REMOTE-KV-LOADING"),
    "ignore-encoder-budget": (IgnoreEncoderBudget, "ENCODER-BUDGET"),
    "no-encoder-cache-check": (NoEncoderCacheCheck, "ENCODER-INPUTS"),
    "evict-newest-first": (EvictNewestFirst, "ENCODER-CACHE"),
    "no-encoder-give-back": (NoEncoderGiveBack, "ENCODER-INPUTS"),
}
MUTANTS: dict[str, type[Scheduler]] = {k: v[0] for k, v in MUTANTS_AND_TARGETS.items()}
EXPECTED_INVARIANT: dict[str, str] = {k: v[1] for k, v in MUTANTS_AND_TARGETS.items()}
