"""Doctored-trace tests of the outputs, finishing and liveness family
(harness/check/lifecycle.py)."""

from __future__ import annotations

import pytest

from harness.check import MAX_PER_INVARIANT, PROFILES, check_steps


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


def _scenario_file_rows(path: str):
    from harness.trace.recorder import run_to_rows
    from workloads.scenario import load_scenario

    scenario = load_scenario(path)
    rows: list = []
    config = scenario.engine_config()
    run_to_rows(scenario.workload, config, seed=scenario.seed, on_step_rows=lambda step, r: rows.append((step, r)))
    return config.to_dict(), rows


@pytest.mark.parametrize("release", ["0.20.2", "0.25.0"])
def test_stop_min_tokens_fires_on_a_0_33_engine_checked_as_0_20_2(release: str) -> None:
    """The reference (0.33.0: EOS is tested before min_tokens) stops A at its
    first EOS; under 0.20.2's and 0.25.0's semantics (min_tokens first,
    ``sched/utils.py:100`` in both) that is a violation of STOP-MIN-TOKENS, a
    semantics rule: silent under safety."""
    config, rows = _scenario_file_rows("traces/scenarios/min-tokens-eos.toml")
    assert check_steps(config, rows).ok
    result = check_steps(config, rows, PROFILES[release])
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("STOP-MIN-TOKENS", 0, "A", "finished with 'stop' but check_stop gives None (1 outputs, max_tokens 8)")]
    assert check_steps(config, rows, PROFILES["safety"]).ok


def _crash_row(step: int, index: int) -> dict:
    return {"step": step, "event_index": index, "kind": "crash", "rank": 0, "status": "schedule",
            "message": "RuntimeError: x", "stop_reason": "mod.py:3"}


def test_engine_crash_fires_once_and_liveness_stays_silent_on_a_trace_cut_by_a_crash(scenario_rows) -> None:
    """A crash row ends the run: the requests it cut off are not LIVENESS
    findings of their own (the one ENGINE-CRASH is), and the trace fails."""
    config, rows = scenario_rows("fcfs-tight")
    end = max(range(1, len(rows)), key=lambda i: _unfinished(rows[:i]))
    assert _unfinished(rows[:end]) >= 2
    step, step_rows = rows[end - 1]
    step_rows.append(_crash_row(step, len(step_rows)))
    result = check_steps(config, rows[:end])
    assert result.by_invariant == {"ENGINE-CRASH": 1}
    (v,) = result.violations
    assert (v.step, v.request, v.message) == (step, None, "schedule() raised RuntimeError: x at mod.py:3")
    assert v.history[-1].startswith(f"step {step}: update of the batch of step {step}: outputs ")
    # A safety invariant: it fires under every profile (older versions' semantics
    # also flag this 0.33.0 engine's free order), alone under safety.
    for profile in PROFILES.values():
        assert check_steps(config, rows[:end], profile).by_invariant["ENGINE-CRASH"] == 1, profile.name
    assert check_steps(config, rows[:end], PROFILES["safety"]).by_invariant == {"ENGINE-CRASH": 1}


def test_a_crash_row_fails_even_a_complete_trace(scenario_rows) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    assert check_steps(config, rows).ok  # silent on the clean rows
    step, step_rows = rows[-1]
    step_rows.append(_crash_row(step, len(step_rows)))
    assert check_steps(config, rows).by_invariant == {"ENGINE-CRASH": 1}
def test_scheduled_has_data_fires_on_request_data_that_differs_from_num_scheduled_tokens(scenario_rows) -> None:
    """schedule_end's request_data_ids (schema 6) against the step's schedule
    rows: an id twice, an id missing, an id not scheduled."""
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
    assert witnesses(None) == []  # rows made in memory: see the schema 6 regression below


