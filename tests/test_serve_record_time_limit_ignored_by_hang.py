"""Regression: ``serve-record --offline --time-limit 40`` with a
``--candidate-class`` that hangs in ``schedule()`` ran 398 s: each engine op
waited up to 300 s whatever the time limit, then the polite ``close`` waited
60 s more on an engine still stuck in the op. An op now waits at most the
time left, and a hung engine is stopped by its PID at once."""

from __future__ import annotations

import time

import pytest

from tests.test_serve import model  # noqa: F401 - fixture
from tests.test_serve_candidate_class import _left_running, _serve

STOP = "harness/serve/async-stop.toml"


@pytest.mark.vllm
def test_regression_time_limit_ends_a_hung_candidate_class(model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "hang.parquet"
    started = time.monotonic()
    proc = _serve([STOP, "--offline", "--model", str(model), "--time-limit", "30",
                   "--candidate-class", "serve_schedulers:HangInScheduleScheduler", "-o", str(out)])
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The class check (11-21 s here) and vLLM's start come before the limit's clock
    # runs out; 300 s per op before the fix.
    assert took < 150, took
    assert "vLLM failed mid-run: vLLM gave no answer to 'step' within" in proc.stderr
    assert "within 300 s" not in proc.stderr
    assert _left_running(out) == []
