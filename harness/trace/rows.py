"""Rebuild workload inputs from trace rows (no engine imports: the reader uses it)."""

from __future__ import annotations

from typing import Any

from reference.workload import RequestSpec

Row = dict[str, Any]


def spec_from_row(row: Row) -> RequestSpec:
    """Rebuild the workload's RequestSpec from an ``arrival``/``reject`` row."""
    return RequestSpec(
        request_id=row["request_id"],
        arrival_time=row["arrival_time_s"],
        prompt_token_ids=tuple(row["prompt_token_ids"] or ()),
        max_tokens=row["max_tokens"],
        min_tokens=row["min_tokens"],
        ignore_eos=row["ignore_eos"],
        eos_token_id=row["eos_token_id"],
        stop_token_ids=tuple(row["stop_token_ids"] or ()),
        priority=row["priority"],
        scripted_output_len=row["scripted_output_len"],
        abort_time=row["abort_time_s"],
        mm_positions=tuple(tuple(p) for p in row.get("mm_positions") or ()),
        arrival_step=row.get("arrival_step"),
        after=row.get("after"),
        abort_step=row.get("abort_step"),
        output_token_ids=None if row.get("output_token_ids") is None else tuple(row["output_token_ids"]),
        draft_acceptance_pattern=row.get("draft_acceptance_pattern"),
    )
