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

from harness.candidates import CandidateSpecError, resolve_candidate
from harness.check import check_steps
from harness.cli import main
from harness.recorder import record
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
    from harness.vllm_env import ensure_env

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
    from harness.vllm_candidate import VLLMCandidate

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
def test_killed_driver_gives_a_clean_one_line_error(vllm_env):
    from harness.vllm_candidate import VLLMCandidate, VLLMDriverError

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
                os.kill(candidate.pid, signal.SIGKILL)  # dies before update_from_output
            return output

        candidate.schedule = schedule  # type: ignore[method-assign]
        return candidate

    with pytest.raises(CandidateError) as info:
        Engine(config, candidate_factory=killing_factory).run(_crash_workload())
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("candidate raised VLLMDriverError at step 0:")
    assert "exited with code -9" in message or "is gone" in message
    # The broken candidate keeps failing the same way, without hanging.
    with pytest.raises(VLLMDriverError):
        victims[0].stats()


@vllm
@needs_vllm
def test_driver_error_is_reported_with_the_failing_op(vllm_env):
    from harness.vllm_candidate import VLLMCandidate, VLLMDriverError

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
    with pytest.raises(CandidateError, match=r"at step 3: vLLM 0\.33\.0 raised during 'schedule': "
                                             r"AssertionError: .*num_new_tokens == 1 \+ "
                                             r"self\.num_spec_tokens"):
        Engine(config, candidate_factory=resolve_candidate(SPEC)).run(workload)
    gc.collect()


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


@pytest.mark.parametrize("name", ["vllm_driver.py", "vllm_events.py"])
def test_driver_is_standalone(name):
    """The driver runs under vLLM's venv: only the stdlib, vllm, torch and its
    sibling vllm_events (imported by path)."""
    tree = ast.parse((REPO / "harness" / name).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert not roots - set(sys.stdlib_module_names) - {"vllm", "torch", "vllm_events"}, roots


def test_pins_are_one_exact_pin_per_line():
    from harness.vllm_env import read_pins

    pins = read_pins()
    assert len(pins) > 50 and all(p.count("==") == 1 for p in pins)
    assert not any(p.lower().startswith(("vllm==", "torch==", "triton")) for p in pins)
