"""Regression (new-user trial): the pytest plugin's witness of a step-level violation read
"STATE-CONTINUITY at step 3, request None: waiting at step start ..."; it now reads as `harness
check` prints it, the request named only when the rule is about one."""

from __future__ import annotations

from types import SimpleNamespace

from harness.check.result import Violation
from harness.conformance import _witness


def test_regression_plugin_witness_said_request_none() -> None:
    result = SimpleNamespace(violations=[
        Violation("STATE-CONTINUITY", 3, None, "waiting at step start ['b', 'a'] != ['a', 'b']"),
        Violation("MAX-NUM-SEQS", 4, "r000001", "admitted with 1 running = max_num_seqs 1"),
    ])
    assert _witness(result).splitlines() == [
        "STATE-CONTINUITY at step 3: waiting at step start ['b', 'a'] != ['a', 'b']",
        "MAX-NUM-SEQS at step 4, request r000001: admitted with 1 running = max_num_seqs 1",
    ]
