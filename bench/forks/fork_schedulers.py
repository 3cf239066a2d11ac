"""Scheduler subclasses of vLLM 0.33.0 for bench/fork_experiment.py (issue 23):
eight with one realistic bug each, one with a semantics-only change, three
correct policies that decide differently from vLLM. Imported only inside the
vLLM driver (``vllm@0.33.0,scheduler_cls=fork_schedulers:Class``, this folder
on PYTHONPATH), never by the harness's own process.
"""

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus


# -- bugs: each corrupts or loses progress ----------------------------------------

class FreeBeforeFence(Scheduler):
    """Bug: frees a request's blocks although a step in flight may still write
    them (the deferred-free fence ignored)."""

    def _request_blocks_can_be_freed(self, request):
        return True  # the bug: was `not self.defer_block_free or last_sched_seq <= processed_step_seq`


class PreemptKeepsComputed(Scheduler):
    """Bug: a preempted request keeps its num_computed_tokens (its KV is gone)."""

    def _preempt_request(self, request, timestamp, drop_stale_output=False):
        computed = request.num_computed_tokens
        super()._preempt_request(request, timestamp, drop_stale_output)
        request.num_computed_tokens = computed  # the bug: progress not reset


class LeakOnFinish(Scheduler):
    """Bug: a finished request's blocks are never returned to the pool."""

    def _free_blocks(self, request):
        del self.requests[request.request_id]  # the bug: _free_request_blocks forgotten


class ForgetFinishedIds(Scheduler):
    """Bug: a finished request is not reported in finished_req_ids (the model
    runner keeps its state)."""

    def _free_request(self, request, delay_free_blocks=False):
        result = super()._free_request(request, delay_free_blocks)
        self.finished_req_ids.discard(request.request_id)  # the bug
        return result


class RunningCapPlusTwo(Scheduler):
    """Bug: admits up to max_num_seqs + 2 running requests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_running_reqs += 2  # the bug (and the admission cap with it)
        self.max_num_active_reqs += 2


class AdmitOnePerStep(Scheduler):
    """Bug (progress): the admission cap counts this step's admissions, so one
    request is admitted per step although more fit."""

    def schedule(self, throttle_prefills: bool = False):
        cap = self.max_num_active_reqs
        self.max_num_active_reqs = min(cap, len(self.running) + 1)  # the bug
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs = cap


class KeepReserve(Scheduler):
    """Bug (progress): a running request's allocation fails while fewer than 3
    blocks are free, so the scheduler preempts although the blocks sufficed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def reserve(request, *args, **kwargs):
            if request.status == RequestStatus.RUNNING and manager.block_pool.get_num_free_blocks() < 3:
                return None  # the bug: a reserve the running loop must not keep
            return allocate(request, *args, **kwargs)

        manager.allocate_slots = reserve


class SkipTailEveryThird(Scheduler):
    """Bug (progress): every third step the running tail is left out of the
    running loop (an off-by-one in a custom running-queue walk)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._calls = 0

    def schedule(self, throttle_prefills: bool = False):
        self._calls += 1
        if self._calls % 3 or len(self.running) < 2 or len(self.running) >= self.max_num_active_reqs:
            return super().schedule(throttle_prefills)
        hidden = self.running.pop()  # the bug
        before = {r.request_id for r in self.running}
        self.max_num_active_reqs -= 1
        self.max_num_running_reqs -= 1
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_active_reqs += 1
            self.max_num_running_reqs += 1
            self.running.insert(sum(1 for r in self.running if r.request_id in before), hidden)


class NoLongPrefillThreshold(Scheduler):
    """Semantics only: the long-prefill threshold ignored (a fairness knob of
    vLLM's design; corrupts nothing, loses no progress)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler_config.long_prefill_token_threshold = 0


# -- correct policies that decide differently -------------------------------------

class TighterTokenCap(Scheduler):
    """Correct: its own token cap, three quarters of vLLM's (never under a whole
    prompt without chunked prefill)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cap = self.max_num_scheduled_tokens * 3 // 4
        if not self.scheduler_config.enable_chunked_prefill:
            cap = max(cap, self.max_model_len)
        self.max_num_scheduled_tokens = min(self.max_num_scheduled_tokens, cap)


class RunningCapTwo(Scheduler):
    """Correct: runs at most two requests at once (max_num_seqs is a maximum)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_num_running_reqs = min(2, self.max_num_running_reqs)
        self.max_num_active_reqs = min(2, self.max_num_active_reqs)


class ChunkAt32(Scheduler):
    """Correct: every long prefill is chunked at 32 tokens a step (a fairness
    policy: vLLM applies its threshold only with more than one eligible request)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduler_config.long_prefill_token_threshold = 32
