"""No false alarms on correct releases: every canonical scenario recorded by
real vLLM, checked with ``--semantics auto`` (the recording release's
profile), is clean but for a release's known bugs (``FINDINGS``, exact
counts), for vLLM 0.33.0 and one older release (0.29.0; both are built
here, about a minute each), and for 0.25.0 (a release of the 0.2x series)
where its environment exists (``harness vllm-env 0.25.0``; CI does not
build it, so those cases skip there). ``bench/semantics_versions.py`` measures
every release we can build, the bug-shape scenarios and the recording
scheduler too (figures in the README's "Safety invariants and version
semantics").

A scenario a release cannot express is refused by the driver at start, in
one line; the refusals are listed exactly, so a new one fails the test."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.check import check_trace
from harness.check.invariants import INVARIANTS
from harness.check.result import SAFETY
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from harness.trace.recorder import record
from reference.candidate import CandidateError

pytestmark = pytest.mark.vllm
VERSIONS = ("0.33.0", "0.29.0", "0.25.0")
#: Releases CI does not build: their cases skip when the env is absent (never built on demand).
OPTIONAL = {"0.25.0"}
# Scenario -> the start of the refusal, per release.
REFUSED = {
    "0.33.0": {"encoder-inputs": "config key(s) ['encoder_cache_size', 'max_num_encoder_input_tokens'] "
                                 "have no vLLM mapping in the driver"},
    "0.29.0": {"encoder-inputs": "config key(s) ['encoder_cache_size', 'max_num_encoder_input_tokens'] "
                                 "have no vLLM mapping in the driver",
               "kv-connector": "vLLM 0.29.0's Scheduler has no kv_holding_waiting"},
    "0.25.0": {"encoder-inputs": "config key(s) ['encoder_cache_size', 'max_num_encoder_input_tokens'] "
                                 "have no vLLM mapping in the driver",
               "kv-connector": "vLLM 0.25.0's Scheduler has no kv_holding_waiting"},
}

# Scenario -> the violations a release's real bug shows, exactly (findings, not false alarms).
# 0.29.0 preempts a victim whose free is fenced behind a step in flight, so the preemption frees
# nothing and the retry preempts the next one: vllm-project/vllm#49674, fixed by #49675 (0.31.0
# on; docs/explanation/progress.md, "Soundness").
# 0.25.0 has the same one and 0.20.2's resume before a stale output (STALE-OUTPUT, a safety rule:
# docs/explanation/findings.md, tests/test_finding_vllm_0_20_2_resume_before_stale_output.py).
FINDINGS = {
    "0.33.0": {},
    "0.29.0": {"deferred-frees": {"PROGRESS-PREEMPT-FREES": 7}},
    "0.25.0": {"deferred-frees": {"PROGRESS-PREEMPT-FREES": 7}, "async-pipeline-3": {"STALE-OUTPUT": 2}},
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_correct_release_records_every_canonical_scenario_clean_under_its_profile(
        tmp_path: Path, version: str, name: str) -> None:
    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import ensure_env, is_ready

    if version in OPTIONAL and not is_ready(version):
        pytest.skip(f"no vLLM {version} env (`harness vllm-env {version}`)")
    ensure_env(version)
    scenario = SCENARIOS[name]
    path = tmp_path / f"{name}.parquet"
    engine = f"vllm@{version}"
    try:
        record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed,
               engine=engine, candidate_factory=resolve_candidate(engine))
    except CandidateError as exc:
        assert name in REFUSED[version], f"{engine} refused {name}: {exc}"
        assert REFUSED[version][name] in str(exc)
        return
    finally:
        gc.collect()  # the driver goes back to the pool
    assert name not in REFUSED[version], f"{engine} now runs {name}: drop it from REFUSED"
    result = check_trace(open_trace(path), "auto")
    assert (result.profile, result.profile_reason) == (version, f"recorded by vLLM {version}")
    expected = FINDINGS[version].get(name, {})
    assert result.by_invariant == expected, [f"{v.invariant} step {v.step}: {v.message}"
                                             for v in result.violations[:5]]
    # Under safety alone only the safety findings stay (a progress finding: the release's safety holds).
    assert check_trace(open_trace(path), "safety").by_invariant == {
        rule: n for rule, n in expected.items() if INVARIANTS[rule].layer == SAFETY}


def test_regression_a_refused_config_is_not_an_engine_crash(tmp_path: Path) -> None:
    """Regression (merging crash rows): a config the driver refuses at init
    (here: encoder keys it cannot map) was recorded as a crash of vLLM and
    reported as ENGINE-CRASH, a false alarm on a correct engine. It is a
    refusal: record exits 2 with one line and writes no trace."""
    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from click.testing import CliRunner

    from harness.cli import main

    out = tmp_path / "t.parquet"
    r = CliRunner().invoke(main, ["record", "harness/scenarios/encoder-inputs.toml", "--engine", "vllm@0.33.0",
                                  "-o", str(out)])
    assert r.exit_code == 2 and not out.exists()
    assert r.output.strip().splitlines()[-1] == (
        "error: vllm@0.33.0 refused the run: vLLM 0.33.0 cannot run this config: config key(s) "
        "['encoder_cache_size', 'max_num_encoder_input_tokens'] have no vLLM mapping in the driver "
        "(no trace written)")


def test_regression_golden_check_skips_a_golden_the_candidate_cannot_run() -> None:
    """Regression (a new user's walkthrough, issue 16): `golden check --candidate
    vllm@0.33.0` exited 1 on encoder-inputs, a golden the driver cannot run.
    It is checked, skipped with the reason, and the command exits 0; a replay
    of it says so in one line (exit 2)."""
    if os.environ.get("HARNESS_SKIP_VLLM") == "1":
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from click.testing import CliRunner

    from harness.cli import main

    r = CliRunner().invoke(main, ["golden", "check", "--candidate", "vllm@0.33.0"])
    lines = r.output.strip().splitlines()
    num_goldens = len(SCENARIOS)
    assert r.exit_code == 0, r.output
    assert [line.split()[:2] for line in lines if line.startswith("skip")] == [["skip", "encoder-inputs"]]
    assert lines[-1].startswith(f"{num_goldens - 1} ok, 1 skipped, 0 failed (")
    r = CliRunner().invoke(main, ["replay", "golden/encoder-inputs.parquet", "--candidate", "vllm@0.33.0"])
    assert r.exit_code == 2 and r.output.strip().splitlines()[-1] == (
        "error: vllm@0.33.0 cannot replay golden/encoder-inputs.parquet: vLLM 0.33.0 cannot run this config: "
        "config key(s) ['encoder_cache_size', 'max_num_encoder_input_tokens'] have no vLLM mapping in the driver")
