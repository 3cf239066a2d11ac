"""Doctored-trace tests of the budget family (harness/check/budget.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_budget_left_fires_when_the_budget_left_is_inconsistent(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, end = first_row(rows, "schedule_end", lambda row: row["total_num_scheduled_tokens"] > 0)
    total = end["total_num_scheduled_tokens"]
    budget = config["max_num_batched_tokens"]
    assert end["token_budget"] == budget - total
    end["token_budget"] += 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("BUDGET-LEFT", step, None, f"budget left {budget - total + 1} != {budget} - {total}")]


def test_budget_tokens_silent_on_a_fork_with_a_tighter_internal_token_cap(scenario_rows) -> None:
    """Issue 23: a fork whose own cap is 8 tokens under max_num_batched_tokens
    leaves 8 tokens less every step. BUDGET-TOKENS (safety) holds; the
    "budget left" clause is BUDGET-LEFT, vLLM's accounting, a semantics rule
    (checked under a release's profile, not under safety or the fork gate)."""
    from harness.check.profiles import PROFILES

    config, rows = scenario_rows("fcfs-roomy")
    ends = [row for _, events in rows for row in events if row["kind"] == "schedule_end"]
    for end in ends:
        end["token_budget"] -= 8
    assert check_steps(config, rows, PROFILES["safety"]).ok
    result = check_steps(config, rows)
    assert result.by_invariant == {"BUDGET-LEFT": len(ends)}
