"""A custom vLLM ``Scheduler`` subclass as the candidate:
``vllm@0.33.0,scheduler_cls=custom_schedulers:Class`` (issue 14).

The classes live in ``tests/vllm_classes/custom_schedulers.py`` (each with one
deliberate change) and are imported only inside the vLLM driver, from the
caller's ``PYTHONPATH``. The tests marked ``vllm`` need vLLM 0.33.0's CPU venv
(built by the fixture when missing; ``HARNESS_SKIP_VLLM=1`` skips them). One
driver serves the whole module: the class is chosen at each ``init``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.vllm.spec import (VLLMSpecError, caller_pythonpath, normalise_class_name,
                                          split_spec)
from harness.cli import main
from harness.trace import open_trace

REPO = Path(__file__).resolve().parent.parent
CLASSES = Path(__file__).resolve().parent / "vllm_classes"
GOLDEN = REPO / "golden"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"

vllm = pytest.mark.vllm
needs_vllm = pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")


def spec(cls: str, module: str = "custom_schedulers") -> str:
    return f"vllm@0.33.0,scheduler_cls={module}:{cls}"


def _invoke(*args: str):
    return CliRunner().invoke(main, list(args), prog_name="harness")


@vllm
@needs_vllm
def test_lower_seq_cap_subclass_diverges_where_the_reference_admits_a_third(classes_env):
    """Capping running requests at 2 under max_num_seqs=4 is legal: no
    violation, and replay names the first step the reference admits r000002."""
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"),
                     "--candidate", spec("LowerSeqCapScheduler"), "--json")
    assert result.exit_code == 1, result.output
    payload = json.loads(result.output)
    assert payload["num_violations"] == 0
    assert payload["divergence"] == {"step": 9, "request": "r000002", "field": "event",
                                     "expected": "schedule r000002", "actual": "schedule_end",
                                     "event_index": 4, "kind": "schedule"}
    assert payload["candidate"] == spec("LowerSeqCapScheduler")


@vllm
@needs_vllm
def test_unchanged_subclass_replays_the_golden_identically(classes_env):
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"),
                     "--candidate", spec("PlainScheduler"))
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == \
        "conformant (profile 0.33.0): 372 steps replayed, identical decisions"


@vllm
@needs_vllm
def test_regression_a_module_named_like_a_driver_file_is_the_user_s(classes_env):
    """Regression (adversarial trial): the driver, run as a script, had its own folder first on
    sys.path, so ``scheduler_cls=events:X`` imported the harness's events.py ("has no attribute")."""
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"),
                     "--candidate", spec("NamedLikeADriverFile", "events"))
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == \
        "conformant (profile 0.33.0): 372 steps replayed, identical decisions"


@vllm
@needs_vllm
def test_higher_seq_cap_subclass_records_max_num_seqs_violations(classes_env, tmp_path):
    """record --engine with the class; check (profile 0.33.0 from the trace's
    engine_version) reports MAX-NUM-SEQS, first where a 5th request is admitted."""
    out = tmp_path / "high.parquet"
    result = _invoke("record", str(REPO / "harness/scenarios/fcfs-roomy.toml"), "-o", str(out),
                     "--engine", spec("HigherSeqCapScheduler"))
    assert result.exit_code == 0, result.output
    trace = open_trace(out)
    assert trace.meta["engine"] == spec("HigherSeqCapScheduler")
    assert trace.meta["engine_version"] == "0.33.0"
    assert trace.meta["vllm_source"] == {"version": "0.33.0",
                                         "scheduler_cls": "custom_schedulers:HigherSeqCapScheduler"}
    result = _invoke("check", str(out), "--json")
    assert result.exit_code == 1, result.output
    payload = json.loads(result.output)
    assert payload["violations_by_invariant"] == {"MAX-NUM-SEQS": 6}
    first = payload["violations"][0]
    assert (first["step"], first["request"], first["message"]) == \
        (10, "r000004", "admitted with 4 running = max_num_seqs 4")
    assert payload["profile_reason"] == ("recorded by vLLM 0.33.0 with scheduler_cls "
                                         "custom_schedulers:HigherSeqCapScheduler")
    assert payload["vllm_source"] == trace.meta["vllm_source"]


