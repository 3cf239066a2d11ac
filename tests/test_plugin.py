"""The pytest plugin: a user's suite runs the conformance suite against their candidate."""

from __future__ import annotations

import pytest

from harness.conformance import ALL_SCENARIOS, LIBRARY
from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS

#: The canonical scenarios and the hybrid models' (golden/hybrid/).
N = len(SCENARIOS) + len(HYBRID_SCENARIOS)
assert len(HYBRID_SCENARIOS) == 3
#: The library's scenario files (traces/scenarios/): one test_library each.
L = len(list(LIBRARY.glob("*.toml")))
#: Every test of the suite: invariants and golden per canonical scenario, the
#: unused-golden test, the library's, the short fuzz.
T = 2 * N + 1 + L + 1
NO_FUZZ = ("--harness-fuzz-examples", "0")


def test_conformance_suite_passes_for_the_reference(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=T)


def test_conformance_suite_fails_a_mutant_with_witnesses(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance",
                                           "--harness-candidate", "mutant:preempt-head",
                                           "-k", "not test_library and not test_fuzz")
    outcomes = result.parseoutcomes()
    # Fourteen canonical scenarios preempt (async-spec-decode too), and the three hybrid ones:
    # each fails its invariants and its golden.
    assert outcomes["failed"] == 34 and outcomes["passed"] == 2 * N + 1 - 34
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
    result.assert_outcomes(passed=N, deselected=T - N)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance",
                                           "--harness-candidate", "nosuch_mod:make", "-k", "invariants")
    assert result.ret == 4
    result.stderr.fnmatch_lines(["ERROR: --harness-candidate: cannot import 'nosuch_mod'*"])


def test_update_golden_rerecords_into_a_folder(pytester: pytest.Pytester, tmp_path) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-k", "golden",
                                           "--harness-golden-dir", str(tmp_path / "g"),
                                           "--harness-update-golden", "-s")
    result.assert_outcomes(passed=N + 1, deselected=T - N - 1)
    assert len(list((tmp_path / "g").glob("*.parquet"))) == len(SCENARIOS)
    assert sorted(p.stem for p in (tmp_path / "g" / "hybrid").glob("*.parquet")) == sorted(HYBRID_SCENARIOS)
    result.stdout.fnmatch_lines(["*golden fcfs-tight: new*"])


def test_missing_golden_folder_fails_instead_of_skipping(pytester: pytest.Pytester, tmp_path) -> None:
    """Regression: a missing golden folder skipped every golden replay, so a
    candidate passed the suite without being compared with any golden."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-k", "golden",
                                           "--harness-golden-dir", str(tmp_path / "none"))
    result.assert_outcomes(errors=N + 1, deselected=T - N - 1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines([f"*no golden folder at {tmp_path / 'none'}*"])


def test_regression_node_ids_have_a_file_part(pytester: pytest.Pytester) -> None:
    """Regression (issue 16): run from a project whose rootdir does not hold
    the installed suite, the node ids had no file part
    (``::test_golden[fcfs-tight]``), so ``--deselect`` could not name one."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "--co", "-q",
                                           "-p", "no:cacheprovider")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert len(ids) == T
    assert ids[0] == f"harness/conformance.py::test_invariants[{sorted(ALL_SCENARIOS)[0]}]"
    assert all(i.startswith("harness/conformance.py::") for i in ids)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "--co", "-q", "-p",
                                           "no:cacheprovider", "--deselect",
                                           "harness/conformance.py::test_golden[fcfs-tight]")
    result.stdout.fnmatch_lines([f"{T - 1}/{T} tests collected (1 deselected)*"])


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
    # Four canonical scenarios and two library ones are async; the short fuzz
    # skips the async configs it draws (issue 23: a refusal is never a finding).
    result.assert_outcomes(passed=T - 2 * 4 - 2, skipped=2 * 4 + 2)
    result.stdout.fnmatch_lines(["*async-tight: the candidate cannot run this scenario's config: "
                                 "*no async scheduling here*",
                                 "*async-tight: the candidate cannot replay this golden: *no async scheduling here*"])


def test_fork_gate_passes_a_correct_policy_and_reports_its_differences(pytester: pytest.Pytester) -> None:
    """Issue 23: under --harness-semantics fork (safety + progress) a fork
    with a correct but different policy (PRIORITY victims: the lowest
    priority, ties to the earliest arrival; vLLM takes the latest) passes;
    its decisions that differ from the goldens are listed as information."""
    pytester.makepyfile(earliest="""
        from reference.scheduler import Scheduler
        class Earliest(Scheduler):
            def _select_victim(self):
                if self.config.policy == "priority":
                    return max(self.running, key=lambda r: (r.priority, -r.arrival_time))
                return super()._select_victim()
        def make(config):
            return Earliest(config)
    """)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "earliest:make",
                                           "--harness-semantics", "fork", *NO_FUZZ)
    result.assert_outcomes(passed=T - 1, skipped=1)
    result.stdout.fnmatch_lines(["*sched-harness: decisions that differ from the goldens (information)*",
                                 "priority-tight: candidate diverges at step *"])


