"""Finding: vLLM 0.20.2 resumes a preempted request before its stale output
arrives (async scheduling, 3 batches in flight) and its engine core dies on
``assert request.num_output_placeholders >= 0``.

The config is one real 0.20.2 accepts: ``VllmConfig.__post_init__`` refuses
explicitly enabled async scheduling only for non-EAGLE speculative decoding
and executors without support (``vllm/config/vllm.py:774-796``); the
multiprocessing and Ray executors support it and give
``max_concurrent_batches = pipeline_parallel_size`` (``v1/executor/
multiproc_executor.py:475-478``, ``ray_executor.py:100-105``), and the
scheduler and worker have an async + PP path (``sched/scheduler.py:1079``,
``v1/worker/gpu_model_runner.py:4147``). (0.33.0 refuses async + PP on the
V1 runner, ``config/vllm.py:1652-1679``; 0.29.0 and 0.33.0 skip a request
whose stale output is in flight, STALE-OUTPUT.)

The mechanism (0.20.2): ``_preempt_request`` resets ``num_computed_tokens``
but keeps ``num_output_placeholders`` and marks nothing
(``sched/scheduler.py:965-985``); the waiting loop has no stale-output skip.
With 3 batches in flight a request preempted at step s still has the outputs
of s-2 and s-1 in flight; s-2's arrives at s's update, so at s+1 the request
resumes from prompt + 1 output while s-1's token (position P) is in flight.
The worker re-syncs a resumed request's tokens from the scheduler's
``all_token_ids`` (``gpu_model_runner.py:1318-1325``, async only), so its
sequence ends at P and the resumed prefill samples position P again
(``discard_request_mask`` is ``seq_len < num_tokens``, 1919-1921): two
tokens for one position. The scheduler counted the resumed step as a prefill
chunk (``is_prefill_chunk = num_computed < num_tokens + placeholders``,
1001-1003: the stale placeholder), so it added no placeholder for it; the
extra token drives ``num_output_placeholders`` to -1
(``async_scheduler.py:52-53``). Without the assert (``python -O``) the
token would be appended after P's: a duplicated token in the output.

The harness's scripted and torch runners keep a worker's own token list
across a preemption (they never re-sync), so they sample nothing there and
``--verify-outputs`` passes; ``Resync`` below adds the re-sync, and the
same runner gives the reference's outputs on 0.33.0-design engines and on
0.20.2 with 2 batches in flight (no stale output survives to a resume).
Needs the vLLM 0.20.2 env (``harness vllm-env 0.20.2``): skipped without it.
"""

from __future__ import annotations

import collections
import gc
import os
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.check import check_steps, check_trace
from harness.check.profiles import resolve
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from harness.trace.recorder import record
from reference.runners.base import ScriptedRunnerAdapter
from reference.runners.scripted import ScriptedModelRunner

VERSION = "0.20.2"


def _needs_env() -> None:
    from harness.candidates.vllm.env import is_ready

    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    if not is_ready(VERSION):
        pytest.skip(f"no vLLM {VERSION} env (`harness vllm-env {VERSION}`)")


class Resync(ScriptedRunnerAdapter):
    """The scripted model as vLLM 0.20.2's async GPU worker treats a resumed
    request: its tokens become the scheduler's (prompt + the outputs
    delivered by the updates so far, ``gpu_model_runner.py:1318-1325``),
    dropping what the worker sampled into batches still in flight."""

    def __init__(self, config, seed: int) -> None:
        super().__init__(ScriptedModelRunner(seed))
        self.prompt: dict[str, int] = {}
        self.delivered: collections.Counter[str] = collections.Counter()
        self.in_flight: collections.deque[tuple[int, dict[str, int]]] = collections.deque()

    def add_request(self, spec, script) -> None:
        super().add_request(spec, script)
        self.prompt[spec.request_id] = script.num_prompt_tokens

    def execute(self, output, step: int) -> dict[str, list[int]]:
        runner = self.runner
        for rec in output.scheduled:
            if rec.kind == "resumed":
                rid = rec.request_id
                runner._num_tokens[rid] = self.prompt[rid] + self.delivered[rid]
                runner._num_outputs[rid] = self.delivered[rid]
        sampled = runner.execute(output)
        self.in_flight.append((step, {rid: len(tokens) for rid, tokens in sampled.items()}))
        return sampled

    def batch_done(self, step: int) -> None:
        done, counts = self.in_flight.popleft()
        assert done == step, (done, step)
        self.delivered.update(counts)


