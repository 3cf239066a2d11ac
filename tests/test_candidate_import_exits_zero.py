"""Regression: a ``module:factory`` candidate's module was imported in the
harness's own process to check the spec, so a module whose import calls
``os._exit(0)`` made ``replay`` exit 0 with nothing printed (a faked pass).
Now the module is imported only in the candidate's process
(``harness.candidates.isolated.probe_spec``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "golden" / "fcfs-roomy.parquet"


@pytest.mark.parametrize("body, reason", [
    ("import os\nos._exit(0)\n", "the candidate process exited with code 0 while importing it"),
    ("import sys\nsys.exit(0)\n", "importing it raised SystemExit: 0 at hostile_import.py:2"),
    ("print('PASS ' * 3)\nraise KeyboardInterrupt\n", "importing it raised KeyboardInterrupt"),
])
def test_regression_candidate_import_cannot_end_the_harness(tmp_path, body, reason) -> None:
    (tmp_path / "hostile_import.py").write_text(body + "def factory(config):\n    return None\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "harness.cli", "replay", str(GOLDEN), "--candidate",
                           "hostile_import:factory", "--json"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stdout == ""  # what the import printed went nowhere near --json
    assert reason in proc.stderr.strip().splitlines()[-1], proc.stderr
