"""Child processes the harness starts, and why none of them outlives it.

Invariant: when a harness command ends, by any path (return, exception,
Ctrl-C, SIGTERM, SIGKILL), no process it started is left running. Three
layers, each covering what the one before cannot:

* ``finally`` blocks stop the child by its PID (``stop_gracefully``,
  ``stop_process_group``): every path but SIGKILL of the harness;
* the kernel signals the child when the harness dies (``PR_SET_PDEATHSIG``:
  ``set_parent_death_signal`` in the child, ``die_with_parent`` as a
  ``preexec_fn``): SIGKILL included, but only the direct child, and a child
  may ignore or be slow to honour SIGTERM (vLLM's server, still starting up,
  was seen alive 60 s after it);
* a watchdog (``GroupWatchdog``): a tiny process in its own session that
  holds the read end of a pipe only the harness writes; when the harness
  dies the pipe reads EOF and the watchdog SIGTERMs the child's whole process
  group, then SIGKILLs it after a grace period. This is what catches the
  grandchildren (vLLM's EngineCore and workers) and a child that lingers.

Children are started with ``start_new_session=True``, so each leads a process
group holding everything it forks; the group id is the child's PID.

A process group does not hold a descendant that calls ``setsid`` (a daemon's
double fork), and such a grandchild, orphaned, is adopted by init. So a
candidate's process runs under a *reaper shim* (``shim_command``, issue 26):
a tiny process of ours, the child the harness starts, that is a child
subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``): every orphan of its tree,
whatever session it made, is re-parented to the shim and so stays in its
descendant tree, which ``kill_tree`` walks through ``/proc`` (each
descendant stopped first, so none can fork behind the walk, then killed).
``stop_process_group`` kills that tree before the group; the shim itself,
when the candidate exits on its own or it gets SIGTERM (the watchdog, the
parent-death signal), kills whatever the candidate left and exits with the
candidate's status. The harness's stdio is never inherited by a candidate:
its stdin and stdout are the protocol's pipes, its stderr a pipe that
``relay_stderr`` copies to the harness's stderr (or a log file).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def set_parent_death_signal(sig: int) -> bool:
    """In the calling process: ask Linux to send ``sig`` when the parent dies
    (``prctl(PR_SET_PDEATHSIG)``). Returns False where that is not available
    (not Linux); the caller's other layers still stop it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    return True


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when
    the process that started it dies, even by SIGKILL; if that process already
    died between fork and exec, the child sends ``sig`` to itself."""
    parent = os.getpid()

    def preexec() -> None:
        if set_parent_death_signal(sig) and os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def descendants(pid: int) -> list[int]:
    """The PIDs of every descendant of ``pid`` (children, their children, ...),
    parents first, read from ``/proc/PID/task/TID/children`` (Linux 3.5+;
    empty elsewhere or once ``pid`` is gone)."""
    found: list[int] = []
    seen = {pid}
    todo = [pid]
    while todo:
        parent = todo.pop(0)
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in seen:
                    seen.add(kid)
                    found.append(kid)
                    todo.append(kid)
    return found


def kill_tree(pid: int, rounds: int = 50) -> list[int]:
    """SIGKILL every descendant of ``pid`` (not ``pid`` itself), whatever
    process group or session it made: each is SIGSTOPped as it is found, and
    the tree walked again until a walk finds nothing new, so a process cannot
    fork a child behind the walk; then all are killed. Returns the PIDs
    signalled. Never raises. (A descendant whose parent died is found only if
    an ancestor is a subreaper: the reaper shim.)"""
    stopped: list[int] = []
    for _ in range(rounds):
        new = [p for p in descendants(pid) if p not in stopped]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        stopped += new
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    return stopped


# The reaper shim's whole program (``python -I -S -c``: nothing of ours
# imported, ~15 ms): subreaper, fork + exec the command (with a parent-death
# signal), forward SIGINT, reap every orphan that comes to it; when the
# command ends, or on SIGTERM, kill what is left of its tree and exit as the
# command did (the same code, or the same signal).
_SHIM = r"""
import ctypes, os, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)
parent = os.getppid()
def tree():
    found, todo = [], [os.getpid()]
    while todo:
        p = todo.pop(0)
        try:
            tasks = os.listdir("/proc/%d/task" % p)
        except OSError:
            continue
        for t in tasks:
            try:
                with open("/proc/%d/task/%s/children" % (p, t)) as f:
                    kids = [int(k) for k in f.read().split()]
            except (OSError, ValueError):
                continue
            for k in kids:
                if k not in found:
                    found.append(k)
                    todo.append(k)
    return found
def kill_all():
    stopped = []
    for _ in range(50):
        new = [p for p in tree() if p not in stopped]
        if not new:
            break
        for p in new:
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        stopped += new
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
shim = os.getpid()
child = os.fork()
if child == 0:
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != shim:
        os._exit(1)
    os.environ.pop("HARNESS_SHIM_FORWARD_SIGINT", None)
    try:
        os.execvp(sys.argv[1], sys.argv[1:])
    finally:
        os._exit(127)
