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
from harness.ray_cluster import LOCAL_CPUS, MAX_RETRIES, RayUnavailable, completed, init_ray, ray_module, shutdown

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
    rows: dict[int, TraceRow] = {}
    for i, row, error in completed(refs):
        if error is not None:  # this trace's row says so
            row = error_row(paths[i], EXIT_UNUSABLE, f"{paths[i]}: {error}")
        rows[i] = row
        if on_row is not None:
            on_row(i, row)
    return [rows[i] for i in range(len(paths))]

