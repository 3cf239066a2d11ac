"""The step loop: ``schedule``, ``update`` and ``drafts`` on vLLM's ``Scheduler``, batches in flight.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. Mirrors ``EngineCore.step_with_batch_queue``
(``vllm/v1/engine/core.py``): ``Scheduler.schedule``, then, for the oldest
batch in flight, ``Scheduler.update_from_output`` with the model-output stub
(``driver_model_runner_output.py``), and ``EngineCore.post_step``'s
``Scheduler.update_draft_token_ids``. Each answer carries a ``snapshot``
(``events.snapshot``).

Decisions come back in the shape of the harness's ``reference/output.py``:
``SchedulerOutput.events`` is the chronological list of
``{"type": "schedule", request_id, kind, num_computed_tokens,
num_scheduled_tokens, num_prefix_hit_tokens, new_block_ids}``,
``{"type": "withdraw", request_id, num_scheduled_tokens, block_ids}`` and
``{"type": "preempt", request_id, num_computed_tokens, freed_block_ids, fence}``
and ``{"type": "skip", request_id, reason}``, and with the KV connector
``{"type": "kv_load", ...}`` and ``{"type": "kv_promote", ...}``.
The order comes from wrapping, on the scheduler instance,
``kv_cache_manager.allocate_slots`` (each successful call is a scheduling
decision), ``_preempt_request``, ``kv_cache_manager.free`` and
``pop_blocks_for_free`` (the blocks a request releases, tail first) and the
``deferred_waiting`` set (a waiting-loop skip); the values are taken from the
real ``SchedulerOutput``, an inconsistent one recorded as it is, with the ids
its request data carries (``request_data_ids``; ``events.py``).
"""

from __future__ import annotations

from . import events as ev
from .driver_errors import DriverError

# The hooks and the normalisation are shared with the recording scheduler.
NormalisationError = ev.NormalisationError


