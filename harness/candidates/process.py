"""Stopping a candidate's process: what the isolated ``module:factory``
candidate (``harness.candidates.isolated``) and the vLLM driver
(``harness.candidates.vllm.candidate``) do when they are done with a child.

Both start their child with ``start_new_session=True``, so the child leads a
process group holding everything it forked (vLLM's model-registry probe, a
candidate's own children); the group is killed even when the child itself has
already exited (``os._exit``, a crash), since what it forked is still there.
"""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads and ``proc`` itself, reap it
    (up to 5 s) and close its stdin/stdout pipes. Call it once per process:
    once ``proc`` is reaped its group id may be reused. Never raises OSError."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    if proc.poll() is None:
        try:
            proc.kill()
        except OSError:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass
