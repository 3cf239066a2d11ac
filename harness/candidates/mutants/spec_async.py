"""Mutants of speculative decoding, async scheduling and its fences, and
the prefill cadence.

Each breaks one rule of drafts (stored while prefilling, not rolled back),
of batches in flight (a free before its fence, a stale output re-admitted,
the max_tokens guard on in-flight tokens) or of deferring prefills (the
local cadence, the data-parallel throttle); the invariant that catches it is
in its docstring and in ``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

from reference.request import Request, RequestStatus
from reference.output import SchedulerOutput
from reference.scheduler import Scheduler


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

    def update_from_output(self, output, sampled_token_ids, kv_connector_output=None):
        result = super().update_from_output(output, sampled_token_ids, kv_connector_output)
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
        return self.kv_cache_manager.free(request), None, None


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


class StaleSpecOutput(Scheduler):
    """Async scheduling with drafts: applies the stale speculative output of a
    batch whose request was preempted after the batch was scheduled, as if it
    were the request's own fresh output: its rejected drafts are rolled back
    from num_computed_tokens and num_output_placeholders and its tokens resolve
    placeholders, although the preemption already reset both to 0 (vLLM 0.33.0
    discards all three for stale output, ``update_from_output`` and
    ``_update_request_with_output``, ``is_stale``). The resumed request then
    starts with negative placeholders: its prefill counts as done too early
    and its later steps schedule the wrong number of draft positions
    (SPEC-TOKENS)."""

    def update_from_output(self, output, sampled_token_ids, kv_connector_output=None):
        stale = {}
        for req_id, drafts in output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(req_id)
            tokens = sampled_token_ids.get(req_id) or []
            if request is not None and request.num_stale_output_tokens > 0 and tokens:
                stale[req_id] = (request, len(drafts) - (len(tokens) - 1), len(tokens))
        result = super().update_from_output(output, sampled_token_ids, kv_connector_output)
        for request, rejected, num_tokens in stale.values():
            # The bug: no is_stale test (and no > 0 guard: a fresh output's
            # request always has them positive).
            request.num_computed_tokens -= rejected
            request.num_output_placeholders -= rejected + num_tokens
        return result
