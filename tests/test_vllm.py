"""Real vLLM as a candidate (``vllm@0.33.0``): driver, replay fidelity, check, crashes.

The tests marked ``vllm`` need vLLM 0.33.0's CPU venv (``harness vllm-env 0.33.0``,
about a minute the first time: the module fixture builds it when missing).
``HARNESS_SKIP_VLLM=1`` skips them. One driver process (importing vLLM costs
10-17 s) is shared by the whole module: candidates hand it back to a pool when
they are released, and the next one re-initialises it with its own config.
The unmarked tests at the end need no vLLM.
"""

from __future__ import annotations

import ast
import gc
import json
import os
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.check import check_steps
from harness.cli import main
from harness.trace.recorder import record
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from reference.candidate import CandidateError
from reference.config import ConfigError, EngineConfig
from reference.engine import Engine
from reference.workload import RequestSpec, Workload

VERSION = "0.33.0"
SPEC = f"vllm@{VERSION}"
REPO = Path(__file__).resolve().parent.parent
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"

vllm = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")

# Scenarios whose vLLM decisions equal the reference's on every step.
IDENTICAL = ["fcfs-tight", "priority-tight", "prefix-sharing", "chunked-threshold",
             "no-prefix-caching", "eos-stop-abort", "spec-decode-priority"]


@pytest.fixture(scope="module")
def vllm_env():
    """Build (or find) the vLLM env once per module."""
    from harness.candidates.vllm.env import ensure_env

    return ensure_env(VERSION, log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))


def _record(tmp_path: Path, name: str, engine: str) -> Path:
    scenario = SCENARIOS[name]
    path = tmp_path / f"{name}.{engine.split('@')[0]}.parquet"
    record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
           engine=engine, candidate_factory=resolve_candidate(engine))
    gc.collect()  # release the candidate: its driver goes back to the pool
    return path


@vllm
@needs_vllm
def test_driver_starts_and_reports_its_version(vllm_env):
    from harness.candidates.vllm.candidate import VLLMCandidate

    config = EngineConfig(num_gpu_blocks=50, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64)
    candidate = VLLMCandidate(config, VERSION)
    assert candidate.pid is None  # lazy: nothing started yet
    snap = candidate.snapshot()
    assert (snap.waiting, snap.running, snap.num_free_blocks) == ((), (), 49)  # block 0 is null
    assert candidate.info["vllm_version"] == VERSION
    assert candidate.info["use_v2_model_runner"] is False
    stats = candidate.stats()
    assert stats["import_s"] > 0
    candidate.close()


@vllm
@needs_vllm
@pytest.mark.parametrize("name", IDENTICAL)
def test_replay_of_reference_trace_on_vllm_is_identical(vllm_env, tmp_path, name):
    trace = _record(tmp_path, name, "reference")
    result = CliRunner().invoke(main, ["replay", str(trace), "--candidate", SPEC, "--json"])
    gc.collect()
    payload = json.loads(result.output)
    assert payload["divergence"] is None, payload["divergence"]
    assert result.exit_code == 0 and payload["ok"]
    assert payload["replayed_steps"] == payload["steps"] > 0


@vllm
@needs_vllm
def test_vllm_recorded_trace_passes_check(vllm_env, tmp_path):
    # priority-tight has preemptions and a PRIORITY give-back (withdraw row).
    trace = _record(tmp_path, "priority-tight", SPEC)
    tr = open_trace(trace)
    assert tr.meta["engine"] == SPEC
    result = check_steps(tr.meta["config"], tr.iter_steps())
    assert result.ok, result.by_invariant
    assert result.preemptions > 0
    cli = CliRunner().invoke(main, ["check", str(trace), "--json"])
    assert cli.exit_code == 0, cli.output
    kinds = {row["kind"] for _, rows in tr.iter_steps() for row in rows}
    assert {"withdraw", "preempt", "schedule", "finish"} <= kinds


@vllm
@needs_vllm
def test_vllm_and_reference_traces_diff_equal(vllm_env, tmp_path):
    ref = _record(tmp_path, "preemption-heavy", "reference")
    real = _record(tmp_path, "preemption-heavy", SPEC)
    result = CliRunner().invoke(main, ["diff", str(ref), str(real), "--json"])
    payload = json.loads(result.output)
    assert result.exit_code == 0 and payload["same"], payload["first_divergence"]
    assert payload["a"]["preemptions"] == payload["b"]["preemptions"] > 0


