"""Mutants of queues, admission, preemption, the token budget and stop rules.

Each breaks one rule of the reference ``Scheduler``'s waiting/running
queues (admission after a preemption, victim choice, PRIORITY give-back,
running order, max_num_seqs, max_loras), of its token budget (the total, the long
prefill threshold) or of finishing a request; the invariant that catches it
is in its docstring and in ``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

import dataclasses

from reference.request import Request, RequestStatus
from reference.output import Preemption, ScheduledRequest, SchedulerOutput, Withdrawal
from reference.scheduler import Scheduler


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
        output.request_data_ids.append(request.request_id)
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


class IgnoreMaxNumSeqs(Scheduler):
    """Admits past max_num_seqs (MAX-NUM-SEQS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.max_num_running_reqs = config.max_num_seqs + 4


class IgnoreMaxLoras(Scheduler):
    """Admits a waiting request whatever its LoRA adapter: never skips one
    whose adapter would make more than max_loras distinct adapters scheduled
    in the step (MAX-LORAS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.max_loras = None  # the bug: the waiting loop's adapter limit is off


class NoStopOnMaxTokens(Scheduler):
    """Keeps generating past max_tokens (STOP-RULES)."""

    def update_from_output(self, output, sampled_token_ids, kv_connector_output=None):
        for request in self.requests.values():
            request.max_tokens = request.sampling_params.max_tokens + 1
        return super().update_from_output(output, sampled_token_ids, kv_connector_output)


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
    """PRIORITY victim scheduled earlier in the step keeps its tokens and its
    request data in the output: the worker runs a preempted request
    (SCHEDULED-NOT-PREEMPTED)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        for event in _keep_withdrawn(output):
            # (A step that preempted admits nothing: its request data is the
            # running requests', which the victim rejoins.)
            output.request_data_ids.append(event.request_id)
        return output


class VictimStaysScheduled(Scheduler):
    """A PRIORITY victim scheduled earlier in the step leaves the request
    data (vLLM's ``scheduled_running_reqs.remove``) but stays in
    ``num_scheduled_tokens`` (its ``num_scheduled_tokens.pop`` forgotten): a
    key without request data, for a preempted request (SCHEDULED-HAS-DATA,
    and SCHEDULED-NOT-PREEMPTED)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        output = super().schedule(throttle_prefills)
        _keep_withdrawn(output)
        return output


def _keep_withdrawn(output: SchedulerOutput) -> list[Withdrawal]:
    """Undo the output's PRIORITY give-backs: each withdrawn victim's tokens
    go back into ``num_scheduled_tokens`` (and the totals); returns the
    withdrawals undone."""
    withdrawals = [e for e in output.events if isinstance(e, Withdrawal)]
    for event in withdrawals:
        output.events.remove(event)
        output.num_scheduled_tokens[event.request_id] = event.num_scheduled_tokens
        output.total_num_scheduled_tokens += event.num_scheduled_tokens
        output.token_budget -= event.num_scheduled_tokens
    return withdrawals


class PreemptKeepsDrafts(Scheduler):
    """A victim keeps the draft tokens it held (vLLM's ``spec_token_ids = []``
    in ``_preempt_request`` forgotten): a PREEMPTED request waits holding
    drafts (PREEMPTED-NO-DRAFTS). A running request holds the drafts of
    the last draft update until it is scheduled, so a victim taken before
    its turn in the running loop holds some."""

    def _preempt_request(self, request: Request) -> Preemption:
        drafts = list(request.spec_token_ids)
        preemption = super()._preempt_request(request)
        request.spec_token_ids = drafts
        return preemption


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


class ReverseRunningOrder(Scheduler):
    """Serves running requests newest first (RUNNING-ORDER)."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        before = list(self.running)
        self.running.reverse()
        output = super().schedule(throttle_prefills)
        kept = [r for r in before if r in self.running]
        self.running = kept + [r for r in self.running if r not in before]
        return output


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
        output.request_data_ids.remove(last.request_id)
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


class ResetPreemptsHead(Scheduler):
    """A forced ``reset_prefix_cache`` (reset_running_requests) preempts the
    running queue from its head instead of its tail (RESET-PREEMPTS-RUNNING)."""

    def reset_prefix_cache(self, reset_running_requests: bool = False):
        if not reset_running_requests or len(self.running) < 2:
            return super().reset_prefix_cache(reset_running_requests)
        # Reverse running so the reference's tail-first loop takes the head first.
        running_before = [r.request_id for r in self.running]
        self.running.reverse()
        result = super().reset_prefix_cache(reset_running_requests)
        result.running_before = running_before
        return result


class CrashInSchedule(Scheduler):
    """Crashes inside ``schedule()`` the first time its running loop runs out of
    KV blocks: the victim selection asserts that no preemption is ever needed
    (ENGINE-CRASH at the step that must preempt; the trace ends there, as
    vLLM's ``EngineCore`` dies on such an exception)."""

    def _select_victim(self) -> Request:
        victim = super()._select_victim()
        raise AssertionError(f"out of KV blocks: the running loop would preempt {victim.request_id}")
