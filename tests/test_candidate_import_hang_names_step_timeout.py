"""Regression: a ``module:factory`` whose import hangs was refused after 60 s
(``START_TIMEOUT_S``, whatever ``--step-timeout`` says) with a message that
blamed ``--step-timeout``: ``no answer from importing 'hang:make' within 60 s
(--step-timeout; the candidate process was killed)``."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.candidates import isolated


def test_regression_import_hang_message_does_not_name_step_timeout(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "hangmod.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert isolated.probe_spec("hangmod:make", timeout=2) == (
        "candidate 'hangmod:make': no answer from importing 'hangmod:make' within 2 s (the candidate "
        "process was killed)")


def test_regression_factory_hang_message_names_the_start_limit(tmp_path: Path, monkeypatch) -> None:
    """A factory (``make()``) that never returns waited out the start limit
    (60 s, however small --step-timeout is) and the message blamed
    --step-timeout (adversarial trial)."""
    from harness.candidates.isolated import CandidateProcessError, IsolatedCandidate
    from reference.config import EngineConfig

    (tmp_path / "hangfactory.py").write_text("import time\ndef make(config):\n    while True:\n        time.sleep(1)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + ":" + __import__("os").environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    monkeypatch.setattr(isolated, "START_TIMEOUT_S", 2.0)
    try:
        IsolatedCandidate("hangfactory:make", EngineConfig(), step_timeout=0.5)
    except CandidateProcessError as exc:
        assert str(exc).endswith(
            "no answer from the factory of hangfactory:make within 2 s (the start limit: 2 s or "
            "--step-timeout if longer; the candidate process was killed)"), str(exc)
    else:
        raise AssertionError("a hanging factory was accepted")
