"""Regression: a candidate's answer is unpickled in the harness's process, so a
returned object whose ``__reduce__`` names ``os._exit`` ended ``harness replay``
with exit 0 and nothing printed (the candidate chose the verdict). Answers may
only name the harness's own result classes and builtin containers."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from harness.candidates.isolated import _loads_answer

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-tight.parquet"

EVIL = """\
import os
from reference.scheduler import Scheduler


class _Exit:
    def __reduce__(self):
        return (os._exit, (0,))


class PickleExit(Scheduler):
    def schedule(self, throttle_prefills=False):
        out = super().schedule(throttle_prefills)
        self._n = getattr(self, "_n", 0) + 1
        return _Exit() if self._n == 3 else out


def make(config):
    return PickleExit(config)
"""


class _Exit:
    def __reduce__(self):
        return (os._exit, (0,))


def test_regression_candidate_pickled_answer_cannot_call_os_exit(tmp_path: Path) -> None:
    (tmp_path / "evil_pickle.py").write_text(EVIL)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN),
                           "--candidate", "evil_pickle:make"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CRASH at step 2" in proc.stdout
    assert "UnpicklingError: the answer names posix._exit" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("payload", [
    (os._exit, (0,)), (getattr, ("x", "upper")), (eval, ("1",)),
    (__import__("harness.trace.writer", fromlist=["TraceWriter"]).TraceWriter, ("/tmp/x.parquet", {})),
    (__import__("reference.scheduler", fromlist=["Scheduler"]).Scheduler, (None,)),
])
def test_regression_answer_unpickler_refuses_callables(payload) -> None:
    class Evil:
        def __reduce__(self):
            return payload
    data = pickle.dumps(("ok", Evil(), None), protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(pickle.UnpicklingError, match="not one of the harness's result types"):
        _loads_answer(data)


def test_answer_unpickler_reads_result_types() -> None:
    from reference.output import SchedulerOutput
    from reference.request import RequestStatus

    value = ("ok", ({"a": [1, 2.5, (3,)], "s": {4}}, RequestStatus.RUNNING), {"num_unfinished": 2})
    assert _loads_answer(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)) == value
    out = SchedulerOutput.__new__(SchedulerOutput)
    assert type(_loads_answer(pickle.dumps(out))) is SchedulerOutput
