"""``harness sweep --ray [ADDRESS]``: one Ray task per candidate (the
``[ray]`` extra; the cluster is joined or started by ``harness.ray_cluster``).

Each task runs ``harness.sweep.sweep_candidate`` (the same code as the local
run) on whatever node Ray picks: a release's env is built there when that
node lacks it, once (the env root is the node's cache; ``ensure_env`` locks
against a concurrent build), or the cells say ``unavailable`` with the
reason in one line. A task whose worker dies is retried (``MAX_RETRIES``);
results are gathered by candidate index, so the table is the local one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from harness.ray_cluster import MAX_RETRIES, completed, ray_module
from harness.sweep import Cell, sweep_candidate


def sweep_ray(specs: Sequence[str], scenarios: Sequence[str], *, step_timeout: float | None = None,
              on_candidate: Callable[[int, list[Cell]], None] | None = None,
              task: Callable[..., list[Cell]] = sweep_candidate) -> list[list[Cell]]:
    """``sweep_local``'s result (cells by candidate, in ``specs`` order) with
    each candidate a task on the cluster this process joined. A task that
    fails after its retries gives that candidate ``failed`` cells (the error's
    first line), never the end of the sweep; interrupted, the unfinished tasks
    are cancelled. ``step_timeout``: as ``sweep_candidate``'s. ``task``: the task body (tests substitute one that kills
    its worker)."""
    ray = ray_module()
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(task)
    options = {} if step_timeout is None else {"step_timeout": step_timeout}
    refs = [remote.options(name=f"harness-sweep-{i}").remote(spec, list(scenarios), **options)
            for i, spec in enumerate(specs)]
    results: dict[int, list[Cell]] = {}
    for i, cells, error in completed(refs):
        if error is not None:
            cells = [Cell(specs[i], name, "failed", reason=error) for name in scenarios]
        results[i] = cells
        if on_candidate is not None:
            on_candidate(i, results[i])
    return [results[i] for i in range(len(specs))]
