"""Every invariant in the catalogue is shown to fire.

Scheduler bugs are shown by the mutants (harness mutants). ARRIVAL-ADMISSIBLE
guards the engine's input processor, not the scheduler, so it is shown on a
hand-made trace.
"""

from __future__ import annotations

from harness.check import TraceChecker
from harness.check.invariants import INVARIANTS
from harness.mutation import kill_matrix
from reference.config import EngineConfig

CONFIG = EngineConfig(num_gpu_blocks=30, block_size=4, max_model_len=96, max_num_seqs=4,
                      max_num_batched_tokens=64).to_dict()


def _arrival(rid: str, n: int) -> dict:
    return {"kind": "arrival", "request_id": rid, "prompt_token_ids": list(range(10, 10 + n)),
            "priority": 0, "arrival_time_s": 0.0, "max_tokens": 4, "min_tokens": 0,
            "ignore_eos": True, "eos_token_id": 2, "stop_token_ids": []}


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


def test_every_invariant_is_shown_to_fire() -> None:
    fired = {"ARRIVAL-ADMISSIBLE", "SPEC-ACCEPTANCE", "DP-ROUTING"}  # doctored-trace tests here
    for row in kill_matrix():
        for cell in row.cells.values():
            fired |= set(cell.result.by_invariant)
    assert sorted(set(INVARIANTS) - fired) == []


def test_spec_acceptance_fires_when_the_model_output_ignores_the_drafts(tmp_path) -> None:
    """A model runner (not the scheduler) that returns tokens which do not
    start with the accepted drafts: shown on a doctored spec-decode trace."""
    from harness.trace.recorder import record
    from harness.scenarios import SCENARIOS
    from harness.trace import open_trace

    scenario = SCENARIOS["spec-decode"]
    path = tmp_path / "spec.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path)
    trace = open_trace(path)
    steps = list(trace.iter_steps())
    doctored = None
    for step, events in steps:
        drafts = {e["request_id"]: e["spec_token_ids"] for e in events
                  if e["kind"] == "schedule" and e["spec_token_ids"]}
        for e in events:
            if e["kind"] == "output" and e["request_id"] in drafts and len(e["token_ids"]) >= 2:
                e["token_ids"] = [e["token_ids"][0] + 1] + e["token_ids"][1:]
                doctored = (step, e["request_id"])
                break
        if doctored:
            break
    assert doctored is not None
    checker = TraceChecker(trace.meta["config"])
    for step, events in steps:
        checker.check_step(step, events)
        if step == doctored[0]:
            break
    assert [(v.invariant, v.step, v.request) for v in checker.result.violations][0] == \
        ("SPEC-ACCEPTANCE", doctored[0], doctored[1])


def test_dp_routing_fires_when_an_arrival_goes_to_the_busier_rank(tmp_path) -> None:
    """The coordinator (engine side, not a scheduler) routes to the least
    loaded rank: shown on a doctored data-parallel trace."""
    from harness.check import check_steps
    from harness.trace.recorder import record
    from harness.scenarios import SCENARIOS
    from harness.trace import open_trace

    scenario = SCENARIOS["dp2-throttle"]
    path = tmp_path / "dp.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path)
    trace = open_trace(path)
    steps = list(trace.iter_steps())
    assert check_steps(trace.meta["config"], steps).ok
    # Move the first arrival routed to rank 1 onto rank 0.
    arrival = next(e for _, events in steps for e in events
                   if e["kind"] == "arrival" and e["rank"] == 1)
    arrival["rank"] = 0
    result = check_steps(trace.meta["config"], steps)
    first = next(v for v in result.violations if v.invariant == "DP-ROUTING")
    assert first.request == arrival["request_id"]
    assert first.message.startswith("routed to rank 0, but rank 1 had the fewest unfinished")