@vllm
@needs_vllm
def test_regression_vllm_candidate_ignored_step_timeout(classes_env):
    """A scheduler class that hangs in schedule() waited out the driver's own
    120 s; --step-timeout now bounds each op of a vllm@ candidate too: exit 1,
    a crash at the step it hung in, the driver killed."""
    import time

    t0 = time.monotonic()
    result = _invoke("replay", str(GOLDEN / "fcfs-roomy.parquet"), "--candidate", spec("HangingScheduler"),
                     "--step-timeout", "3", "--json")
    assert result.exit_code == 1, result.output
    assert time.monotonic() - t0 < 60
    payload = json.loads(result.output)
    assert payload["divergence"]["step"] == 2
    assert "did not answer 'schedule' within 3 s" in json.dumps(payload)


@vllm
@needs_vllm
def test_fuzz_finds_the_subclass_violation(classes_env, tmp_path):
    result = _invoke("fuzz", "--candidate", spec("HigherSeqCapScheduler"), "--max-examples", "10",
                     "--seed", "1", "-o", str(tmp_path))
    assert result.exit_code == 1, result.output
    assert "FOUND violation: MAX-NUM-SEQS at step 0, request r000001" in result.output
    # The replay hint keeps the PYTHONPATH the class was found on.
    assert f"replay: PYTHONPATH={CLASSES} harness replay" in result.output


@vllm
@needs_vllm
def test_async_scheduler_subclass_on_a_synchronous_scenario_is_refused_in_one_line(classes_env, tmp_path):
    """Issue 23: vLLM's AsyncScheduler as scheduler_cls on the synchronous
    pipeline-3 scenario was run and misjudged (SCHEDULED-SPAN x346); it is
    refused in one line (exit 2, no trace), and golden check skips it."""
    out = tmp_path / "p3.parquet"
    result = _invoke("record", str(REPO / "harness/scenarios/pipeline-3.toml"), "-o", str(out),
                     "--engine", spec("AsyncPlainScheduler"))
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "scheduler_cls custom_schedulers.AsyncPlainScheduler is an AsyncScheduler subclass: it runs "
        "only with async_scheduling = true, and this config is synchronous (no trace written)"), errors
    assert not out.exists()


@vllm
@needs_vllm
def test_regression_a_plain_subclass_refused_async_says_how_to_cover_it(classes_env, tmp_path):
    """New-user trial: a plain Scheduler subclass read "15 ok, 5 skipped, 0 failed" in
    golden check, the skips saying only that async_scheduling needs an AsyncScheduler
    subclass; the refusal now says a second run with one covers async scheduling."""
    out = tmp_path / "a.parquet"
    result = _invoke("record", str(REPO / "harness/scenarios/async-tight.toml"), "-o", str(out),
                     "--engine", spec("PlainScheduler"))
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and (
        "async_scheduling needs an AsyncScheduler subclass; scheduler_cls custom_schedulers.PlainScheduler "
        "is not one (to cover async scheduling, run again with scheduler_cls= your change on a subclass of "
        "vllm.v1.core.sched.async_scheduler.AsyncScheduler)") in errors[0], errors
    assert not out.exists()


