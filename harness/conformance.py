"""The conformance suite, runnable against any candidate through the pytest
plugin (harness/pytest_plugin.py)::

    pytest --pyargs harness.conformance --harness-candidate mymod:make_scheduler

For every canonical scenario (harness/scenarios/*.toml): the candidate must
violate no invariant and must not stall or raise; and it must make exactly
the decisions recorded in the golden trace of that scenario. A scenario whose
config the candidate refuses (``CandidateRefused``: a vLLM release without an
option it sets, a config the driver cannot map) is skipped with the reason.
"""

from __future__ import annotations

import pytest

from harness.scenarios import SCENARIOS


def _witness(result) -> str:
    lines = [f"{v.invariant} at step {v.step}, request {v.request}: {v.message}"
             for v in result.violations[:5]]
    return "\n".join(lines)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_invariants(scenario: str, harness_candidate) -> None:
    """The candidate violates no invariant on the scenario."""
    from harness.mutation import run_candidate

    cell = run_candidate(harness_candidate, SCENARIOS[scenario])
    if cell.refused:  # e.g. a vLLM release without an option the scenario sets: not compared, not failed
        pytest.skip(f"{scenario}: the candidate cannot run this scenario's config: {cell.refused}")
    if cell.ended:
        pytest.fail(f"{scenario}: run ended early: {cell.ended}", pytrace=False)
    if not cell.result.ok:
        pytest.fail(f"{scenario}: {cell.result.by_invariant}\n{_witness(cell.result)}", pytrace=False)


@pytest.fixture(scope="module")
def golden_results(harness_candidate, harness_golden_dir, harness_update_golden, harness_require_sealed) -> dict:
    """Check (or, with --harness-update-golden, re-record) all goldens once."""
    from harness.golden import check_goldens, update_goldens

    if harness_update_golden:
        for change in update_goldens(harness_golden_dir):
            print(f"golden {change.scenario}: {change.status} {'; '.join(change.details)}")
        return {}
    if not harness_golden_dir.exists():
        # A missing folder fails: skipping would pass a candidate that was never compared.
        pytest.fail(f"no golden folder at {harness_golden_dir} (pass --harness-golden-dir)", pytrace=False)
    return {r.scenario: r for r in check_goldens(harness_golden_dir, harness_candidate,
                                                   require_sealed=harness_require_sealed)}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_golden(scenario: str, golden_results: dict) -> None:
    """The candidate makes the golden trace's decisions, step by step."""
    if not golden_results:
        return  # goldens were just re-recorded
    result = golden_results[scenario]
    if result.skipped:
        pytest.skip(f"{scenario}: the candidate cannot replay this golden: {result.skipped}")
    if not result.ok:
        pytest.fail(f"{scenario}: " + "; ".join(result.reasons), pytrace=False)


def test_no_unused_goldens(golden_results: dict) -> None:
    unused = [name for name, r in golden_results.items() if r.unused]
    if unused:
        pytest.fail(f"golden traces for no scenario: {unused}", pytrace=False)
