"""Mutants of progress: schedulers that corrupt nothing but lose progress.

Each keeps every safety invariant (no block, budget or queue is corrupted)
and breaks one rule of the progress layer (``harness.check.progress``): a
running request skipped while the step has room, an admission refused while
the waiting head fits, a preemption while the free blocks sufficed, a
preemption of a victim whose free is fenced (it frees nothing now), a
preemption that ends the step for the running requests behind it. The
invariant that catches each is in its docstring and in
``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

from reference.output import SchedulerOutput
from reference.request import Request, RequestStatus
from reference.scheduler import Scheduler


class SkipRunningTail(Scheduler):
    """Every third step, the running tail is left out of the running loop
    while the step has budget and blocks for it (PROGRESS-RUNNING): a
    request silently skipped for a step."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._calls = 0

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._calls += 1
        if self._calls % 3 or len(self.running) < 2 or len(self.running) >= self.max_num_running_reqs:
            return super().schedule(throttle_prefills)
        hidden = self.running.pop()
        before = set(r.request_id for r in self.running)
        cap = self.max_num_running_reqs
        self.max_num_running_reqs = cap - 1  # (the hidden one still counts against max_num_seqs)
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs = cap
            # Back at the end of the old running requests (before this step's admissions).
            at = sum(1 for r in self.running if r.request_id in before)
            self.running.insert(at, hidden)


class AdmitOnePerStep(Scheduler):
    """Admits at most one waiting request per step although the next one fits
    (PROGRESS-ADMIT): the admission cap counts this step's admissions, not
    max_num_seqs."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        cap = self.max_num_running_reqs
        self.max_num_running_reqs = min(cap, len(self.running) + 1)
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs = cap


class EagerPreempt(Scheduler):
    """Keeps two blocks in reserve for the running loop: an allocation that
    would leave fewer free fails and preempts (PROGRESS-PREEMPT-NEEDED), although
    the free blocks sufficed for the request."""

    def __init__(self, config) -> None:
        super().__init__(config)
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def eager(request: Request, num_new_tokens: int, **kwargs):
            if request.status == RequestStatus.RUNNING and not kwargs:
                needed = manager.get_num_blocks_to_hold(request, request.num_computed_tokens + num_new_tokens)
                if needed > 0 and manager.block_pool.get_num_free_blocks() - needed < 2:
                    return None
            return allocate(request, num_new_tokens, **kwargs)

        manager.allocate_slots = eager


class PreemptFenced(Scheduler):
    """The running loop preempts a victim whose free is fenced behind a step
    in flight (vLLM 0.33.0 gives up instead): its blocks stay held, the
    preemption frees nothing now (PROGRESS-PREEMPT-FREES)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._choosing_victim = False

    def _select_victim(self) -> Request:
        self._choosing_victim = True
        return super()._select_victim()

    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        if self._choosing_victim:
            # The running loop's question (may this victim be preempted?): always yes.
            self._choosing_victim = False
            return True
        return super()._request_blocks_can_be_freed(request)


class StopAfterPreempt(Scheduler):
    """A preemption ends the step's running loop: once the request that
    triggered it is scheduled, every later running request is left out,
    as if its allocation failed with no victim to take (PROGRESS-AFTER-PREEMPT)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._trigger: Request | None = None
        self._at_hand: Request | None = None
        self._choosing_victim = False
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def stop_after(request: Request, num_new_tokens: int, **kwargs):
            if request.status == RequestStatus.RUNNING and not kwargs:
                self._at_hand = request
                if self._trigger is not None and request is not self._trigger:
                    return None
            return allocate(request, num_new_tokens, **kwargs)

        manager.allocate_slots = stop_after

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self._trigger = self._at_hand = None
        return super().schedule(throttle_prefills)

    def _select_victim(self) -> Request:
        self._choosing_victim = True
        return super()._select_victim()

    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        if self._choosing_victim:
            self._choosing_victim = False
            if self._trigger is not None and self._at_hand is not self._trigger:
                return False  # give up on this request: the loop ends
        return super()._request_blocks_can_be_freed(request)

    def _preempt_request(self, request: Request):
        if self._trigger is None:
            self._trigger = self._at_hand
        return super()._preempt_request(request)
