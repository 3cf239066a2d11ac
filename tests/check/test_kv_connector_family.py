"""Doctored-trace tests of the KV-connector family (harness/check/kv_connector.py).

(tests/test_kv_connector.py tests the reference's connector; this module,
named apart from it, holds the checker's.)
"""

from __future__ import annotations

from harness.check import check_steps


def test_remote_kv_reservation_fires_when_a_load_records_the_wrong_reservation(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("kv-connector")
    assert check_steps(config, rows).ok
    step, load = first_row(rows, "kv_load")
    reserved = load["reserved_blocks"] or 0
    load["reserved_blocks"] = reserved + 1
    result = check_steps(config, rows)
    (v,) = result.violations
    assert (v.invariant, v.step, v.request) == ("REMOTE-KV-RESERVATION", step, load["request_id"])
    # "1 block", not "1 blocks" (issue 27).
    assert v.message.startswith(f"reserved {reserved + 1} block{'s' * (reserved + 1 != 1)}, but in-flight prefills ")
    assert v.message.endswith(f" still need {reserved}")
