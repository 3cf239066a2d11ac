"""Deliberately broken schedulers: each proves that an invariant checker fires.

Every mutant changes one rule of the reference ``Scheduler`` and names the
invariant that must catch it. Select one with ``--engine mutant:NAME`` or
``--candidate mutant:NAME``.
"""

from __future__ import annotations

from reference.block_pool import BlockPool
from reference.kv_cache_manager import KVCacheManager
from reference.request import Request, RequestStatus
from reference.scheduler import ScheduledRequest, Scheduler, SchedulerOutput


class AdmitAfterPreempt(Scheduler):
    """Runs the waiting phase even in a step that preempted (NO-ADMIT-AFTER-PREEMPT)."""

    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
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
        self.kv_cache_manager = _LeakyKVCacheManager(
            num_gpu_blocks=config.num_gpu_blocks, block_size=config.block_size,
            max_model_len=config.max_model_len, enable_caching=config.enable_prefix_caching,
            watermark=config.watermark)


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


MUTANTS: dict[str, type[Scheduler]] = {
    "admit-after-preempt": AdmitAfterPreempt,
    "preempt-head": PreemptHead,
    "leak-on-finish": LeakOnFinish,
    "hit-evicted-block": HitEvictedBlock,
    "ignore-max-num-seqs": IgnoreMaxNumSeqs,
    "no-stop-on-max-tokens": NoStopOnMaxTokens,
}

# Which invariant each mutant must trip (used by the self-test).
EXPECTED_INVARIANT: dict[str, str] = {
    "admit-after-preempt": "NO-ADMIT-AFTER-PREEMPT",
    "preempt-head": "FCFS-VICTIM-TAIL",
    "leak-on-finish": "BLOCK-CONSERVATION",
    "hit-evicted-block": "PREFIX-HIT-RULES",
    "ignore-max-num-seqs": "MAX-NUM-SEQS",
    "no-stop-on-max-tokens": "STOP-RULES",
}
