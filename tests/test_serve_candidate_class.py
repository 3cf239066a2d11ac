"""``harness serve-record --candidate-class pkg.mod:Class``: the recording scheduler over the user's
own vLLM ``Scheduler`` subclass, and an injected vLLM crash (issue 15).

The classes are in ``tests/vllm_classes/serve_schedulers.py`` (imported only in the serving env:
the class check's driver and the engine process) and ``custom_schedulers.py`` (issue 14's). Under
the serving env (``harness vllm-env --serving``; ``HARNESS_SKIP_VLLM=1`` skips them), with the tiny
llama of tests/test_serve.py:

- offline, a class that preempts the tail of running under PRIORITY: check clean under the safety
  layer, PRIORITY-VICTIM-MAX under 0.33.0's rules, and the reference replayed on the recording
  diverges at the first such preemption; the metadata names the class;
- offline, a class raising in ``schedule()`` at step 20 and one raising in ``update_from_output()``;
  served, the first: one line on stderr naming the step, the exception and its innermost frame,
  the 20 steps before it checked, exit 1, no vLLM process left;
- a class whose ``__init__`` raises: one line, exit 2, no engine or server started.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.processes import outlived
from tests.test_serve import HARNESS, REPO, SCENARIO, model  # noqa: F401 - fixture

CLASSES = Path(__file__).resolve().parent / "vllm_classes"
#: class -> (the call that raises, its line in serve_schedulers.py)
CRASHES = {"CrashAtStepScheduler": ("schedule", 43), "CrashInUpdateScheduler": ("update_from_output", 62)}


def crash_line(cls: str = "CrashAtStepScheduler") -> str:
    """The one stderr line of ``cls``'s crash (at step 20)."""
    call, line = CRASHES[cls]
    return (f"vLLM raised RuntimeError in {call}() at step 20: injected crash in {call}() call 20 "
            f"(at serve_schedulers.py:{line})")


