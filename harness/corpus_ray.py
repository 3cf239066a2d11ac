"""``harness check PATH... --ray [ADDRESS]``: the corpus's per-trace checks
as Ray tasks (the ``[ray]`` extra).

Each trace is one task running ``harness.corpus.check_row`` (the same code as
``--workers``); a task whose worker process dies (killed, out of memory) is
retried by Ray (``MAX_RETRIES``), and results are gathered by trace index, so
a retried trace is counted once and none is lost. Without ADDRESS a local
cluster is started for the run (``LOCAL_CPUS`` CPUs, no dashboard, quiet
logging) and shut down after; with ADDRESS (``auto``, ``HOST:PORT``,
``ray://HOST:PORT``) the run joins that cluster, whose nodes need this
project installed and the traces readable at the same paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from harness.corpus import EXIT_UNUSABLE, CheckTask, TraceRow, check_row, error_row

#: Times Ray re-runs a task whose worker died.
MAX_RETRIES = 3
#: CPUs of the local cluster started when no ADDRESS is given.
LOCAL_CPUS = 2


class RayUnavailable(RuntimeError):
    """Ray is not installed, or the cluster cannot be reached; the message says which."""


def _ray():
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--ray needs Ray: pip install 'sched-harness[ray]'") from None
    return ray


def init_ray(address: str | None, num_cpus: int = LOCAL_CPUS) -> bool:
    """Join the cluster at ``address``, or start a local one of ``num_cpus``
    CPUs (``address`` None); True if this call did (False: this process had
    already joined one, which is used as it is). Raises RayUnavailable."""
    ray = _ray()
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "logging_level": logging.ERROR, "configure_logging": True}
    try:
        if address is None:
            ray.init(address="local", num_cpus=num_cpus, **kwargs)
        else:
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = address or "a local cluster"
        raise RayUnavailable(f"--ray: cannot start or reach {where}: {exc}") from None
    return True


def check_ray(paths: Sequence[str], params: dict[str, Any], task: CheckTask,
              on_row: Callable[[int, TraceRow], None] | None = None) -> list[TraceRow]:
    """Rows of ``paths`` in input order, one Ray task per trace on the
    cluster ``ray.init`` joined (``init_ray``). ``on_row(index, row)`` as
    each finishes. A task that fails after its retries becomes that trace's
    row (exit 2, the error), never the end of the corpus."""
    ray = _ray()
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(check_row)
    refs = [remote.remote(path, params, task) for path in paths]
    index = {ref: i for i, ref in enumerate(refs)}
    rows: dict[int, TraceRow] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        for ref in ready:
            i = index[ref]
            try:
                row = ray.get(ref)
            except Exception as exc:  # retries spent: this trace's row says so
                error = f"{paths[i]}: the Ray task failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                row = error_row(paths[i], EXIT_UNUSABLE, error)
            rows[i] = row
            if on_row is not None:
                on_row(i, row)
    return [rows[i] for i in range(len(paths))]


def shutdown() -> None:
    """Leave the cluster (stopping it if this process started it)."""
    _ray().shutdown()
