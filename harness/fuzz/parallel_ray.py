"""``harness fuzz --ray [ADDRESS]``: the workers of ``fuzz_parallel`` as Ray
tasks (the ``[ray]`` extra; the cluster is joined or started by
``harness.ray_cluster``).

Worker i is one task running ``run_worker`` with hypothesis seed
``worker_seed(seed, i)`` on its ``split_examples`` share: the same code, seeds
and shares as ``--workers N`` in local processes, so the same arguments give
the same findings, worker for worker, wherever the tasks run. Progress comes
back through a Ray queue (an actor of no CPU). A task whose worker process
dies is retried by Ray (``MAX_RETRIES``): it starts its search again from its
seed, and its result is taken once. An interrupted run (SIGINT, SIGTERM)
cancels its unfinished tasks, killing their workers, before it returns.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from harness.fuzz.parallel import (MAX_WORKERS, FuzzWorkerError, ParallelFuzzResult, WorkerProgress,
                                   WorkerResult, run_worker, split_examples, throttled_progress,
                                   worker_seed)
from harness.fuzz.run import SHRINK_BUDGET_S, FuzzResult, fuzz_profile
from harness.fuzz.strategies import FuzzCase
from harness.ray_cluster import MAX_RETRIES, cancel, progress_queue, ray_module


def _fuzz_task(spec: str, worker: int, seed: int, max_examples: int, deadline: float | None,
               queue: Any, options: dict[str, Any]) -> FuzzResult:
    """Body of one Ray task: ``run_worker`` with progress put on ``queue``
    (a ``ray.util.queue.Queue``; a full or gone queue drops the update)."""

    def put(item: tuple) -> None:
        try:
            queue.put_nowait(item)
        except Exception:  # noqa: BLE001 - progress is best effort; the result is what counts
            pass

    return run_worker(spec, seed, max_examples, deadline, throttled_progress(put, worker), **options)


def fuzz_ray(spec: str, *, workers: int, max_examples: int = 200, seed: int = 0,
             time_budget_s: float | None = None,
             on_progress: Callable[[list[WorkerProgress]], None] | None = None,
             skip_known: bool = False, base: FuzzCase | None = None, async_spec: bool = False,
             step_timeout: float | None = None, semantics: str = "auto",
             shrink_budget_s: float | None = SHRINK_BUDGET_S,
             task: Callable[..., FuzzResult] = _fuzz_task, hybrid: bool = False) -> ParallelFuzzResult:
    """``fuzz_parallel`` (same arguments, same result for the same ``spec``,
    ``workers``, ``max_examples`` and ``seed``) with each worker a task on
    the cluster this process joined (``harness.ray_cluster.init_ray``).

    ``time_budget_s``: seconds of wall time for the whole campaign from this
    call (a task waiting for a CPU or starting up spends it too).
    ``task``: the task body (tests substitute one that kills its worker).
    Raises ValueError for ``workers`` outside 1..MAX_WORKERS, CandidateSpecError
    for a bad ``spec`` (checked here first), FuzzWorkerError if a task fails
    after its retries (the message names the worker, its seed and the error's
    first line)."""
    from harness.candidates.resolve import resolve_candidate

    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be an integer in 1..{MAX_WORKERS}, got {workers!r}")
    shares = split_examples(max_examples, workers)
    seeds = [worker_seed(seed, i) for i in range(len(shares))]
    if spec != "reference":
        resolve_candidate(spec, step_timeout=step_timeout)
    fuzz_profile(semantics)
    ray = ray_module()

    options = {"skip_known": skip_known, "base": base, "async_spec": async_spec,
               "step_timeout": step_timeout, "semantics": semantics, "shrink_budget_s": shrink_budget_s,
               "hybrid": hybrid}
    progress = [WorkerProgress(0, share) for share in shares]
    start = time.monotonic()
    deadline = None if time_budget_s is None else time.time() + time_budget_s

    def report(i: int, **changes: Any) -> None:
        progress[i] = dataclasses.replace(progress[i], **changes)
        if on_progress is not None:
            on_progress(list(progress))

    queue, Empty = progress_queue()  # noqa: N806 - the exception class
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(task)
    refs = [remote.options(name=f"harness-fuzz-{i}").remote(spec, i, seeds[i], shares[i], deadline,
                                                             queue, options)
            for i in range(len(shares))]
    index = {ref: i for i, ref in enumerate(refs)}
    results: dict[int, FuzzResult] = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
            try:
                for _kind, i, n, shrinking in queue.get_nowait_batch(queue.qsize()):
                    if i not in results:
                        report(i, examples=n, shrinking=shrinking)
            except Empty:
                pass
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # retries spent, or the task raised
                    lines = [line for line in str(exc).splitlines() if line.strip()]
                    first = next((line for line in reversed(lines) if "Error" in line), lines[0] if lines else "")
                    raise FuzzWorkerError(f"fuzz worker {i} (seed {seeds[i]}) failed on Ray: "
                                          f"{type(exc).__name__}: {first.strip()}") from None
                report(i, examples=results[i].examples, done=True)
    finally:  # interrupted or failed: leave no task running on the cluster
        cancel(pending)
        ray.kill(queue.actor)
    return ParallelFuzzResult(seed, [WorkerResult(i, seeds[i], shares[i], results[i])
                                     for i in range(len(shares))], time.monotonic() - start, runner="Ray")
