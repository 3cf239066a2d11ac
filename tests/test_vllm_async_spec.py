"""Real vLLM 0.33.0 with async scheduling and speculative decoding, through the driver.

vLLM's ``AsyncScheduler`` with an n-gram ``SpeculativeConfig`` is driven the
way ``EngineCore.step_with_batch_queue`` drives it: two ``SchedulerOutput``s in
flight, the oldest updated, and no ``update_draft_token_ids`` call (under async
scheduling ``EngineCore.post_step`` hands no drafts to the scheduler; the
harness's worker fills the ``-1`` placeholders, ``reference/async_spec.py``).
Needs vLLM 0.33.0's env (``harness vllm-env 0.33.0``); ``HARNESS_SKIP_VLLM=1``
skips. Runs on the vLLM test worker (tests/conftest.py).
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, seed as hyp_seed, settings

from harness.candidates.resolve import resolve_candidate
from harness.check import check_steps
from harness.cli import main
from harness.fuzz.run import run_case
from harness.fuzz.strategies import fuzz_cases
from harness.replay import first_difference
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from harness.trace.recorder import record
from reference.scheduler import Scheduler

SPEC = "vllm@0.33.0"
needs_vllm = pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
pytestmark = [pytest.mark.vllm, needs_vllm]


@pytest.fixture(scope="module")
def vllm_env():
    from harness.candidates.vllm.env import ensure_env

    return ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))


def _record(tmp_path: Path, engine: str) -> Path:
    scenario = SCENARIOS["async-spec-decode"]
    path = tmp_path / f"async-spec-decode.{engine.split('@')[0]}.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
           engine=engine, candidate_factory=resolve_candidate(engine))
    gc.collect()
    return path


def _rows(path: Path) -> list[dict]:
    return [row for _, rows in open_trace(path).iter_steps() for row in rows]


def _stale_spec_outputs(rows: list[dict]) -> int:
    """Outputs of a batch with drafts whose request was preempted after that batch was scheduled."""
    drafts, preempted_at, batch, count = {}, {}, None, 0
    for r in rows:
        if r["kind"] == "schedule":
            drafts[(r["step"], r["request_id"])] = bool(r["spec_token_ids"])
        elif r["kind"] == "preempt":
            preempted_at[r["request_id"]] = r["step"]
        elif r["kind"] == "update_begin":
            batch = r["batch_step"]
        elif r["kind"] == "output" and drafts.get((batch, r["request_id"])):
            count += preempted_at.get(r["request_id"], -1) > batch
    return count


def test_async_spec_decode_replays_identically_on_vllm(vllm_env, tmp_path):
    """The canonical scenario (176 steps, 14 preemptions, 5 stale speculative
    outputs, two batches in flight, every scheduled draft a -1 placeholder):
    vLLM 0.33.0 re-driven with its inputs decides the same on every step."""
    trace = _record(tmp_path, "reference")
    rows = _rows(trace)
    assert max(r["step"] - r["batch_step"] for r in rows if r["kind"] == "update_begin") == 1
    assert sum(r["kind"] == "preempt" for r in rows) == 14 and _stale_spec_outputs(rows) == 5
    assert not any(r["kind"] == "draft" for r in rows)
    result = CliRunner().invoke(main, ["replay", str(trace), "--candidate", SPEC, "--json"])
    gc.collect()
    payload = json.loads(result.output)
    assert payload["divergence"] is None, payload["divergence"]
    assert result.exit_code == 0 and payload["ok"] and payload["replayed_steps"] == payload["steps"] == 176


def test_vllm_recorded_async_spec_trace_passes_check_and_diffs_equal(vllm_env, tmp_path):
    """Recorded by vLLM itself: every invariant holds (placeholders, -1
    drafts, rollback one step later, stale speculative output discarded) and
    the decisions equal the reference's."""
    real = _record(tmp_path, SPEC)
    tr = open_trace(real)
    result = check_steps(tr.meta["config"], tr.iter_steps())
    assert result.ok, result.by_invariant
    assert (result.draft_tokens, result.rejected_draft_tokens, result.preemptions) == (642, 365, 14)
    ref = _record(tmp_path, "reference")
    diff = CliRunner().invoke(main, ["diff", str(ref), str(real), "--json"])
    payload = json.loads(diff.output)
    assert diff.exit_code == 0 and payload["same"], payload["first_divergence"]


def test_generated_async_spec_configs_are_identical_on_vllm(vllm_env):
    """12 cases of the fuzzer's strategy restricted to async scheduling with
    drafts (``fuzz_cases(async_spec=True)``, hypothesis seed 2024; encoder
    inputs, which the driver does not pass, filtered out): vLLM takes the
    reference's decisions on every step of each (the longer sweep:
    bench/vllm_async_spec_sweep.py)."""
    factory = resolve_candidate(SPEC)
    seen = {"cases": 0, "steps": 0}

    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              phases=[Phase.generate])
    @hyp_seed(2024)
    @given(fuzz_cases(async_spec=True).filter(lambda c: "max_num_encoder_input_tokens" not in c.config))
    def prop(case):
        ref, real = run_case(Scheduler, case), run_case(factory, case)
        gc.collect()
        assert case.config["async_scheduling"] and case.config["num_speculative_tokens"] > 0
        assert real.ended == ref.ended and len(real.steps) == len(ref.steps)
        for (rs, rrows), (cs, crows) in zip(ref.steps, real.steps):
            assert rs == cs and first_difference(rs, rrows, crows) is None, (case.config, rs)
        seen["cases"] += 1
        seen["steps"] += len(ref.steps)

    prop()
    assert seen["cases"] == 12 and seen["steps"] > 0


def test_driver_refuses_drafts_under_async_scheduling(vllm_env):
    """EngineCore never calls update_draft_token_ids under async scheduling,
    so neither may the harness: the driver answers the ``drafts`` op with a
    one-line error naming the reason."""
    from reference.config import EngineConfig

    sched = resolve_candidate(SPEC)(EngineConfig(async_scheduling=True, num_speculative_tokens=2,
                                                 num_gpu_blocks=64, max_model_len=64))
    with pytest.raises(Exception, match=r"draft tokens sent with async scheduling \(EngineCore hands "
                                        r"drafts to the scheduler only when scheduling is synchronous\)"):
        sched.update_draft_token_ids({"r": [1, 2]})
    del sched
    gc.collect()
