"""``harness check PATH... --ray [ADDRESS]``: the corpus's per-trace checks
as Ray tasks (the ``[ray]`` extra; the cluster is joined or started by
``harness.ray_cluster``).

Each trace is one task running ``harness.corpus.check_row`` (the same code as
``--workers``); a task whose worker process dies (killed, out of memory) is
retried by Ray (``MAX_RETRIES``), and results are gathered by trace index, so
a retried trace is counted once and none is lost. Nodes of a real cluster
need this project installed and the traces readable at the same paths.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from harness.corpus import EXIT_UNUSABLE, CheckTask, TraceRow, check_row, error_row
from harness.ray_cluster import LOCAL_CPUS, MAX_RETRIES, RayUnavailable, cancel, init_ray, ray_module, shutdown

__all__ = ["LOCAL_CPUS", "MAX_RETRIES", "RayUnavailable", "check_ray", "init_ray", "shutdown"]


def check_ray(paths: Sequence[str], params: dict[str, Any], task: CheckTask,
              on_row: Callable[[int, TraceRow], None] | None = None) -> list[TraceRow]:
    """Rows of ``paths`` in input order, one Ray task per trace on the
    cluster ``ray.init`` joined (``init_ray``). ``on_row(index, row)`` as
    each finishes; interrupted, the unfinished tasks are cancelled. A task
    that fails after its retries becomes that trace's row (exit 2, the
    error), never the end of the corpus."""
    ray = ray_module()
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(check_row)
    refs = [remote.remote(path, params, task) for path in paths]
    index = {ref: i for i, ref in enumerate(refs)}
    rows: dict[int, TraceRow] = {}
    pending = list(refs)
    try:
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
    finally:  # interrupted: leave no task running on the cluster
        cancel(pending)
    return [rows[i] for i in range(len(paths))]