def _serve(args: list[str]) -> subprocess.CompletedProcess:
    """``harness serve-record ARGS`` with the classes' folder on PYTHONPATH (relative, as a user
    would give it: the harness makes it absolute for the engine process)."""
    env = dict(os.environ, PYTHONPATH=os.path.relpath(CLASSES, REPO))
    return subprocess.run([HARNESS, "serve-record", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def _harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HARNESS, *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def _meta(path: Path) -> dict:
    return json.loads(pq.read_schema(path).metadata[b"sched_harness"])


def _left_running(out: Path) -> list[int]:
    """PIDs whose environment carries this run's recording path (vLLM and what it started)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if str(out.with_suffix(".jsonl")).encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            continue
    return [pid for pid in found if outlived(pid, 1.0)]


def _check_crash(out: Path, cls: str = "CrashAtStepScheduler") -> dict:
    """The trace holds the 20 steps before the crash and ends on its crash row: ENGINE-CRASH only.
    Returns check's JSON report."""
    call, line = CRASHES[cls]
    r = _harness("check", str(out), "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["steps"] == 21, r.stdout
    assert report["violations_by_invariant"] == {"ENGINE-CRASH": 1}
    crash = report["violations"][0]
    assert (crash["step"], crash["message"]) == (
        20, f"{call}() raised RuntimeError: injected crash in {call}() call 20 at serve_schedulers.py:{line}")
    return report


# ---------------------------------------------------------------- no vLLM needed

def test_the_base_class_is_imported_from_the_environment(monkeypatch) -> None:
    """``SCHED_HARNESS_BASE_CLS``, read where vLLM builds the recording scheduler (here with
    ``dict`` standing for vLLM's Scheduler)."""
    from harness.candidates.vllm.recording_scheduler import ENV_BASE_CLS, RecordingError, _base_scheduler_class

    monkeypatch.delenv(ENV_BASE_CLS, raising=False)
    assert _base_scheduler_class(dict) == (dict, None)
    import collections

    for name in ("collections:OrderedDict", "collections.OrderedDict"):  # ours and vLLM's spelling
        monkeypatch.setenv(ENV_BASE_CLS, name)
        assert _base_scheduler_class(dict) == (collections.OrderedDict, name)
    for name, problem in [
        ("json:JSONDecoder", "SCHED_HARNESS_BASE_CLS=json:JSONDecoder is not a subclass of "
                             "vllm.v1.core.sched.scheduler.Scheduler"),
        ("collections:Nope", "SCHED_HARNESS_BASE_CLS=collections:Nope: cannot import it: AttributeError: "
                             "module 'collections' has no attribute 'Nope'"),
        ("sched_harness_no_such_module:X", "SCHED_HARNESS_BASE_CLS=sched_harness_no_such_module:X: cannot "
                                           "import it: ModuleNotFoundError: No module named "
                                           "'sched_harness_no_such_module'"),
    ]:
        monkeypatch.setenv(ENV_BASE_CLS, name)
        with pytest.raises(RecordingError) as info:
            _base_scheduler_class(dict)
        assert str(info.value) == problem


# ---------------------------------------------------------------- real vLLM

@pytest.mark.vllm
def test_offline_class_preempting_the_running_tail_under_priority(model, tmp_path) -> None:  # noqa: F811
    scenario = REPO / "harness" / "serve" / "preempt-priority.toml"
    out = tmp_path / "newest.parquet"
    cls = "serve_schedulers:NewestVictimScheduler"
    p = _serve([str(scenario), "--offline", "--model", str(model), "--candidate-class", cls, "-o", str(out)])
    assert p.returncode == 0, p.stdout + p.stderr
    assert "offline vLLM 0.32.0: 346 engine steps, 24/24 finished, 0 aborted, 0 rejected, 1034 output " \
           "tokens" in p.stdout
    assert ": 346 steps, 24 requests, 24 finished, 0 aborted, 14 preemptions, 1056 prefix-hit tokens" in p.stdout
    # The change is safe: the safety layer (vLLM 0.32.0's profile) holds.
    assert p.stdout.rstrip().splitlines()[-1] == "conformant (profile safety)"
    meta = _meta(out)
    assert meta["engine"] == f"vllm@0.32.0,scheduler_cls={cls}" and meta["engine_version"] == "0.32.0"
    assert meta["vllm_source"] == {"version": "0.32.0", "scheduler_cls": cls}
    # vLLM's design is the largest (priority, arrival): 0.33.0's rules name each other victim.
    r = _harness("check", str(out), "--semantics", "0.33.0", "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["violations_by_invariant"] == {"PRIORITY-VICTIM-MAX": 4}, r.stdout
    assert [(v["step"], v["request"]) for v in report["violations"]] == [
        (5, "r000006"), (8, "r000010"), (26, "r000003"), (29, "r000010")]
    assert report["violations"][0]["message"] == \
        "victim (priority, arrival) (1, 0.0104) but r000000 has (2, 0.0)"
    assert report["profile_reason"] == "chosen with --semantics"
    # The reference, re-driven on the recording, takes r000000 (withdrawn, then preempted) at step 5.
    r = _harness("replay", str(out), "--candidate", "reference", "--json")
    report = json.loads(r.stdout)
    assert r.returncode == 1 and report["num_violations"] == 0, r.stdout
    assert report["divergence"] == {"step": 5, "request": "r000006", "field": "event",
                                    "expected": "preempt r000006", "actual": "withdraw r000000",
                                    "event_index": 5, "kind": "preempt"}


@pytest.mark.vllm
@pytest.mark.parametrize("cls", sorted(CRASHES))
def test_offline_crash_is_one_line_and_a_checked_prefix(model, tmp_path, cls) -> None:  # noqa: F811
    out = tmp_path / "crash.parquet"
    p = _serve([str(SCENARIO), "--offline", "--model", str(model),
                "--candidate-class", f"serve_schedulers:{cls}", "-o", str(out)])
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr.splitlines() == [crash_line(cls)]
    assert "offline vLLM 0.32.0: 20 engine steps, 0/24 finished" in p.stdout
    assert ": 21 steps, 24 requests, 0 finished, 0 aborted, 1 preemption, 0 prefix-hit tokens" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "1 violation of 1 invariant: ENGINE-CRASH ×1 (profile safety)"
    assert _check_crash(out, cls)["requests"] == 24  # all arrived at step 0
    assert _left_running(out) == []


@pytest.mark.vllm
def test_served_crash_in_schedule_stops_the_server(model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "served-crash.parquet"
    p = _serve([str(SCENARIO), "--model", str(model),
                "--candidate-class", "serve_schedulers:CrashAtStepScheduler", "-o", str(out)])
    assert p.returncode == 1, p.stdout + p.stderr
    note, crash = p.stderr.splitlines()  # "serve: vllm serve pid N on 127.0.0.1:PORT (log: ...)"
    assert note.startswith("serve: vllm serve pid ") and crash == crash_line(), p.stderr
    assert "vLLM 0.32.0 server: 0/24 answered (0 aborted by disconnect, 0 refused, 24 failed)" in p.stdout
    assert p.stdout.rstrip().splitlines()[-1] == "1 violation of 1 invariant: ENGINE-CRASH ×1 (profile safety)"
    assert _meta(out)["vllm_source"] == {"version": "0.32.0",
                                         "scheduler_cls": "serve_schedulers:CrashAtStepScheduler"}
    _check_crash(out)  # how many requests had reached vLLM by step 20 varies (HTTP arrivals race)
    assert not outlived(int(note.split(" pid ")[1].split()[0]), 1.0)
    assert _left_running(out) == []


@pytest.mark.vllm
def test_a_class_whose_init_raises_is_one_line_and_starts_nothing(model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "bad.parquet"
    p = _serve([str(SCENARIO), "--model", str(model), "--candidate-class",
                "custom_schedulers:RaisingScheduler", "-o", str(out)])
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr == ("error: --candidate-class: scheduler_cls custom_schedulers.RaisingScheduler: __init__ "
                        "raised RuntimeError: deliberately broken constructor\n")
    # No server was started: it would have left its log (and recording) beside the trace.
    assert sorted(tmp_path.iterdir()) == []