def test_fork_gate_fails_a_progress_bug(pytester: pytest.Pytester) -> None:
    """The fork gate fails a scheduler that loses progress (admits one request
    a step although more fit): PROGRESS-ADMIT, on its own library scenario."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "mutant:admit-one-per-step",
                                           "--harness-semantics", "fork", *NO_FUZZ,
                                           "-k", "admit-all-that-fit")
    result.assert_outcomes(failed=1, deselected=T - 1)
    result.stdout.fnmatch_lines(["*admit-all-that-fit: {'PROGRESS-ADMIT': 3}*",
                                 "PROGRESS-ADMIT at step 20, request F: waiting *"])


def test_bad_harness_semantics_is_one_line(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-semantics", "forkk")
    assert result.ret == 4
    assert result.stderr.lines[0].startswith("ERROR: --harness-semantics: unknown semantics 'forkk'")


def test_hybrid_goldens_catch_a_sliding_window_bug_under_the_fork_gate(pytester: pytest.Pytester) -> None:
    """The plugin runs the hybrid models' scenarios and goldens (golden/hybrid/) too: a fork that
    frees sliding-window blocks the window still reads fails its CI (it never shows on the
    canonical scenarios); under the fork gate its differing decisions are not held against it,
    but its own run of each golden's inputs is (the golden tests fail with the same witness)."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "mutant:free-window-ahead",
                                           "--harness-semantics", "fork", *NO_FUZZ, "-k", "hybrid")
    result.assert_outcomes(failed=4, passed=2, deselected=T - 6)
    result.stdout.fnmatch_lines(["*hybrid-alternating: {'SLIDING-WINDOW-HELD': 178}*",
                                 "SLIDING-WINDOW-HELD at step 1, request r000000: group 0: freed block 16 as out "
                                 "of the window of token 64, but the window reads slot 15",
                                 "hybrid-alternating: the candidate's own run (profile fork): 178 violations "
                                 "(SLIDING-WINDOW-HELD ×178), first SLIDING-WINDOW-HELD at step 1 (r000000): group 0: "
                                 "freed block 16 as out of the window of token 64, but the window reads slot 15"])
    assert [line.split(" - ")[0] for line in result.stdout.lines if line.startswith("FAILED")] == [
        "FAILED harness/conformance.py::test_invariants[hybrid-alternating]",
        "FAILED harness/conformance.py::test_invariants[hybrid-five-to-one]",
        "FAILED harness/conformance.py::test_golden[hybrid-alternating]",
        "FAILED harness/conformance.py::test_golden[hybrid-five-to-one]"]


def test_regression_golden_test_did_not_pass_the_semantics_profile(pytester: pytest.Pytester) -> None:
    """The plugin's golden test called check_goldens without --harness-semantics's
    profile: under fork every differing decision was information, and the
    candidate's own run of that golden's inputs was never checked (a crash
    after the first difference passed too). Now it is checked as `harness golden
    check --semantics fork` checks it: MAX-NUM-SEQS broken on fcfs-roomy fails
    the golden test with the own run's witness."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "mutant:ignore-max-num-seqs",
                                           "--harness-semantics", "fork", *NO_FUZZ,
                                           "-k", "test_golden and (fcfs-roomy or prefix-sharing)")
    result.assert_outcomes(failed=1, passed=1, deselected=T - 2)
    lines = [line for line in result.stdout.lines if line.startswith(("FAILED", "fcfs-roomy: "))]
    assert lines[0] == ("fcfs-roomy: the candidate's own run (profile fork): 6 violations (MAX-NUM-SEQS ×6), "
                        "first MAX-NUM-SEQS at step 10 (r000004): admitted with 4 running = max_num_seqs 4")
    # (pytest cuts the summary line to the terminal's width: only its start is the same everywhere)
    assert len(lines) == 2 and lines[1].startswith("FAILED harness/conformance.py::test_golden[fcfs-roomy] - ")
    assert "decisions that differ from the goldens" not in result.stdout.str()


def test_regression_a_forks_semantics_finding_names_the_fork_gate(pytester: pytest.Pytester,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """New-user trial: under auto a correct fork failed on a bare
    ``{'ADMISSION-ORDER': 29}``; a failure where only version-semantics rules
    fired now ends with the fork gate's option."""
    from forks import put_on_path

    put_on_path(monkeypatch)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "forks.shortest_prompt_first:make", *NO_FUZZ,
                                           "-k", "test_invariants and fcfs-tight")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fcfs-tight: {'ADMISSION-ORDER': *}*",
                                 "*hint: ADMISSION-ORDER is a version-semantics rule (a release's design, not a "
                                 "safety or progress bug): for a fork whose policy differs on purpose, "
                                 "--harness-semantics fork holds it to safety and progress only*"])


