"""``harness check PATH... --ray`` (issue 25, harness/corpus_ray.py) on a
local 2-CPU Ray cluster, started once for the module (~10-20 s): the 20
goldens plus a violating, a junk, a truncated and a missing trace give the
same rows, trace for trace, as ``--workers 1``; a Ray worker killed with
SIGKILL mid-run (each of three tasks kills its own worker on its first
attempt) changes no row, none lost or counted twice.

Needs the ``[ray]`` extra (the ``[test]`` extra installs it); skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'sched-harness[ray]'; "
                                        "the [test] extra brings it)")

from click.testing import CliRunner  # noqa: E402

from harness.check_cli import check_one_json  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.corpus import check_local, expand_paths  # noqa: E402
from harness.corpus_ray import check_ray, init_ray, shutdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = {"semantics": "auto"}


@pytest.fixture(scope="module")
def cluster():
    # The workers unpickle this module's task by value: they do not have tests/ on their path.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert init_ray(None)
    yield
    shutdown()


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    bad = tmp_path_factory.mktemp("bad")
    (bad / "junk.parquet").write_bytes(b"junk\n")
    (bad / "cut.parquet").write_bytes((ROOT / "golden" / "pipeline-3.parquet").read_bytes()[:3000])
    return expand_paths([str(ROOT / "golden"), str(ROOT / "traces" / "mutant-ignore-max-num-seqs.parquet"),
                         str(bad), str(bad / "missing.parquet")])


@pytest.fixture(scope="module")
def local_rows(paths: list[str]):
    return check_local(paths, OPTIONS, check_one_json, workers=1)


def test_ray_rows_equal_one_worker_trace_for_trace(cluster, paths, local_rows) -> None:
    assert len(paths) == 27  # golden/ (20), golden/hybrid/ (3), the mutant trace, two bad files, a missing one
    rows = check_ray(paths, OPTIONS, check_one_json)
    assert [r.path for r in rows] == paths
    assert [(r.exit, r.verdict, r.violations, r.steps) for r in rows] == \
        [(r.exit, r.verdict, r.violations, r.steps) for r in local_rows]
    assert all(a.same_outcome(b) for a, b in zip(rows, local_rows, strict=True))
    assert [r.exit for r in rows].count(0) == 23 and sorted({r.exit for r in rows}) == [0, 1, 2]


def test_cli_ray_joins_the_running_cluster(cluster, paths, local_rows) -> None:
    result = CliRunner().invoke(main, ["check", *paths, "--json", "--ray"])
    assert result.exit_code == 2, result.output
    report = json.loads(result.output)
    assert report["runner"] == "Ray local cluster"
    assert report["traces"] == [{**r.to_dict(), "cpu_s": t["cpu_s"]}
                                for r, t in zip(local_rows, report["traces"], strict=True)]
    assert ray.is_initialized()  # the CLI leaves a cluster it did not start


def die_on_first_attempt(path: str, options: dict) -> tuple[int, str, str]:
    """Three of the traces: the first attempt SIGKILLs its own Ray worker
    (a marker file says it happened), the retry checks the trace."""
    options = dict(options)
    markers = Path(options.pop("_markers"))
    name = Path(path).name
    if name in ("fcfs-tight.parquet", "junk.parquet", "mutant-ignore-max-num-seqs.parquet"):
        marker = markers / name
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
    return check_one_json(path, options)


def test_killed_ray_workers_change_no_row(cluster, paths, local_rows, tmp_path: Path) -> None:
    rows = check_ray(paths, {**OPTIONS, "_markers": str(tmp_path)}, die_on_first_attempt)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "fcfs-tight.parquet", "junk.parquet", "mutant-ignore-max-num-seqs.parquet"]
    assert [r.path for r in rows] == paths
    assert all(a.same_outcome(b) for a, b in zip(rows, local_rows, strict=True))