@vllm
@needs_vllm
def test_replay_through_the_real_cli_process(vllm_env, tmp_path):
    """One end-to-end run of the installed command (its own vLLM import)."""
    import subprocess

    trace = _record(tmp_path, "fcfs-roomy", "reference")
    harness = Path(sys.executable).with_name("harness")
    cmd = [str(harness)] if harness.exists() else [sys.executable, "-m", "harness.cli"]
    proc = subprocess.run(cmd + ["replay", str(trace), "--candidate", SPEC, "--json"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["divergence"] is None


def _crash_workload() -> Workload:
    specs = tuple(RequestSpec(f"r{i}", 0.001 * i, tuple(range(100, 120 + i)), max_tokens=20)
                  for i in range(4))
    return Workload(source="synthetic", sha256="0" * 64, params={}, requests=specs)


@vllm
@needs_vllm
def test_driver_error_is_reported_with_the_failing_op(vllm_env):
    from harness.candidates.vllm.candidate import VLLMCandidate, VLLMDriverError

    candidate = VLLMCandidate(EngineConfig(), VERSION)
    with pytest.raises(VLLMDriverError, match=r"raised during 'update': DriverError: "
                                              r"'update' without a preceding 'schedule'"):
        candidate._call("update", sampled={})
    candidate.snapshot()  # an error answer leaves the driver usable
    candidate.close()


@vllm
@needs_vllm
def test_known_finding_priority_tie_preemption_livelock_in_vllm(vllm_env, tmp_path):
    """Found by `harness fuzz --seed 6`: with equal priorities and arrival
    times, caching off, one token per step and a pool that cannot hold both
    prompts, vLLM 0.33.0's PRIORITY victim (the first running request with the
    largest (priority, arrival_time), i.e. the older one) makes two requests
    preempt each other forever: the reference and real vLLM take identical
    decisions until the harness's livelock detector stops them."""
    from harness.fuzz import FuzzCase
    from harness.replay import replay

    case = FuzzCase.from_dict(json.loads(
        (REPO / "tests" / "regressions" / "fuzz-finding-priority-tie-preemption-livelock.json").read_text())["scenario"])
    path = tmp_path / "livelock.parquet"
    summary = record(case.workload(), case.engine_config(), path, seed=case.seed)
    assert summary.stalled is not None and "livelock" in summary.stalled
    trace = open_trace(path)
    assert set(check_steps(trace.meta["config"], trace.iter_steps()).by_invariant) == {"LIVENESS"}
    divergence, steps = replay(trace, resolve_candidate(SPEC))
    assert divergence is None and steps == summary.steps
    gc.collect()


@vllm
@needs_vllm
def test_known_finding_padded_spec_decode_with_small_threshold_crashes_vllm(vllm_env, tmp_path):
    """vLLM 0.33.0 pads a new decode to 1 + K tokens, then caps it at
    long_prefill_token_threshold (< 1 + K) and fails its own assert
    ``num_new_tokens == 1 + self.num_spec_tokens`` (scheduler.py, waiting loop).
    Minimal case: r1 (a 1-token prompt) is admitted while r0 decodes."""
    specs = (RequestSpec("r0", 0.0, tuple(range(100, 108)), max_tokens=10),
             RequestSpec("r1", 0.012, (200,), max_tokens=10))
    workload = Workload(source="synthetic", sha256="0" * 64, params={}, requests=specs)
    fields = dict(block_size=16, max_model_len=128, num_gpu_blocks=20, max_num_seqs=4,
                  max_num_batched_tokens=256, num_speculative_tokens=4)
    # The reference refuses this config because of this very crash ...
    with pytest.raises(ConfigError, match="crashes vLLM 0.33.0's spec-decode padding"):
        EngineConfig(**fields, long_prefill_token_threshold=4)
    # ... so bypass the validation to show vLLM accepting it and then failing.
    config = EngineConfig(**fields)
    object.__setattr__(config, "long_prefill_token_threshold", 4)
    with pytest.raises(CandidateError, match=r"^candidate raised AssertionError in schedule\(\) at step 3: "
                                             r"`assert num_new_tokens == 1 \+ self\.num_spec_tokens` "
                                             r"\(at vllm/v1/core/sched/scheduler\.py:1579\)$"):
        Engine(config, candidate_factory=resolve_candidate(SPEC)).run(workload)
    gc.collect()


@vllm
@needs_vllm
def test_vllm_crash_through_the_driver_is_a_crash_row_and_engine_crash(vllm_env, tmp_path):
    """The same vLLM 0.33.0 assert, recorded: the driver reports vLLM's own
    exception (type, message, innermost vLLM frame), the trace ends on a
    ``crash`` row after step 3's schedule_begin (vLLM's decisions before the
    assert are not reported by the driver), ``harness check`` reports one
    ENGINE-CRASH (no LIVENESS for the two requests it cut off) and vLLM
    replayed on the trace crashes the same way (matched)."""
    from harness.replay import replay

    specs = (RequestSpec("r0", 0.0, tuple(range(100, 108)), max_tokens=10),
             RequestSpec("r1", 0.012, (200,), max_tokens=10))
    workload = Workload(source="synthetic", sha256="0" * 64, params={}, requests=specs)
    data = {**EngineConfig(block_size=16, max_model_len=128, num_gpu_blocks=20, max_num_seqs=4,
                           max_num_batched_tokens=256, num_speculative_tokens=4).to_dict(),
            "long_prefill_token_threshold": 4}
    config = EngineConfig.from_dict(data, accept_vllm_crash=True)
    path = tmp_path / "crash.parquet"
    line = ("candidate raised AssertionError in schedule() at step 3: `assert num_new_tokens == 1 + "
            "self.num_spec_tokens` (at vllm/v1/core/sched/scheduler.py:1579)")
    summary = record(workload, config, path, engine=SPEC, candidate_factory=resolve_candidate(SPEC))
    assert (summary.steps, summary.crashed) == (4, line)
    trace = open_trace(path)
    assert trace.summary["crashed"] == line
    step, rows = list(trace.iter_steps())[-1]
    assert step == 3
    assert [(r["kind"], r["request_id"]) for r in rows] == [("arrival", "r1"), ("schedule_begin", None),
                                                            ("crash", None)]
    assert (rows[1]["waiting"], rows[1]["running"]) == (["r1"], ["r0"])
    assert {k: rows[2][k] for k in ("status", "message", "stop_reason", "rank")} == {
        "status": "schedule", "message": "AssertionError: `assert num_new_tokens == 1 + self.num_spec_tokens`",
        "stop_reason": "vllm/v1/core/sched/scheduler.py:1579", "rank": 0}
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.by_invariant == {"ENGINE-CRASH": 1}
    (v,) = result.violations
    assert (v.step, v.message) == (3, "schedule() raised AssertionError: `assert num_new_tokens == 1 + "
                                      "self.num_spec_tokens` at vllm/v1/core/sched/scheduler.py:1579")
    assert v.history == ["step 3: inputs: arrival r1",
                         "step 3: queues at step start: waiting ['r1'], running ['r0'], 17 free blocks",
                         "step 3: decisions before the crash: none recorded (schedule() raised before "
                         "returning them)"]
    assert replay(trace, resolve_candidate(SPEC)) == (None, 4)
    result = CliRunner().invoke(main, ["check", str(path)])
    assert result.exit_code == 1
    assert result.output.splitlines()[-1] == "1 violation of 1 invariant: ENGINE-CRASH ×1 (profile 0.33.0)"
    gc.collect()


# -- pipelining, async scheduling, deferred frees, prefill gating, DP ---------------

def _assert_vllm_replays_identically(trace: Path) -> None:
    """vLLM re-driven with the trace's inputs decides the same on every step."""
    from harness.replay import replay

    divergence, steps = replay(open_trace(trace), resolve_candidate(SPEC))
    gc.collect()
    assert divergence is None, divergence.to_dict()
    assert steps == open_trace(trace).summary["steps"] > 0


def _rows(trace_path: Path) -> list[dict]:
    return [row for _, rows in open_trace(trace_path).iter_steps() for row in rows]


def _batch_lag(rows: list[dict]) -> int:
    """The largest (step - batch_step) of an update: batches in flight - 1."""
    return max((r["step"] - r["batch_step"] for r in rows if r["kind"] == "update_begin"), default=0)


# Each newly driven feature: a golden scenario, and what its trace must show
# for the comparison to mean anything (the feature really ran).
FEATURES = {
    # AsyncScheduler: the next decode is scheduled before the previous output
    # returns; preemptions with output in flight (stale output delivered).
    "async-tight": lambda rows: _batch_lag(rows) == 1 and any(r["kind"] == "preempt" for r in rows),
    # Three batches in flight, plain Scheduler (pipeline-parallel-like).
    "pipeline-3": lambda rows: _batch_lag(rows) == 2,
    # Async with three batches in flight: resumes skipped while stale output is in flight.
    "async-pipeline-3": lambda rows: _batch_lag(rows) == 2 and any(
        r["kind"] == "skip" and r["message"] == "stale output in flight" for r in rows),
    # Deferred, fenced frees (finishes and aborts in flight), drained FIFO.
    "deferred-frees": lambda rows: any(r["kind"] == "free_drain" for r in rows) and any(
        r["kind"] == "abort" and r["fence"] is not None for r in rows),
    # Two DP ranks, each its own vLLM scheduler; the coordinator throttles prefills.
    "dp2-throttle": lambda rows: {r["rank"] for r in rows} == {0, 1} and any(
        r["kind"] == "schedule_end" and r["defer_prefills"] and r["rank"] == 1 for r in rows),
    # The local prefill cadence (prefill_schedule_interval, no DP).
    "prefill-cadence": lambda rows: any(r["kind"] == "schedule_end" and r["defer_prefills"]
                                        for r in rows),
}


@vllm
@needs_vllm
@pytest.mark.parametrize("name", sorted(FEATURES))
def test_pipelined_and_gated_scenarios_replay_identically_on_vllm(vllm_env, tmp_path, name):
    """vLLM 0.33.0 driven with several batches in flight (AsyncScheduler or
    Scheduler), deferred frees, prefill gating and DP ranks takes the
    reference's decisions on every step, and the trace shows the feature."""
    trace = _record(tmp_path, name, "reference")
    assert FEATURES[name](_rows(trace)), f"{name} does not exercise its feature"
    _assert_vllm_replays_identically(trace)


@vllm
@needs_vllm
@pytest.mark.parametrize("name", ["deferred-frees", "async-pipeline-3"])
def test_vllm_recorded_pipelined_trace_passes_check_and_diffs_equal(vllm_env, tmp_path, name):
    """Recorded by vLLM itself: every invariant holds (fenced frees, stale
    output, placeholders) and the decisions equal the reference's."""
    real = _record(tmp_path, name, SPEC)
    tr = open_trace(real)
    result = check_steps(tr.meta["config"], tr.iter_steps())
    assert result.ok, result.by_invariant
    assert FEATURES[name](_rows(real))
    ref = _record(tmp_path, name, "reference")
    diff = CliRunner().invoke(main, ["diff", str(ref), str(real), "--json"])
    payload = json.loads(diff.output)
    assert diff.exit_code == 0 and payload["same"], payload["first_divergence"]


def _max_in_flight(rows: list[dict]) -> int:
    """The most batches scheduled and not yet updated at once (a step's batch
    counts from its schedule_begin to the update_begin naming it)."""
    live: set[int] = set()
    most = 0
    for r in rows:
        if r["kind"] == "schedule_begin":
            live.add(r["step"])
            most = max(most, len(live))
        elif r["kind"] == "update_begin":
            live.discard(r["batch_step"])
    return most


# `harness record synthetic:40 --set async_scheduling=true` on a pool small
# enough to preempt (README's small-scenario sizes), alone and with pipeline
# parallelism: (extra --set, batches in flight vLLM derives, steps, preemptions).
ASYNC_RECORDINGS = {
    "async": ([], 2, 299, 1),
    "async-pp3": (["--set", "pipeline_parallel_size=3"], 3, 331, 1),
}
SMALL_POOL = ["--set", "num_gpu_blocks=30", "--set", "block_size=4", "--set", "max_model_len=96",
              "--set", "max_num_seqs=4", "--set", "max_num_batched_tokens=64"]


@vllm
@needs_vllm
@pytest.mark.parametrize("variant", sorted(ASYNC_RECORDINGS))
def test_async_scheduling_set_alone_records_and_replays_identically_on_vllm(vllm_env, tmp_path,
                                                                           variant):
    """`--set async_scheduling=true` alone works as in vLLM (2 batches in
    flight, derived); with pipeline_parallel_size=3 vLLM's V1-runner rule
    gives 3. The trace records the derived count, and vLLM 0.33.0 (its
    VllmConfig deriving the same count from the same keys) takes the same
    decisions on every step."""
    extra, batches, steps, preemptions = ASYNC_RECORDINGS[variant]
    path = tmp_path / f"{variant}.parquet"
    recorded = CliRunner().invoke(main, ["record", "synthetic:40", "-o", str(path),
                                         "--set", "async_scheduling=true", *SMALL_POOL, *extra])
    assert recorded.exit_code == 0, recorded.output
    trace = open_trace(path)
    assert trace.meta["config"]["max_concurrent_batches"] == batches
    assert trace.config.async_scheduling is True
    rows = _rows(path)
    assert (trace.summary["steps"], sum(r["kind"] == "preempt" for r in rows)) == (steps, preemptions)
    assert _max_in_flight(rows) == batches
    result = CliRunner().invoke(main, ["replay", str(path), "--candidate", SPEC, "--json"])
    gc.collect()
    payload = json.loads(result.output)
    assert payload["divergence"] is None, payload["divergence"]
    assert result.exit_code == 0 and payload["ok"]
    assert payload["replayed_steps"] == payload["steps"] == steps


@vllm
@needs_vllm
def test_driver_builds_the_scheduler_each_feature_needs(vllm_env):
    from harness.candidates.vllm.candidate import VLLMCandidate

    def info(name: str, **over) -> dict:
        candidate = VLLMCandidate(EngineConfig(**{**SCENARIOS[name].config, **over}), VERSION)
        candidate.snapshot()  # starts (or reuses) the driver
        try:
            return dict(candidate.info, pid=candidate.pid)
        finally:
            candidate.close()

    # Async scheduling: vLLM's AsyncScheduler, built directly (the CPU platform
    # turns SchedulerConfig.async_scheduling off).
    deferred = info("deferred-frees")
    assert deferred["scheduler_class"] == "AsyncScheduler"
    assert deferred["defer_block_free"] is True and deferred["max_concurrent_batches"] == 2
    assert info("async-tight")["defer_block_free"] is False  # no KV consumer: vLLM frees at once
    pipeline = info("pipeline-3")
    assert (pipeline["scheduler_class"], pipeline["max_concurrent_batches"]) == ("Scheduler", 3)
    # The local prefill cadence applies without DP, and is off on a DP rank
    # (the coordinator's throttle_prefills drives it there).
    assert info("prefill-cadence")["local_prefill_interval"] == 3
    assert info("dp2-throttle")["local_prefill_interval"] == 1


@vllm
@needs_vllm
def test_dp_ranks_are_separate_vllm_schedulers(vllm_env):
    """One candidate, hence one driver process and one vLLM Scheduler, per rank."""
    config = SCENARIOS["dp2-throttle"].engine_config()
    engine = Engine(config, candidate_factory=resolve_candidate(SPEC))
    summary = engine.run(SCENARIOS["dp2-throttle"].make_workload())
    pids = [c.pid for c in engine.schedulers]
    assert len(pids) == 2 and None not in pids and pids[0] != pids[1]
    assert summary.finished == summary.requests - summary.rejected - summary.aborted
    for candidate in engine.schedulers:
        candidate.close()


@vllm
@needs_vllm
def test_batches_in_flight_are_updated_oldest_first(vllm_env):
    from harness.candidates.vllm.candidate import VLLMCandidate, VLLMDriverError
    from reference.request import Request, SamplingParams

    config = EngineConfig(num_gpu_blocks=50, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64, async_scheduling=True)
    candidate = VLLMCandidate(config, VERSION)
    candidate.add_request(Request("r0", list(range(100, 110)), SamplingParams(max_tokens=5),
                                  arrival_time=0.0, block_size=4))
    first = candidate.schedule()
    second = candidate.schedule()  # the decode, scheduled on a placeholder
    assert first.num_scheduled_tokens == {"r0": 10} and second.num_scheduled_tokens == {"r0": 1}
    with pytest.raises(VLLMDriverError, match="oldest schedule"):
        candidate.update_from_output(second, {"r0": [7]})
    with pytest.raises(VLLMDriverError, match=r"'schedule' with 2 batches in flight"):
        candidate._call("schedule")  # the driver's own guard: max_concurrent_batches
    assert candidate.update_from_output(first, {"r0": [7]}).new_token_ids == {"r0": [7]}
    assert candidate.update_from_output(second, {"r0": [8]}).new_token_ids == {"r0": [8]}
    candidate.close()


@vllm
@needs_vllm
def test_driver_takes_batches_in_flight_from_vllms_own_derivation(vllm_env):
    """pipeline_parallel_size reaches vLLM's ParallelConfig and the batches in
    flight are vLLM's VllmConfig.max_concurrent_batches; a config whose stored
    count vLLM does not derive (an old dict without pipeline_parallel_size)
    is refused in one line."""
    from harness.candidates.vllm.candidate import VLLMCandidate, VLLMDriverError, driver_config

    candidate = VLLMCandidate(EngineConfig(), VERSION)
    candidate.snapshot()
    try:
        with pytest.raises(VLLMDriverError, match=r"vLLM 0\.33\.0 derives max_concurrent_batches=1 from "
                                                  r"pipeline_parallel_size=1, async_scheduling=False "
                                                  r"\(use_v2_model_runner=False\); the harness config "
                                                  r"says 3"):
            candidate._call("init", config={**EngineConfig().to_dict(), "max_concurrent_batches": 3},
                            seed=0)
        for config, batches in [(EngineConfig(async_scheduling=True, pipeline_parallel_size=2), 2),
                                (EngineConfig(pipeline_parallel_size=4), 4),
                                (EngineConfig(), 1)]:
            info = candidate._call("init", config=driver_config(config), seed=0)
            assert info["max_concurrent_batches"] == batches == config.max_concurrent_batches
    finally:
        candidate.close()


# -- KV connector (async KV loads) -------------------------------------------------

def _kv_rows_show_the_connector(rows: list[dict], policy: str) -> bool:
    """The trace really loads, promotes, fails loads and frees after a
    transfer; under the fail policy a failed load finishes with an error."""
    kinds = {r["kind"] for r in rows}
    if not {"kv_load", "kv_promote", "kv_invalid", "kv_finished", "kv_free"} <= kinds:
        return False
    if not any(r["kind"] == "skip" and r["message"] == "waiting for remote KV" for r in rows):
        return False
    errors = [r for r in rows if r["kind"] == "finish" and r["status"] == "FINISHED_ERROR"]
    if policy == "fail":
        return bool(errors)
    return not errors and any(r["kind"] == "kv_promote" and r["message"] == "load failed"
                              for r in rows)


def _record_config(tmp_path: Path, name: str, config: EngineConfig, engine: str = "reference",
                   tag: str = "") -> Path:
    scenario = SCENARIOS[name]
    path = tmp_path / f"{name}{tag}.{engine.split('@')[0]}.parquet"
    record(scenario.make_workload(), config, path, seed=scenario.seed, engine=engine,
           candidate_factory=resolve_candidate(engine))
    gc.collect()
    return path


# The kv-connector scenario (async loads over 3 steps, 25% failed loads,
# aborts while loading), with each failure policy, and with async scheduling
# and deferred frees (which vLLM's own KV-consumer gate turns on).
KV_VARIANTS = {
    "recompute": {},
    "fail": {"kv_load_failure_policy": "fail"},
    "async-deferred": {"async_scheduling": True, "defer_block_free": True},
    "async-deferred-fail": {"async_scheduling": True, "defer_block_free": True,
                            "kv_load_failure_policy": "fail"},
}


@vllm
@needs_vllm
@pytest.mark.parametrize("variant", sorted(KV_VARIANTS))
def test_kv_connector_scenario_replays_identically_on_vllm(vllm_env, tmp_path, variant):
    """vLLM 0.33.0 with the harness's connector stand-in takes the reference's
    decisions on every step: async-load admissions (local hit, external
    tokens, block table, reserved blocks), waiting-for-remote-KV skips,
    promotions (status, computed tokens, freed blocks), failed blocks,
    transfers done, frees of requests aborted while loading (with fences),
    and FINISHED_ERROR finishes under the fail policy."""
    overrides = KV_VARIANTS[variant]
    config = EngineConfig(**{**SCENARIOS["kv-connector"].config, **overrides})
    trace = _record_config(tmp_path, "kv-connector", config, tag=f"-{variant}")
    rows = _rows(trace)
    assert _kv_rows_show_the_connector(rows, config.kv_load_failure_policy), variant
    assert any(r["kind"] == "abort" for r in rows)
    if config.defer_block_free:
        assert any(r["kind"] == "free_drain" for r in rows)
    _assert_vllm_replays_identically(trace)


@vllm
@needs_vllm
@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_vllm_recorded_kv_connector_trace_passes_check_and_diffs_equal(vllm_env, tmp_path, policy):
    """Recorded by vLLM itself (its loads fed by the harness's simulated
    worker): every invariant holds and the trace equals the reference's."""
    config = EngineConfig(**{**SCENARIOS["kv-connector"].config, "kv_load_failure_policy": policy})
    real = _record_config(tmp_path, "kv-connector", config, SPEC)
    tr = open_trace(real)
    result = check_steps(tr.meta["config"], tr.iter_steps())
    assert result.ok, result.by_invariant
    assert result.remote_kv_loads > 0 and result.failed_kv_loads > 0
    assert _kv_rows_show_the_connector(_rows(real), policy)
    ref = _record_config(tmp_path, "kv-connector", config)
    diff = CliRunner().invoke(main, ["diff", str(ref), str(real), "--json"])
    payload = json.loads(diff.output)
    assert diff.exit_code == 0 and payload["same"], payload["first_divergence"]


@vllm
@needs_vllm
def test_driver_configures_the_kv_connector_stand_in(vllm_env):
    """vLLM builds the stand-in from KVTransferConfig (KV consumer), takes the
    failure policy, and turns defer_block_free on by itself with more than
    one batch in flight: two of the AsyncScheduler, and three of the plain
    Scheduler with pipeline_parallel_size 3 (which the driver passes to
    vLLM's ParallelConfig, so VllmConfig.max_concurrent_batches reads 3)."""
    from harness.candidates.vllm.candidate import VLLMCandidate

    def info(**over) -> dict:
        config = EngineConfig(**{**SCENARIOS["kv-connector"].config, **over})
        candidate = VLLMCandidate(config, VERSION)
        candidate.snapshot()
        try:
            return dict(candidate.info)
        finally:
            candidate.close()

    plain = info()
    assert plain["kv_connector"] == "HarnessKVStoreConnector"
    assert plain["recompute_kv_load_failures"] is True and plain["defer_block_free"] is False
    assert info(kv_load_failure_policy="fail")["recompute_kv_load_failures"] is False
    async_ = info(async_scheduling=True, defer_block_free=True)
    assert (async_["scheduler_class"], async_["defer_block_free"],
            async_["defer_block_free_by_vllm"]) == ("AsyncScheduler", True, True)
    pipelined = info(pipeline_parallel_size=3, defer_block_free=True)
    assert (pipelined["scheduler_class"], pipelined["max_concurrent_batches"],
            pipelined["defer_block_free"], pipelined["defer_block_free_by_vllm"]) == ("Scheduler", 3, True, True)


@vllm
@needs_vllm
def test_kv_connector_is_refused_where_it_cannot_be_driven(vllm_env):
    """One-line refusals: KV-connector output without the connector, and a
    vLLM version without 0.33.0's connector plumbing (kv_holding_waiting)."""
    from harness.candidates.vllm.candidate import VLLMCandidate, VLLMDriverError, VLLMRefused
    from harness.candidates.vllm.env import is_ready

    candidate = VLLMCandidate(EngineConfig(), VERSION)
    candidate._call("schedule")
    with pytest.raises(VLLMDriverError, match=r"raised during 'update': DriverError: KV connector "
                                              r"output sent with kv_connector off"):
        candidate._call("update", sampled={}, kv={"finished_recving": ["x"]})
    candidate.close()
    if not is_ready("0.29.0"):
        pytest.skip("no vLLM 0.29.0 env (`harness vllm-env 0.29.0`)")
    old = VLLMCandidate(EngineConfig(kv_connector=True), "0.29.0")
    # A refusal (CandidateRefused), not a crash of vLLM: record exits 2, no ENGINE-CRASH.
    with pytest.raises(VLLMRefused) as info:
        old.snapshot()
    message = str(info.value)
    assert "\n" not in message and message == (
        "vLLM 0.29.0 cannot run this config: vLLM 0.29.0's Scheduler has no kv_holding_waiting: "
        "async KV loads cannot be driven")
    old.close()


def _one_request(prompt: tuple[int, ...], max_tokens: int) -> Workload:
    return Workload(source="synthetic", sha256="0" * 64, params={},
                    requests=(RequestSpec("r0", 0.0, prompt, max_tokens=max_tokens),))


# Liveness findings in vLLM 0.33.0's async-load path (the reference mirrors
# each; the same request without the connector finishes in one or two steps).
KV_WEDGES = {
    # A load fails with nothing valid: the promotion frees every block, but
    # the request stays in _inflight_prefills, so its retry's reserved_blocks
    # ("for *other* in-flight sequences", allocate_slots' docstring) count its
    # own whole sequence: 10 blocks reserved + 1 to load > 10 free. The retry
    # breaks the waiting loop at the head of kv_holding_waiting every step.
    "failed-load-retry-reserves-itself": (
        dict(num_gpu_blocks=11, block_size=4, max_model_len=40, max_num_seqs=2,
             max_num_batched_tokens=64, kv_connector=True, kv_store_fraction=0.5,
             kv_load_failure_rate=1.0),
        tuple(range(400, 439)), 1, "nothing scheduled"),
    # The load reserves its own first spec-decode step (1 + K = 4 tokens, 2
    # blocks), although max_model_len caps that step: 13 + 2 > 14 free, while
    # a local prefill of the same request fits. It never loads, never runs.
    "load-reserves-capped-spec-step": (
        dict(num_gpu_blocks=15, block_size=2, max_model_len=28, max_num_seqs=2,
             max_num_batched_tokens=43, num_speculative_tokens=3, kv_connector=True,
             kv_store_fraction=1.0),
        tuple(range(100, 126)), 2, "nothing scheduled"),
    # A 1-token prompt held by the store (block_size 1): promotion sets
    # num_computed_tokens = num_tokens - 1 = 0, which the waiting loop takes
    # for a fresh request: prefix lookup, the store offers the token again,
    # a new load, forever.
    "one-token-prompt-reloads-forever": (
        dict(num_gpu_blocks=10, block_size=1, max_model_len=8, max_num_seqs=2,
             max_num_batched_tokens=16, kv_connector=True, kv_store_fraction=1.0),
        (100,), 2, "livelock"),
}


@vllm
@needs_vllm
@pytest.mark.parametrize("name", sorted(KV_WEDGES))
def test_known_finding_async_kv_load_wedges_vllm(vllm_env, tmp_path, name):
    """Found by replaying generated KV-connector configs on vLLM 0.33.0:
    three ways its async-load path stops a request forever. The reference
    and real vLLM take identical decisions until the harness's stall or
    livelock detector ends the run; the checker reports LIVENESS (and, for
    the two wedges, IDLE-ADMISSION)."""
    from harness.replay import replay

    fields, prompt, max_tokens, stall = KV_WEDGES[name]
    workload = _one_request(prompt, max_tokens)
    local = Engine(EngineConfig(**{**fields, "kv_connector": False})).run(workload)
    assert local.finished == 1 and local.steps <= 3
    path = tmp_path / f"{name}.parquet"
    summary = record(workload, EngineConfig(**fields), path)
    assert summary.stalled is not None and stall in summary.stalled
    trace = open_trace(path)
    invariants = set(check_steps(trace.meta["config"], trace.iter_steps()).by_invariant)
    assert "LIVENESS" in invariants
    rows = _rows(path)
    loads = [r for r in rows if r["kind"] == "kv_load"]
    if name == "one-token-prompt-reloads-forever":
        assert len(loads) > 100
    else:
        # A request that fits an empty engine is never admitted.
        assert "IDLE-ADMISSION" in invariants
        assert len(loads) <= 1 and not any(r["kind"] == "schedule" for r in rows)
    divergence, steps = replay(trace, resolve_candidate(SPEC))
    gc.collect()
    assert divergence is None, divergence.to_dict()
    assert steps == summary.steps


@vllm
@needs_vllm
def test_killed_driver_gives_a_clean_one_line_error(vllm_env):
    # Last of the pool's users in this module: it kills a pooled driver, and
    # every test after it would pay a fresh vLLM import (5-17 s) for it.
    from harness.candidates.vllm.candidate import VLLMCandidate, VLLMDriverError
    from harness.children import descendants

    config = EngineConfig(num_gpu_blocks=50, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64)
    victims: list[VLLMCandidate] = []

    def killing_factory(cfg: EngineConfig) -> VLLMCandidate:
        candidate = VLLMCandidate(cfg, VERSION)
        victims.append(candidate)
        original = candidate.schedule

        def schedule(throttle_prefills: bool = False):
            output = original(throttle_prefills)
            if output.total_num_scheduled_tokens:
                # The driver itself (the reaper shim's child, issue 26) dies before
                # update_from_output; the shim then exits as it did (-9).
                os.kill(descendants(candidate.pid)[0], signal.SIGKILL)
            return output

        candidate.schedule = schedule  # type: ignore[method-assign]
        return candidate

    with pytest.raises(CandidateError) as info:
        Engine(config, candidate_factory=killing_factory).run(_crash_workload())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("candidate raised VLLMDriverError in update_from_output() at step 0: vLLM "
                              f"{VERSION} driver (pid ")
    assert "exited with code -9" in message or "is gone" in message
    # The broken candidate keeps failing the same way, without hanging.
    with pytest.raises(VLLMDriverError):
        victims[0].stats()


@vllm
@needs_vllm
def test_vllm_env_command_is_idempotent(vllm_env):
    result = CliRunner().invoke(main, ["vllm-env", VERSION])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(str(vllm_env))


# -- no vLLM needed -----------------------------------------------------------

def test_unsupported_or_malformed_versions_are_refused():
    with pytest.raises(CandidateSpecError, match="not supported"):
        resolve_candidate("vllm@9.9.9")
    with pytest.raises(CandidateSpecError, match="bad vLLM version"):
        resolve_candidate("vllm@latest")


def test_missing_env_names_the_command_that_builds_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path / "none"))
    with pytest.raises(CandidateSpecError, match=r"run `harness vllm-env 0\.33\.0`"):
        resolve_candidate(SPEC)


