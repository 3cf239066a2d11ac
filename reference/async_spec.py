"""Speculative decoding under async scheduling: the worker's side of the drafts.

With more than one batch in flight (``async_scheduling``), vLLM 0.33.0 never
hands real draft ids to the scheduler. How the drafts flow instead:

* ``AsyncScheduler._update_after_schedule``
  (``vllm/v1/core/sched/async_scheduler.py``): every request scheduled this
  step that is not a partial prefill chunk gets ``1 + len(its scheduled
  drafts)`` output placeholders and, as its pending drafts,
  ``num_speculative_tokens`` placeholders ``-1`` (``_spec_token_placeholders``).
  So the next ``schedule()`` (before this step's output is back) gives it
  ``1 + K`` tokens, ``K`` of them the ``-1`` placeholders, exactly as the sync
  scheduler would with real drafts (``Scheduler.schedule``, running loop:
  ``num_new_tokens + num_computed_tokens - num_tokens -
  num_output_placeholders`` draft positions).
* ``EngineCore.post_step`` (``vllm/v1/engine/core.py``) calls
  ``update_draft_token_ids`` only when scheduling is *not* async; under
  async scheduling ``step_with_batch_queue`` calls
  ``take_draft_token_ids`` only for a batch deferred for structured output,
  and then into that batch's output (``update_draft_token_ids_in_output``),
  never into a request. So the scheduler's pending drafts are the ``-1``
  placeholders all along, and the trace has no ``draft`` rows.
* The worker (``vllm/v1/worker/gpu_model_runner.py``, ``_prepare_input_ids``)
  scatters the drafts it proposed after the previous batch it executed into
  the ``-1`` positions of each request that batch sampled for
  (``prev_req_id_to_index``: partial prefill chunks excluded); a request it
  has no drafts for keeps ``-1``, which the model never samples, so every
  such draft is rejected (a resumed request's padding, a request that skipped
  the previous batch). An empty batch returns before any of this, so it keeps
  the drafts of the batch before it. The positions the scheduler counted
  optimistically (all drafts of the unprocessed batch accepted) are corrected
  on the device by that batch's rejections (``_update_states``,
  ``correct_spec_decode_token_counts``).
* When the output comes back one step later, ``Scheduler.update_from_output``
  rolls the rejected drafts back from ``num_computed_tokens`` and
  ``num_output_placeholders`` (so each placeholder is resolved exactly once:
  ``1 + K`` per decode, by the accepted tokens plus the rejections). The
  output of a batch whose request was preempted after the batch was scheduled
  is *stale* (``num_stale_output_tokens``, counted in scheduled tokens, the
  ``-1`` draft positions included): its tokens are still appended, but its
  rejections, its placeholder resolution and its stop trim change no counter
  (the preemption already reset them to 0), and its stale share drains by the
  batch's scheduled tokens, not by the tokens it returned.

``WorkerDrafts`` is that worker state for one data-parallel rank; the engine
(``reference.engine``) passes each batch through ``worker_view`` before the
model runner executes it and calls ``after_execute`` right after. The model
runner itself proposes and verifies drafts exactly as in sync mode
(``reference.runners.scripted``).
"""

from __future__ import annotations

import dataclasses

from reference.output import ScheduledRequest, SchedulerOutput

#: The draft id the scheduler schedules in place of a draft it does not know.
SPEC_TOKEN_PLACEHOLDER = -1


class WorkerDrafts:
    """The worker's drafts and position corrections for one rank.

    ``drafts``: request id -> the drafts proposed after the last non-empty
    batch, for the requests it sampled for. ``rejected``: request id -> drafts
    of the batch launched just before (empty or not) that the model rejected;
    the scheduler has not rolled them back yet when it schedules the next
    batch (one batch in flight besides it: ``max_concurrent_batches`` 2).
    """

    def __init__(self) -> None:
        self.drafts: dict[str, list[int]] = {}
        self.rejected: dict[str, int] = {}

    def worker_view(self, output: SchedulerOutput) -> SchedulerOutput:
        """``output`` as the worker runs it: each scheduled request's ``-1``
        drafts replaced by the worker's own (the first ``k`` of them; ``-1``
        kept where it has none), and a running request's
        ``num_computed_tokens`` lowered by the rejections of the batch before,
        which the scheduler counted as accepted. ``output`` itself (what the
        scheduler decided, and what the trace records) is left untouched."""
        for req_id in output.preempted_req_ids | output.finished_req_ids:
            self.drafts.pop(req_id, None)  # the worker drops their state
        events = []
        for event in output.events:
            if isinstance(event, ScheduledRequest) and event.request_id in output.num_scheduled_tokens:
                event = self._fill(event)
            events.append(event)
        return dataclasses.replace(output, events=events)

    def _fill(self, s: ScheduledRequest) -> ScheduledRequest:
        computed = s.num_computed_tokens
        if s.kind == "running":
            computed -= self.rejected.get(s.request_id, 0)
        if not s.spec_token_ids and computed == s.num_computed_tokens:
            return s
        own = self.drafts.get(s.request_id, [])
        drafts = [own[i] if d == SPEC_TOKEN_PLACEHOLDER and i < len(own) else d
                  for i, d in enumerate(s.spec_token_ids)]
        return dataclasses.replace(s, num_computed_tokens=computed, spec_token_ids=drafts)

    def after_execute(self, view: SchedulerOutput, sampled: dict[str, list[int]],
                      proposals: dict[str, list[int]]) -> None:
        """Remember what executing ``view`` (the worker's view of a batch)
        left on the device: its rejections, and ``proposals``, the drafts the
        model runner proposed after it for the requests it sampled for (an
        empty batch changes nothing but clears the rejections: the scheduler
        processes the batch it followed before scheduling again)."""
        self.rejected = {}
        for s in view.scheduled:
            tokens = sampled.get(s.request_id) or []
            if s.spec_token_ids and tokens:
                self.rejected[s.request_id] = len(s.spec_token_ids) - (len(tokens) - 1)
        if view.total_num_scheduled_tokens == 0:
            return
        self.drafts = {req_id: list(d) for req_id, d in proposals.items() if sampled.get(req_id)}

    @staticmethod
    def sampled_ids(view: SchedulerOutput, sampled: dict[str, list[int]]) -> list[str]:
        """The requests of ``view`` that sampled (the ones the worker drafts for)."""
        return [s.request_id for s in view.scheduled if sampled.get(s.request_id)]
