"""Doctored-trace tests of the preemption family (harness/check/preemption.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_preempt_effects_fires_when_a_victim_frees_its_table_head_first(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    assert check_steps(config, rows).ok
    step, preempt = first_row(rows, "preempt", lambda row: len(row["block_ids"]) > 1)
    tail_first = list(preempt["block_ids"])
    preempt["block_ids"] = tail_first[::-1]
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("PREEMPT-EFFECTS", step, preempt["request_id"],
         f"preemption freed {tail_first[::-1]}, but it must give back its whole table tail first: "
         f"{tail_first}")]
