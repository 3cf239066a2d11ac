"""Issue 27: ``diff`` (and ``replay``) context lines printed whole block-id
lists and floats like ``0.41960000000000003`` in 700-character lines. Long
lists are elided with a count, floats rounded, lines bounded (harness/brief.py)."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from harness.brief import MAX_LINE, short, short_text
from harness.diff import FirstDivergence, brief_row, decision_diff, diff_traces, render_report
from harness.trace import open_trace


def test_short_elides_long_lists_and_rounds_floats() -> None:
    assert short(list(range(3, 126))) == "[3, 4, 5, … +120 more]"
    assert short([1, 2, 3, 4, 5]) == "[1, 2, 3, 4, 5]"  # five or fewer: whole
    assert short(["r1", "r2", "r3", "r4", "r5", "r6"]) == "['r1', 'r2', 'r3', … +3 more]"
    assert short(0.41960000000000003) == "0.4196"
    assert short([[1, 2], list(range(9))]) == "[[1, 2], [0, 1, 2, … +6 more]]"


def test_short_text_bounds_a_deepdiff_line() -> None:
    line = ("Item root[0] ({'kind': 'schedule', 'clock_s': 0.41960000000000003, 'block_ids': ["
            + ", ".join(map(str, range(3, 126))) + "]}) added to iterable.")
    assert short_text(line) == ("Item root[0] ({'kind': 'schedule', 'clock_s': 0.4196, "
                                "'block_ids': [3, 4, 5, … +120 more]}) added to iterable.")
    cut = short_text("x" * 300)
    assert len(cut) == MAX_LINE and cut.endswith(" … +153 chars")


ROW_A = {"step": 7, "event_index": 2, "kind": "schedule", "request_id": "r000001", "schedule_kind": "running",
         "num_computed_tokens": 2000, "num_scheduled_tokens": 1, "block_ids": list(range(3, 126))}
END = {"step": 6, "event_index": 9, "kind": "schedule_end", "clock_s": 0.41960000000000003,
       "waiting": [f"r{i:06d}" for i in range(40)], "running": ["r000001"], "num_free_blocks": 3}


def test_diff_report_lines_are_short() -> None:
    trace = open_trace("traces/shared-prefix.parquet")
    result = diff_traces(trace, trace)
    row_b = {**ROW_A, "block_ids": list(range(3, 127))}
    d = FirstDivergence(7, 2, "r000001", "block_ids", ROW_A["block_ids"], row_b["block_ids"], "schedule",
                        decision_diff([ROW_A, END], [row_b, {**END, "clock_s": 0.5}]), [ROW_A], [row_b],
                        prev_end_a=END, prev_end_b=END)
    console = Console(width=400, record=True, force_terminal=False)
    render_report(dataclasses.replace(result, first_divergence=d), console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= MAX_LINE + 8  # the indent
    assert "0.41960000000000003" not in text
    lines = [ln for ln in text.splitlines() if "DIVERGENCE" in ln or ln.lstrip().startswith((">#", "step 6"))]
    assert lines == [
        "DIVERGENCE at step 7, event #2 (schedule), request r000001, field block_ids: A [3, 4, 5, … +120 more], "
        "B [3, 4, 5, … +121 more]",
        "  step 6 schedule_end (same in A and B): waiting ['r000000', 'r000001', 'r000002', … +37 more] "
        "running ['r000001']",
        "   >#2 schedule request_id=r000001 schedule_kind=running num_computed_tokens=2000 num_scheduled_tokens=1 "
        "block_ids=[3, 4, 5, … +120 more]",
        "   >#2 schedule request_id=r000001 schedule_kind=running num_computed_tokens=2000 num_scheduled_tokens=1 "
        "block_ids=[3, 4, 5, … +121 more]",
    ]
    assert "    Value of root[1]['clock_s'] changed from 0.4196 to 0.5." in text.splitlines()


def test_brief_row_rounds_clock() -> None:
    assert brief_row(END) == ("schedule_end clock_s=0.4196 num_free_blocks=3 waiting=['r000000', 'r000001', "
                              "'r000002', … +37 more] running=['r000001']")
