"""Doctored-trace tests of the encoder family (harness/check/encoder.py).

(tests/test_encoder.py tests the reference's encoder cache and budget; this
module, named apart from it, holds the checker's.)
"""

from __future__ import annotations

from harness.check import check_steps
from harness.scenarios import SCENARIOS


def test_checker_finds_a_window_over_an_unencoded_input() -> None:
    """A doctored trace: the first encoder_plan and schedule rows of the
    scenario lose their encoder inputs (the window runs over items nobody
    encoded): ENCODER-INPUTS, with the window and the items."""
    scenario = SCENARIOS["encoder-inputs"]
    rows: list[tuple[int, list[dict]]] = []
    from harness.trace.recorder import run_to_rows

    run_to_rows(scenario.make_workload(), scenario.engine_config(), seed=scenario.seed,
                on_step_rows=lambda step, step_rows: rows.append((step, step_rows)))
    first = next(row for _, step_rows in rows for row in step_rows if row.get("encoder_input_ids"))
    assert (first["kind"], first["request_id"], first["num_scheduled_tokens"], first["encoder_input_ids"]) == \
        ("encoder_plan", "r000000", 11, [0])  # a 4-embed budget: cut before the second item at 11
    for row in rows[0][1]:
        if row.get("request_id") == "r000000" and row["kind"] in ("encoder_plan", "schedule"):
            row["encoder_input_ids"] = []
    result = check_steps(scenario.engine_config().to_dict(), rows)
    violation = result.violations[0]
    assert (violation.invariant, violation.step, violation.request) == ("ENCODER-INPUTS", 0, "r000000")
    assert violation.message.startswith("encoder plan window [0, 11) encoding inputs [], but with ")
    assert "the inputs to encode are [0]; the encoder cache can no longer be inferred" in violation.message
