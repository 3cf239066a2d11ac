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


def test_scheduled_has_data_fires_on_request_data_that_differs_from_num_scheduled_tokens(scenario_rows) -> None:
    """schedule_end's request_data_ids (schema 6) against the step's schedule
    rows: an id twice, an id missing, an id not scheduled; null (an older
    trace) is not checked."""
    config, rows = scenario_rows("fcfs-roomy")
    step, step_rows = next((s, r) for s, r in rows if any(x["kind"] == "schedule" for x in r))
    end = next(r for r in step_rows if r["kind"] == "schedule_end")
    data = list(end["request_data_ids"])
    assert data and check_steps(config, rows).ok

    def witnesses(ids):
        end["request_data_ids"] = ids
        return [(v.invariant, v.step, v.request, v.message) for v in check_steps(config, rows).violations]

    assert witnesses(data + data[:1]) == [("SCHEDULED-HAS-DATA", step, data[0],
                                           f"request data carries {data[:1]} more than once")]
    assert witnesses(data[1:]) == [("SCHEDULED-HAS-DATA", step, data[0],
                                    f"in num_scheduled_tokens without request data: {data[:1]} "
                                    f"(request data {data[1:]})")]
    assert witnesses(data + ["r999999"]) == [("SCHEDULED-HAS-DATA", step, "r999999",
                                              f"request data for ['r999999'], absent from "
                                              f"num_scheduled_tokens {data}")]
    assert witnesses(None) == []
