"""vLLM's own scheduler tests under the recorder (issue 22): the recorder bugs they exposed, and
``harness vllm-tests`` on a small selection of 0.33.0's tests.

The first test runs one script under vLLM 0.33.0's CPU venv (the recording scheduler built as the
vLLM driver builds vLLM's Scheduler) and checks what vLLM's tests tripped on:
``reset_prefix_cache`` raised TypeError; an abort between ``schedule()`` and
``update_from_output()`` was held back until an update that never came (vLLM behaved differently
under the recorder); a scheduler built with ``object.__new__`` raised AttributeError. The second
runs ``harness vllm-tests 0.33.0 -k ...`` (the sdist fetched once and cached beside the envs; the
full files are ``bench/vllm_own_tests.py``).

``HARNESS_SKIP_VLLM=1`` skips both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"

SCRIPT = r'''
import json, os, sys
from harness.candidates.vllm.driver import Driver  # the CPU-only vLLM defaults
from harness.candidates.vllm.recording_scheduler import RecordingScheduler
from harness.candidates.vllm.candidate import driver_config
from reference.config import EngineConfig

out = {}
driver = Driver()
driver.Scheduler = RecordingScheduler
os.environ["SCHED_HARNESS_TRACE"] = sys.argv[1]
driver.init(driver_config(EngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=256,
                                       max_num_batched_tokens=256, enable_prefix_caching=True)), 0)
sched = driver.sched
out["reset"] = sched.reset_prefix_cache()
for i in range(2):
    driver.add({"request_id": f"q{i}", "prompt_token_ids": list(range(1 + i, 40 + i)), "max_tokens": 4,
                "ignore_eos": True, "eos_token_id": 2, "priority": 0, "arrival_time": 0.0})
so = sched.schedule()
sched.finish_requests(["q0"], driver.RequestStatus.FINISHED_ABORTED)
# vLLM applies the abort at once (no update follows in this test).
out["q0_status"] = sched.requests["q0"].status.name if "q0" in sched.requests else "removed"
out["running"] = [r.request_id for r in sched.running]
out["free_blocks"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
sched.shutdown()
bare = object.__new__(RecordingScheduler)
try:
    bare.reset_prefix_cache()
except AttributeError as exc:
    out["bare"] = str(exc)
print("RESULT " + json.dumps(out))
'''


@pytest.mark.vllm
def test_reset_prefix_cache_mid_step_abort_and_object_new_behave_as_vllm(tmp_path: Path) -> None:
    """Regressions: ``_Recorder.guard() got an unexpected keyword argument 'result'``; a deferred
    mid-step abort never applied; ``object.__new__`` schedulers."""
    if SKIP:
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import ensure_env
    from harness.candidates.vllm.recording_convert import convert

    python = ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    script = tmp_path / "drive.py"
    script.write_text(SCRIPT)
    jsonl = tmp_path / "rec.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHED_HARNESS_STRICT="1", VLLM_USE_V2_MODEL_RUNNER="0")
    env.pop("SCHED_HARNESS_MID_STEP_ABORTS", None)
    proc = subprocess.run([str(python), str(script), str(jsonl)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    got = json.loads(line[len("RESULT "):])
    assert got["reset"] is True
    assert got["q0_status"] in ("FINISHED_ABORTED", "removed") and got["running"] == ["q1"]
    assert got["free_blocks"] == 63 - 3  # q1's 3 blocks (39 tokens of 16); q0's freed at once
    assert "_sched_harness" not in got["bare"]  # vLLM's own attribute is what is missing
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [r["what"] for r in records if r["t"] == "note"] == ["reset_prefix_cache"]
    assert [r["result"] for r in records if r["t"] == "note"] == [True]
    assert [(r["mid_step"], [f["request_id"] for f in r["finished"]]) for r in records
            if r["t"] == "abort"] == [(True, ["q0"])]
    assert records[-1]["t"] == "end" and records[-1]["by"] == "shutdown"
    summary = convert(jsonl, tmp_path / "rec.parquet")
    assert summary["steps"] == 0
    # The reset came before any step (nothing cached: no break); the abort at vLLM's timing is one.
    assert "1 request(s) aborted between schedule() and update_from_output()" in summary["protocol"]


DIAMOND = r'''
import json, os, sys
from harness.candidates.vllm.driver import Driver
from harness.candidates.vllm import recording_scheduler as rs
from harness.candidates.vllm.candidate import driver_config
from reference.config import EngineConfig

Sync, Async = rs._build_recording_scheduler(False), rs._build_recording_scheduler(True)


class Diamond(Sync, Async):  # as vLLM's DiffusionAsyncScheduler(DiffusionScheduler, AsyncScheduler)
    pass


driver = Driver()
driver.Scheduler = Diamond
os.environ["SCHED_HARNESS_TRACE"] = sys.argv[1]
driver.init(driver_config(EngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=256,
                                       max_num_batched_tokens=256)), 0)
driver.add({"request_id": "q0", "prompt_token_ids": list(range(1, 20)), "max_tokens": 2,
            "ignore_eos": True, "eos_token_id": 2, "priority": 0, "arrival_time": 0.0})
for _ in range(2):
    driver.schedule()
    driver.update({"q0": [7]})
driver.sched.shutdown()
print("RESULT " + json.dumps({"layers": [c.__name__ for c in rs._recording_layers(Diamond)],
                              "async": driver.sched._sched_harness_async}))
'''


@pytest.mark.vllm
def test_a_scheduler_deriving_from_both_recording_classes_records_once(tmp_path: Path) -> None:
    """Regression: vLLM 0.33.0's ``DiffusionAsyncScheduler(DiffusionScheduler, AsyncScheduler)``
    with both replaced by recording classes (``harness vllm-tests``) started two recorders on one
    file (torn lines: "not a JSON object", the recording refused) and recorded every call twice."""
    if SKIP:
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import ensure_env
    from harness.candidates.vllm.recording_convert import convert

    python = ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    script = tmp_path / "diamond.py"
    script.write_text(DIAMOND)
    jsonl = tmp_path / "rec.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHED_HARNESS_STRICT="1", VLLM_USE_V2_MODEL_RUNNER="0")
    proc = subprocess.run([str(python), str(script), str(jsonl)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    got = json.loads(line[len("RESULT "):])
    assert got == {"layers": ["RecordingScheduler", "AsyncRecordingScheduler"], "async": True}
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [r["t"] for r in records] == ["meta", "arrival", "schedule", "update", "schedule", "update",
                                         "end"]
    summary = convert(jsonl, tmp_path / "rec.parquet")
    assert summary["steps"] == 2 and summary["finished"] == 1 and summary["protocol"] is None


#: A selection of 0.33.0's tests that exercises the recorder's fixed paths: the prefix-cache
#: reset, aborts (mid-step too), spec decode, a KV connector, preemption, prefix caching, a class
#: deriving from both recording classes (DiffusionAsyncScheduler: its recordings were torn).
SELECTION = ("test_scheduler_reset_prefix_cache or test_stop_via_update_from_output or "
             "test_preempt_during_execution or test_schedule_spec_decoding_stats or "
             "test_kv_connector_basic or test_abort_request_waiting_for_remote_kvs or "
             "test_update_draft_token_ids_strips_ngram_padding or test_prefill_plp or "
             "test_reset_prefix_cache or test_diffusion_scheduler_trims_full_width_worker_drafts or "
             "test_pause_new_ignores_streaming_session_waiting_for_input or "
             "test_drafter_lookahead_encoder_cache_cap_makes_progress")


@pytest.mark.vllm
def test_vllm_tests_on_a_selection_of_0_33_0s_own_tests(tmp_path: Path, vllm_0_33_0_tests) -> None:
    from harness.cli import main

    result = CliRunner().invoke(main, ["vllm-tests", "0.33.0", "-k", SELECTION, "-o", str(tmp_path),
                                       "--json"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output)
    assert report["broken_by_recorder"] == [] and report["violations"] == []
    assert report["plain_passed"] == report["injected_passed"] >= 10
    assert report["recordings"] >= 10 and report["converted"] == report["recordings"]
    # Every clean recording replays identically, the KV connector tests' too: the recorder keeps
    # what vLLM's MockKVConnector answered (get_num_new_matched_tokens, KVConnectorOutput) and the
    # reference answers as recorded (RecordedKVConnector). (Before: "not-replayed-unmodelled".)
    assert report["replay_diverged"] == 0 and report["replay_identical"] == report["clean"]
    assert report["artefacts"].get("not-replayed-unmodelled", 0) == 0
    assert report["artefacts"].get("unmodelled-kv_connector", 0) >= 3
    # test_kv_connector_basic[True]: MockKVConnector(matched_tokens=32, is_async=True) answered
    # (32, async) once per request; both loads reported done with the first batch's output.
    from harness.trace import open_trace
    manifest = [json.loads(x) for x in (tmp_path / "recordings" / "manifest.jsonl").read_text().splitlines()]
    entry = next(e for e in manifest if e.get("nodeid", "").endswith("test_kv_connector_basic[True]"))
    trace = open_trace(tmp_path / "traces" / (Path(entry["file"]).stem + ".parquet"))
    assert trace.config.kv_connector_matches == (("r000000", ((32, True),)), ("r000001", ((32, True),)))
    assert trace.config.kv_connector_outputs == ((1, ("r000000", "r000001"), ()),)
    # Issue 22: the streaming-input session that stops is parked (config resumable_request_ids),
    # and the drafter look-ahead a test sets by hand before its first step is the config's
    # num_prefill_lookahead: both replay (before: not replayed, and no complete step).

    def trace_of(suffix: str):
        entry = next(e for e in manifest if e.get("nodeid", "").endswith(suffix))
        return open_trace(tmp_path / "traces" / (Path(entry["file"]).stem + ".parquet"))

    assert trace_of("test_pause_new_ignores_streaming_session_waiting_for_input").config.resumable_request_ids \
        == ("r000000",)
    for lookahead in (1, 3):
        assert trace_of(f"test_drafter_lookahead_encoder_cache_cap_makes_progress[{lookahead}]"
                        ).config.num_prefill_lookahead == lookahead


K29 = "test_throttle_prefills_excludes_fully_transferred_remote_kv or test_scheduler_stats_waiting_queues"


def _vllm_tests_029_033(out: Path, *more: str) -> dict:
    """``harness vllm-tests 0.29.0 0.33.0 -k K29 -o OUT --json [MORE]``'s one object (skips without
    the envs or the sdists)."""
    if SKIP:
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import is_ready
    from harness.candidates.vllm.own_tests import OwnTestsError, fetch_sdist
    from harness.cli import main

    for version in ("0.29.0", "0.33.0"):
        if not is_ready(version):
            pytest.skip(f"no vLLM {version} env (harness vllm-env {version})")
        try:
            fetch_sdist(version)
        except OwnTestsError as exc:  # no index reachable and nothing cached
            pytest.skip(str(exc))
    result = CliRunner().invoke(main, ["vllm-tests", "0.29.0", "0.33.0", "-o", str(out), "--json",
                                       "-k", K29, *more])
    assert result.exit_code == 0, result.output[-3000:]
    return json.loads(result.output)


@pytest.fixture(scope="module")
def local_029_033(tmp_path_factory) -> tuple[Path, dict]:
    """The two releases run one after the other, here (the regression test below and the Ray
    comparison share it)."""
    out = tmp_path_factory.mktemp("vllm-tests-local")
    return out, _vllm_tests_029_033(out)


@pytest.mark.vllm
def test_vllm_0_29_0_kv_load_promotions_are_recorded_and_hand_queued_requests_are_a_break(
        local_029_033) -> None:
    """Regressions from 0.29.0's own tests: its KV-load promotions go through
    ``_try_promote_blocked_waiting_request`` (0.31.0 renamed it), which the recorder did not hook, so
    each admission after a load read as ADMISSION-ORDER "admitted as new but its status was
    WAITING_FOR_REMOTE_KVS"; ``test_scheduler_stats_waiting_queues`` queues requests by hand before
    its first ``schedule()`` and its recording was refused ("request '3' was never added").
    Run with 0.33.0 (several releases: one report each, ``DIR/VERSION``), whose same two tests
    record the promotions under their new name."""
    out, both = local_029_033
    assert (both["ok"], both["exit"], both["runner"]) == (True, 0, "local")
    assert [(r["version"], r["exit"], r["error"], r["out_dir"]) for r in both["releases"]] == [
        ("0.29.0", 0, None, str(out / "0.29.0")), ("0.33.0", 0, None, str(out / "0.33.0"))]
    # 0.29.0's test_scheduler_stats_waiting_queues queues requests by hand before its first
    # schedule() (the break: no complete step); 0.33.0's adds them all and completes a step.
    # The KV connector test (throttle_prefills ... remote_kv) replays identical on both: the
    # recorder keeps its connector's answers (before: "not-replayed-unmodelled").
    expected = {"0.29.0": ((2, 2, 2, 2, 1, 1, 1), {"no-complete-step": 1, "stopped-by-driver": 1,
                                                  "unmodelled-kv_connector": 1}),
                "0.33.0": ((2, 2, 2, 2, 2, 2, 2), {"stopped-by-driver": 2, "unmodelled-kv_connector": 1})}
    for report in both["releases"]:
        assert ((report["plain_passed"], report["injected_passed"], report["recordings"], report["converted"],
                 report["checkable"], report["clean"], report["replay_identical"]), report["artefacts"]) == \
            expected[report["version"]]
        assert report["violations"] == [] and report["refused"] == [] and report["broken_by_recorder"] == []
        assert report["replay_diverged"] == 0
        assert json.loads((Path(report["out_dir"]) / "report.json").read_text()) == {
            k: v for k, v in report.items() if k not in ("exit", "error")}
    recordings = out / "0.29.0" / "recordings"
    manifest = [json.loads(line) for line in (recordings / "manifest.jsonl").read_text().splitlines()]
    throttle = next(m["file"] for m in manifest if "throttle" in m["nodeid"])
    promotions = [(r["step"], e["request_id"], e["status"], e["num_computed_tokens"])
                  for r in map(json.loads, (recordings / throttle).read_text().splitlines())
                  if r["t"] == "schedule" for e in r["output"]["events"] if e["type"] == "kv_promote"]
    assert promotions == [(2, "r1", "WAITING", 31), (4, "r2", "WAITING", 31)]


def _same_run(report: dict) -> dict:
    """A release's entry without what differs between two runs of it (CPU seconds, its folder)."""
    return {k: v for k, v in report.items() if k not in ("plain_cpu_s", "injected_cpu_s", "out_dir")}


