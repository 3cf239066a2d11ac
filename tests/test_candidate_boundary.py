"""The candidate boundary (issue 17): a candidate's outputs are checked before
use, what it prints stays off stdout, and its own KeyboardInterrupt is a crash.

Each hostile candidate below takes over the reference's third ``schedule()``
call (step 2 of the fcfs-tight golden) and does one bad thing there; replaying
the golden must end in exit 1 with the crash named in one line, never a
traceback, a silently stored value or corrupted ``--json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main
from reference.output import ScheduledRequest, SchedulerSnapshot
from reference.validate import CandidateOutputError, check_return, conforms

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"

HOSTILE = """\
import os, signal, sys, time
from dataclasses import replace
from reference.scheduler import Scheduler


class _At(Scheduler):
    def act(self, out):
        return out

    def schedule(self, throttle_prefills=False):
        out = super().schedule(throttle_prefills)
        self._n = getattr(self, "_n", 0) + 1
        return self.act(out) if self._n == 3 else out


class Exit0(_At):
    def act(self, out):
        sys.exit(0)


class OsExit0(_At):
    def act(self, out):
        os._exit(0)


class Hang(_At):
    def act(self, out):
        while True:
            time.sleep(0.05)


class Segv(_At):
    def act(self, out):
        os.kill(os.getpid(), signal.SIGSEGV)


class NoneRet(_At):
    def act(self, out):
        return None


class KbInt(_At):
    def act(self, out):
        raise KeyboardInterrupt


class Printer(_At):
    def act(self, out):
        print("hello from the candidate")
        return out


class StrTokens(_At):
    def act(self, out):
        out.num_scheduled_tokens["r000000"] = "seven"
        return out


class HalfTokens(_At):
    def act(self, out):
        s = out.events[0]
        out.events[0] = replace(s, num_computed_tokens=s.num_computed_tokens + 0.5)
        return out


class UnknownId(_At):
    def act(self, out):
        out.num_scheduled_tokens["ghost"] = out.num_scheduled_tokens.pop("r000000")
        return out


class RefuseLate(_At):
    def act(self, out):
        from reference.candidate import CandidateRefused
        raise CandidateRefused("not this step")


class RefuseAll(Scheduler):
    def __init__(self, config):
        from reference.candidate import CandidateRefused
        raise CandidateRefused("no config suits me")


class HugeBlock(_At):
    def act(self, out):
        s = out.events[0]
        out.events[0] = replace(s, new_block_ids=[2 ** 31])
        return out
