"""Correct forks of the reference scheduler, shared by the tests that hold
the fork gate (``--semantics fork``) to "a correct engine never fails it".
A helper folder, not tests: a test puts ``tests/`` on ``PYTHONPATH`` and
names a candidate ``forks.MODULE:factory``."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def put_on_path(monkeypatch, *more: Path) -> None:
    """Make ``forks.*`` (and the folders in ``more``) importable here and in
    a candidate's own process: ``sys.path`` and ``PYTHONPATH`` (the
    repository too, for ``reference``)."""
    for folder in (*more, TESTS):
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(str(f) for f in (*more, TESTS, REPO)))