@pytest.mark.vllm
def test_vllm_tests_on_ray_gives_the_local_reports_release_for_release(local_029_033, tmp_path: Path) -> None:
    """``harness vllm-tests 0.29.0 0.33.0 --ray``: each release a task on a local 2-CPU Ray cluster
    (issue 25); the reports, and the files in each release's folder, are the local run's."""
    pytest.importorskip("ray", reason="Ray is not installed (the [test] extra brings it)")
    local_out, local = local_029_033
    on_ray = _vllm_tests_029_033(tmp_path, "--ray")
    assert (on_ray["ok"], on_ray["exit"], on_ray["runner"]) == (True, 0, "Ray local cluster")
    assert [_same_run(r) for r in on_ray["releases"]] == [_same_run(r) for r in local["releases"]]
    for version, report in zip(("0.29.0", "0.33.0"), on_ray["releases"]):
        assert report["out_dir"] == str(tmp_path / version)

        def files(root: Path) -> list[str]:
            return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

        assert files(tmp_path / version) == files(local_out / version)
        assert json.loads((tmp_path / version / "report.json").read_text())["out_dir"] == str(tmp_path / version)


# -- without vLLM: the sdist fetch, the JUnit reading, the pins, the report ------------------

def _serve(files: dict[str, bytes]):
    """A local HTTP index serving ``files`` (path -> body); returns (server, base URL)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def test_fetch_sdist_checks_the_index_sha256_and_caches_it(tmp_path: Path, monkeypatch) -> None:
    import hashlib

    from harness.candidates.vllm import own_tests

    body = b"not really a tarball"
    digest = hashlib.sha256(body).hexdigest()
    page = {"files": [{"filename": "vllm-0.33.0.tar.gz", "url": "/files/vllm-0.33.0.tar.gz",
                       "hashes": {"sha256": "0" * 64}, "size": len(body)}]}
    files = {"/simple/vllm/": json.dumps(page).encode(), "/files/vllm-0.33.0.tar.gz": body}
    server, base = _serve(files)
    try:
        monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path / "envs"))
        monkeypatch.setenv("PIP_INDEX_URL", f"{base}/simple")
        with pytest.raises(own_tests.OwnTestsError, match=f"sha256 {digest} is not the index's 0000"):
            own_tests.fetch_sdist("0.33.0")
        assert list((tmp_path / "envs" / "sdists").iterdir()) == []  # nothing half-written left
        page["files"][0]["hashes"]["sha256"] = digest
        files["/simple/vllm/"] = json.dumps(page).encode()
        path = own_tests.fetch_sdist("0.33.0")
        assert path == tmp_path / "envs" / "sdists" / "vllm-0.33.0.tar.gz" and path.read_bytes() == body
        del files["/files/vllm-0.33.0.tar.gz"]  # cached: the index is not asked again
        assert own_tests.fetch_sdist("0.33.0") == path
        with pytest.raises(own_tests.OwnTestsError, match="lists no vllm-0.29.0.tar.gz"):
            own_tests.fetch_sdist("0.29.0")
    finally:
        server.shutdown()


def test_junit_outcomes_rebuild_node_ids_and_pins_come_from_the_release(tmp_path: Path) -> None:
    from harness.candidates.vllm.own_tests import _junit_outcomes, _pins

    (tmp_path / "tests" / "v1").mkdir(parents=True)
    (tmp_path / "tests" / "v1" / "test_a.py").write_text("")
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite>'
        '<testcase classname="tests.v1.test_a" name="test_x[1]"/>'
        '<testcase classname="tests.v1.test_a.TestK" name="test_y"><failure message="OSError: Invalid '
        'repository ID&#10;second line"/></testcase>'
        '<testcase classname="tests.v1.test_a" name="test_z"><skipped/></testcase>'
        '<testcase classname="tests.v1.test_a" name="test_x[1]"><error/></testcase>'
        '</testsuite></testsuites>')
    messages: dict[str, str] = {}
    assert _junit_outcomes(tmp_path / "junit.xml", tmp_path, messages) == {
        "tests/v1/test_a.py::test_x[1]": "failed",  # an error at teardown after its pass
        "tests/v1/test_a.py::TestK::test_y": "failed",
        "tests/v1/test_a.py::test_z": "skipped"}
    # Each failure's first message line (new-user trial: a plain failure was a bare count).
    assert messages == {"tests/v1/test_a.py::TestK::test_y": "OSError: Invalid repository ID",
                        "tests/v1/test_a.py::test_x[1]": ""}
    req = tmp_path / "requirements" / "test"
    req.mkdir(parents=True)
    req.joinpath("cpu.txt").write_text("pytest==9.1.0\n    # via -r x\ntblib==3.1.0\ntorch==2.13.0\n")
    assert _pins(tmp_path) == {"pytest": "9.1.0", "tblib": "3.1.0"}


def test_protocol_kinds_name_every_line_the_converter_writes() -> None:
    from harness.vllm_tests_report import protocol_kind

    assert [protocol_kind(line) for line in (
        "the recorded run left the trace's step protocol at a.jsonl:line 9: schedule() called with 1 batch(es) ...",
        "... update_from_output() without a schedule(): ...",
        "... given a SchedulerOutput that no schedule() returned (built by hand) ...",
        "... the running queue changed outside schedule() ...",
        "... request(s) 'a' entered the waiting queue outside schedule() ...",
        "... 1 request(s) aborted between schedule() and update_from_output() ...",
        "... the prefix cache was reset ...",
        "... a streaming-input update of request 'a' ...",
        "stopped by the driver after step 3 with 1 request(s) live ...",
        "... Scheduler.need_mamba_block_aligned_split set to True by hand (vLLM derived False from the config)",
        "... Scheduler.max_num_encoder_input_tokens 100 and encoder cache size 1000 set after the first "
        "schedule() by hand (vLLM derived 8192 and 8192, ...)",
        "... EncoderCacheManager.can_allocate replaced on the instance by hand (a stub: ...)",
        "something else")] == [
        "schedule-twice", "update-without-schedule", "hand-built-output", "queue-edited",
        "preempted-by-hand", "mid-step-abort", "prefix-cache-reset", "streaming-input",
        "stopped-by-driver", "scheduler-flag-set-by-hand", "scheduler-flag-set-by-hand",
        "method-stubbed-by-hand", "other"]


def test_layered_env_without_pip_gets_test_packages_through_the_harness_pip(tmp_path: Path) -> None:
    """A layered env (``layered.py``: a venv built without pip) made ``harness vllm-tests 0.25.0``
    die on ``pip freeze`` (CalledProcessError); the harness's pip acts on it with ``--python``."""
    import venv

    from harness.candidates.vllm.own_tests import _pip_for

    venv.EnvBuilder(with_pip=False).create(tmp_path / "layered")
    python = str(tmp_path / "layered" / "bin" / "python")
    assert _pip_for(python) == [sys.executable, "-m", "pip", "--python", python]
    assert _pip_for(sys.executable) == [sys.executable, "-m", "pip"]
    listed = subprocess.run([*_pip_for(python), "list", "--format=json"], capture_output=True, text=True)
    assert listed.returncode == 0 and json.loads(listed.stdout) == []  # it sees that env, not ours


