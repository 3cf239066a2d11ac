"""Mutants of the simulated KV connector's remote loads.

Each breaks one rule of a request in WAITING_FOR_REMOTE_KVS (freed while
loading, its blocks cached before they arrive, no reservation for in-flight
prefills, promoted early); the invariant that catches it is in its docstring
and in ``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

from reference.kv_cache_manager import KVCacheManager
from reference.kv_connector import KVConnectorOutput
from reference.request import RequestStatus
from reference.output import SchedulerOutput
from reference.scheduler import Scheduler

from harness.candidates.mutants.blocks import build_kv_manager


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
        self.kv_cache_manager = build_kv_manager(_EagerCachingKVManager, config)


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
