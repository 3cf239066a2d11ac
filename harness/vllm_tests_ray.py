"""``harness vllm-tests VERSION... --ray [ADDRESS]``: each release's own-test
run a Ray task (the ``[ray]`` extra; the cluster is joined or started by
``harness.ray_cluster``).

Each task runs ``vllm_tests_run.run_release`` (the same code as the local
run) into a temporary folder on whatever node Ray picks, building the
release's env there when that node lacks it (``env.ensure_env``, locked
against a concurrent build; the env root is the node's cache) or saying in one
line why it could not. The task's output folder (recordings, traces, JUnit
files, report) comes back as a tar archive and is unpacked into the folder
this process chose for the release, and the report's paths are rewritten to
it, so the reports are the local run's. Progress lines come back through a Ray
queue (an actor holding no CPU). A task whose worker dies is retried
(``MAX_RETRIES``); one that fails after its retries is that release's error.
"""

from __future__ import annotations

import io
import json
import platform
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from harness.ray_cluster import MAX_RETRIES, cancel, progress_queue, ray_module
from harness.vllm_tests_run import EXIT_UNUSABLE, ReleaseRun, clear_stale_recordings, run_release, write_report


def pack(folder: Path) -> bytes:
    """``folder``'s regular files as a tar archive (gzip level 1; names relative to ``folder``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=1) as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and not path.is_symlink():
                tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buf.getvalue()


def unpack(data: bytes, folder: Path) -> None:
    """Extract ``pack``'s archive into ``folder`` (created if missing; files of
    the same names replaced, others left; the ``data`` filter refuses any
    member that would land outside ``folder``)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(folder, filter="data")


def release_task(version: str, files: list[str], k: str | None, queue: Any) -> tuple[ReleaseRun, bytes | None]:
    """A Ray task's body: ``run_release`` into a temporary folder of this node
    (building the env when missing), its progress lines put on ``queue`` as
    ``(version, line)`` (dropped when the queue is full or gone); returns the
    run and its folder packed (None when nothing was written). An error names
    the node."""

    def log(line: str) -> None:
        try:
            queue.put_nowait((version, line))
        except Exception:  # noqa: BLE001 - progress is best effort; the result is what counts
            pass

    with tempfile.TemporaryDirectory(prefix=f"sched-harness-vllm-tests-{version}-") as tmp:
        out = Path(tmp) / "out"
        run = run_release(version, files, k, out, log, build_env=True)
        if run.error is not None:
            run.error = f"on Ray node {platform.node()}: {run.error}"
        return run, pack(out) if out.is_dir() else None


def relocate(run: ReleaseRun, data: bytes | None, out: Path) -> ReleaseRun:
    """``run`` as if it had run in ``out``: its files unpacked there (after
    removing a previous run's recordings, as the local run does), every
    mention of the task's folder in the report and the error replaced by
    ``out``, ``out/report.json`` rewritten."""
    if data is not None:
        clear_stale_recordings(out / "recordings")
        unpack(data, out)
    old, new = json.dumps(run.out_dir)[1:-1], json.dumps(str(out))[1:-1]
    report = None if run.report is None else json.loads(json.dumps(run.report).replace(old, new))
    error = None if run.error is None else run.error.replace(run.out_dir, str(out))
    moved = ReleaseRun(run.version, run.exit, str(out), report=report, error=error)
    if report is not None:
        write_report(out, report)
    return moved


def vllm_tests_ray(versions: Sequence[str], files: list[str], k: str | None, outs: Sequence[Path], *,
                   log: Callable[[str, str], None] = lambda _v, _line: None,
                   on_release: Callable[[int, ReleaseRun], None] | None = None,
                   task: Callable[..., tuple[ReleaseRun, bytes | None]] = release_task) -> list[ReleaseRun]:
    """The local run's results (one ``ReleaseRun`` per release, in
    ``versions`` order, its files in ``outs[i]``) with each release a task on
    the cluster this process joined (all submitted at once). ``log(version,
    line)``: the tasks' progress lines; ``on_release(index, run)`` as each
    finishes, in any order. Interrupted, the unfinished tasks are cancelled.
    ``task``: the task body (tests substitute one that kills its worker)."""
    ray = ray_module()
    queue, Empty = progress_queue()  # noqa: N806 - the exception class
    remote = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(task)
    refs = [remote.options(name=f"harness-vllm-tests-{version}").remote(version, list(files), k, queue)
            for version in versions]
    index = {ref: i for i, ref in enumerate(refs)}
    runs: dict[int, ReleaseRun] = {}
    pending = list(refs)

    def drain() -> None:
        try:
            for version, line in queue.get_nowait_batch(queue.qsize()):
                log(version, line)
        except Empty:
            pass

    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            drain()
            for ref in ready:
                i = index[ref]
                try:
                    run, data = ray.get(ref)
                    runs[i] = relocate(run, data, outs[i])
                except Exception as exc:  # retries spent (or the folder cannot be written here)
                    first = (str(exc).splitlines() or [""])[0]
                    runs[i] = ReleaseRun(versions[i], EXIT_UNUSABLE, str(outs[i]),
                                         error=f"the Ray task failed: {type(exc).__name__}: {first}")
                if on_release is not None:
                    on_release(i, runs[i])
        drain()
    finally:  # interrupted: leave no task running on the cluster
        cancel(pending)
        ray.kill(queue.actor)
    return [runs[i] for i in range(len(versions))]
