"""Regression: ``--candidate vllm@PATH`` whose PATH is a wrapper script that
hangs: the version probe timed out after 60 s, killed only the script and left
its child running, and the one-line error quoted the whole probe program."""

from __future__ import annotations

import time
from pathlib import Path

from click.testing import CliRunner

import harness.candidates.vllm.spec as spec_mod
from harness.cli import main
from processes import outlived

REPO = Path(__file__).resolve().parent.parent


def test_regression_vllm_path_probe_timeout_kills_the_wrapper_children(tmp_path: Path, monkeypatch) -> None:
    pid_file = tmp_path / "child.pid"
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pid_file}\nwait\n")
    script.chmod(0o755)
    monkeypatch.setattr(spec_mod, "PROBE_TIMEOUT_S", 2.0)
    start = time.monotonic()
    result = CliRunner().invoke(main, ["replay", str(REPO / "golden" / "fcfs-roomy.parquet"),
                                       "--candidate", f"vllm@{script}"])
    assert time.monotonic() - start < 30
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (f"error: Invalid value: 'vllm@{script}': {script} did not answer the version "
                                     f"probe within 2 s (killed) (main replay --help)")
    pid = int(pid_file.read_text())
    assert not outlived(pid), "the probe's child outlived the refusal"