def test_regression_a_plain_failure_is_named_and_an_empty_run_says_nothing_was_checked(tmp_path: Path) -> None:
    """New-user trial: ``vllm-tests -k ...`` printed "plain: 4 tests, 3 passed"
    without naming the failing test, and a run with 0 checkable recordings ended
    on a verdict that read as clean."""
    from harness.vllm_tests_cli import release_verdict
    from harness.vllm_tests_report import analyse, render
    from harness.vllm_tests_run import ReleaseRun

    node = "tests/v1/core/test_scheduler.py::test_schedule_partial_requests"
    report = analyse({node: "failed", "tests/v1/core/test_scheduler.py::test_a": "passed"},
                     {node: "failed", "tests/v1/core/test_scheduler.py::test_a": "passed"},
                     tmp_path / "rec", tmp_path / "traces", "0.33.0",
                     plain_messages={node: "OSError: Invalid repository ID"})
    assert report["failed_plain"] == [{"test": node, "reason": "OSError: Invalid repository ID"}]
    assert report["broken_by_recorder"] == []
    assert render(report)[-1] == (f"failed without the recorder (not a finding): {node}: "
                                  "OSError: Invalid repository ID")
    run = ReleaseRun(version="0.33.0", out_dir=str(tmp_path), report=report, exit=0)
    assert release_verdict(run) == (
        "vllm-tests 0.33.0: 0 test(s) broken by the recorder, 0 unexplained violation(s); nothing was checked: "
        f"no recording had a complete step; report in {tmp_path / 'report.json'}")
