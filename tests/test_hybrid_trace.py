"""Hybrid models recorded and checked (issue 28 stage 2): per-group block ids
in the trace (schema 9, docs/trace-format.md "Hybrid models"), the per-group
block rules and the sliding-window rules (harness/check/hybrid.py), their
mutants, and the hybrid goldens (golden/hybrid/)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.check import check_steps
from harness.check.invariants import INVARIANTS
from harness.golden import CHECKOUT_DIR, check_goldens
from harness.mutation import kill_matrix, run_candidate
from harness.scenarios import HYBRID_SCENARIOS
from harness.trace import open_trace
from harness.trace.schema import HYBRID_SCHEMA_VERSION, SCHEMA_VERSION
from reference.scheduler import Scheduler

HYBRID = CHECKOUT_DIR / "hybrid"
SLIDING_WINDOW_SCENARIOS = ["hybrid-alternating", "hybrid-five-to-one"]


def _rows(path: Path, steps: set[int]) -> list[dict]:
    return [r for step, rows in open_trace(path).iter_steps() if step in steps for r in rows]


def _brief(r: dict) -> tuple:
    return (r["step"], r["event_index"], r["kind"], r["request_id"], r["num_computed_tokens"],
            r["num_scheduled_tokens"], r["num_prefix_hit_tokens"], r["block_ids"], r["group_block_ids"])


def test_a_hybrid_trace_is_schema_9_and_a_one_group_trace_keeps_schema_8_without_the_column() -> None:
    hybrid = pq.ParquetFile(HYBRID / "hybrid-alternating.parquet").schema_arrow
    single = pq.ParquetFile(CHECKOUT_DIR / "prefix-sharing.parquet").schema_arrow
    assert str(hybrid.field("group_block_ids").type) == "list<element: list<element: int32>>"
    assert "group_block_ids" not in single.names and len(hybrid.names) == len(single.names) + 1
    assert open_trace(HYBRID / "hybrid-alternating.parquet").meta["schema_version"] == HYBRID_SCHEMA_VERSION == 9
    one_group = open_trace(CHECKOUT_DIR / "prefix-sharing.parquet")
    assert one_group.meta["schema_version"] == SCHEMA_VERSION == 8
    assert all(r["group_block_ids"] is None for _, rows in one_group.iter_steps() for r in rows)  # read as null


def test_blocks_per_group_window_frees_and_a_sliding_window_hit_in_the_alternating_golden() -> None:
    # Layers [sliding (window 8), full]: group 0 sliding window, group 1 full attention; block 4 tokens.
    rows = [_brief(r) for r in _rows(HYBRID / "hybrid-alternating.parquet", {0, 12, 52})
            if r["kind"] in ("schedule", "skipped_free", "finish")]
    # A 64-token chunk: 16 blocks a group, every group's blocks in allocation order pool-wide.
    assert rows[0] == (0, 2, "schedule", "r000000", 0, 64, 0, list(range(1, 33)),
                       [list(range(1, 17)), list(range(17, 33))])
    # 35 computed: the window of token 35 starts at 28, so slot 6 (tokens 24-27) leaves group 0
    # before the allocation, last block first, and its slot holds the null block.
    assert rows[1] == (12, 2, "skipped_free", "r000001", None, None, None, [43], [[43], []])
    assert rows[2] == (12, 3, "schedule", "r000001", 35, 1, 0, [], [[], []])
    # A finish frees group after group, each table tail first, leading null slots left out.
    assert rows[4] == (12, 9, "finish", "r000001", None, None, None, [1, 5, 16, 4, 8, 9, 10, 11, 12, 13, 14],
                       [[1, 5], [16, 4, 8, 9, 10, 11, 12, 13, 14]])
    # A 32-token hit: the sliding window keeps its last cdiv(8 - 1, 4) = 2 blocks and the null
    # block before them; every group's hit blocks come first pool-wide, then the new ones.
    hit = next(r for r in rows if r[0] == 52 and r[6])
    assert hit[:7] == (52, 2, "schedule", "r000010", 32, 1, 32)
    assert hit[8] == [[0, 0, 0, 0, 0, 0, 12, 17, 36], [41, 38, 39, 1, 8, 21, 30, 2, 25]]
    assert hit[7] == [12, 17, 41, 38, 39, 1, 8, 21, 30, 2, 36, 25]


def test_the_hybrid_goldens_check_clean_and_replay_identically_on_the_reference() -> None:
    results = check_goldens(HYBRID, scenarios=HYBRID_SCENARIOS)
    assert [(r.scenario, r.ok, r.steps, r.replayed_steps) for r in results] == [
        ("hybrid-alternating", True, 192, 192), ("hybrid-five-to-one", True, 244, 244),
        ("hybrid-mamba", True, 153, 153)]
    manifest = json.loads((HYBRID / "MANIFEST.json").read_text())["scenarios"]
    # Pools sized by vLLM's start-up check over every group (one block over its sum: 44, 85, and
    # 48 > 28 for the Mamba one), still small enough to preempt; the sliding ones hit prefixes.
    assert {name: (s["preemptions"], s["prefix_hit_tokens"]) for name, s in manifest.items()} == {
        "hybrid-alternating": (4, 372), "hybrid-five-to-one": (17, 456), "hybrid-mamba": (14, 0)}
    assert all(s["preemptions"] > 0 for s in manifest.values())
    assert {name: HYBRID_SCENARIOS[name].engine_config().num_gpu_blocks for name in manifest} == {
        "hybrid-alternating": 44, "hybrid-five-to-one": 85, "hybrid-mamba": 48}


@pytest.mark.parametrize("name, target", [("keep-skipped-blocks", "SLIDING-WINDOW-FREE"),
                                          ("free-window-ahead", "SLIDING-WINDOW-HELD")])
def test_each_sliding_window_rule_fires_on_its_mutant_only(name: str, target: str) -> None:
    assert INVARIANTS[target].layer == ("semantics" if target == "SLIDING-WINDOW-FREE" else "safety")
    (row,) = kill_matrix([name], SLIDING_WINDOW_SCENARIOS)
    for scenario, cell in row.cells.items():
        assert cell.ended == "" and cell.result.by_invariant.get(target), (scenario, cell.result.by_invariant)
        # The reference on the same scenario: silent.
        clean = run_candidate(Scheduler, HYBRID_SCENARIOS[scenario])
        assert clean.ended == "" and clean.result.by_invariant == {}, (scenario, clean.result.by_invariant)
    if name == "free-window-ahead":  # a freed block the window reads: nothing else to blame
        assert set(row.cells["hybrid-alternating"].result.by_invariant) == {"SLIDING-WINDOW-HELD"}


def test_mamba_groups_hold_one_state_block_each_in_the_mamba_golden() -> None:
    # Layers [linear_attention x 3, full_attention] (Qwen3-Next's 3:1): three Mamba groups, then full
    # attention (block 4 tokens); mamba_cache_mode "none": one state block of max_model_len (96) tokens.
    rows = [_brief(r) for r in _rows(HYBRID / "hybrid-mamba.parquet", {0, 1, 14})
            if r["kind"] in ("schedule", "preempt", "skipped_free")]
    # A 64-token chunk: one block in each Mamba group, 16 for full attention, group after group.
    assert rows[0] == (0, 2, "schedule", "r000000", 0, 64, 0, list(range(1, 20)),
                       [[1], [2], [3], list(range(4, 20))])
    # The next chunk: only full attention grows; no Mamba block is added or freed (no skipped_free).
    assert rows[1] == (1, 2, "schedule", "r000000", 64, 7, 0, [20, 21], [[], [], [], [20, 21]])
    assert not any(r[2] == "skipped_free" for r in rows)
    # A preemption frees every group's table, group after group, tail first.
    assert rows[-1][2:4] == ("preempt", "r000004")
    assert rows[-1][7:] == ([23, 22, 2, 36, 37, 38, 39, 40, 41, 42, 1], [[23], [22], [2], [36, 37, 38, 39, 40, 41, 42, 1]])


@pytest.mark.parametrize("name, target, layer", [("mamba-free-state", "MAMBA-STATE-HELD", "safety"),
                                                 ("mamba-extra-state-block", "MAMBA-STATE-BLOCKS", "semantics")])
def test_each_mamba_rule_fires_on_its_mutant(name: str, target: str, layer: str) -> None:
    assert INVARIANTS[target].layer == layer
    (row,) = kill_matrix([name], ["hybrid-mamba"])
    cell = row.cells["hybrid-mamba"]
    assert cell.ended == "" and cell.result.by_invariant.get(target), cell.result.by_invariant
    if name == "mamba-free-state":  # a freed state block: nothing else to blame
        assert set(cell.result.by_invariant) == {"MAMBA-STATE-HELD"}


def _doctored(mutate) -> dict[str, int]:
    trace = open_trace(HYBRID / "hybrid-alternating.parquet")
    steps = [(step, [dict(r) for r in rows]) for step, rows in trace.iter_steps()]
    mutate(steps)
    return check_steps(trace.meta["config"], steps).by_invariant


def test_a_free_out_of_group_order_is_free_order_and_a_row_without_groups_blocks_cover() -> None:
    def swap_groups(steps):
        row = next(r for _, rows in steps for r in rows if r["kind"] == "finish")
        row["group_block_ids"] = row["group_block_ids"][::-1]

    def drop_groups(steps):
        row = next(r for _, rows in steps for r in rows if r["kind"] == "schedule" and r["step"] == 5)
        row["group_block_ids"] = None

    assert _doctored(swap_groups) == {"FREE-ORDER": 1}
    assert "BLOCKS-COVER" in _doctored(drop_groups)
