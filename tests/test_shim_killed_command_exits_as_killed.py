"""Regression: the reaper shim turned a command killed by SIGKILL into exit 1
(``signal.signal(SIGKILL, SIG_DFL)`` raises), so a SIGKILLed vLLM driver read
"exited with code 1" instead of -9 (tests/test_vllm.py's killed-driver test)."""
import signal
import subprocess
import sys

import pytest

from harness.children import shim_command


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_shim_exits_as_its_command_was_killed(sig: signal.Signals) -> None:
    code = f"import os; os.kill(os.getpid(), {int(sig)})"
    done = subprocess.run(shim_command([sys.executable, "-c", code]), start_new_session=True, timeout=60)
    assert done.returncode == -int(sig)


def test_the_shim_exits_with_its_commands_code() -> None:
    done = subprocess.run(shim_command([sys.executable, "-c", "raise SystemExit(7)"]),
                          start_new_session=True, timeout=60)
    assert done.returncode == 7
