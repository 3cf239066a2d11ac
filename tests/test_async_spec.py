"""Async scheduling with speculative decoding (reference/async_spec.py, vLLM 0.33.0
``AsyncScheduler`` + the GPU model runner's draft handling): placeholders,
rollback one step later, stale speculative output, the worker's drafts, the
engine's draft flow, the stale-spec-output mutant and the restricted fuzz strategy."""

from __future__ import annotations

import functools

from harness.candidates.mutants import MUTANTS_AND_TARGETS
from harness.check import check_steps
from harness.fuzz import fuzz
from harness.fuzz.run import known_reference_finding
from harness.scenarios import SCENARIOS
from harness.trace.recorder import run_to_rows
from reference.async_spec import WorkerDrafts
from reference.config import EngineConfig
from reference.engine import Engine
from reference.output import ScheduledRequest, SchedulerOutput
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler

# The cases asserted here are hypothesis's shrinks run to their end: no wall-clock bound on
# shrinking (fuzz's default, SHRINK_BUDGET_S, cut one short on a loaded machine: 8 requests, not 2).
fuzz = functools.partial(fuzz, shrink_budget_s=None)

CONFIG = EngineConfig(num_gpu_blocks=20, block_size=4, max_model_len=64, async_scheduling=True,
                      num_speculative_tokens=2)


def _one_request() -> tuple[Scheduler, Request]:
    sched = Scheduler(CONFIG)
    request = Request(request_id="A", prompt_token_ids=list(range(8)),
                      sampling_params=SamplingParams(max_tokens=10), arrival_time=0.0, priority=0,
                      block_size=4)
    sched.add_request(request)
    return sched, request


def test_placeholders_and_rejections_rolled_back_one_step_later() -> None:
    """An 8-token prompt, K=2, two batches in flight. The prefill (8 tokens)
    leaves 1 output placeholder and [-1, -1] as pending drafts; the next step,
    before that output is back, schedules 1 + 2 tokens with drafts [-1, -1]
    (computed 8 -> 11, placeholders 1 + 3). The prefill's token resolves one
    placeholder; the decode's output (one draft accepted, one rejected: 2
    tokens) rolls back 1 computed token and 1 + 2 placeholders, leaving those
    of the batch scheduled meanwhile."""
    sched, a = _one_request()
    o1 = sched.schedule()
    assert (o1.num_scheduled_tokens, o1.scheduled_spec_decode_tokens) == ({"A": 8}, {})
    assert (a.num_computed_tokens, a.num_output_placeholders, a.spec_token_ids) == (8, 1, [-1, -1])
    o2 = sched.schedule()
    assert (o2.num_scheduled_tokens, o2.scheduled_spec_decode_tokens) == ({"A": 3}, {"A": [-1, -1]})
    assert (a.num_computed_tokens, a.num_output_placeholders) == (11, 4)
    sched.update_from_output(o1, {"A": [100]})
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (11, 3, 9)
    o3 = sched.schedule()
    assert (o3.num_scheduled_tokens, o3.scheduled_spec_decode_tokens) == ({"A": 3}, {"A": [-1, -1]})
    assert (a.num_computed_tokens, a.num_output_placeholders) == (14, 6)
    u2 = sched.update_from_output(o2, {"A": [101, 102]})
    assert (u2.new_token_ids, u2.num_draft_tokens, u2.num_rejected_draft_tokens) == ({"A": [101, 102]}, 2, 1)
    # 11 tokens, 10 computed + the 3 of o3 in flight; o3's 1 + 2 placeholders left.
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens) == (13, 3, 11)


def test_stale_speculative_output_is_delivered_and_changes_no_counter() -> None:
    """Preempted while its decode (1 + 2 tokens, drafts [-1, -1]) is in flight:
    the preemption resets computed, placeholders and drafts to 0 and marks
    those 3 tokens stale; the resume is skipped while they are in flight. The
    stale output (2 tokens: one draft rejected) is appended and its drafts
    counted, but its rejection, placeholder resolution and stop trim change
    nothing; the stale share drains by the 3 scheduled tokens, not the 2
    returned; then the request resumes from its cached prefix (8 of 11)."""
    sched, a = _one_request()
    o1, o2 = sched.schedule(), sched.schedule()
    sched.update_from_output(o1, {"A": [100]})
    sched.running.remove(a)
    preemption = sched._preempt_request(a)
    assert (preemption.num_computed_tokens, preemption.freed_block_ids) == (11, [3, 2, 1])
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_stale_output_tokens,
            a.spec_token_ids) == (0, 0, 3, [])
    o3 = sched.schedule()
    assert o3.num_scheduled_tokens == {} and [(e.request_id, e.reason) for e in o3.events] == \
        [("A", "stale output in flight")]
    u2 = sched.update_from_output(o2, {"A": [101, 102]})
    assert (u2.new_token_ids, u2.num_draft_tokens, u2.num_rejected_draft_tokens) == ({"A": [101, 102]}, 2, 1)
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_tokens, a.num_stale_output_tokens,
            a.status) == (0, 0, 11, 0, RequestStatus.PREEMPTED)
    o4 = sched.schedule()
    assert [(e.kind, e.num_computed_tokens, e.num_scheduled_tokens, e.spec_token_ids)
            for e in o4.scheduled] == [("resumed", 8, 3, [])]


def _output(*scheduled: ScheduledRequest, preempted=()) -> SchedulerOutput:
    return SchedulerOutput(list(scheduled), {s.request_id: s.num_scheduled_tokens for s in scheduled},
                           sum(s.num_scheduled_tokens for s in scheduled), set(preempted), set(), 0)