def _record(tmp_path: Path, name: str, engine: str, runner_factory=None) -> Path:
    scenario = SCENARIOS[name]
    path = tmp_path / f"{name}.{engine.replace('@', '-')}.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
           engine=engine, candidate_factory=resolve_candidate(engine), runner_factory=runner_factory)
    gc.collect()  # the driver goes back to the pool
    return path


def _outputs(path: Path) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    for _, rows in open_trace(path).iter_steps():
        for row in rows:
            if row["kind"] == "output":
                outputs[row["request_id"]] += list(row["token_ids"])
    return dict(outputs)


@pytest.mark.vllm
def test_finding_vllm_0_20_2_resumes_before_stale_output_and_trips_the_placeholder_assert(tmp_path) -> None:
    _needs_env()
    path = _record(tmp_path, "async-pipeline-3", f"vllm@{VERSION}", Resync)
    crash = [row for _, rows in open_trace(path).iter_steps() for row in rows if row["kind"] == "crash"]
    assert [(row["step"], row["status"], row["message"], row["stop_reason"]) for row in crash] == [
        (112, "update_from_output", "AssertionError: `assert request.num_output_placeholders >= 0`",
         "vllm/v1/core/sched/async_scheduler.py:53")]
    # The trace ends on vLLM's crash (ENGINE-CRASH); before it, the resume with
    # output in flight (STALE-OUTPUT) and the resumed prefill's second token
    # for the position the stale output fills (OUTPUT-ONLY-COMPLETE).
    result = check_trace(open_trace(path))
    assert (result.profile, result.by_invariant) == (
        "0.20.2", {"STALE-OUTPUT": 1, "OUTPUT-ONLY-COMPLETE": 1, "ENGINE-CRASH": 1})


@pytest.mark.vllm
def test_stale_output_is_the_witness_of_the_0_20_2_resume(tmp_path) -> None:
    """With the harness's own (non-re-syncing) scripted worker 0.20.2 runs to
    the end; the safety invariant STALE-OUTPUT names both early resumes
    (r000025 preempted at 109 with steps 107 and 108 in flight, resumed at
    110; r000030 preempted at 136, resumed at 137), and nothing else fires
    under 0.20.2's profile."""
    _needs_env()
    trace = open_trace(_record(tmp_path, "async-pipeline-3", f"vllm@{VERSION}"))
    profile, _ = resolve("auto", trace.meta)
    result = check_steps(trace.meta["config"], trace.iter_steps(), profile)
    assert profile.name == VERSION
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("STALE-OUTPUT", 110, "r000025", "admitted (resumed) with 1 token of stale output still in flight"),
        ("STALE-OUTPUT", 137, "r000030", "admitted (resumed) with 1 token of stale output still in flight")]


@pytest.mark.vllm
def test_the_re_syncing_worker_is_right_where_no_stale_output_survives(tmp_path) -> None:
    """Controls: the re-syncing worker gives the golden's outputs on the
    reference (which skips such a resume), and 0.20.2 with 2 batches in flight
    (async-tight: a victim's one in-flight output arrives before it can
    resume) produces exactly the reference's tokens."""
    _needs_env()
    golden = _outputs(Path(__file__).resolve().parent.parent / "golden" / "async-pipeline-3.parquet")
    assert _outputs(_record(tmp_path, "async-pipeline-3", "reference", Resync)) == golden
    reference = _outputs(_record(tmp_path, "async-tight", "reference", Resync))
    assert len(reference) == 50
    assert _outputs(_record(tmp_path, "async-tight", f"vllm@{VERSION}", Resync)) == reference
