"""Queue snapshots stored as changes (schema 8, harness.trace.queues): exact
encodings of the moves a scheduler makes, round trips, and refusal of a
change that does not fit the previous list."""

from __future__ import annotations

import pytest

from harness.trace.queues import QueueDecoder, QueueEncoder, encode


def test_admission_pops_the_head_and_arrivals_append() -> None:
    previous = ["a", "b", "c", "d"]
    assert encode(previous, ["c", "d", "e"]) == ([2, 2], [], ["e"])


def test_preempted_ids_pushed_in_front_are_the_head() -> None:
    assert encode(["a", "b", "c"], ["x", "y", "a", "b", "c"]) == ([0, 3], ["x", "y"], [])


def test_first_snapshot_or_nothing_kept_is_stored_whole() -> None:
    assert encode(None, ["a"]) == (None, None, ["a"])
    assert encode(["a", "b"], ["x", "y"]) == (None, None, ["x", "y"])
    assert encode(["a"], []) == (None, None, [])


def test_a_reordered_queue_keeps_the_longest_run_it_finds() -> None:
    """Priority order may move ids around: what is kept is exact, the rest stored."""
    assert encode(["a", "b", "c", "d"], ["a", "c", "b", "d"]) == ([0, 1], [], ["c", "b", "d"])


def test_rows_round_trip_per_rank_and_queue() -> None:
    rows = [
        {"kind": "schedule_begin", "rank": 0, "waiting": ["a", "b", "c"], "running": []},
        {"kind": "schedule_begin", "rank": 1, "waiting": ["p", "q"], "running": ["r"]},
        {"kind": "schedule", "rank": 0, "request_id": "a"},
        {"kind": "schedule_end", "rank": 0, "waiting": ["b", "c"], "running": ["a"]},
        {"kind": "reset_prefix_cache", "rank": 0, "running": ["a"]},
        {"kind": "schedule_begin", "rank": 0, "waiting": ["z", "b", "c", "d"], "running": ["a"]},
    ]
    encoder, decoder = QueueEncoder(), QueueDecoder()
    stored = [encoder.encode_row(r) for r in rows]
    assert (stored[3]["waiting_kept"], stored[3]["waiting_head"], stored[3]["waiting"]) == ([1, 2], [], [])
    assert (stored[5]["waiting_kept"], stored[5]["waiting_head"], stored[5]["waiting"]) == ([0, 2], ["z"], ["d"])
    assert stored[4] is rows[4]  # not a snapshot: stored whole, outside the chain
    assert stored[1].get("waiting_kept") is None and stored[1]["waiting"] == ["p", "q"]
    decoded = []
    for row in stored:
        row = {**row}
        decoder.decode_row(row)
        decoded.append(row)
    assert decoded == rows


def test_a_kept_slice_outside_the_previous_list_is_refused() -> None:
    decoder = QueueDecoder()
    decoder.decode_row({"kind": "schedule_begin", "rank": 0, "waiting": ["a", "b"]})
    with pytest.raises(ValueError, match=r"waiting_kept \[1, 5\] is not a slice of the previous waiting \(2 ids\)"):
        decoder.decode_row({"kind": "schedule_end", "rank": 0, "waiting": [], "waiting_kept": [1, 5]})
    with pytest.raises(ValueError, match=r"previous running \(there is none\)"):
        QueueDecoder().decode_row({"kind": "schedule_end", "rank": 0, "running": [], "running_kept": [0, 0]})