BAD_CLASSES = {
    "not-a-scheduler": (spec("NotAScheduler"),
                        "scheduler_cls custom_schedulers:NotAScheduler is class "
                        "custom_schedulers.NotAScheduler, not a subclass of "
                        "vllm.v1.core.sched.scheduler.Scheduler"),
    "raises-in-init": (spec("RaisingScheduler"),
                       "scheduler_cls custom_schedulers.RaisingScheduler: __init__ raised "
                       "RuntimeError: deliberately broken constructor"),
    "module-does-not-import": (spec("BrokenScheduler", "broken_module"),
                               "scheduler_cls broken_module:BrokenScheduler: module 'broken_module' "
                               "does not import: ModuleNotFoundError: No module named "
                               "'sched_harness_no_such_dependency'"),
    # Regression (a new user's trial): a forgotten PYTHONPATH gave no hint.
    "module-not-on-pythonpath": (spec("MyScheduler", "not_on_the_path"),
                                 "scheduler_cls not_on_the_path:MyScheduler: module 'not_on_the_path' "
                                 "is not found on this interpreter's path (is its folder on PYTHONPATH?)"),
    # Both found before vLLM is imported (class_precheck.py).
    "no-such-class": (spec("Nope"),
                      f"scheduler_cls custom_schedulers:Nope: module 'custom_schedulers' "
                      f"({CLASSES / 'custom_schedulers.py'}) defines no 'Nope'"),
    "misspelled-class": (spec("HigherSeqCapSchedulr"),
                         f"scheduler_cls custom_schedulers:HigherSeqCapSchedulr: module 'custom_schedulers' "
                         f"({CLASSES / 'custom_schedulers.py'}) defines no 'HigherSeqCapSchedulr' "
                         "(did you mean 'HigherSeqCapScheduler'?)"),
}


@vllm
@needs_vllm
@pytest.mark.parametrize("case", sorted(BAD_CLASSES))
@pytest.mark.parametrize("command", ["replay", "record", "golden"])
def test_unusable_scheduler_class_is_one_line_exit_2(classes_env, tmp_path, case, command):
    candidate, message = BAD_CLASSES[case]
    args = {"replay": ["replay", str(GOLDEN / "fcfs-roomy.parquet"), "--candidate", candidate],
            "record": ["record", str(REPO / "harness/scenarios/fcfs-roomy.toml"),
                       "-o", str(tmp_path / "x.parquet"), "--engine", candidate],
            "golden": ["golden", "check", "--candidate", candidate]}[command]
    result = _invoke(*args)
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    usage = {"replay": "replay", "record": "record", "golden": "golden check"}[command]
    assert errors == [f"error: Invalid value: candidate {candidate!r}: {message} (harness {usage} --help)"]
    assert not (tmp_path / "x.parquet").exists()


@vllm
@needs_vllm
def test_pytest_plugin_runs_the_subclass(classes_env, pytester: pytest.Pytester):
    result = pytester.runpytest_subprocess(
        "--pyargs", "harness.conformance", "-p", "no:cacheprovider",
        "--harness-candidate", spec("HigherSeqCapScheduler"), "-k", "test_invariants and fcfs-roomy")
    # Deselected: the other goldens' two tests, the scenario library and the short fuzz.
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed") == 1 and not outcomes.get("passed"), outcomes
    assert outcomes.get("deselected", 0) >= 2 * 20 - 1, outcomes
    result.stdout.fnmatch_lines(["*fcfs-roomy: {'MAX-NUM-SEQS': 6}*"])


# -- no vLLM needed -----------------------------------------------------------

def test_spec_options_are_parsed_and_checked():
    assert split_spec("vllm@0.33.0,scheduler_cls=a.b:C") == ("0.33.0", {"scheduler_cls": "a.b:C"})
    assert split_spec("vllm@/x/bin/python") == ("/x/bin/python", {})
    with pytest.raises(VLLMSpecError, match="unknown option 'scheduler'"):
        split_spec("vllm@0.33.0,scheduler=a:C")
    with pytest.raises(VLLMSpecError, match="given twice"):
        split_spec("vllm@0.33.0,scheduler_cls=a:C,scheduler_cls=a:D")
    with pytest.raises(VLLMSpecError, match="expected key=value"):
        split_spec("vllm@0.33.0,scheduler_cls")


def test_class_names_take_both_spellings():
    assert normalise_class_name("pkg.mod:Cls") == "pkg.mod:Cls"
    assert normalise_class_name("pkg.mod.Cls") == "pkg.mod:Cls"  # vLLM's --scheduler-cls form
    for bad in ("Cls", "pkg.mod:", "pkg mod:Cls", ":Cls"):
        with pytest.raises(VLLMSpecError, match="expected package.module:Class"):
            normalise_class_name(bad)


def test_caller_pythonpath_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["rel", str(tmp_path / "abs"), "", "rel"]))
    assert caller_pythonpath(tmp_path) == (str(tmp_path / "rel"), str(tmp_path / "abs"),
                                           str(tmp_path))
