"""Doctored-trace tests of the preemption family (harness/check/preemption.py)."""

from __future__ import annotations

from harness.check import PROFILES, check_steps


def test_free_order_not_preempt_effects_fires_when_a_victim_frees_its_table_head_first(
        scenario_rows, first_row) -> None:
    """Every block comes back, only the order is wrong: a semantics rule of
    0.33.0 (FREE-ORDER), silent under the safety profile."""
    config, rows = scenario_rows("fcfs-tight")
    assert check_steps(config, rows).ok
    step, preempt = first_row(rows, "preempt", lambda row: len(row["block_ids"]) > 1)
    tail_first = list(preempt["block_ids"])
    preempt["block_ids"] = tail_first[::-1]
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("FREE-ORDER", step, preempt["request_id"],
         f"freed {tail_first[::-1]}, expected its table tail first {tail_first}")]
    assert check_steps(config, rows, PROFILES["safety"]).ok


def test_preempt_effects_fires_when_a_victim_keeps_a_block(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    step, preempt = first_row(rows, "preempt", lambda row: len(row["block_ids"]) > 1)
    table = list(preempt["block_ids"])[::-1]
    preempt["block_ids"] = list(preempt["block_ids"])[:-1]
    result = check_steps(config, rows, PROFILES["safety"])
    assert (result.violations[0].invariant, result.violations[0].step, result.violations[0].message) == (
        "PREEMPT-EFFECTS", step,
        f"preemption freed {preempt['block_ids']}, but it must give back its whole table {table}")