def test_worker_fills_placeholders_with_its_own_drafts_and_corrects_positions() -> None:
    """The worker's view of a batch: -1 placeholders become the drafts it
    proposed after the previous non-empty batch (for the requests that batch
    sampled), -1 stays where it has none, a running request's computed count
    loses the rejections of the batch before; an empty batch keeps the drafts
    but clears the rejections; a preempted request's drafts are dropped."""
    w = WorkerDrafts()
    first = _output(ScheduledRequest("A", "running", 10, 3, 0, [], [-1, -1]),
                    ScheduledRequest("B", "new", 0, 5, 0, [1]))
    view = w.worker_view(first)
    assert view.scheduled[0].spec_token_ids == [-1, -1] and view.scheduled[0].num_computed_tokens == 10
    w.after_execute(view, {"A": [7], "B": []}, {"A": [40, 41], "B": [50, 51]})
    assert (w.drafts, w.rejected) == ({"A": [40, 41]}, {"A": 2})
    second = _output(ScheduledRequest("A", "running", 13, 3, 0, [], [-1, -1]),
                     ScheduledRequest("B", "running", 5, 3, 0, [], [-1, -1]))
    view = w.worker_view(second)
    assert [(s.request_id, s.num_computed_tokens, s.spec_token_ids) for s in view.scheduled] == \
        [("A", 11, [40, 41]), ("B", 5, [-1, -1])]
    assert second.scheduled[0].spec_token_ids == [-1, -1]  # the scheduler's output is untouched
    w.after_execute(view, {"A": [40, 9], "B": [8]}, {"A": [60, 61], "B": [70, 71]})
    assert (w.drafts, w.rejected) == ({"A": [60, 61], "B": [70, 71]}, {"A": 1, "B": 2})
    empty = w.worker_view(_output(preempted={"B"}))
    w.after_execute(empty, {}, {})
    assert (w.drafts, w.rejected) == ({"A": [60, 61]}, {})


def test_engine_never_hands_drafts_to_the_scheduler_under_async_scheduling() -> None:
    """EngineCore.post_step calls update_draft_token_ids only when scheduling
    is synchronous: on the async canonical scenario it is never called (the
    worker keeps its drafts), on the synchronous spec-decode scenario every
    update step calls it."""
    calls = []

    class Counting(Scheduler):
        def update_draft_token_ids(self, draft_token_ids):
            calls.append(dict(draft_token_ids))
            return super().update_draft_token_ids(draft_token_ids)

    for name, expected_calls in (("async-spec-decode", 0), ("spec-decode", 127)):
        scenario = SCENARIOS[name]
        calls.clear()
        Engine(scenario.engine_config(), seed=scenario.seed, candidate_factory=Counting).run(
            scenario.make_workload())
        assert len(calls) == expected_calls, name


def test_stale_spec_output_mutant_is_caught_by_check_and_by_fuzz() -> None:
    """The mutant applies the stale speculative output (rollback, placeholder
    resolution) of a preempted request: on the canonical scenario the resumed
    requests then schedule draft positions their placeholders do not leave
    (SPEC-TOKENS x18, first at step 26, request r000006; then negative
    computed counts at admissions, COMPUTED-CONTINUITY and PREFIX-HIT-LONGEST); ``harness fuzz --async-spec`` finds it at
    seed 0 after 502 examples, shrunk to 3 requests. Only the five stale
    speculative outputs of the scenario trigger it: the decisions before the
    first one equal the reference's."""
    cls, target = MUTANTS_AND_TARGETS["stale-spec-output"]
    assert target == "SPEC-TOKENS"
    scenario = SCENARIOS["async-spec-decode"]
    rows: list = []
    run_to_rows(scenario.make_workload(), scenario.engine_config(), seed=scenario.seed,
                candidate_factory=cls, on_step_rows=lambda s, r: rows.append((s, r)))
    result = check_steps(scenario.engine_config().to_dict(), rows)
    # PROGRESS-RUNNING: a request whose stale drafts the mutant kept is left out of a step it fit.
    assert result.by_invariant == {"SPEC-TOKENS": 18, "COMPUTED-CONTINUITY": 3, "PREFIX-HIT-LONGEST": 2,
                                   "PROGRESS-RUNNING": 1}
    first = result.violations[0]
    assert (first.invariant, first.step, first.request) == ("SPEC-TOKENS", 26, "r000006")
    found = fuzz(cls, max_examples=600, seed=0, known=known_reference_finding, async_spec=True)
    assert found.found and (found.examples, len(found.case.requests)) == (502, 3)
    assert found.case.config["async_scheduling"] and found.case.config["num_speculative_tokens"] == 1


def test_async_spec_strategy_draws_only_async_spec_and_the_reference_survives_it() -> None:
    """``fuzz(async_spec=True)``: 300 examples at seed 0, all async scheduling
    with 1-3 drafts and pipeline_parallel_size 1; the reference fails none but
    the known findings."""
    seen = []

    def on_example(n: int, shrinking: bool) -> None:
        seen.append(n)

    result = fuzz(None, max_examples=300, seed=0, known=known_reference_finding, async_spec=True,
                  on_example=on_example)
    assert result.failure is None, result.failure and result.failure.to_dict()
    assert result.examples == 300 and seen[-1] == 300
    assert result.known == {"kv-failed-load-wedge": 5, "kv-spec-reservation-wedge": 2}
