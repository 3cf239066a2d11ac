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
