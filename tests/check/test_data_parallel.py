"""Doctored-trace tests of the data-parallel family (harness/check/data_parallel.py)."""

from __future__ import annotations


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
