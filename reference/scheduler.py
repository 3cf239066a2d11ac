"""The scheduler: which requests run each step, with how many tokens.

Mirrors ``vllm/v1/core/sched/scheduler.py::Scheduler`` of vLLM 0.33.0 (spec
sections 3, 4, 6 and the 0.33.0 deltas of section 10) for one full-attention
KV-cache group, text-only requests, no LoRA, no KV connector, synchronous
scheduling and no speculative decoding.

There is no prefill or decode phase: each request has ``num_computed_tokens``
and a target (``num_tokens_with_spec`` + placeholders); every step gives
requests tokens so the computed count catches up, first to ``running`` (in
order, preempting on KV shortage), then, only if nobody was preempted, to
``waiting`` (admissions).
"""

from __future__ import annotations

from reference.config import EngineConfig
from reference.kv_cache_manager import KVCacheManager
from collections import deque

from reference.kv_cache_utils import KVCacheBlock
from reference.output import (FinishedRequest, Preemption, ScheduledRequest, SchedulerOutput,
                              SchedulerSnapshot, Skip, UpdateResult, Withdrawal)
from reference.request import Request, RequestStatus, check_stop
from reference.request_queue import create_request_queue


class Scheduler:
    """The reference scheduler. One instance per engine (per DP rank).

    State: ``requests`` (id -> Request, unfinished only), ``waiting`` (policy
    queue), ``running`` (list, admission order), ``kv_cache_manager``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.max_num_running_reqs = config.max_num_seqs
        self.max_num_scheduled_tokens = config.token_budget
        self.kv_cache_manager = KVCacheManager(
            num_gpu_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            watermark=config.watermark,
        )
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(config.policy)
        self.running: list[Request] = []
        # Ids finished / preempted since the previous schedule(): the next
        # SchedulerOutput carries them so the worker drops their state.
        self.finished_req_ids: set[str] = set()
        self.reset_preempted_req_ids: set[str] = set()
        # Tokens the model samples per scheduled step (0 only for diffusion).
        self.num_sampled_tokens_per_step = 1
        self.num_spec_tokens = config.num_speculative_tokens
        self.async_scheduling = config.async_scheduling
        # Deferred block frees (spec 5.10): a request's blocks may still be
        # written by a step in flight; they return to the pool only after the
        # output of the newest step that scheduled it has been processed.
        self.defer_block_free = config.defer_block_free
        self.sched_step_seq = 0       # +1 per schedule() that scheduled tokens
        self.processed_step_seq = 0   # +1 per update_from_output of such a step
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()
        # Prefill gating (spec 7.1, 10.4).
        # With data parallelism the interval drives the coordinator's throttle
        # flag instead (spec 10.4).
        self.local_prefill_interval = (config.prefill_schedule_interval
                                       if config.data_parallel_size == 1 else 1)
        self.prefill_capacity_bound = False
        self.last_prefill_step = -self.local_prefill_interval
        self.num_executed_steps = 0
        # Requests skipped by the waiting loop or enqueued blocked (vLLM's
        # deferred_waiting); it only feeds prefill_capacity_bound.
        self.deferred_waiting: set[str] = set()

    # -- requests in and out -------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Enqueue a new request in ``waiting``. ValueError on a duplicate id."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.waiting.add_request(request)
        self.requests[request.request_id] = request

    def finish_requests(self, request_ids: list[str], finished_status: RequestStatus) -> list[FinishedRequest]:
        """Finish requests from outside (client abort). Unknown or already
        finished ids are ignored. Returns what was finished, in the given order."""
        assert RequestStatus.is_finished(finished_status)
        valid = [self.requests[i] for i in request_ids
                 if i in self.requests and not self.requests[i].is_finished()]
        gone = set(map(id, valid))
        self.running = [r for r in self.running if id(r) not in gone]
        self.waiting.remove_requests(valid)
        finished = []
        for request in valid:
            request.status = finished_status
            finished.append(self._free_request(request))
        return finished

    def _free_request(self, request: Request) -> FinishedRequest:
        assert request.is_finished()
        self.finished_req_ids.add(request.request_id)
        self.deferred_waiting.discard(request.request_id)
        freed, fence = self._free_request_blocks(request)
        del self.requests[request.request_id]
        return FinishedRequest(request.request_id, request.status, request.get_finished_reason(),
                               request.stop_reason, request.num_output_tokens, freed, fence)

    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        # An in-flight step may still write the request's blocks.
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, request: Request) -> tuple[list[int], int | None]:
        """Free now, or defer behind the fence ``sched_step_seq`` (spec 5.10).
        Returns (block ids in free order, fence or None)."""
        if self._request_blocks_can_be_freed(request):
            return self.kv_cache_manager.free(request), None
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))
        return [b.block_id for b in reversed(blocks)], self.sched_step_seq

    def _drain_deferred_frees(self) -> list[tuple[int, list[int]]]:
        """Return deferred blocks whose fence has passed, FIFO, stopping at
        the first pending fence; each entry is freed tail first."""
        drained = []
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            fence, blocks = self.deferred_frees.popleft()
            self.kv_cache_manager.block_pool.free_blocks(reversed(blocks))
            drained.append((fence, [b.block_id for b in reversed(blocks)]))
        return drained

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def snapshot(self) -> SchedulerSnapshot:
        """Queue orders and free blocks (the candidate protocol's state view)."""
        return SchedulerSnapshot(tuple(r.request_id for r in self.waiting),
                                 tuple(r.request_id for r in self.running),
                                 self.kv_cache_manager.num_free_blocks)

    # -- schedule --------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Decide one step. See the module docstring and spec 3, 4, 10.3-10.6.

        ``throttle_prefills`` is the data-parallel coordinator's flag for a
        step off its prefill cadence (spec 7.1).
        """
        events: list[ScheduledRequest | Withdrawal | Preemption] = []
        scheduled_running: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        token_budget = self.max_num_scheduled_tokens
        # 0.33.0 input budget; draft slots are 0 without a draft-model proposer.
        draft_slots = 0
        input_budget = self.config.max_num_batched_tokens
        # 0.33.0: the long-prefill cap applies only when someone could starve.
        num_eligible = len(self.running) + len(self.waiting)
        threshold = self.config.long_prefill_token_threshold if num_eligible > 1 else 0

        # A running-loop request that was still prefilling before this step
        # (then new decodes are not padded with placeholder drafts).
        prefill_scheduled = False
        # An admission with prompt left to compute (stamps the cadence).
        prefill_admitted = False

        # Prefill gating: on a throttled step, or inside the local cadence
        # interval, defer prefill compute while decodes are running, unless
        # the last release step could not drain the waiting queue.
        has_decode = any(not r.is_prefill_chunk for r in self.running)
        defer_prefills = throttle_prefills and not self.prefill_capacity_bound and has_decode
        if (not defer_prefills and self.local_prefill_interval > 1
                and not self.prefill_capacity_bound
                and (self.num_executed_steps + 1) - self.last_prefill_step < self.local_prefill_interval
                and has_decode):
            defer_prefills = True

        # 1. RUNNING requests, in order.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            if input_budget <= draft_slots:
                break
            # Async: enough is in flight to reach max_tokens even if every
            # draft is rejected; do not schedule past it.
            if (request.num_output_placeholders > 0
                    and request.num_computed_tokens + 2 - request.num_output_placeholders
                    >= request.num_prompt_tokens + request.max_tokens):
                req_index += 1
                continue
            num_new_tokens = (request.num_tokens_with_spec + request.num_output_placeholders
                              - request.num_computed_tokens)
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, token_budget, input_budget - draft_slots)
            # Keep the sampled token's position inside max_model_len.
            num_new_tokens = min(num_new_tokens, self.max_model_len - request.num_computed_tokens
                                 - self.num_sampled_tokens_per_step)
            if defer_prefills and request.is_prefill_chunk:
                req_index += 1  # a prefill chunk waits for a cadence-aligned step
                continue
            if num_new_tokens <= 0:
                # Skip, not break: lower-priority requests may still run.
                req_index += 1
                continue

            num_computed_before = request.num_computed_tokens
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_blocks is not None:
                    break
                # Out of KV blocks: preempt the lowest-priority running request.
                victim = self._select_victim()
                if not self._request_blocks_can_be_freed(victim):
                    break  # 0.33.0: a deferred free would not help now; give up
                victim_index = self.running.index(victim)
                del self.running[victim_index]
                # 0.33.0: decrement whenever the victim sat before the cursor
                # (only possible under PRIORITY: the FCFS tail never does).
                if victim_index < req_index:
                    req_index -= 1
                given_back = scheduled_running.pop(victim.request_id, None)
                if given_back is not None:
                    # PRIORITY give-back of a victim scheduled earlier this step.
                    restored = num_scheduled_tokens.pop(victim.request_id)
                    events.append(Withdrawal(victim.request_id, restored, given_back.new_block_ids))
                    token_budget += restored
                    input_budget += restored + draft_slots
                events.append(self._preempt_request(victim))
                preempted.append(victim)
                if victim is request:
                    break

            if new_blocks is None:
                if self.config.policy == "priority" and request.status == RequestStatus.PREEMPTED:
                    # 0.33.0: it preempted itself; `req_index` already points at
                    # the next (higher-priority) request, which may still fit.
                    continue
                break

            record = ScheduledRequest(request.request_id, "running", num_computed_before,
                                      num_new_tokens, 0, [b.block_id for b in new_blocks])
            events.append(record)
            scheduled_running[request.request_id] = record
            prefill_scheduled |= request.is_prefill_chunk
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            input_budget -= num_new_tokens + draft_slots
            req_index += 1
            # Drafts ride along only on the tokens past num_tokens, so never
            # on a prefill chunk; whatever is not scheduled is dropped.
            if request.spec_token_ids:
                k = (num_new_tokens + request.num_computed_tokens - request.num_tokens
                     - request.num_output_placeholders)
                if k > 0:
                    record.spec_token_ids = request.spec_token_ids[:k]
                request.spec_token_ids = []

        # 2. WAITING requests, only if nobody was preempted this step.
        if not preempted:
            step_skipped: list[Request] = []
            while token_budget > 0:
                if not self.waiting or input_budget <= draft_slots:
                    break
                if len(self.running) >= self.max_num_running_reqs:
                    break
                request = self.waiting.peek_request()
                if request.num_stale_output_tokens and not request.drop_stale_output:
                    # Deliverable stale output still in flight: resuming now could
                    # resample a position that output will deliver.
                    step_skipped.append(self.waiting.pop_request())
                    self.deferred_waiting.add(request.request_id)
                    events.append(Skip(request.request_id, "stale output in flight"))
                    continue
                # Prefix lookup: preempted requests were reset to 0 and re-match.
                hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
                if defer_prefills and num_hit_tokens < request.num_tokens - 1:
                    break  # local prefill deferred to a cadence-aligned step
                request_budget = min(token_budget, input_budget - draft_slots)
                num_new_tokens = request.num_tokens - num_hit_tokens
                pad_spec_decode = False
                # 0.33.0 (spec 10.6): a new decode (one token left) is padded to
                # 1 + K with -1 drafts so the batch stays uniform.
                if (self.num_spec_tokens > 0 and self.num_sampled_tokens_per_step > 0
                        and num_new_tokens == 1 and not prefill_scheduled
                        and (scheduled_running or num_hit_tokens > 0)):
                    padded = 1 + self.num_spec_tokens
                    if num_hit_tokens + padded + self.num_sampled_tokens_per_step <= self.max_model_len:
                        if padded > request_budget:
                            break  # rather not schedule than schedule unpadded
                        num_new_tokens = padded
                        pad_spec_decode = True
                if 0 < threshold < num_new_tokens:
                    num_new_tokens = threshold
                if not self.config.enable_chunked_prefill and num_new_tokens > request_budget:
                    break  # no skipping ahead to shorter requests
                num_new_tokens = min(num_new_tokens, request_budget)
                assert num_new_tokens > 0
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens,
                    num_new_computed_tokens=num_hit_tokens,
                    new_computed_blocks=hit_blocks,
                    full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
                    has_scheduled_reqs=bool(self.running),
                )
                if new_blocks is None:
                    break  # admission never preempts

                self.waiting.pop_request()
                self.running.append(request)
                if request.status == RequestStatus.WAITING:
                    kind = "new"
                elif request.status == RequestStatus.PREEMPTED:
                    kind = "resumed"
                else:
                    raise RuntimeError(f"invalid status {request.status.name} in waiting")
                events.append(ScheduledRequest(
                    request.request_id, kind, num_hit_tokens, num_new_tokens, num_hit_tokens,
                    self.kv_cache_manager.get_block_ids(request.request_id),
                    [-1] * self.num_spec_tokens if pad_spec_decode else []))
                num_scheduled_tokens[request.request_id] = num_new_tokens
                token_budget -= num_new_tokens
                input_budget -= num_new_tokens + draft_slots
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit_tokens
                self.deferred_waiting.discard(request.request_id)
                prefill_admitted |= num_hit_tokens < request.num_tokens - 1
            # Skipped requests go back to the head, in the order met.
            for request in reversed(step_skipped):
                self.waiting.prepend_request(request)
            if not defer_prefills:
                # Saturation guard: a release step that could not drain the
                # never-skipped waiting requests stops the gating.
                self.prefill_capacity_bound = len(self.waiting) > len(self.deferred_waiting)

        total = sum(num_scheduled_tokens.values())
        if total > 0:
            self.num_executed_steps += 1
        if self.local_prefill_interval > 1 and (prefill_scheduled or prefill_admitted):
            self.last_prefill_step = self.num_executed_steps
        assert total <= self.max_num_scheduled_tokens
        assert token_budget >= 0 and input_budget >= 0
        assert len(self.running) <= self.max_num_running_reqs

        output = SchedulerOutput(
            events=events,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            token_budget=token_budget,
            throttle_prefills=throttle_prefills,
            defer_prefills=defer_prefills,
            prefill_capacity_bound=self.prefill_capacity_bound,
        )
        if self.defer_block_free and total > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(output)
        return output

    def _select_victim(self) -> Request:
        """Spec 4.2: PRIORITY takes the running request with the largest
        (priority, arrival_time), the first such in running order; FCFS the
        tail of running (the most recently admitted)."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt_request(self, request: Request) -> Preemption:
        """Spec 4.3: free blocks, reset progress, back to the head of waiting.

        The caller has already removed ``request`` from ``running``.
        """
        assert request.status == RequestStatus.RUNNING, "only running requests can be preempted"
        num_computed_before = request.num_computed_tokens
        freed, fence = self._free_request_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.drop_stale_output = False
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.waiting.prepend_request(request)
        self.reset_preempted_req_ids.add(request.request_id)
        return Preemption(request.request_id, num_computed_before, freed, fence)

    def _update_after_schedule(self, output: SchedulerOutput) -> None:
        # Advance computed counts now, so the next schedule() can continue a
        # chunked prefill before this step's output returns.
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            request.num_in_flight_tokens += n
            if self.defer_block_free:
                request.last_sched_seq = self.sched_step_seq
            request.is_prefill_chunk = request.num_computed_tokens < (
                request.num_tokens + request.num_output_placeholders)
            if self.async_scheduling and not request.is_prefill_chunk:
                # AsyncScheduler: the sampled token (and drafts) are in flight.
                request.num_output_placeholders += (
                    self.num_sampled_tokens_per_step
                    + len(output.scheduled_spec_decode_tokens.get(req_id, ())))
        # Fresh sets: the output keeps the old objects.
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()

    # -- update ----------------------------------------------------------------
    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]]) -> UpdateResult:
        """Apply the model's sampled tokens for ``output`` (spec 6, 10.8).

        ``sampled_token_ids[id]`` is empty for a partial prefill chunk. Tokens
        are appended one at a time with ``check_stop`` after each; a stop
        truncates the rest. Finished requests leave ``running`` and free
        their blocks (tail first).
        """
        result = UpdateResult()
        stopped: set[int] = set()
        if self.defer_block_free and output.total_num_scheduled_tokens > 0:
            # Every write of this and earlier steps has completed.
            self.processed_step_seq += 1
            result.drained = self._drain_deferred_frees()
        spec_tokens = output.scheduled_spec_decode_tokens
        for req_id, n in output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            is_stale = False
            if request is not None:
                request.num_in_flight_tokens -= n
                if request.num_stale_output_tokens > 0:
                    is_stale = True
                    request.num_stale_output_tokens -= n
            if request is None or request.is_finished():
                continue  # aborted while in flight
            new_token_ids = list(sampled_token_ids.get(req_id, ()))
            drafts = spec_tokens.get(req_id)
            if drafts and new_token_ids and not is_stale:
                # Greedy verification: the model returns the accepted drafts
                # plus one token; roll back the rejected positions.
                accepted = max(len(new_token_ids) - self.num_sampled_tokens_per_step, 0)
                rejected = len(drafts) - accepted
                if request.num_computed_tokens > 0:
                    request.num_computed_tokens -= rejected
                if request.num_output_placeholders > 0:
                    request.num_output_placeholders -= rejected
                result.num_draft_tokens += len(drafts)
                result.num_rejected_draft_tokens += rejected
            if not new_token_ids:
                continue
            status_before = request.status
            had_placeholders = request.num_output_placeholders > 0
            for num_new, token_id in enumerate(new_token_ids, 1):
                request.append_output_token_ids(token_id)
                if check_stop(request, self.max_model_len):
                    if not is_stale:
                        request.num_computed_tokens -= len(new_token_ids) - num_new
                    del new_token_ids[num_new:]
                    break
            if not is_stale and request.num_output_placeholders > 0:
                request.num_output_placeholders -= len(sampled_token_ids[req_id])
            # 0.33.0 (spec 10.8): with drafts or placeholders, blocks completed
            # by accepted tokens are cached now, before a stopped request frees.
            if (not is_stale and status_before == RequestStatus.RUNNING
                    and (had_placeholders or self.num_spec_tokens > 0)):
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_in_flight_tokens)
            result.new_token_ids[req_id] = new_token_ids
            if request.is_finished():
                if status_before == RequestStatus.RUNNING:
                    stopped.add(id(request))
                else:
                    self.waiting.remove_requests([request])
                result.finished.append(self._free_request(request))
        if stopped:
            self.running = [r for r in self.running if id(r) not in stopped]
        return result

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Store the proposer's drafts for the next step (vLLM
        ``update_draft_token_ids``): finished or unknown requests are ignored,
        a request still prefilling gets none. Returns what was stored."""
        stored: dict[str, list[int]] = {}
        for req_id, drafts in draft_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            request.spec_token_ids = [] if request.is_prefill_chunk else list(drafts)
            if request.spec_token_ids:
                stored[req_id] = request.spec_token_ids
        return stored
