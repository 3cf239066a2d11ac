"""Doctored-trace tests of the outputs, finishing and liveness family
(harness/check/lifecycle.py)."""

from __future__ import annotations

from harness.check import MAX_PER_INVARIANT, check_steps


def test_stop_rules_fires_on_the_wrong_finish_reason(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, finish = first_row(rows, "finish", lambda row: row["finish_reason"] == "length")
    finish["finish_reason"] = "stop"
    result = check_steps(config, rows)
    (v,) = result.violations
    assert (v.invariant, v.step, v.request) == ("STOP-RULES", step, finish["request_id"])
    assert v.message.startswith("finished with 'stop' but check_stop gives 'length' (")


def _unfinished(rows) -> int:
    kinds = [row["kind"] for _, step_rows in rows for row in step_rows]
    return kinds.count("arrival") - kinds.count("finish") - kinds.count("abort")


def test_liveness_fires_on_a_trace_cut_short(scenario_rows) -> None:
    config, rows = scenario_rows("fcfs-tight")
    # Cut where the most requests are still live; each is one LIVENESS witness.
    end = max(range(1, len(rows)), key=lambda i: _unfinished(rows[:i]))
    live: dict[str, None] = {}
    for _, step_rows in rows[:end]:
        for row in step_rows:
            if row["kind"] == "arrival":
                live[row["request_id"]] = None
            elif row["kind"] in ("finish", "abort"):
                live.pop(row["request_id"])
    assert len(live) >= 2
    result = check_steps(config, rows[:end])
    assert result.by_invariant == {"LIVENESS": len(live)}
    assert [(v.invariant, v.step, v.request) for v in result.violations] == \
        [("LIVENESS", rows[end - 1][0], rid) for rid in list(live)[:MAX_PER_INVARIANT]]
