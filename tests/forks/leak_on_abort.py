"""A broken fork of the reference scheduler: an aborted request's last KV
block keeps one extra reference, so it never returns to the free queue (new-
user trial, "block leaked on abort"). BLOCK-CONSERVATION catches it; the
progress rules must count free blocks as the engine's rows say, not as the
checker's model of a correct engine would hold them."""

from __future__ import annotations

from reference.request import RequestStatus
from reference.scheduler import Scheduler


class LeakOnAbort(Scheduler):
    """``finish_requests`` of an abort first takes one more reference on the
    request's last block: the free that follows leaves it held."""

    def finish_requests(self, request_ids, finished_status):
        if finished_status == RequestStatus.FINISHED_ABORTED:
            for rid in request_ids:
                blocks = self.kv_cache_manager.req_to_blocks.get(rid)
                if blocks:
                    blocks[-1].ref_cnt += 1  # the bug: never dropped
        return super().finish_requests(request_ids, finished_status)


def make(config):
    """``forks.leak_on_abort:make``."""
    return LeakOnAbort(config)
