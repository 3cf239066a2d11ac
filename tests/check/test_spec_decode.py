"""Doctored-trace tests of the spec-decode family (harness/check/spec_decode.py)."""

from __future__ import annotations

from harness.check import TraceChecker


def test_spec_acceptance_fires_when_the_model_output_ignores_the_drafts(tmp_path) -> None:
    """A model runner (not the scheduler) that returns tokens which do not
    start with the accepted drafts: shown on a doctored spec-decode trace."""
    from harness.trace.recorder import record
    from harness.scenarios import SCENARIOS
    from harness.trace import open_trace

    scenario = SCENARIOS["spec-decode"]
    path = tmp_path / "spec.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path)
    trace = open_trace(path)
    steps = list(trace.iter_steps())
    doctored = None
    for step, events in steps:
        drafts = {e["request_id"]: e["spec_token_ids"] for e in events
                  if e["kind"] == "schedule" and e["spec_token_ids"]}
        for e in events:
            if e["kind"] == "output" and e["request_id"] in drafts and len(e["token_ids"]) >= 2:
                e["token_ids"] = [e["token_ids"][0] + 1] + e["token_ids"][1:]
                doctored = (step, e["request_id"])
                break
        if doctored:
            break
    assert doctored is not None
    checker = TraceChecker(trace.meta["config"])
    for step, events in steps:
        checker.check_step(step, events)
        if step == doctored[0]:
            break
    assert [(v.invariant, v.step, v.request) for v in checker.result.violations][0] == \
        ("SPEC-ACCEPTANCE", doctored[0], doctored[1])


# -- async scheduling with drafts (reference.async_spec) ---------------------------

def _check(config, rows):
    from harness.check import check_steps

    return check_steps(config, rows)


def test_async_spec_decode_reference_rows_are_conformant_with_placeholders_only(scenario_rows) -> None:
    """The canonical async-spec-decode run: every draft the scheduler schedules
    is a -1 placeholder, no ``draft`` row exists (no real draft reaches the
    scheduler under async scheduling) and every invariant holds."""
    config, rows = scenario_rows("async-spec-decode")
    scheduled = [r["spec_token_ids"] for _, rs in rows for r in rs if r["kind"] == "schedule" and r["spec_token_ids"]]
    assert scheduled and all(set(d) == {-1} and len(d) == 3 for d in scheduled)
    assert not any(r["kind"] == "draft" for _, rs in rows for r in rs)
    result = _check(config, rows)
    assert result.ok, result.by_invariant
    assert (result.draft_tokens, result.rejected_draft_tokens) == (642, 365)


def test_spec_tokens_fires_on_async_drafts_past_the_placeholders(scenario_rows, first_row) -> None:
    """Async: a running decode scheduled with one draft position more than its
    placeholders leave (``num_tokens + num_output_placeholders``) breaks
    SPEC-TOKENS at that row."""
    config, rows = scenario_rows("async-spec-decode")
    step, row = first_row(rows, "schedule", lambda r: r["schedule_kind"] == "running"
                          and r["spec_token_ids"] == [-1, -1, -1])
    row["spec_token_ids"] = [-1, -1]  # two drafts where the placeholders leave three positions
    result = _check(config, [(s, rs) for s, rs in rows if s <= step])
    first = result.violations[0]
    assert (first.invariant, first.step, first.request) == ("SPEC-TOKENS", step, row["request_id"])
    assert "scheduled drafts [-1, -1] but its pending drafts were [-1, -1, -1]" in first.message


def test_spec_acceptance_under_async_accepts_any_token_at_a_placeholder_only(scenario_rows, first_row) -> None:
    """Async: a -1 placeholder stands for the worker's draft (any sampled token
    may have matched it); a real draft id must still match. Doctored: one
    scheduled placeholder replaced by an id the model did not sample, on a
    batch that accepted it, fires SPEC-ACCEPTANCE."""
    config, rows = scenario_rows("async-spec-decode")
    batch = {}
    target = None
    for step, rs in rows:
        for r in rs:
            if r["kind"] == "schedule" and r["spec_token_ids"]:
                batch[(step, r["request_id"])] = r
            if r["kind"] == "update_begin":
                current = r["batch_step"]
            if r["kind"] == "output" and len(r["token_ids"]) >= 2 and (current, r["request_id"]) in batch:
                target = (step, batch[(current, r["request_id"])], r)
                break
        if target:
            break
    step, sched, out = target
    sched["spec_token_ids"] = [out["token_ids"][0] + 1] + sched["spec_token_ids"][1:]
    result = _check(config, [(s, rs) for s, rs in rows if s <= step])
    assert [(v.invariant, v.step, v.request) for v in result.violations
            if v.invariant == "SPEC-ACCEPTANCE"][0] == ("SPEC-ACCEPTANCE", step, out["request_id"])
