"""Regression (issue 22, vLLM 0.33.0's whole tests/v1/core): three false alarms on
``tests/v1/core/test_priority_preemption_bug.py::test_priority_scheduler_preempt_skipped_request``.

Its recording (``tests/data/vllm-0.33.0-test_priority_preemption_bug.jsonl``, the real one, its
``vllm_config`` cut to the keys the converter reads): a priority scheduler on 6 blocks of 16 tokens,
``max_model_len`` 1000, ``long_prefill_token_threshold`` 15; A (200 tokens) added alone, then B
(15) and C (1); the test's ``mock_output`` samples a token for every scheduled request.

* IDLE-ADMISSION at step 0 ("nothing running, 1 waiting, and nothing admitted"): A alone is the only
  eligible request, so vLLM drops the threshold (``long_prefill_token_threshold`` 0) and asks for
  all 200 tokens (13 blocks) of a 5-block pool. The rule's premise (every accepted request fits an
  empty engine: vLLM's engine start-up check) does not hold for a pool smaller than one
  ``max_model_len`` request; not judged now for a waiting request longer than the pool.
* OUTPUT-ONLY-COMPLETE at steps 1 and 2 ("1 token sampled by a step reaching 15 of 200 tokens"):
  the hand-made ``ModelRunnerOutput`` samples a token for A's partial prefill chunk (EngineCore's
  model runner samples none there) and vLLM appends it: now a protocol break at that update
  (kind ``model-output-partial-prefill-token``), the trace keeping step 0.
* Then the replay diverged ("expected 'next step', got 'engine stalled: step 0: 1 unfinished
  requests but nothing scheduled and no arrival or abort ahead'"): the request that unblocked vLLM
  came after the break, outside the trace. A stall after every recorded step of a trace its driver
  ended is beyond the trace: identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from harness.candidates.vllm import recording_convert as rc
from harness.check.checker import check_trace
from harness.check.lifecycle import _longer_than_the_pool
from harness.check.model import TraceModel
from harness.candidates.resolve import resolve_candidate
from harness.replay import replay
from harness.trace.reader import open_trace
from harness.vllm_tests_report import protocol_kind

DATA = Path(__file__).resolve().parent / "data" / "vllm-0.33.0-test_priority_preemption_bug.jsonl"


def test_the_recording_converts_to_step_0_and_names_the_hand_made_output(tmp_path: Path) -> None:
    src = tmp_path / "rec.jsonl"
    shutil.copy(DATA, src)
    summary = rc.convert(src, tmp_path / "rec.parquet")
    assert summary["steps"] == 1
    assert summary["protocol"] == (
        "the recorded run left the trace's step protocol at rec.jsonl:line 7: the model output samples a token for "
        "request 'A', whose step reached 15 of its 200 tokens (a partial prefill chunk: EngineCore's model "
        "runner samples none there; a hand-made ModelRunnerOutput)")
    assert protocol_kind(summary["protocol"]) == "model-output-partial-prefill-token"
    trace = open_trace(tmp_path / "rec.parquet")
    # Regression: a trace ended by a protocol break was also "salvaged" (its end record, past the
    # break, was never read): "a vLLM recording without its end record (the server was cut off)".
    assert trace.summary.get("salvaged") is None and trace.summary["protocol"] == summary["protocol"]
    for semantics in ("auto", "safety"):
        result = check_trace(trace, semantics)
        assert result.ok and result.steps == 1, [(v.invariant, v.step) for v in result.violations]
    assert replay(trace, resolve_candidate("reference")) == (None, 1)


def _model(num_gpu_blocks: int, max_model_len: int, waiting_tokens: int, **extra) -> TraceModel:
    config = json.loads(DATA.read_text().splitlines()[0])["config"]
    config.update(num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len, **extra)
    m = TraceModel(config)
    m.reqs["A"] = type("R", (), {"num_tokens": waiting_tokens})()
    return m


def test_idle_admission_is_judged_unless_a_waiting_request_is_longer_than_a_small_pool() -> None:
    # The recording's pool: 5 usable blocks of 16 = 80 tokens, max_model_len 1000.
    assert _longer_than_the_pool(_model(6, 1000, 200), ["A"]) is True
    assert _longer_than_the_pool(_model(6, 1000, 80), ["A"]) is False   # fits the pool: judged
    assert _longer_than_the_pool(_model(6, 80, 200), ["A"]) is False    # the pool holds max_model_len
    assert _longer_than_the_pool(_model(6, 1000, 200), ["gone"]) is False
    # A windowed model needs fewer blocks than its tokens: never claimed (the rule stays judged;
    # tests/test_regression_hybrid_pool_check_one_group.py pins it firing one block short).
    assert _longer_than_the_pool(_model(6, 1000, 200, sliding_window=8), ["A"]) is False
