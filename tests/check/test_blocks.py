"""Doctored-trace tests of the blocks and prefix-cache family (harness/check/blocks.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_block_conservation_fires_when_a_free_count_is_off_by_one(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, begin = first_row(rows, "schedule_begin", lambda row: row["num_free_blocks"] is not None)
    num_free = begin["num_free_blocks"]
    begin["num_free_blocks"] = num_free - 1
    usable = config["num_gpu_blocks"] - 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("BLOCK-CONSERVATION", step, None,
         f"at schedule_begin: {num_free - 1} free + {usable - num_free} held != {usable} usable blocks "
         f"(the trace implies {num_free} free)")]
