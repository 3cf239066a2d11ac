"""Doctored-trace tests of the budget family (harness/check/budget.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_budget_tokens_fires_when_the_budget_left_is_inconsistent(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, end = first_row(rows, "schedule_end", lambda row: row["total_num_scheduled_tokens"] > 0)
    total = end["total_num_scheduled_tokens"]
    budget = config["max_num_batched_tokens"]
    assert end["token_budget"] == budget - total
    end["token_budget"] += 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("BUDGET-TOKENS", step, None, f"budget left {budget - total + 1} != {budget} - {total}")]
