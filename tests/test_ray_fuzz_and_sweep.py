"""``harness fuzz --ray`` and ``harness sweep --ray`` (issue 25,
harness/fuzz/parallel_ray.py, harness/sweep_ray.py) on a local 2-CPU Ray
cluster, started once for the module (~10-20 s): the fuzz workers as Ray
tasks find what ``--workers 2`` finds, worker for worker (the same seeds,
shares, cases); the sweep's table is the local one, cell for cell; a task
that SIGKILLs its own worker is retried and changes nothing; an interrupted
run cancels its tasks (their workers die); a ``kill -9`` of a ``harness fuzz
--ray`` leaves no process of its cluster running.

Needs the ``[ray]`` extra (the ``[test]`` extra installs it); skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'sched-harness[ray]'; "
                                        "the [test] extra brings it)")

from click.testing import CliRunner  # noqa: E402

from harness.children import descendants  # noqa: E402
from harness.cli import main  # noqa: E402
from harness.fuzz import WorkerProgress, split_examples, worker_seed  # noqa: E402
from harness.fuzz.parallel import run_worker  # noqa: E402
from harness.fuzz.parallel_ray import _fuzz_task, fuzz_ray  # noqa: E402
from harness.ray_cluster import init_ray, shutdown  # noqa: E402
from harness.sweep import sweep_candidate  # noqa: E402
from harness.sweep_ray import sweep_ray  # noqa: E402
from test_sweep import EXPECTED, SCENARIOS, SPECS  # noqa: E402

SPEC = "mutant:drafts-on-prefill"


@pytest.fixture(scope="module")
def cluster():
    # The workers unpickle this module's tasks by value: they do not have tests/ on their path.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    assert init_ray(None)
    yield
    shutdown()


@pytest.fixture(scope="module")
def local_cases():
    """What ``--workers 2`` runs in each of its processes (``run_worker``), here in-process."""
    return [run_worker(SPEC, worker_seed(0, i), share, None, None, skip_known=True)
            for i, share in enumerate(split_examples(40, 2))]


def test_fuzz_ray_finds_what_workers_2_finds_worker_for_worker(cluster, local_cases) -> None:
    states: list[list[WorkerProgress]] = []
    result = fuzz_ray(SPEC, workers=2, max_examples=40, seed=0, skip_known=True, on_progress=states.append)
    assert [(w.worker, w.seed, w.max_examples) for w in result.workers] == \
        [(0, 0, 20), (1, 2430097083777867444, 20)]
    assert [w.result.case for w in result.workers] == [r.case for r in local_cases]
    assert [w.result.examples for w in result.workers] == [r.examples for r in local_cases] == [4, 7]
    assert result.smallest().worker == 0
    assert [(w.examples, w.share, w.done) for w in states[-1]] == [(4, 20, True), (7, 20, True)]


def test_cli_fuzz_ray_joins_the_running_cluster_one_worker_per_cpu(cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["fuzz", "--candidate", SPEC, "--ray", "--max-examples", "40",
                                    "--seed", "0", "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert "11 examples on 2 workers on Ray in" in res.output and "FOUND by 2 of 2 workers, 2 distinct" in res.output
    assert res.output.splitlines()[-1] == f"found: 2 witnesses written to {out}"
    infos = [json.loads((out / f"fuzz-{SPEC.replace(':', '-')}-seed0-worker{i}of2.json").read_text())
             for i in (0, 1)]
    assert [(i["worker_seed"], i["examples_before_failure"], i["num_requests"]) for i in infos] == \
        [(0, 4, 1), (2430097083777867444, 7, 1)]
    assert ray.is_initialized()  # the CLI leaves a cluster it did not start


def die_on_first_attempt(spec, worker, seed, max_examples, deadline, queue, options):
    """Worker 1's first attempt SIGKILLs its own Ray worker (a marker file
    says it happened); the retry fuzzes from its seed."""
    marker = Path(os.environ["HARNESS_TEST_MARKERS"]) / f"worker{worker}"
    if worker == 1 and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return _fuzz_task(spec, worker, seed, max_examples, deadline, queue, options)


def test_a_killed_ray_worker_is_retried_and_changes_no_finding(cluster, local_cases, tmp_path: Path) -> None:
    (tmp_path / "markers").mkdir()
    task = _with_marker_dir(die_on_first_attempt, str(tmp_path / "markers"))
    result = fuzz_ray(SPEC, workers=2, max_examples=40, seed=0, skip_known=True, task=task)
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["worker1"]
    assert [w.result.case for w in result.workers] == [r.case for r in local_cases]
    assert [w.result.examples for w in result.workers] == [4, 7]


def _with_marker_dir(task, markers: str):
    def wrapped(*args):
        os.environ["HARNESS_TEST_MARKERS"] = markers
        return task(*args)
    return wrapped


class Stop(Exception):
    pass


def note_pid_then_fuzz(spec, worker, seed, max_examples, deadline, queue, options):
    """Write this Ray worker's PID, then fuzz (the reference: nothing found, for long)."""
    (Path(os.environ["HARNESS_TEST_MARKERS"]) / f"worker{worker}").write_text(str(os.getpid()))
    return _fuzz_task(spec, worker, seed, max_examples, deadline, queue, options)


