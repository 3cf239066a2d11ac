"""Joining or starting the Ray cluster that ``--ray [ADDRESS]`` names (the
``[ray]`` extra): the one module that imports Ray, lazily, so the plain
commands never do.

Without ADDRESS a local cluster is started for the run (``LOCAL_CPUS`` CPUs,
no dashboard, quiet logging) and shut down after; with ADDRESS (``auto``,
``HOST:PORT``, ``ray://HOST:PORT``) the run joins that cluster, whose nodes
need this project installed (and, for a corpus, the traces readable at the
same paths).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from harness.children import PipeWatchdog, descendants

#: Times Ray re-runs a task whose worker died.
MAX_RETRIES = 3
#: CPUs of the local cluster started when no ADDRESS is given.
LOCAL_CPUS = 2


# The watchdog's whole program (``python -I -S -c``, ~15 ms): while the
# harness lives (its pipe open), note every process of the local cluster (the
# roots Ray started and their descendants, each with its start time, so a
# reused PID is never hit); when the pipe reads EOF (shut down, or the harness
# killed), SIGKILL the ones still running.
_WATCHDOG = r"""
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
roots = [int(p) for p in sys.argv[1:]]
def started(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
def walk():
    found, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(k) for k in f.read().split() if int(k) not in found]
        except (OSError, ValueError):
            pass
    return found
seen = {}
while True:
    for pid in walk():
        if pid not in seen:
            seen[pid] = started(pid)
    if select.select([0], [], [], 1.0)[0]:
        try:
            if not os.read(0, 4096):
                break
        except OSError:
            break
for pid, start in seen.items():
    if start is not None and started(pid) == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class ClusterWatchdog(PipeWatchdog):
    """Stops a local cluster's processes if the harness dies first.

    Ray ties its head processes (GCS, raylet) to the driver with a
    parent-death signal and its workers follow the raylet, but the raylet's
    agents (``DashboardAgent``, ``RuntimeEnvAgent``) were seen alive a minute
    after a ``kill -9`` of the driver (their last report to the dead GCS waits
    out a 60 s timeout). ``ClusterWatchdog(roots)`` with the PIDs Ray started
    starts a tiny process holding the read end of a pipe only this process
    writes; it notes the roots' descendants every second, and when the pipe
    reads EOF (``release()`` after ``ray.shutdown``, or this process killed)
    SIGKILLs those still running. Never raises."""

    release_wait_s = 10.0

    def __init__(self, roots: list[int]) -> None:
        if not roots or not sys.platform.startswith("linux"):
            self._write_fd, self._proc = None, None
            return
        super().__init__(_WATCHDOG, [str(pid) for pid in roots])


_watchdog: list[ClusterWatchdog] = []  # the one of the local cluster this process started, if any


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached; the message says which."""


def ray_module() -> Any:
    """The ``ray`` package. Raises RayUnavailable (one line: how to install it)."""
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'sched-harness[ray]'") from None
    return ray


def init_ray(address: str | None, num_cpus: int = LOCAL_CPUS) -> bool:
    """Join the cluster at ``address``, or start a local one of ``num_cpus``
    CPUs (``address`` None); True if this call did (False: this process had
    already joined one, which is used as it is). A local cluster gets a
    ``ClusterWatchdog``: a ``kill -9`` of this process leaves none of its
    processes running. The SIGINT and SIGTERM
    handlers in place before (the harness's, which unwind a command through
    its ``finally`` blocks) are put back: ``ray.init`` replaces SIGTERM's
    with one that exits at once. Raises RayUnavailable."""
    ray = ray_module()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "logging_level": logging.ERROR, "configure_logging": True}
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    before = set(descendants(os.getpid()))
    try:
        if address is None:
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
            _watchdog.append(ClusterWatchdog([p for p in descendants(os.getpid()) if p not in before]))
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local cluster"
        raise RayUnavailable(f"--ray: cannot start or reach {where}: {exc}") from None
    finally:
        for signum, handler in saved.items():
            if handler is not None:
                try:
                    signal.signal(signum, handler)
                except ValueError:  # not the main thread: ray.init could not set them either
                    pass
    return True


@contextlib.contextmanager
def ray_session(address: str | None) -> Iterator[bool]:
    """``--ray [ADDRESS]`` for the length of a ``with``: join the cluster at
    ``address`` or start a local one (None), and leave it after (stopping it
    if this call started it). Yields ``init_ray``'s answer. Raises
    RayUnavailable on entry."""
    started = init_ray(address)
    try:
        yield started
    finally:
        if started:
            shutdown()


def cluster_cpus() -> int:
    """CPUs of the cluster this process joined (at least 1)."""
    return max(1, int(ray_module().cluster_resources().get("CPU", 1)))


def cancel(refs: Any) -> None:
    """Cancel the tasks of ``refs`` (ObjectRefs) not yet finished, killing
    their workers (``force``): what an interrupted command leaves behind on a
    cluster it joined. Errors (a task already gone) are ignored."""
    ray = ray_module()
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001 - finished, or the cluster already gone
            pass


def completed(refs: list[Any]) -> Iterator[tuple[int, Any, str | None]]:
    """Each of ``refs``' results as its task finishes: ``(index in refs, result,
    None)``, or ``(index, None, error)`` for a task that failed after its retries
    (``error``: "the Ray task failed: Type: first line"). The unfinished tasks are
    cancelled when the loop ends early (an interrupt, the caller's exception)."""
    ray = ray_module()
    index = {ref: i for i, ref in enumerate(refs)}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    result = ray.get(ref)
                except Exception as exc:  # retries spent
                    yield index[ref], None, (f"the Ray task failed: {type(exc).__name__}: "
                                             f"{str(exc).splitlines()[0] if str(exc) else ''}")
                    continue
                yield index[ref], result, None
    finally:  # interrupted: leave no task running on the cluster
        cancel(pending)


def progress_queue() -> tuple[Any, type[Exception]]:
    """A ``ray.util.queue.Queue`` (an actor holding no CPU, so it never
    takes a task's place) and the ``Empty`` its ``get_nowait_batch`` raises."""
    ray_module()
    from ray.util.queue import Empty, Queue

    return Queue(actor_options={"num_cpus": 0}), Empty


def shutdown() -> None:
    """Leave the cluster (stopping it, and whatever of it outlives
    ``ray.shutdown``, if this process started it)."""
    ray_module().shutdown()
    while _watchdog:
        _watchdog.pop().release()
