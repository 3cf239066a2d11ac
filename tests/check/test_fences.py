"""Doctored-trace tests of the async-and-fences family (harness/check/fences.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_deferred_free_fenced_fires_when_a_drain_names_another_fence(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("deferred-frees")
    assert check_steps(config, rows).ok
    step, drain = first_row(rows, "free_drain")
    fence, blocks = drain["fence"], list(drain["block_ids"])
    drain["fence"] = fence + 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("DEFERRED-FREE-FENCED", step, None,
         f"drained (fence {fence + 1}, {blocks}); the oldest deferred free is (fence {fence}, {blocks})")]