def test_vllm_env_command_refuses_a_bad_version():
    result = CliRunner().invoke(main, ["vllm-env", "1.2"])
    assert result.exit_code == 2
    assert "bad vLLM version" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("name", ["driver.py", "events.py", *sorted(
    p.name for p in (REPO / "harness" / "candidates" / "vllm").glob("driver_*.py"))])
def test_driver_is_standalone(name):
    """The driver runs under vLLM's venv: only the stdlib, vllm, torch and its
    sibling modules (events.py, driver_*.py: loaded by path, imported relatively)."""
    tree = ast.parse((REPO / "harness" / "candidates" / "vllm" / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert not roots - set(sys.stdlib_module_names) - {"vllm", "torch"}, roots


def test_driver_store_matches_the_reference_store():
    """The driver's copy of held_prefix_tokens (it cannot import the
    reference) answers as the reference's on every prompt."""
    import random

    from harness.candidates.vllm import events as vllm_events
    from reference.kv_connector import held_prefix_tokens

    rng = random.Random(7)
    for _ in range(300):
        block_size = rng.choice([1, 2, 4, 16])
        prompt = [rng.randrange(50000) for _ in range(rng.randrange(0, 70))]
        fraction = rng.choice([0.0, 0.3, 0.8, 0.98, 1.0])
        assert vllm_events.held_prefix_tokens(prompt, block_size, fraction) == \
            held_prefix_tokens(prompt, block_size, fraction)


def test_pins_are_one_exact_pin_per_line():
    from harness.candidates.vllm.env import read_pins

    pins = read_pins()
    assert len(pins) > 50 and all(p.count("==") == 1 for p in pins)
    assert not any(p.lower().startswith(("vllm==", "torch==", "triton")) for p in pins)