"""


@pytest.fixture
def hostile(tmp_path: Path, monkeypatch):
    """The module ``hostile`` (the candidates above) importable here and, through
    PYTHONPATH, in any candidate process."""
    (tmp_path / "hostile.py").write_text(HOSTILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield tmp_path
    sys.modules.pop("hostile", None)


def run(*args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


RETURN_CASES = [
    ("StrTokens", "schedule() returned num_scheduled_tokens['r000000'] = 'seven' (str), not an int"),
    ("HalfTokens", "schedule() returned events[0].num_computed_tokens = 40.5 (float), not an int"),
    ("UnknownId", "schedule() returned num_scheduled_tokens key = 'ghost', a request id never added to "
                  "this candidate"),
    ("HugeBlock", "schedule() returned events[0].new_block_ids[0] = 2147483648 (int), outside the int32 "
                  "range of the trace's columns"),
    ("NoneRet", "schedule() returned NoneType, not a SchedulerOutput"),
]


@pytest.mark.parametrize("name,why", RETURN_CASES, ids=[c[0] for c in RETURN_CASES])
def test_regression_a_malformed_schedule_output_is_a_crash_naming_the_value(hostile, name, why) -> None:
    """Regression (issue 17): ``num_scheduled_tokens="seven"`` gave a traceback
    one call later, 114.5 computed tokens was stored as 114 and checked
    conformant, an unknown request id diverged without saying why."""
    code, out, _ = run("replay", GOLDEN, "--candidate", f"hostile:{name}", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["divergence"]["actual"] == f"candidate raised TypeError in schedule() at step 2: {why}"
    assert report["divergence"]["step"] == 2 and report["divergence"]["kind"] == "crash"


def test_regression_a_malformed_output_is_recorded_as_a_crash_row(hostile, tmp_path) -> None:
    path = tmp_path / "t.parquet"
    code, out, err = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", "hostile:HalfTokens",
                         "-o", path)
    assert code == 1
    assert err.strip().splitlines()[-1] == (
        "engine crashed: hostile:HalfTokens: candidate raised TypeError in schedule() at step 2: schedule() "
        "returned events[0].num_computed_tokens = 40.5 (float), not an int (the trace ends there; harness "
        "check reports ENGINE-CRASH)")
    code, out, _ = run("check", path, "--json")
    assert code == 1 and [v["invariant"] for v in json.loads(out)["violations"]] == ["ENGINE-CRASH"]


def test_regression_candidate_print_keeps_json_valid(hostile, capfd) -> None:
    """Regression (issue 17): a candidate printing to stdout corrupted ``--json``.
    Its process's stdout is its stderr: the line reaches file descriptor 2."""
    code, out, _ = run("replay", GOLDEN, "--candidate", "hostile:Printer", "--json")
    assert code == 0
    assert json.loads(out)["replayed_steps"] == json.loads(run("replay", GOLDEN, "--json")[1])["replayed_steps"]
    assert "hello" not in out and capfd.readouterr().err == "hello from the candidate\n"


def test_conforms_names_the_first_bad_value_by_path() -> None:
    ok = ScheduledRequest("r1", "new", 0, 16, 0, [1, 2])
    assert conforms(ok, ScheduledRequest, known={"r1"}) is None
    assert conforms(ScheduledRequest("r1", "new", 0, 16, 0, [1, True]), ScheduledRequest) == \
        "new_block_ids[1] = True (bool), not an int"
    assert conforms(ScheduledRequest("r1", "fresh", 0, 16, 0, [1]), ScheduledRequest) == \
        "kind = 'fresh' (str), not one of new, resumed, running"
    assert conforms(ScheduledRequest("r1", "new", -1, 16, 0, [1]), ScheduledRequest) == \
        "num_computed_tokens = -1 (int), negative"
    assert conforms(ScheduledRequest("r1", "new", 0, 16, 0, [1], [-1, -1]), ScheduledRequest) is None
    assert conforms(ScheduledRequest("r1", "new", 0, 16, 0, [1]), ScheduledRequest, known={"r2"}) == \
        "request_id = 'r1', a request id never added to this candidate"
    assert conforms(SchedulerSnapshot(("r1",), (), 3.0), SchedulerSnapshot) == \
        "num_free_blocks = 3.0 (float), not an int"


def test_check_return_refuses_wrong_types_of_the_small_calls() -> None:
    with pytest.raises(CandidateOutputError, match=r"^has_request\(\) returned 1 \(int\), not a bool$"):
        check_return("has_request", 1, set())
    with pytest.raises(CandidateOutputError, match=r"^get_num_unfinished_requests\(\) returned "
                                                   r"None \(NoneType\), not an int$"):
        check_return("get_num_unfinished_requests", None, set())
    with pytest.raises(CandidateOutputError, match=r"^finish_requests\(\) returned \[0\] = 'r1' \(str\), "
                                                   r"not a FinishedRequest$"):
        check_return("finish_requests", ["r1"], set())
    check_return("finish_requests", [], set())


def test_regression_a_candidate_raising_keyboard_interrupt_is_a_crash(hostile) -> None:
    """Regression (issue 17): KeyboardInterrupt raised by the candidate passed the
    guard ("Aborted!", exit 1, nothing compared); only the user's own interrupt
    (the harness's signal handler's UserInterrupt) may stop the run."""
    code, out, _ = run("replay", GOLDEN, "--candidate", "hostile:KbInt", "--json")
    assert code == 1
    line = HOSTILE.splitlines().index("        raise KeyboardInterrupt") + 1
    assert json.loads(out)["divergence"]["actual"] == (
        f"candidate raised KeyboardInterrupt in schedule() at step 2: `raise KeyboardInterrupt` "
        f"(at hostile.py:{line})")


