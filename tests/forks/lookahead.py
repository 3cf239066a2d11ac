"""A correct fork: running requests get one block of look-ahead slots reserved
ahead of need (``num_lookahead_tokens=block_size`` to ``allocate_slots``, the
argument vLLM passes a drafter's look-ahead in), falling back to the plain
allocation when that does not fit. More blocks than the tokens need corrupt
nothing: BLOCKS-EXACT (semantics), never BLOCKS-COVER (safety)."""

from __future__ import annotations

from reference.request import RequestStatus
from reference.scheduler import Scheduler


def make(config):
    """The reference scheduler whose KV manager over-allocates by a block for RUNNING requests."""
    sched = Scheduler(config)
    manager = sched.kv_cache_manager
    plain = manager.allocate_slots

    def allocate_slots(request, num_new_tokens, **kwargs):
        if request.status == RequestStatus.RUNNING and not kwargs.get("num_lookahead_tokens"):
            blocks = plain(request, num_new_tokens, **{**kwargs, "num_lookahead_tokens": config.block_size})
            if blocks is not None:
                return blocks
        return plain(request, num_new_tokens, **kwargs)

    manager.allocate_slots = allocate_slots
    return sched
