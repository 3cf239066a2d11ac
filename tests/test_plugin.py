"""The pytest plugin: a user's suite runs the conformance suite against their candidate."""

from __future__ import annotations

import pytest

from harness.scenarios import SCENARIOS

N = len(SCENARIOS)


def test_conformance_suite_passes_for_the_reference(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2 * N + 1)


def test_conformance_suite_fails_a_mutant_with_witnesses(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance",
                                           "--harness-candidate", "mutant:preempt-head")
    outcomes = result.parseoutcomes()
    # Fourteen scenarios preempt (async-spec-decode too): each fails its invariants and its golden.
    assert outcomes["failed"] == 28 and outcomes["passed"] == 2 * N + 1 - 28
    result.stdout.fnmatch_lines(["*fcfs-tight: *FCFS-VICTIM-TAIL*",
                                 "FCFS-VICTIM-TAIL at step 148, request r000024: victim is not the tail*",
                                 "*fcfs-tight: candidate diverges at step 148*"])


def test_user_candidate_module_and_bad_spec(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(mycand="""
        from reference.scheduler import Scheduler
        def make(config):
            return Scheduler(config)
    """)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance",
                                           "--harness-candidate", "mycand:make", "-k", "invariants")
    result.assert_outcomes(passed=N, deselected=N + 1)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance",
                                           "--harness-candidate", "nosuch_mod:make", "-k", "invariants")
    assert result.ret == 4
    result.stdout.fnmatch_lines(["*--harness-candidate: cannot import 'nosuch_mod'*"])


def test_update_golden_rerecords_into_a_folder(pytester: pytest.Pytester, tmp_path) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-k", "golden",
                                           "--harness-golden-dir", str(tmp_path / "g"),
                                           "--harness-update-golden", "-s")
    result.assert_outcomes(passed=N + 1, deselected=N)
    assert len(list((tmp_path / "g").glob("*.parquet"))) == N
    result.stdout.fnmatch_lines(["*golden fcfs-tight: new*"])


def test_missing_golden_folder_fails_instead_of_skipping(pytester: pytest.Pytester, tmp_path) -> None:
    """Regression: a missing golden folder skipped every golden replay, so a
    candidate passed the suite without being compared with any golden."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-k", "golden",
                                           "--harness-golden-dir", str(tmp_path / "none"))
    result.assert_outcomes(errors=N + 1, deselected=N)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*no golden folder at {tmp_path / 'none'}*"])


def test_regression_node_ids_have_a_file_part(pytester: pytest.Pytester) -> None:
    """Regression (issue 16): run from a project whose rootdir does not hold
    the installed suite, the node ids had no file part
    (``::test_golden[fcfs-tight]``), so ``--deselect`` could not name one."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "--co", "-q",
                                           "-p", "no:cacheprovider")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert len(ids) == 2 * N + 1
    assert ids[0] == f"harness/conformance.py::test_invariants[{sorted(SCENARIOS)[0]}]"
    assert all(i.startswith("harness/conformance.py::") for i in ids)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "--co", "-q", "-p",
                                           "no:cacheprovider", "--deselect",
                                           "harness/conformance.py::test_golden[fcfs-tight]")
    result.stdout.fnmatch_lines([f"{2 * N}/{2 * N + 1} tests collected (1 deselected)*"])


def test_regression_a_refused_scenario_is_skipped_not_failed(pytester: pytest.Pytester) -> None:
    """Regression: the README's fork-CI job failed on stock vLLM 0.33.0
    (`test_invariants[encoder-inputs]`: 'run ended early: ... VLLMRefused'):
    a scenario whose config the candidate refuses is skipped with the reason,
    in both the invariant and the golden tests."""
    pytester.makepyfile(refusing="""
        from reference.candidate import CandidateRefused
        from reference.scheduler import Scheduler
        def make(config):
            if config.async_scheduling:
                raise CandidateRefused("no async scheduling here")
            return Scheduler(config)
    """)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-rs",
                                           "--harness-candidate", "refusing:make")
    result.assert_outcomes(passed=2 * N + 1 - 2 * 4, skipped=2 * 4)
    result.stdout.fnmatch_lines(["*async-tight: the candidate cannot run this scenario's config: "
                                 "*no async scheduling here*",
                                 "*async-tight: the candidate cannot replay this golden: *no async scheduling here*"])
