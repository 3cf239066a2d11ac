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
    proc = _serve([STOP, "--offline", "--model", str(model), "--time-limit", "60",
                   "--candidate-class", "serve_schedulers:HangInScheduleScheduler", "-o", str(out)])
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stdout + proc.stderr
    # The class check (11-21 s idle) and vLLM's start (36 s on a loaded machine) count
    # against the limit; 300 s per op before the fix.
    assert took < 200, took
    assert "within 300 s" not in proc.stderr
    assert _left_running(out) == []
    if "vLLM failed mid-run: vLLM gave no answer to 'step' within" in proc.stderr:
        assert "converted" in proc.stdout and ": 9 steps," in proc.stdout  # the 10th hung
    else:  # vLLM's start spent the whole limit: still a failed run (exit 1), not bad input (2)
        assert "vLLM failed mid-run: the run did not finish within" in proc.stderr, proc.stderr
        assert "no engine step was recorded: nothing to check" in proc.stderr


@pytest.mark.vllm
def test_regression_a_time_limit_spent_starting_vllm_is_a_failed_run_not_bad_input(model, tmp_path) -> None:  # noqa: F811
    """Regression (CI on a loaded machine): vLLM's start outlasted ``--time-limit``, no step
    was recorded, and the empty trace exited 2 ("empty trace: nothing to check"), the exit
    code of unusable input; a run that failed is exit 1."""
    out = tmp_path / "late.parquet"
    proc = _serve([STOP, "--offline", "--model", str(model), "--time-limit", "1", "-o", str(out)])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "vLLM failed mid-run: the run did not finish within 100000 steps / the time limit (step 0" \
        in proc.stderr
    assert proc.stderr.rstrip().splitlines()[-1].startswith("no engine step was recorded: nothing to check")
    assert _left_running(out) == []
