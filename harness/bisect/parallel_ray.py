"""``harness bisect --ray [ADDRESS]``: the releases of a bisect recorded in
parallel, one Ray task each (the ``[ray]`` extra; the cluster is joined or
started by ``harness.ray_cluster``).

Each task runs ``core.record_release`` (the same code as the local run) on
whatever node Ray picks: the release's env is built there when that node
lacks it (the env root is the node's cache), and the recording comes back as
the trace file's bytes. The comparisons, release against the previous one
that ran, are made here, in order, once every row is in (``core.compare_rows``),
so the result is the local one row for row. A task whose worker dies is
retried (``MAX_RETRIES``); one that fails after its retries is a ``failed``
row with the error's first line.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

from reference.config import EngineConfig
from reference.workload import Workload

from harness.bisect.core import BisectResult, Row, compare_rows, record_release, release_spec
from harness.ray_cluster import MAX_RETRIES, completed, ray_module


def record_release_task(version: str, spec: str, workload: Workload, config: EngineConfig, seed: int,
                        step_timeout: float | None) -> tuple[Row, bytes | None]:
    """A Ray task's body: ``record_release`` into a temporary file, and that
    file's bytes (None when the release did not run)."""
    with tempfile.TemporaryDirectory(prefix="sched-harness-bisect-") as tmp:
        out = Path(tmp) / "trace.parquet"
        row = record_release(version, spec, workload, config, seed, out, step_timeout=step_timeout)
        return row, out.read_bytes() if row.status == "ran" else None


def bisect_ray(source: str, workload: Workload, config: EngineConfig, seed: int, versions: list[str],
               *, scheduler_cls: str | None = None, step_timeout: float | None = None,
               on_row: Callable[[str, Row | None], None] | None = None,
               spec_for: Callable[[str], str] | None = None,
               task: Callable[..., tuple[Row, bytes | None]] = record_release_task) -> BisectResult:
    """``core.run_bisect``'s result with every release a task on the cluster
    this process joined (all submitted at once; ``on_row(version, row)`` as
    each finishes, in any order). Interrupted, the unfinished tasks are
    cancelled. ``task``: the task body (tests substitute one that kills its
    worker)."""
    ray = ray_module()
    spec_of = spec_for or (lambda v: release_spec(v, scheduler_cls))
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(task)
    workload_ref, config_ref = ray.put(workload), ray.put(config)
    refs = [remote.options(name=f"harness-bisect-{version}").remote(
                version, spec_of(version), workload_ref, config_ref, seed, step_timeout)
            for version in versions]
    rows: dict[int, Row] = {}
    with tempfile.TemporaryDirectory(prefix="sched-harness-bisect-") as tmp:
        traces: dict[str, Path] = {}
        for i, result, error in completed(refs):
            if error is not None:
                row = Row(versions[i], "failed", reason=error)
            else:
                row, data = result
                if data is not None:
                    traces[row.version] = Path(tmp) / f"{i}.parquet"
                    traces[row.version].write_bytes(data)
            rows[i] = row
            if on_row is not None:
                on_row(versions[i], row)
        ordered = [rows[i] for i in range(len(versions))]
        compare_rows(ordered, traces)
    return BisectResult(source, scheduler_cls, ordered)