def test_scheduled_has_data_fires_on_a_schema_6_trace_without_request_data_ids(scenario_rows) -> None:
    """Regression (a hostile user's doctored trace): a null request_data_ids on a
    schema 6 schedule_end was skipped as if the trace were older, so the
    check passed vacuously. Schema 6 always records it (the recorder derives
    it when a candidate does not say): a null is a witness; an older trace
    (schema_version 5) is still only a note."""
    config, rows = scenario_rows("fcfs-roomy")
    step, step_rows = next((s, r) for s, r in rows if any(x["kind"] == "schedule" for x in r))
    end = next(r for r in step_rows if r["kind"] == "schedule_end")
    end["request_data_ids"] = None
    result = check_steps(config, rows, schema_version=6)
    assert [(v.invariant, v.step, v.message) for v in result.violations] == [
        ("SCHEDULED-HAS-DATA", step, "schedule_end has no request_data_ids, which schema 6 always records: "
                                     "the step's request data is unobserved")]
    older = check_steps(config, rows, schema_version=5)
    assert older.ok and any(n.startswith("SCHEDULED-HAS-DATA: not checkable on schema 5") for n in older.notes)


# -- issue 26: rows that contradict each other ---------------------------------------------
def test_output_count_fires_on_a_finish_count_off_its_output_rows(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("eos-stop-abort")
    step, finish = first_row(rows, "finish", lambda row: row["finish_reason"] == "stop")
    n = finish["num_output_tokens"]
    finish["num_output_tokens"] = n + 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("OUTPUT-COUNT", step, finish["request_id"],
         f"finish row says {n + 1} output tokens, its output rows delivered {n}")]


def _renumber(step_rows) -> None:
    for index, row in enumerate(step_rows):
        row["event_index"] = index


def test_output_order_fires_on_outputs_out_of_scheduling_order(scenario_rows) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, step_rows = next((s, r) for s, r in rows if sum(row["kind"] == "output" for row in r) >= 2)
    i, j = [k for k, row in enumerate(step_rows) if row["kind"] == "output"][:2]
    first_id, second_id = step_rows[i]["request_id"], step_rows[j]["request_id"]
    step_rows[i], step_rows[j] = step_rows[j], step_rows[i]
    _renumber(step_rows)
    result = check_steps(config, rows)
    (v,) = result.violations
    assert (v.invariant, v.step, v.request) == ("OUTPUT-ORDER", step, first_id)
    assert v.message.startswith(f"output after {second_id}'s, but it was scheduled before it (batch of step ")


def test_output_order_fires_on_two_outputs_for_one_request_in_one_batch(scenario_rows) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, step_rows = next((s, r) for s, r in rows if any(row["kind"] == "output" for row in r))
    at, output = next((k, row) for k, row in enumerate(step_rows) if row["kind"] == "output")
    step_rows.insert(at + 1, dict(output))
    _renumber(step_rows)
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("OUTPUT-ORDER", step, output["request_id"],
         f"a second output row for this request in the processed batch (of step {step})")]


def test_stop_rules_fires_on_max_tokens_below_a_length_capped_finish(scenario_rows, first_row) -> None:
    """The arrival's max_tokens against the finish row alone: a request capped
    by "length" finishes with exactly max_tokens outputs (or at max_model_len).
    Here the last output row carries two tokens (spec decode), so the shadow
    stops inside it: STOP-RULES from the row, OUTPUT-COUNT from the count."""
    config, rows = scenario_rows("spec-decode")
    _, arrival = first_row(rows, "arrival", lambda row: row["request_id"] == "r000008")
    step, finish = first_row(rows, "finish", lambda row: row["request_id"] == "r000008")
    assert (arrival["max_tokens"], finish["finish_reason"], finish["num_output_tokens"]) == (12, "length", 12)
    arrival["max_tokens"] = 11
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request) for v in result.violations] == [
        ("OUTPUT-COUNT", step, "r000008"), ("STOP-RULES", step, "r000008")]
    assert result.violations[1].message.startswith(
        "finished ('length') with 12 outputs, but its arrival says max_tokens 11 (prompt ")
