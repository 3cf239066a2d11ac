"""How the ``harness`` command ends (issue 17): SIGINT exits 130 and SIGTERM 143
with one line and no temp file left; fuzz workers die with their parent; click
usage errors are one line, exit 2 (``harness/signals.py``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "harness.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_regression_an_interrupted_record_exits_128_plus_signal_and_leaves_no_temp_file(
        tmp_path, signum, code) -> None:
    """Regression (issue 17): SIGINT exited 1 ("Aborted!", the code for a
    violation); SIGTERM (what CI and `timeout` send) left the temp file."""
    proc = _start("record", "synthetic:20000", "-o", str(tmp_path / "t.parquet"), cwd=tmp_path)
    _wait_for(lambda: any(p.suffix == ".tmp" for p in tmp_path.iterdir()))
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == code
    assert err.splitlines() == [f"interrupted by {signal.Signals(signum).name}"] and out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _fuzz_with_workers(tmp_path: Path) -> tuple[subprocess.Popen, list[int]]:
    proc = _start("fuzz", "--workers", "2", "--max-examples", "1000000", "-o", str(tmp_path / "f"), cwd=tmp_path)
    workers: list[int] = []

    def started() -> bool:
        workers[:] = [c for c in _children(proc.pid) if "harness-fuzz" in _cmdline(c) or "spawn_main" in _cmdline(c)]
        return len(workers) >= 2
    _wait_for(started)
    return proc, workers


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_regression_sigterm_to_fuzz_leaves_no_worker_running(tmp_path) -> None:
    """Regression (issue 17): SIGTERM to `harness fuzz --workers 2` left its
    workers running at 99 % CPU for good."""
    proc, workers = _fuzz_with_workers(tmp_path)
    time.sleep(1.0)  # the workers are fuzzing
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.splitlines()[-1] == "interrupted by SIGTERM"
    _wait_for(lambda: not any(_running(w) for w in workers), timeout=20)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_regression_fuzz_workers_die_with_a_killed_parent(tmp_path) -> None:
    """kill -9 runs no handler: the workers' parent-death signal kills them."""
    proc, workers = _fuzz_with_workers(tmp_path)
    proc.kill()
    proc.communicate(timeout=60)
    _wait_for(lambda: not any(_running(w) for w in workers), timeout=20)


@pytest.mark.parametrize("args,message", [
    (["record", "--bogus"], "error: No such option '--bogus'. (harness record --help)"),
    (["replay"], "error: Missing argument 'TRACE'. (harness replay --help)"),
    (["fuzz", "-o", "x", "--workers", "-3"], None),
    (["nosuch"], "error: No such command 'nosuch'. (harness --help)"),
])
def test_regression_usage_errors_are_one_line_exit_2(tmp_path, args, message) -> None:
    """Regression (issue 17): click's usage errors printed three lines."""
    proc = _start(*args, cwd=tmp_path)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    if message is not None:
        assert err.strip() == message


def test_regression_a_fuzz_worker_adopted_by_a_subreaper_exits() -> None:
    """Regression (CI): a worker still importing when ``harness fuzz`` was killed checked
    ``getppid() == 1``; under ``make test``'s reaper shim (a subreaper) its new parent is the
    shim, so it fuzzed on holding the run's pipes. It now compares with its real parent's PID."""
    code = ("import os; from harness.fuzz.parallel import die_with_parent; "
            "die_with_parent(os.getppid() + 100000); print('survived')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", "")