def test_regression_a_typo_in_a_harness_scenarios_file_is_one_line_exit_4(pytester: pytest.Pytester,
                                                                         tmp_path) -> None:
    """A fork's own scenario file with a typo'd config key was a FAILED test with
    a traceback into the harness, and pytest exited 1: a CI could not tell the
    user's typo from a candidate that failed (adversarial trial)."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "a.toml").write_text('format_version = 1\n[config]\nnum_gpu_blocks = 16\nenable_prefix_cachng = true\n'
                                   '[[requests]]\nrequest_id = "A"\nprompt_len = 64\nmax_tokens = 1\n')
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-scenarios", str(folder))
    assert result.ret == 4
    assert f"ERROR: --harness-scenarios: {folder / 'a.toml'}:4: bad config: unknown config key " \
           "'enable_prefix_cachng'; did you mean 'enable_prefix_caching'?" in result.stderr.lines


@pytest.mark.parametrize("option, value, line", [
    ("--harness-candidate", "mutant:preempt-hed",
     "ERROR: --harness-candidate: unknown mutant 'preempt-hed'; did you mean 'preempt-head'"),
    ("--harness-semantics", "forks", "ERROR: --harness-semantics: unknown semantics 'forks'; did you mean 'fork'?"),
    ("--harness-step-timeout", "0", "ERROR: --harness-step-timeout: 0.0 is not a positive number of seconds"),
])
def test_regression_a_bad_option_is_one_line_before_collection(pytester: pytest.Pytester, option, value,
                                                               line) -> None:
    """New-user trial: a bad --harness-candidate read ``! _pytest.outcomes.Exit:
    --harness-candidate: ... !`` after 9 s of collection. Now pytest_configure
    refuses it, as --harness-scenarios's files: one line, exit 4, nothing collected."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           option, value)
    assert result.ret == 4
    assert [x for x in result.stderr.lines if x.strip()][0].startswith(line), result.stderr.lines
    assert "Exit" not in result.stdout.str() + result.stderr.str()
    assert "collected" not in result.stdout.str()


def test_regression_a_failing_scenario_prints_the_command_that_reproduces_it(pytester: pytest.Pytester,
                                                                             tmp_path) -> None:
    """New-user trial: a failing test_invariants printed no command to reproduce it
    locally. The line it prints now records and checks the scenario as the suite did."""
    import shlex

    from click.testing import CliRunner

    from harness.cli import main

    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "mutant:ignore-max-num-seqs", *NO_FUZZ,
                                           "-k", "test_invariants and fcfs-roomy")
    result.assert_outcomes(failed=1, deselected=T - 1)
    path = SCENARIOS["fcfs-roomy"].path
    command = (f"reproduce: harness record {path} --engine mutant:ignore-max-num-seqs -o fcfs-roomy.parquet "
               "&& harness check fcfs-roomy.parquet --semantics 0.33.0")
    assert command in result.stdout.lines
    record, check = command.split(": ", 1)[1].split(" && ")
    out = tmp_path / "fcfs-roomy.parquet"
    r = CliRunner().invoke(main, [*shlex.split(record)[1:-1], str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out), *shlex.split(check)[3:]])
    assert (r.exit_code, r.output.splitlines()[-1]) == (1, "6 violations of 1 invariant: MAX-NUM-SEQS ×6 "
                                                           "(profile 0.33.0)")


def test_regression_k_checks_only_the_selected_goldens(pytester: pytest.Pytester, tmp_path) -> None:
    """New-user trial: ``-k`` did not shorten a run: a module fixture checked every
    golden (and every hybrid one) before the first selected test (768 s for 4 tests
    against vllm@PATH). The goldens are checked one by one as their tests ask."""
    calls = tmp_path / "calls"
    pytester.makepyfile(counting=f"""
        from reference.scheduler import Scheduler
        def make(config):
            with open({str(calls)!r}, "a") as f:
                f.write("x\\n")
            return Scheduler(config)
    """)
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "-p", "no:cacheprovider",
                                           "--harness-candidate", "counting:make", *NO_FUZZ,
                                           "-k", "test_golden and fcfs-roomy or unused")
    result.assert_outcomes(passed=2, deselected=T - 2)
    assert calls.read_text() == "x\n"
