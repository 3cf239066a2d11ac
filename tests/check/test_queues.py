"""Doctored-trace tests of the queues/admission family (harness/check/queues.py).

ARRIVAL-ADMISSIBLE guards the engine's input processor, not the scheduler,
so it is shown on hand-made traces; so is SCHEDULED-ONCE (a request listed
twice, or scheduled as running while preempted, is hard to reach by
overriding one method of the reference); the other ids of the family fire
on the mutants (tests/check/test_catalogue.py).
"""

from __future__ import annotations

from harness.check import PROFILES, TraceChecker, check_steps
from reference.config import EngineConfig

CONFIG = EngineConfig(num_gpu_blocks=30, block_size=4, max_model_len=96, max_num_seqs=4,
                      max_num_batched_tokens=64).to_dict()


def _arrival(rid: str, n: int) -> dict:
    return {"kind": "arrival", "request_id": rid, "prompt_token_ids": list(range(10, 10 + n)),
            "priority": 0, "arrival_time_s": 0.0, "max_tokens": 4, "min_tokens": 0,
            "ignore_eos": True, "eos_token_id": 2, "stop_token_ids": []}


def _arrival_mm(rid: str, n: int, positions, kind: str = "arrival") -> dict:
    return {"kind": kind, "request_id": rid, "prompt_token_ids": list(range(10, 10 + n)), "priority": 0,
            "arrival_time_s": 0.0, "max_tokens": 4, "min_tokens": 0, "ignore_eos": True,
            "eos_token_id": 2, "stop_token_ids": [], "mm_positions": [list(p) for p in positions]}


def test_arrival_admissible_fires_on_an_overlong_accepted_prompt() -> None:
    checker = TraceChecker(CONFIG)
    checker.check_step(0, [_arrival("r0", 96)])
    (v,) = checker.result.violations
    assert (v.invariant, v.step, v.request) == ("ARRIVAL-ADMISSIBLE", 0, "r0")
    assert v.message == "accepted a prompt of 96 tokens with max_model_len 96"


def test_arrival_admissible_fires_on_a_needless_rejection() -> None:
    checker = TraceChecker(CONFIG)
    checker.check_step(0, [{**_arrival("r0", 95), "kind": "reject"}])
    (v,) = checker.result.violations
    assert v.message == "rejected a 95-token prompt that fits max_model_len 96"


def test_arrival_admissible_covers_encoder_inputs() -> None:
    config = EngineConfig(num_gpu_blocks=30, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64, encoder_cache_size=16).to_dict()
    checker = TraceChecker(config)
    checker.check_step(0, [_arrival_mm("r0", 40, [(0, 8), (10, 17)]), _arrival_mm("r1", 40, [(0, 17)], "reject"),
                           _arrival_mm("r2", 40, [(0, 16)], "reject")])
    assert [(v.invariant, v.request, v.message) for v in checker.result.violations] == [
        ("ARRIVAL-ADMISSIBLE", "r0", "accepted a request whose encoder input 1 of 17 embeds > encoder cache "
                                     "size 16"),
        ("ARRIVAL-ADMISSIBLE", "r2", "rejected a 40-token prompt that fits max_model_len 96")]


def test_scheduled_once_fires_on_a_request_scheduled_twice_in_a_step(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    step, sched = first_row(rows, "schedule", lambda row: row["schedule_kind"] == "running")
    step_rows = dict(rows)[step]
    step_rows.insert(step_rows.index(sched) + 1, dict(sched))
    result = check_steps(config, rows, PROFILES["safety"])
    assert (result.violations[0].invariant, result.violations[0].step, result.violations[0].request,
            result.violations[0].message) == ("SCHEDULED-ONCE", step, sched["request_id"],
                                              "scheduled twice in one step")


def test_scheduled_once_fires_on_a_preempted_request_scheduled_as_running(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    step, preempt = first_row(rows, "preempt")
    step_rows = dict(rows)[step]
    # The victim is scheduled again, as running, after its preemption.
    step_rows.insert(step_rows.index(preempt) + 1, {
        **preempt, "kind": "schedule", "schedule_kind": "running", "num_computed_tokens": 0,
        "num_scheduled_tokens": 1, "num_prefix_hit_tokens": 0, "block_ids": [], "spec_token_ids": None,
        "encoder_input_ids": None})
    result = check_steps(config, rows, PROFILES["safety"])
    v = result.violations[0]
    assert (v.invariant, v.step, v.request, v.message) == (
        "SCHEDULED-ONCE", step, preempt["request_id"],
        "scheduled as running but status PREEMPTED, not in the running queue")

def test_remaining_matches_the_plain_walk_whatever_the_queue() -> None:
    """``queues.remaining`` (head slice, ids looked up by ``list.index`` when
    few) returns exactly ``[r for r in queue if r not in gone]``: the head
    taken, an admitted id also later in the queue (a duplicate), ids that are
    not the head, more ids than ``_SCAN_IDS``."""
    from harness.check.queues import _SCAN_IDS, remaining
    backlog = [f"r{i}" for i in range(40)]
    cases = [
        (backlog, ["r0", "r1"], ["r2"], backlog[3:]),
        (backlog + ["r1"], ["r0", "r1"], [], backlog[2:]),
        (backlog, ["r5"], [], backlog[:5] + backlog[6:]),
        (backlog, backlog[:_SCAN_IDS + 2], [], backlog[_SCAN_IDS + 2:]),
        (backlog + ["r3"], backlog[:_SCAN_IDS + 2], [], backlog[_SCAN_IDS + 2:]),
        (backlog, [], [], backlog),
    ]
    for queue, admitted, skipped, expected in cases:
        assert remaining(queue, admitted, skipped) == expected
        assert remaining(queue, admitted, skipped) == [r for r in queue if r not in {*admitted, *skipped}]
