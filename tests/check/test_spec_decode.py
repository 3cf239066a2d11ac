"""Doctored-trace tests of the spec-decode family (harness/check/spec_decode.py)."""

from __future__ import annotations

from harness.check import TraceChecker


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
