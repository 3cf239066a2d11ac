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