def on_term(sig, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all()
    os._exit(128 + sig)
def on_int(sig, frame):
    if os.environ.get("HARNESS_SHIM_FORWARD_SIGINT") != "0":
        try:
            os.kill(child, signal.SIGINT)
        except OSError:
            pass
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGINT, on_int)
libc.prctl(1, signal.SIGTERM, 0, 0, 0)
if os.getppid() != parent:
    on_term(signal.SIGTERM, None)
while True:
    try:
        pid, status = os.waitpid(-1, 0)
    except InterruptedError:
        continue
    except ChildProcessError:
        status = 0
        break
    if pid == child:
        break
signal.signal(signal.SIGTERM, signal.SIG_IGN)
kill_all()
if os.WIFSIGNALED(status):
    sig = os.WTERMSIG(status)
    if sig not in (signal.SIGKILL, signal.SIGSTOP):  # no handler can be set for these two
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)
"""


def shim_command(argv: list[str]) -> list[str]:
    """``argv`` run under the reaper shim (see the module docstring): start
    the result with ``start_new_session=True``; the process started is the
    shim, its only child runs ``argv`` with the same stdin, stdout and
    stderr, and its exit status is the command's (a signal's death included).
    A SIGINT to the shim is passed on to the command (environment
    ``HARNESS_SHIM_FORWARD_SIGINT=0``: not, for a shim in a terminal's
    foreground group, where the command gets the terminal's own)."""
    return [sys.executable, "-I", "-S", "-c", _SHIM, *argv]


def main(argv: list[str] | None = None) -> None:
    """``python -m harness.children -- COMMAND ...``: run COMMAND under the
    reaper shim in the foreground (``make test`` does, issue 26): when it
    ends, by Ctrl-C too, every process it left behind (a vLLM driver's
    model-registry subprocess, a watchdog, anything in another session) is
    killed; the exit status is COMMAND's."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m harness.children -- COMMAND [ARG...]", file=sys.stderr)
        raise SystemExit(2)
    os.environ["HARNESS_SHIM_FORWARD_SIGINT"] = "0"
    command = shim_command(args)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()


def relay_stderr(stream, sink_fd: int = 2) -> None:
    """Copy what a child writes to its stderr pipe (``stream``, the read end)
    to ``sink_fd`` (default the harness's own stderr) in a daemon thread,
    until end of stream: the child never holds the harness's stderr, so
    nothing it leaves behind can keep a reader of that stderr waiting."""
    import threading

    def pump() -> None:
        try:
            fd = stream.fileno()
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                try:
                    os.write(sink_fd, chunk)
                except OSError:
                    pass
        except (OSError, ValueError):
            pass
        finally:
            try:
                stream.close()
            except OSError:
                pass

    threading.Thread(target=pump, name="candidate-stderr", daemon=True).start()


def stop_process_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group ``proc`` leads and ``proc`` itself, reap it
    (up to 5 s) and close its stdin/stdout pipes. Call it once per process:
    once ``proc`` is reaped its group id may be reused. Never raises OSError.
    The group is killed even when ``proc`` itself has already exited
    (``os._exit``, a crash), since what it forked may still be there. Every
    descendant of ``proc`` is killed first (``kill_tree``: under the reaper
    shim that includes a grandchild that left the group with ``setsid``)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
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


def stop_gracefully(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """Stop ``proc`` (started with ``start_new_session``): SIGINT to it alone
    (vLLM's server then drains and stops its EngineCore itself, whose
    scheduler finishes the recording), after ``grace_s`` seconds SIGTERM to its
    process group, after 5 s more SIGKILL; returns once it has exited, with
    nothing of its group left."""
    if proc.poll() is None:
        for sig, wait, group in ((signal.SIGINT, grace_s, False), (signal.SIGTERM, 5.0, True),
                                 (signal.SIGKILL, 5.0, True)):
            try:
                os.killpg(proc.pid, sig) if group else os.kill(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    try:  # whatever it left in its group (vLLM's workers)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# The watchdog's whole program (run with ``python -I -S -c``: no site, no
# user paths, nothing of ours imported): block on stdin until EOF, then, if
# the group still has a process, SIGTERM it, wait, SIGKILL it.
_WATCHDOG = r"""
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
try:
    while os.read(0, 4096):
        pass
except OSError:
    pass
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except OSError:
        return False
if alive():
    os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.2)
    if alive():
        os.killpg(pgid, signal.SIGKILL)
"""


class PipeWatchdog:
    """A tiny process (``python -c SCRIPT ARGS``, its own session) holding the read
    end of a pipe only this process writes: it reads EOF when ``release()`` closes
    the write end or when this process dies, even by SIGKILL (the kernel closes
    it), and ``SCRIPT`` then does its cleanup. The base of ``GroupWatchdog`` and
    ``harness.ray_cluster.ClusterWatchdog``. Never raises: without a watchdog (no
    pipe or fork possible), the other layers of this module still apply."""

    #: Seconds ``release()`` waits for the watchdog to exit before killing it.
    release_wait_s = 5.0

    def __init__(self, script: str, args: list[str]) -> None:
        self._write_fd: int | None = None
        self._proc: subprocess.Popen | None = None
        try:
            read_fd, write_fd = os.pipe()  # non-inheritable: only the watchdog gets the read end
        except OSError:
            return
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", script, *args],
                                          stdin=read_fd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True)
            self._write_fd = write_fd
        except OSError:
            os.close(write_fd)
        finally:
            os.close(read_fd)

    def release(self) -> None:
        """Close the pipe (the watchdog does its cleanup and exits) and reap it."""
        if self._write_fd is not None:
            os.close(self._write_fd)
            self._write_fd = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=self.release_wait_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None


class GroupWatchdog(PipeWatchdog):
    """Stops the process group ``pgid`` if this process dies first.

    ``GroupWatchdog(proc.pid, grace_s)`` right after starting ``proc`` (with
    ``start_new_session=True``); ``release()`` once ``proc`` has been stopped
    and reaped. On release the watchdog reads EOF, finds the group empty and
    exits; if this process dies instead (SIGKILL), the kernel closes the pipe
    and the watchdog SIGTERMs the group, then SIGKILLs it after ``grace_s``
    seconds. Never raises."""

    def __init__(self, pgid: int, grace_s: float = 10.0) -> None:
        super().__init__(_WATCHDOG, [str(pgid), str(grace_s)])


class ChildPool:
    """Children kept for reuse, by key, and every live child killed at exit.

    Starting a candidate's process costs 0.1 s (a ``module:factory``) to 5 s
    (vLLM's imports), and ``golden check`` or ``fuzz`` build hundreds of
    candidates in a row, so a child whose candidate is done goes back to an
    idle list (at most ``size`` per key) for the next candidate with the same
    key. Children must have ``alive() -> bool`` and ``kill()``; ``kill()``
    calls ``forget(child)``. At interpreter exit (``atexit``; the signal
    handlers' unwinding gets there too) every child still registered is killed
    and nothing is put back any more. Used by ``harness.candidates.isolated``
    and ``harness.candidates.vllm.candidate``."""

    def __init__(self, size: int) -> None:
        import threading

        self.size = size
        self._live: set = set()
        self._idle: dict[str, list] = {}
        self._pending: dict[str, int] = {}  # children being started in the background, by key
        self._exiting = False
        # Reentrant: a child's kill() calls forget() with the lock held.
        self._cond = threading.Condition(threading.RLock())
        import atexit

        atexit.register(self.kill_all)

    def add(self, child) -> None:
        """Register a newly started child (killed at exit unless forgotten)."""
        with self._cond:
            self._live.add(child)

    def forget(self, child) -> None:
        """``child`` is dead: drop it from the registry and the idle lists."""
        with self._cond:
            self._live.discard(child)
            for idle in self._idle.values():
                if child in idle:
                    idle.remove(child)

    def live(self) -> set:
        """The registered children (a copy)."""
        with self._cond:
            return set(self._live)

    def expect(self, key: str, count: int) -> None:
        """``count`` children for ``key`` are being started in the background
        (a prestart): ``acquire`` waits for them rather than starting its own.
        Each must be followed by ``arrived(key)`` once that child is released
        (or has failed to start)."""
        with self._cond:
            self._pending[key] = self._pending.get(key, 0) + count

    def arrived(self, key: str) -> None:
        """One child ``expect``-ed for ``key`` is released (idle) or gone."""
        with self._cond:
            self._pending[key] = max(0, self._pending.get(key, 0) - 1)
            self._cond.notify_all()

    def pending_count(self, key: str) -> int:
        """Children for ``key`` still being started in the background."""
        with self._cond:
            return self._pending.get(key, 0)

    def acquire(self, key: str, start: Callable[[], object]):
        """An idle, still alive child for ``key``, else, once none is being
        started in the background for it (``expect``), ``start()``'s new one."""
        with self._cond:
            while True:
                idle = self._idle.get(key, [])
                while idle:
                    child = idle.pop()
                    if child.alive():
                        return child
                    child.kill()
                if not self._pending.get(key) or self._exiting:
                    break
                self._cond.wait(timeout=1.0)
        return start()

    def release(self, key: str, child, reusable: bool) -> None:
        """The candidate is done with ``child``: keep it idle if ``reusable``,
        alive, not exiting and there is room, else kill it."""
        with self._cond:
            idle = self._idle.setdefault(key, [])
            if reusable and not self._exiting and child.alive() and len(idle) < self.size:
                idle.append(child)
                self._cond.notify_all()
                return
        child.kill()

    def idle_count(self, key: str) -> int:
        """Idle children for ``key`` still alive (what ``acquire`` would hand out)."""
        with self._cond:
            return sum(1 for child in self._idle.get(key, []) if child.alive())

    def kill_idle(self) -> None:
        """Kill every idle child (tests: to measure a cold start)."""
        for idle in list(self._idle.values()):
            for child in list(idle):
                child.kill()

    def kill_all(self) -> None:
        """Kill every registered child; from now on nothing is kept idle."""
        with self._cond:
            self._exiting = True
            self._cond.notify_all()
        for child in self.live():
            child.kill()
