"""Broken engines for the block rules' regression tests (not forks a gate
should pass): each corrupts the KV pool in one way the checker must name."""

from __future__ import annotations

from reference.request import RequestStatus
from reference.scheduler import Scheduler


def too_few(config):
    """A running request's decode steps get no new block, so a table that
    crosses a block boundary covers one block too few (BLOCKS-COVER)."""
    sched = Scheduler(config)
    plain = sched.kv_cache_manager.allocate_slots

    def allocate_slots(request, num_new_tokens, **kwargs):
        if request.status == RequestStatus.RUNNING and request.num_computed_tokens >= request.num_prompt_tokens:
            return []
        return plain(request, num_new_tokens, **kwargs)

    sched.kv_cache_manager.allocate_slots = allocate_slots
    return sched


class LeakOnAbort(Scheduler):
    """An aborted request's last block keeps one extra reference, so it never
    returns to the free queue (BLOCK-CONSERVATION: the trial user's fork)."""

    def finish_requests(self, request_ids, finished_status):
        if finished_status == RequestStatus.FINISHED_ABORTED:
            for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
                table = self.kv_cache_manager.req_to_blocks.get(rid)
                if table:
                    table[-1].ref_cnt += 1
        return super().finish_requests(request_ids, finished_status)


def leak_on_abort(config):
    """``LeakOnAbort`` for ``config``."""
    return LeakOnAbort(config)
