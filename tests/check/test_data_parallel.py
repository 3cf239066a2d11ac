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
    assert first.message.startswith("routed to rank 0, which receives ")
    assert "but least-loaded routing gives it" in first.message


def test_dp_routing_counts_same_step_arrivals_on_every_rank() -> None:
    """Issue 23: two requests arriving in one step on two ranks, listed in the
    scenario as B then A. The coordinator routes B to rank 0 and A to rank 1;
    the trace lists rank 0's rows first, so the order across ranks is lost,
    and comparing request by request in (arrival time, id) order expected A on
    rank 0. The reference's own trace is conformant; moving A to rank 0 (two
    arrivals on one rank, none on the other) fires once, for the arrival past
    rank 0's share."""
    from harness.check import check_steps
    from harness.trace.recorder import run_to_rows
    from workloads.scenario import load_scenario

    import textwrap
    import tempfile
    from pathlib import Path

    text = textwrap.dedent('''
        format_version = 1
        description = "two ranks, two arrivals in step 0"
        [config]
        block_size = 4
        max_model_len = 64
        num_gpu_blocks = 30
        data_parallel_size = 2
        [[requests]]
        request_id = "B"
        prompt_len = 8
        max_tokens = 4
        ignore_eos = true
        arrival_step = 0
        [[requests]]
        request_id = "A"
        prompt_len = 8
        max_tokens = 4
        ignore_eos = true
        arrival_step = 0
    ''')
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dp.toml"
        path.write_text(text)
        scenario = load_scenario(path)
    steps: list = []
    run_to_rows(scenario.workload, scenario.engine_config(), seed=scenario.seed,
                on_step_rows=lambda s, rows: steps.append((s, rows)))
    config = scenario.engine_config().to_dict()
    arrivals = [(e["request_id"], e["rank"]) for e in steps[0][1] if e["kind"] == "arrival"]
    assert arrivals == [("B", 0), ("A", 1)]
    assert check_steps(config, steps).ok
    for e in steps[0][1]:
        if e["kind"] == "arrival" and e["request_id"] == "A":
            e["rank"] = 0
    routing = [(v.invariant, v.step, v.request) for v in check_steps(config, steps).violations
               if v.invariant == "DP-ROUTING"]
    assert routing == [("DP-ROUTING", 0, "A")]
