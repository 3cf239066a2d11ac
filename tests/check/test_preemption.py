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


def _victim_state(rows, first_row):
    step, state = first_row(rows, "request_state")
    return step, state


def test_preempt_effects_fires_on_a_victim_still_holding_computed_tokens(scenario_rows, first_row) -> None:
    """Observed (schema 6): a victim's request_state row after schedule() says
    PREEMPTED with 0 computed tokens; a count left there, or a victim still
    RUNNING, is a witness."""
    config, rows = scenario_rows("fcfs-tight")
    step, state = _victim_state(rows, first_row)
    assert (state["status"], state["num_computed_tokens"], state["spec_token_ids"]) == ("PREEMPTED", 0, [])
    state["num_computed_tokens"] = 5
    assert [(v.invariant, v.step, v.request, v.message) for v in check_steps(config, rows).violations] == [
        ("PREEMPT-EFFECTS", step, state["request_id"], "preempted in this step, but it holds 5 computed tokens "
         "after schedule() (a resume must start from a fresh prefix lookup)")]
    state["num_computed_tokens"], state["status"] = 0, "RUNNING"
    assert [(v.invariant, v.message) for v in check_steps(config, rows).violations] == [
        ("PREEMPT-EFFECTS", "preempted in this step, but its status after schedule() is RUNNING")]


def test_preempt_effects_fires_on_a_victims_missing_state_row(scenario_rows, first_row) -> None:
    """Issue 26: schema 6 writes a request_state row for every victim of
    schedule(); one dropped hides what the victim holds. Only for an
    observed trace (schema 6 on): older ones never had the rows."""
    config, rows = scenario_rows("fcfs-tight")
    step, state = _victim_state(rows, first_row)
    step_rows = next(r for s, r in rows if s == step)
    step_rows.remove(state)
    for index, row in enumerate(step_rows):
        row["event_index"] = index
    assert [(v.invariant, v.step, v.request, v.message)
            for v in check_steps(config, rows, schema_version=8).violations] == [
        ("PREEMPT-EFFECTS", step, state["request_id"], "preempted in this step, but no request_state row after "
         "schedule_end records what it holds (schema 6 always writes one)")]
    assert check_steps(config, rows, schema_version=5).ok


def test_preempted_no_drafts_fires_on_a_waiting_request_holding_drafts(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    step, state = _victim_state(rows, first_row)
    state["spec_token_ids"] = [7, 8]
    assert [(v.invariant, v.step, v.request, v.message) for v in check_steps(config, rows).violations] == [
        ("PREEMPTED-NO-DRAFTS", step, state["request_id"], "PREEMPTED after schedule(), but it holds drafts [7, 8]")]


def test_scheduled_not_preempted_fires_when_a_give_back_is_missing(scenario_rows, first_row) -> None:
    """priority-tight: drop a withdraw row, and the victim stays in the step's
    num_scheduled_tokens (as the rows record it)."""
    config, rows = scenario_rows("priority-tight")
    step, withdraw = first_row(rows, "withdraw")
    step_rows = dict(rows)[step]
    step_rows.remove(withdraw)
    end = next(r for r in step_rows if r["kind"] == "schedule_end")
    end["request_data_ids"].append(withdraw["request_id"])  # ... with its request data
    end["total_num_scheduled_tokens"] += withdraw["num_scheduled_tokens"]
    end["token_budget"] -= withdraw["num_scheduled_tokens"]
    result = check_steps(config, rows)
    assert (result.violations[0].invariant, result.violations[0].step, result.violations[0].message) == (
        "SCHEDULED-NOT-PREEMPTED", step, f"preempted, but it stays in num_scheduled_tokens with "
                                         f"{withdraw['num_scheduled_tokens']} tokens (no withdraw before)")
    assert "SCHEDULED-HAS-DATA" not in result.by_invariant and "PRIORITY-GIVE-BACK" not in result.by_invariant


def test_a_state_row_of_an_unknown_request_breaks_state_continuity(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-tight")
    step, state = _victim_state(rows, first_row)
    state["request_id"] = "nobody"
    assert [(v.invariant, v.step, v.request, v.message) for v in check_steps(config, rows).violations] == [
        ("STATE-CONTINUITY", step, "nobody", "state of an unknown or finished request")]