# -- process isolation and the step timeout (issue 17) ------------------------------------

def _line(text: str) -> int:
    return HOSTILE.splitlines().index(text) + 1


#: What each candidate's crash at step 2 reads like (``crash_line``'s text).
ENDINGS = {
    "Exit0": f"candidate raised SystemExit in schedule() at step 2: 0 (at hostile.py:{_line('        sys.exit(0)')})",
    "OsExit0": "candidate raised CandidateDied in schedule() at step 2: the candidate process exited with code 0 "
               "during schedule()",
    "Hang": "candidate raised StepTimeout in schedule() at step 2: no answer from schedule() within 1 s "
            "(--step-timeout; the candidate process was killed)",
    "NoneRet": "candidate raised TypeError in schedule() at step 2: schedule() returned NoneType, not a "
               "SchedulerOutput",
}
ENDING_IDS = sorted(ENDINGS)


@pytest.mark.parametrize("name", ENDING_IDS)
def test_regression_exit_hang_or_none_ends_replay_with_exit_1_naming_the_step(hostile, name) -> None:
    """Regression (issue 17): os._exit(0) in schedule() made replay exit 0 with
    nothing printed, a hang hung it for good."""
    code, out, _ = run("replay", GOLDEN, "--candidate", f"hostile:{name}", "--step-timeout", 1)
    assert (code, out.splitlines()[-1]) == (1, "not conformant (profile 0.33.0); the candidate crashed at step 2")
    code, out, _ = run("replay", GOLDEN, "--candidate", f"hostile:{name}", "--step-timeout", 1, "--json")
    assert code == 1 and json.loads(out)["divergence"]["actual"] == ENDINGS[name]


@pytest.mark.parametrize("name", ENDING_IDS)
def test_regression_exit_hang_or_none_ends_record_with_a_crash_row(hostile, tmp_path, name) -> None:
    path = tmp_path / "t.parquet"
    code, out, err = run("record", REPO / "harness/scenarios/fcfs-tight.toml", "--engine", f"hostile:{name}",
                         "--step-timeout", 1, "-o", path)
    assert code == 1
    assert err.strip().splitlines() == [f"engine crashed: hostile:{name}: {ENDINGS[name]} (the trace ends there; "
                                        f"harness check reports ENGINE-CRASH)"]
    code, out, _ = run("check", path, "--json")
    assert code == 1 and [v["invariant"] for v in json.loads(out)["violations"]] == ["ENGINE-CRASH"]


@pytest.mark.parametrize("name", ENDING_IDS)
def test_regression_exit_hang_or_none_fails_every_golden(hostile, name) -> None:
    timeout = 0.5 if name == "Hang" else 1  # 20 goldens, each hangs once
    code, out, _ = run("golden", "check", "--candidate", f"hostile:{name}", "--step-timeout", timeout)
    num_goldens = len(list((REPO / "golden").glob("*.parquet")))
    assert code == 1
    assert out.splitlines()[-1] == f"0 ok, {num_goldens} failed ({REPO / 'golden'}, candidate hostile:{name})"


@pytest.mark.parametrize("name", ENDING_IDS)
def test_regression_exit_hang_or_none_is_found_by_fuzz(hostile, tmp_path, name) -> None:
    """A one-request scenario keeps the shrinking (one run per attempt) short."""
    code, out, _ = run("scenario", "extract", GOLDEN, "--requests", "r000000", "-o", tmp_path / "one.toml")
    assert code == 0
    code, out, _ = run("fuzz", "--candidate", f"hostile:{name}", "--step-timeout", 1, "--scenario",
                       tmp_path / "one.toml", "--max-examples", 2, "-o", tmp_path / "fuzz")
    text = ENDINGS[name].split(" at step 2: ", 1)[1]
    kind = ENDINGS[name].split()[2]
    where = f" at hostile.py:{_line('        sys.exit(0)')}" if name == "Exit0" else ""
    text = text.rsplit(" (at ", 1)[0] if name == "Exit0" else text
    assert code == 1
    assert f"FOUND violation: ENGINE-CRASH at step 2: schedule() raised {kind}: {text}{where}\n" in out