def test_an_interrupted_fuzz_ray_cancels_its_tasks_and_their_workers_die(cluster, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()

    def stop_once_both_run(states: list[WorkerProgress]) -> None:
        if len(list(markers.iterdir())) == 2 and all(w.examples > 0 for w in states):
            raise Stop

    with pytest.raises(Stop):
        fuzz_ray("reference", workers=2, max_examples=1_000_000, seed=0, on_progress=stop_once_both_run,
                 task=_with_marker_dir(note_pid_then_fuzz, str(markers)))
    pids = [int(p.read_text()) for p in sorted(markers.iterdir())]
    deadline = time.monotonic() + 60
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [p for p in pids if _running(p)] == []


def _running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_regression_a_killed_fuzz_ray_leaves_no_process_of_its_cluster_running(tmp_path: Path) -> None:
    """Regression: after ``kill -9`` of ``harness fuzz --ray`` (its own local
    cluster), Ray's GCS, raylet and workers died, but its DashboardAgent and
    RuntimeEnvAgent ran on for a minute (their last report to the dead GCS
    waits out a 60 s timeout); the cluster's watchdog now kills them."""
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli", "fuzz", "--ray", "--workers", "2",
                             "--max-examples", "1000000", "-o", str(tmp_path / "f")], cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            tree = descendants(proc.pid)
            if sum("ray::harness-fuzz-" in _cmdline(p) for p in tree) == 2:
                break
            assert proc.poll() is None, "harness fuzz --ray ended before its tasks ran"
            time.sleep(0.5)
        else:
            raise AssertionError("the fuzz tasks never ran")
        names = {_cmdline(p).split()[0].rsplit("/", 1)[-1] for p in tree}
        assert {"gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 45  # well under the agents' 60 s
    while any(_running(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [_cmdline(p) for p in tree if _running(p)] == []


def test_sweep_ray_gives_the_local_cells(cluster) -> None:
    done: list[int] = []
    results = sweep_ray(SPECS, SCENARIOS, on_candidate=lambda i, _cells: done.append(i))
    assert [c.outcome()[:-1] for cells in results for c in cells] == EXPECTED
    assert sorted(done) == [0, 1]


def sweep_dying_once(spec, scenarios):
    """The mutant's first attempt SIGKILLs its own Ray worker; the retry sweeps it."""
    marker = Path(os.environ["HARNESS_TEST_MARKERS"]) / spec.replace(":", "-")
    if spec.startswith("mutant:") and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return sweep_candidate(spec, scenarios)


def test_a_killed_sweep_worker_changes_no_cell(cluster, tmp_path: Path) -> None:
    results = sweep_ray(SPECS, SCENARIOS, task=_with_marker_dir(sweep_dying_once, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mutant-ignore-max-num-seqs"]
    assert [c.outcome()[:-1] for cells in results for c in cells] == EXPECTED


def test_cli_sweep_ray_json_runner(cluster) -> None:
    res = CliRunner().invoke(main, ["sweep", "fcfs-tight", "--candidate", "reference", "--ray", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert report["runner"] == "Ray local cluster"
    assert [(c["identical"], c["golden_steps"], c["verdict"]) for c in report["cells"]] == [(392, 392, "clean")]


# `harness bisect --ray`: its rows recorded as tasks, compared here in order. The "releases" are
# the reference and a mutant (``spec_for``), so no vLLM env is needed: a change at "b", none at "c".
BISECT_SPECS = {"a": "reference", "b": "mutant:ignore-max-num-seqs", "c": "mutant:ignore-max-num-seqs"}


def _bisect_inputs():
    from harness.scenarios import SCENARIOS

    scenario = SCENARIOS["priority-tight"]
    return scenario.make_workload(), scenario.engine_config(), scenario.seed


def _bisect_rows(result):
    return [{k: v for k, v in r.to_dict().items() if k not in ("seconds", "build_seconds")} for r in result.rows]


@pytest.fixture(scope="module")
def local_bisect():
    from harness.bisect.core import run_bisect

    return run_bisect("priority-tight", *_bisect_inputs(), list(BISECT_SPECS), spec_for=BISECT_SPECS.get)


def test_bisect_ray_gives_the_local_rows(cluster, local_bisect) -> None:
    from harness.bisect.parallel_ray import bisect_ray

    done: list[str] = []
    result = bisect_ray("priority-tight", *_bisect_inputs(), list(BISECT_SPECS), spec_for=BISECT_SPECS.get,
                        on_row=lambda v, _row: done.append(v))
    assert _bisect_rows(result) == _bisect_rows(local_bisect)
    assert [(r.version, r.verdict, r.steps, r.compared_with, r.same_as_previous) for r in result.rows] == [
        ("a", "clean", 221, None, None), ("b", "MAX-NUM-SEQS ×2", 221, "a", False), ("c", "MAX-NUM-SEQS ×2", 221, "b", True)]
    assert result.rows[1].divergence["step"] == 206
    assert (result.first_change.version, sorted(done)) == ("b", ["a", "b", "c"])


def bisect_dying_once(version, spec, workload, config, seed, step_timeout):
    """Release "b"'s first attempt SIGKILLs its own Ray worker; the retry records it."""
    from harness.bisect.parallel_ray import record_release_task

    marker = Path(os.environ["HARNESS_TEST_MARKERS"]) / version
    if version == "b" and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    return record_release_task(version, spec, workload, config, seed, step_timeout)


def test_a_killed_bisect_worker_changes_no_row(cluster, local_bisect, tmp_path: Path) -> None:
    from harness.bisect.parallel_ray import bisect_ray

    result = bisect_ray("priority-tight", *_bisect_inputs(), list(BISECT_SPECS), spec_for=BISECT_SPECS.get,
                        task=_with_marker_dir(bisect_dying_once, str(tmp_path)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]
    assert _bisect_rows(result) == _bisect_rows(local_bisect)


# `harness vllm-tests VERSION... --ray`: each release a task whose output folder comes back packed
# and is unpacked where the local run would have written it. The task body here is a stand-in for
# ``run_release`` (no vLLM): it writes the files a run writes, naming its own folder in the report
# and the recording's refusal; the real runs, local against Ray, are in tests/test_vllm_own_tests.py.
def fake_release_dying_once(version, files, k, queue):
    """A stand-in ``release_task``: release "b"'s first attempt SIGKILLs its own Ray worker; "c"
    fails as a release whose tests cannot run."""
    import tempfile

    from harness.vllm_tests_ray import pack
    from harness.vllm_tests_run import ReleaseRun, write_report

    marker = Path(os.environ["HARNESS_TEST_MARKERS"]) / version
    if version == "b" and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    queue.put_nowait((version, f"plain: {len(files)} file(s), -k {k}"))
    if version == "c":
        return ReleaseRun(version, 2, "/nowhere", error="pytest in the c env exited 5 with no results"), None
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        (out / "recordings").mkdir(parents=True)
        (out / "recordings" / "00000.jsonl").write_text(f"{version}\n")
        report = {"version": version, "out_dir": str(out), "broken_by_recorder": [], "violations": [],
                  "recorder_errors": [], "refused": [{"reason": f"{out / 'recordings' / '00000.jsonl'}: bad"}]}
        write_report(out, report)
        return ReleaseRun(version, 0, str(out), report=report), pack(out)


def test_vllm_tests_ray_unpacks_each_release_where_the_local_run_writes_it(cluster, tmp_path: Path) -> None:
    from harness.vllm_tests_ray import vllm_tests_ray

    (tmp_path / "markers").mkdir()
    outs = [tmp_path / v for v in "abc"]
    (tmp_path / "a" / "recordings").mkdir(parents=True)
    (tmp_path / "a" / "recordings" / "00007.jsonl").write_text("a previous run's")
    (tmp_path / "a" / "notes.txt").write_text("mine")
    lines: list[tuple[str, str]] = []
    runs = vllm_tests_ray(list("abc"), ["t.py"], "x", outs, log=lambda v, line: lines.append((v, line)),
                          task=_with_marker_dir(fake_release_dying_once, str(tmp_path / "markers")))
    assert sorted(p.name for p in (tmp_path / "markers").iterdir()) == ["b"]
    assert [(r.version, r.exit, r.out_dir, r.error) for r in runs] == [
        ("a", 0, str(outs[0]), None), ("b", 0, str(outs[1]), None),
        ("c", 2, str(outs[2]), "pytest in the c env exited 5 with no results")]
    for version, run, out in zip("ab", runs, outs):
        assert run.report["out_dir"] == str(out)
        assert run.report["refused"] == [{"reason": f"{out / 'recordings' / '00000.jsonl'}: bad"}]
        assert json.loads((out / "report.json").read_text()) == run.report
        assert (out / "recordings" / "00000.jsonl").read_text() == f"{version}\n"
    # A previous run's recordings are removed, as the local run removes them; one's own files stay.
    assert sorted(p.name for p in (tmp_path / "a").rglob("*")) == [
        "00000.jsonl", "notes.txt", "recordings", "report.json"]
    assert sorted(lines) == [(v, "plain: 1 file(s), -k x") for v in "abc"]
