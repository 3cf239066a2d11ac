"""Regressions of ``harness serve-record`` (server mode) killed mid-run:

* SIGTERM exited 130 with ``interrupted: ...`` (the SIGINT code) instead of
  143 and ``interrupted by SIGTERM``;
* SIGKILL left ``vllm serve``, its EngineCore and Worker running, orphaned
  (ppid 1), still holding the port: nothing tied the server to the harness.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.test_serve import HARNESS, REPO, SCENARIO, _alive, model  # noqa: F401 - fixture


def _start(model_dir: Path, out: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([HARNESS, "serve-record", str(SCENARIO), "--model", str(model_dir), "-o", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    assert "vllm serve pid" in line, line
    return proc, int(line.split(" pid ")[1].split()[0])


def _vllm_of(out: Path) -> list[int]:
    """PIDs whose environment carries this run's recording path (the server and what it started)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if str(out.with_suffix(".jsonl")).encode() in env.read_bytes() and _alive(int(env.parent.name)):
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.vllm
def test_regression_serve_record_sigterm_exits_143(model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "term.parquet"
    proc, server = _start(model, out)
    time.sleep(8)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    assert stderr.rstrip().splitlines()[-1] == (f"interrupted by SIGTERM: vLLM stopped; log kept at "
                                                f"{out.with_suffix('.log')}")
    assert not _alive(server)


@pytest.mark.vllm
def test_regression_serve_record_sigkill_leaves_no_server(model, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "kill.parquet"
    proc, server = _start(model, out)
    time.sleep(8)  # its EngineCore spawned
    assert _vllm_of(out), "the server is not running"
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 60
    while (_alive(server) or _vllm_of(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [pid for pid in [server, *_vllm_of(out)] if _alive(pid)]
    for pid in left:
        try:
            import os
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert left == []