@pytest.mark.parametrize("name", ENDING_IDS)
def test_regression_exit_hang_or_none_fails_the_pytest_plugin(hostile, pytester: pytest.Pytester, name) -> None:
    """Issue 17: sys.exit(0), os._exit(0), a hang and a None return each fail the
    conformance suite's two tests of the scenario, naming the step."""
    result = pytester.runpytest_subprocess("--pyargs", "harness.conformance", "--harness-candidate",
                                           f"hostile:{name}", "--harness-step-timeout", "1",
                                           "-k", "fcfs-tight", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([f"*fcfs-tight: run ended early: {ENDINGS[name]}*"])


def test_a_segfault_in_the_candidate_is_a_crash_naming_the_signal(hostile) -> None:
    code, out, _ = run("replay", GOLDEN, "--candidate", "hostile:Segv", "--json")
    assert code == 1 and json.loads(out)["divergence"]["actual"] == (
        "candidate raised CandidateDied in schedule() at step 2: the candidate process was killed by SIGSEGV "
        "during schedule()")


def test_an_isolated_candidate_records_the_reference_rows(hostile, tmp_path) -> None:
    """The same decisions through the pipe: the trace's rows are the reference's
    (only the engine name in the metadata differs), and it replays conformant."""
    (tmp_path / "plain.py").write_text("from reference.scheduler import Scheduler\n\n"
                                       "def make(config):\n    return Scheduler(config)\n")
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert run("record", REPO / "harness/scenarios/preemption-heavy.toml", "-o", a)[0] == 0
    assert run("record", REPO / "harness/scenarios/preemption-heavy.toml", "--engine", "plain:make", "-o", b)[0] == 0
    import pyarrow.parquet as pq

    assert pq.read_table(a).to_pylist() == pq.read_table(b).to_pylist()
    code, out, _ = run("replay", REPO / "golden/preemption-heavy.parquet", "--candidate", "plain:make")
    assert code == 0 and out.splitlines()[-1].startswith("conformant (profile 0.33.0)")


def test_regression_a_refusal_after_the_first_decision_is_a_crash(hostile) -> None:
    """Regression (issue 17): a candidate raising CandidateRefused at the step where
    it would diverge turned every golden into "skip", exit 0."""
    code, out, _ = run("golden", "check", "--candidate", "hostile:RefuseLate")
    num_goldens = len(list((REPO / "golden").glob("*.parquet")))
    assert code == 1
    assert out.splitlines()[-1] == f"0 ok, {num_goldens} failed ({REPO / 'golden'}, candidate hostile:RefuseLate)"
    code, out, _ = run("replay", GOLDEN, "--candidate", "hostile:RefuseLate", "--json")
    line = _line('        raise CandidateRefused("not this step")')
    assert code == 1 and json.loads(out)["divergence"]["actual"] == (
        f"candidate raised CandidateRefused in schedule() at step 2: not this step (at hostile.py:{line})")


def test_regression_golden_check_refused_everywhere_is_not_a_pass(hostile) -> None:
    """Regression (issue 17): a candidate refusing every config passed golden check
    ("0 ok, 20 skipped, 0 failed", exit 0) without one step compared."""
    code, out, _ = run("golden", "check", "--candidate", "hostile:RefuseAll")
    num_goldens = len(list((REPO / "golden").glob("*.parquet")))
    assert code == 1
    assert out.splitlines()[-1] == (f"0 ok, {num_goldens} skipped, 0 failed ({REPO / 'golden'}, candidate "
                                    f"hostile:RefuseAll): the candidate refused every golden, nothing was compared")
