"""Regression: SIGTERM of ``harness bisect`` (or any vLLM-candidate run) while a
driver was importing vLLM left vLLM's ``vllm.model_executor.models.registry``
subprocess running, orphaned: the driver was started in its own session but
``_DriverProcess.kill`` killed only the driver, not its process group."""

from __future__ import annotations

import subprocess
import tempfile
import time

from harness.candidates.vllm.candidate import POOL, _DriverProcess
from processes import outlived


def test_regression_driver_kill_kills_its_subprocesses(tmp_path) -> None:
    pid_file = tmp_path / "child.pid"
    driver = _DriverProcess.__new__(_DriverProcess)
    driver.proc = subprocess.Popen(["sh", "-c", f"sleep 300 & echo $! > {pid_file}; wait"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    driver._log = tempfile.NamedTemporaryFile(prefix="breakit-", suffix=".log", delete=False)
    driver.broken = None
    POOL.add(driver)
    deadline = time.monotonic() + 10
    while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(pid_file.read_text())
    driver.kill()
    assert not outlived(child), "the driver's subprocess outlived kill()"
    assert driver.proc.returncode is not None
    assert driver not in POOL.live()
