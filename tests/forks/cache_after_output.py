"""A correct (more conservative) fork: a full block enters the prefix cache
only after the step's output, never at allocation. ``allocate_slots`` always
delays caching (vLLM 0.33.0's ``delay_cache_blocks``, what it does for an
async KV load), and after ``update_from_output`` every running request's full
blocks within ``min(num_computed_tokens, num_tokens)`` are registered
(``cache_blocks``): their tokens are known and their KV scheduled by a step
that runs before any later hit's. Under async scheduling it registers a block
vLLM never registers: a decode's last block, completed by a step still in
flight when the request is preempted (adversarial trial, finding 3: a valid
hit on it failed PREFIX-HIT-RULES, safety, on golden async-tight step 42).
A one-group full-attention model only (a hybrid model runs the reference)."""

from __future__ import annotations

from reference.kv_cache_manager import KVCacheManager
from reference.scheduler import Scheduler


class CacheAfterOutputKVManager(KVCacheManager):
    """The reference's KV manager, never caching at allocation."""

    def allocate_slots(self, request, num_new_tokens, **kwargs):
        kwargs["delay_cache_blocks"] = True
        return super().allocate_slots(request, num_new_tokens, **kwargs)


class CacheAfterOutputScheduler(Scheduler):
    """The reference with caching moved after the step's output."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._late = type(self.kv_cache_manager) is KVCacheManager
        if self._late:
            self.kv_cache_manager.__class__ = CacheAfterOutputKVManager

    def update_from_output(self, *args, **kwargs):
        result = super().update_from_output(*args, **kwargs)
        if self._late:
            manager = self.kv_cache_manager
            for request in self.running:
                if request.request_id in manager.req_to_blocks:
                    manager.cache_blocks(request, min(request.num_computed_tokens, request.num_tokens))
        return result


def make(config):
    """The candidate factory (``forks.cache_after_output:make``)."""
    return CacheAfterOutputScheduler(config)
