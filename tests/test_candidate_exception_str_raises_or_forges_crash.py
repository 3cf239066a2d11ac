"""Regression: a candidate exception whose ``__str__`` raises killed the
isolated candidate's process while it described the exception (its traceback
went to stderr and the crash read ``CandidateDied ... exited with code 1``,
or, at import, ``... exited with code 1 while importing it``); and a
candidate exception with a ``crash_type`` attribute of its own was taken for
one of the harness's, so its multi-line ``crash_message`` reached the trace
and the replay's output verbatim (``StepTimeout: forged\\nsecond line``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reference.candidate import describe_exception

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden" / "fcfs-roomy.parquet"

CANDIDATE = """\
from reference.scheduler import Scheduler


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")


class Forged(Exception):
    crash_type = "StepTimeout"
    crash_message = "StepTimeout: forged\\nsecond line\\nconformant (profile 0.33.0)"
    crash_where = ""


class S(Scheduler):
    n = 0

    def schedule(self, throttle_prefills=False):
        self.n += 1
        if self.n == 5:
            raise {exc}()
        return super().schedule(throttle_prefills)


def make(config):
    return S(config)
"""

IMPORT_RAISES = """\
class Unprintable(BaseException):
    def __str__(self):
        raise RuntimeError("no str")


raise Unprintable()
"""


def _replay(tmp_path: Path, spec: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{REPO}")
    return subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN), "--candidate", spec],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_describe_exception_survives_a_failing_str_and_ignores_a_foreign_crash_type() -> None:
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    class Forged(Exception):
        crash_type = "StepTimeout"
        crash_message = "StepTimeout: forged\nsecond line"

    assert describe_exception(Unprintable())[:2] == ("Unprintable", "Unprintable: <unprintable Unprintable>")
    assert describe_exception(Forged())[:2] == ("Forged", "Forged")


def test_regression_unprintable_exception_in_schedule_is_the_candidates_crash(tmp_path: Path) -> None:
    (tmp_path / "cand.py").write_text(CANDIDATE.format(exc="Unprintable"))
    proc = _replay(tmp_path, "cand:make")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "kind=crash status=schedule message=Unprintable: <unprintable Unprintable> stop_reason=cand.py:21" \
        in proc.stdout
    assert proc.stdout.splitlines()[-1] == "not conformant (profile 0.33.0); the candidate crashed at step 4"
    assert "Traceback" not in proc.stderr and proc.stderr == ""


def test_regression_forged_crash_type_stays_the_candidates_own_one_line(tmp_path: Path) -> None:
    (tmp_path / "cand.py").write_text(CANDIDATE.format(exc="Forged"))
    proc = _replay(tmp_path, "cand:make")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "second line" not in proc.stdout and "forged" not in proc.stdout
    assert "kind=crash status=schedule message=Forged: `raise Forged()` stop_reason=cand.py:21" in proc.stdout


def test_regression_unprintable_exception_at_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "cand.py").write_text(IMPORT_RAISES)
    proc = _replay(tmp_path, "cand:make")
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == ("error: Invalid value: candidate 'cand:make': importing it raised Unprintable: "
                           "<unprintable Unprintable> at cand.py:6 (harness replay --help)\n")