class StepLoop:
    """``Driver``'s half that steps the scheduler (reads ``sched``,
    ``hooks``, ``in_flight``, ``max_in_flight``, ``use_v2``,
    ``num_spec``, ``async_scheduling``,
    ``DraftTokenIds``; sets ``last_preempted``)."""

    def num_free_blocks(self) -> int:
        return ev.num_free_blocks(self.sched)

    def snapshot(self) -> dict:
        return ev.snapshot(self._require(), self.last_preempted)

    # -- schedule -------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> dict:
        sched = self._require()
        if len(self.in_flight) >= self.max_in_flight:
            raise DriverError(f"'schedule' with {len(self.in_flight)} batches in flight "
                              f"(max_concurrent_batches={self.max_in_flight}): update first")
        kwargs = {}
        if throttle_prefills:
            if "throttle_prefills" not in self._schedule_sig:
                raise DriverError(f"vLLM {self.version} schedule() has no throttle_prefills")
            kwargs["throttle_prefills"] = True
        defer = ev.prefill_gate(sched, throttle_prefills)
        self.hooks.begin()
        try:
            so = sched.schedule(**kwargs)
        finally:
            self.hooks.end()
        self.in_flight.append(so)
        # Read every step, as the recording scheduler does: a fork may set its
        # own cap per step (``token_budget`` = this cap - tokens scheduled).
        output = ev.normalise(so, self.hooks.seq, use_v2=self.use_v2,
                              max_num_scheduled_tokens=sched.max_num_scheduled_tokens,
                              requests=sched.requests,
                              num_groups=self.hooks.num_groups if self.hooks.hybrid else 0)
        self.last_preempted = list(output["preempted_req_ids"])
        output.update(throttle_prefills=bool(throttle_prefills), defer_prefills=defer,
                      prefill_capacity_bound=bool(getattr(sched, "prefill_capacity_bound", False)))
        return {"output": output, "snapshot": self.snapshot()}

    def update(self, sampled: dict[str, list[int]], kv: dict | None = None) -> dict:
        sched = self._require()
        if not self.in_flight:
            raise DriverError("'update' without a preceding 'schedule'")
        so = self.in_flight[0]  # the oldest batch, as EngineCore's batch queue pops it
        req_ids = list(so.num_scheduled_tokens)
        unknown = sorted(set(sampled) - set(req_ids))
        if unknown:
            raise DriverError(f"sampled tokens for unscheduled requests {unknown[:5]}")
        requests = {r: sched.requests.get(r) for r in req_ids}
        # Draft accounting as update_from_output does it (its SpecDecodingStats
        # exist only with log_stats): drafts verified for a live request that
        # produced tokens; accepted = tokens returned - the one sampled token.
        num_draft = num_rejected = 0
        spec_tokens = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        for r in req_ids:
            request, drafts, generated = requests[r], spec_tokens.get(r), sampled.get(r)
            if request is None or request.is_finished() or not drafts or not generated:
                continue
            if getattr(request, "num_stale_output_tokens", 0) > 0 and \
                    getattr(request, "drop_stale_output", False):
                continue
            num_draft += len(drafts)
            num_rejected += len(drafts) - max(len(generated) - 1, 0)
        kv_output = self._kv_connector_output(kv)
        # Requests a failed load may finish (fail policy): unscheduled ones
        # waiting in kv_holding_waiting, in queue order.
        known = dict(sched.requests) if kv_output is not None else requests
        holding = {r.request_id: i for i, r in
                   enumerate(getattr(sched, "kv_holding_waiting", ()))}
        self.in_flight.popleft()
        self.hooks.drained = []
        self.hooks.recving, self.hooks.kv_freed = [], []
        engine_outputs = sched.update_from_output(
            so, self._model_runner_output(req_ids, sampled, kv_output))
        drained, self.hooks.drained = self.hooks.drained, []
        recving, self.hooks.recving = self.hooks.recving, []
        kv_freed, self.hooks.kv_freed = self.hooks.kv_freed, []
        new_token_ids: dict[str, list[int]] = {}
        finished: list[dict] = []
        errors: list[dict] = []
        for client in sorted(engine_outputs):
            for out in engine_outputs[client].outputs:
                if out.new_token_ids:
                    new_token_ids[out.request_id] = list(out.new_token_ids)
                if out.finish_reason is not None:
                    request = known.get(out.request_id)
                    if request is None:
                        raise NormalisationError(f"{out.request_id} finished but was not scheduled")
                    info = self._finished_info(request)
                    if info["finish_reason"] != str(out.finish_reason):
                        raise NormalisationError(f"{out.request_id}: finish reason mismatch")
                    if info["status"] == "FINISHED_ERROR" and out.request_id in holding:
                        errors.append(info)
                    else:
                        finished.append(info)
        # KV-load failures under the fail policy finish after every other
        # output, through finish_requests(set): report them in queue order
        # (as the reference does), not in the set's hash order.
        finished += sorted(errors, key=lambda f: holding[f["request_id"]])
        answer = {"new_token_ids": new_token_ids, "finished": finished,
                  "num_draft_tokens": num_draft, "num_rejected_draft_tokens": num_rejected,
                  "drained": [[fence, blocks] for fence, blocks in drained],
                  "num_unfinished": sched.get_num_unfinished_requests(),
                  "snapshot": self.snapshot()}
        if kv_output is not None:
            answer.update(finished_recving=recving,
                          invalid_block_ids=sorted(kv_output.invalid_block_ids or ()),
                          kv_freed=[list(item) for item in kv_freed])
        return answer

    def drafts(self, drafts: dict[str, list[int]]) -> dict:
        sched = self._require()
        if not self.num_spec:
            raise DriverError("draft tokens sent with speculative decoding off")
        if self.async_scheduling:
            # vLLM 0.33.0 EngineCore.post_step: `not self.async_scheduling`.
            raise DriverError("draft tokens sent with async scheduling (EngineCore hands drafts to the "
                              "scheduler only when scheduling is synchronous)")
        ids = list(drafts)
        sched.update_draft_token_ids(self.DraftTokenIds(ids, [list(drafts[i]) for i in ids]))
        stored = {}
        for req_id in ids:
            request = sched.requests.get(req_id)
            if request is not None and not request.is_finished() and request.spec_token_ids:
                stored[req_id] = list(request.spec_token_ids)
        return {"stored": stored, "snapshot": self.snapshot()}
