"""``harness/candidates/vllm/recording_scheduler.py``: record real vLLM with the ``--scheduler-cls``
subclass, convert the JSONL to a trace, check it and replay it against the reference.

No server and no GPU: a script running under vLLM 0.33.0's CPU venv builds
``RecordingScheduler`` exactly as ``harness/candidates/vllm/driver.py`` builds vLLM's
``Scheduler`` (the driver's class swapped for ours) and drives it with the
reference engine loop (virtual clock, scripted model outputs, aborts, drafts)
through ``VLLMCandidate`` answered in-process. Like ``EngineCore.step``, it
calls ``schedule()`` once more with nothing unfinished whenever vLLM still has
finished ids to report, and aborts everything due in a step with one
``finish_requests`` call. Our venv then converts each JSONL, runs ``harness
check`` and ``harness replay --candidate reference`` on it, and compares it
with the engine's summary of the run and with the reference's own recording
of the same workload (same rows but for the virtual times). Cases: four golden
scenarios, a hand-made abort burst (vLLM frees a batch in set order; an
inputs-only step), a log cut mid-line and an injected recording error.

``HARNESS_SKIP_VLLM=1`` skips the vLLM part (the env is built when missing).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.trace.recorder import record
from harness.scenarios import HYBRID_SCENARIOS, SCENARIOS
from reference.config import EngineConfig
from reference.workload import RequestSpec, Workload

VERSION = "0.33.0"
REPO = Path(__file__).resolve().parent.parent
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"
# FCFS preemption, prefix sharing, EOS stops + aborts, PRIORITY + speculative
# decoding (give-back, drafts): all identical between vLLM 0.33.0 and the reference.
SCENARIO_NAMES = ["fcfs-tight", "prefix-sharing", "eos-stop-abort", "spec-decode-priority"]
HARNESS_ONLY = ("draft_acceptance_rate", "step_fixed_s", "step_per_token_s")

DRIVE = r'''
import dataclasses, json, os, sys, time
t0 = time.time()
from harness.candidates.vllm.driver import Driver  # sets the CPU-only vLLM environment defaults
from harness.candidates.vllm.recording_scheduler import RecordingScheduler
from harness.candidates.vllm.candidate import VLLMCandidate, driver_config
from reference.candidate import CandidateCrash
from reference.config import EngineConfig
from reference.engine import Engine
from reference.workload import RequestSpec, Workload

driver = Driver()
driver.Scheduler = RecordingScheduler  # Driver.init builds the scheduler with it


class InProcess:
    """The driver protocol answered in this process. Before the next call, an
    EngineCore-style step with nothing unfinished runs whenever vLLM still has
    finished ids to report (what the server's busy loop does)."""

    pid = os.getpid()
    idle_pending = False

    def call(self, msg, timeout=None):
        op = msg["op"]
        if self.idle_pending and op not in ("drafts", "snapshot"):
            self.idle_step()
        if op == "init":
            resp = driver.init(msg["config"], int(msg.get("seed", 0)))
        elif op == "add":
            resp = driver.add(msg["request"])
        elif op == "abort":
            resp = driver.abort(msg["request_ids"])
            self.idle_pending = True
        elif op == "schedule":
            resp = driver.schedule(bool(msg.get("throttle_prefills", False)))
        elif op == "update":
            resp = driver.update(msg.get("sampled") or {})
            self.idle_pending = True
        elif op == "drafts":
            resp = driver.drafts(msg.get("drafts") or {})
        elif op == "snapshot":
            resp = {"snapshot": driver.snapshot()}
        else:
            raise ValueError(op)
        return {"ok": True, **resp}

    def idle_step(self):
        self.idle_pending = False
        sched = driver.sched
        if sched.get_num_unfinished_requests() == 0 and sched.has_requests():
            so = sched.schedule()
            sched.update_from_output(so, driver._model_runner_output([], {}))
            self.idle_steps += 1

    idle_steps = 0


class InProcessCandidate(VLLMCandidate):
    def _driver(self):
        if self._proc is None:
            self._proc = PROC
            self.info = PROC.call({"op": "init", "config": driver_config(self.config), "seed": self.seed})
            self._snap = None
        return self._proc

    def finish_requests(self, request_ids, finished_status):
        # The engine aborts one request per call; a server aborts a batch in
        # one finish_requests call (vLLM frees it in set order): the first
        # abort of a step aborts every request due, the others are answered
        # from that call.
        if not ABORTED:
            due = [r.request_id for r in ABORTS
                   if r.abort_time <= ENGINE.summary.clock and r.request_id in self._live]
            for fin in super().finish_requests(due, finished_status):
                ABORTED[fin.request_id] = fin
        out = [ABORTED.pop(i) for i in request_ids if i in ABORTED]
        return out + super().finish_requests([i for i in request_ids if i in self._live],
                                             finished_status)

    def schedule(self, throttle_prefills=False):
        assert not ABORTED, f"aborted but not asked for: {sorted(ABORTED)}"
        return super().schedule(throttle_prefills)


results = {"import_s": time.time() - t0, "runs": {}}
from vllm.v1.core.sched.scheduler import Scheduler as VLLMScheduler
VLLM_UPDATE = VLLMScheduler.update_from_output
import harness.candidates.vllm.recording_scheduler as recording
normalise = recording._ev.normalise
for name, run in json.load(open(sys.argv[1])).items():
    os.environ["SCHED_HARNESS_TRACE"] = run["jsonl"]
    os.environ["SCHED_HARNESS_STRICT"] = "0" if run.get("fail_at_step") else "1"

    def failing_normalise(so, seq, fail=run.get("fail_at_step"), **kw):
        if fail is not None and driver.sched._sched_harness.steps == fail:
            raise RuntimeError("injected recording failure")
        return normalise(so, seq, **kw)
    recording._ev.normalise = failing_normalise

    def update_from_output(self, so, mro, fail=run.get("raise_in_update_at_step")):
        if fail is not None and self._sched_harness.steps == fail:
            raise RuntimeError("injected update failure")
        return VLLM_UPDATE(self, so, mro)
    VLLMScheduler.update_from_output = update_from_output  # what RecordingScheduler's super() calls
    config, seed = EngineConfig.from_dict(run["config"], accept_vllm_crash=True), run["seed"]
    workload = Workload("test", "0" * 64, {}, tuple(RequestSpec(**r) for r in run["requests"]))
    PROC, ABORTED = InProcess(), {}
    ABORTS = [r for r in workload.requests if r.abort_time is not None]
    ENGINE = engine = Engine(config, seed=seed,
                             candidate_factory=lambda c: InProcessCandidate(c, "@VERSION@", seed=seed))
    try:
        summary, crashed = engine.run(workload), None
        PROC.idle_step()  # the server's last step: only reports the last finished ids
    except CandidateCrash as exc:  # vLLM raised: the recording scheduler logged it and re-raised
        summary, crashed = engine.summary, str(exc)
    driver.sched.shutdown()  # renames the temporary file
    results["runs"][name] = {"summary": dataclasses.asdict(summary), "idle_steps": PROC.idle_steps,
                             "crashed": crashed}
# What --scheduler-cls does: SchedulerConfig resolves the qualified name.
from vllm.config import SchedulerConfig
from vllm.v1.core.sched.scheduler import Scheduler
cls = SchedulerConfig.default_factory(
    scheduler_cls="harness.candidates.vllm.recording_scheduler.RecordingScheduler").get_scheduler_cls()
results["resolved"] = [cls is RecordingScheduler, issubclass(cls, Scheduler)]
# Under async scheduling the recorder on vLLM's AsyncScheduler is named instead.
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
acls = SchedulerConfig.default_factory(
    scheduler_cls="harness.candidates.vllm.recording_scheduler.AsyncRecordingScheduler").get_scheduler_cls()
results["resolved_async"] = [issubclass(acls, AsyncScheduler), acls.__name__,
                             issubclass(RecordingScheduler, AsyncScheduler)]
# Async scheduling (vLLM's default with a custom class) is refused at start-up.
old = driver.sched
old.vllm_config.scheduler_config.async_scheduling = True
try:
    RecordingScheduler(vllm_config=old.vllm_config, kv_cache_config=old.kv_cache_config,
                       structured_output_manager=old.structured_output_manager,
                       block_size=old.block_size)
    results["async_refused"] = None
except RuntimeError as exc:
    results["async_refused"] = str(exc)
results["total_s"] = time.time() - t0
print("RESULTS " + json.dumps(results))
'''.replace("@VERSION@", VERSION)


def _abort_burst() -> tuple[EngineConfig, Workload]:
    """Aborts that vLLM frees in its own (set) order, several per step, and an
    inputs-only step (every unfinished request aborted at once)."""
    def req(i: int, t: float, abort: float | None, out: int = 40) -> RequestSpec:
        prompt = tuple(10 + (i * 37 + j * 11) % 997 for j in range(14 + i % 9))
        return RequestSpec(f"r{i:06d}", t, prompt, max_tokens=out, abort_time=abort)

    requests = [req(i, 0.001 * i, 0.05 if i % 2 == 0 else None) for i in range(12)]
    requests += [req(12, 100.0, 100.02), req(13, 100.0, 100.02), req(14, 100.0, 100.02),
                 req(15, 200.0, None, out=5)]
    config = EngineConfig(num_gpu_blocks=60, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64)
    return config, Workload("test", "0" * 64, {}, tuple(requests))


def _crash_case() -> tuple[EngineConfig, Workload]:
    """vLLM 0.33.0's spec-decode padding assert (tests/test_vllm.py): r1 (a
    1-token prompt) admitted while r0 decodes, threshold 4 < 1 + 4 drafts."""
    data = {**EngineConfig(block_size=16, max_model_len=128, num_gpu_blocks=20, max_num_seqs=4,
                           max_num_batched_tokens=256, num_speculative_tokens=4).to_dict(),
            "long_prefill_token_threshold": 4}
    specs = (RequestSpec("r0", 0.0, tuple(range(100, 108)), max_tokens=10),
             RequestSpec("r1", 0.012, (200,), max_tokens=10))
    return EngineConfig.from_dict(data, accept_vllm_crash=True), Workload("test", "0" * 64, {}, specs)


def _cases() -> dict[str, tuple[EngineConfig, Workload]]:
    cases = {name: (SCENARIOS[name].engine_config(), SCENARIOS[name].make_workload())
             for name in SCENARIO_NAMES}
    assert all(SCENARIOS[name].seed == 0 for name in SCENARIO_NAMES)  # traces carry seed 0
    cases["abort-burst"] = _abort_burst()
    cases["crash"] = _crash_case()
    # A hybrid model (sliding window + full attention: two KV-cache groups, issue 28).
    # Three Mamba layers to one full-attention layer (mamba_cache_mode "none"): four groups.
    for name in (HYBRID, HYBRID_MAMBA):
        hybrid = HYBRID_SCENARIOS[name]
        assert hybrid.seed == 0
        cases[name] = (hybrid.engine_config(), hybrid.make_workload())
    return cases


CASES = [*SCENARIO_NAMES, "abort-burst"]
HYBRID = "hybrid-alternating"
HYBRID_MAMBA = "hybrid-mamba"


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """Run the drive script once under vLLM's Python: {name: (jsonl path, engine info)}."""
    if SKIP:
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.vllm.env import ensure_env

    python = ensure_env(VERSION, log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    tmp = tmp_path_factory.mktemp("vllm-recording")
    script = tmp / "drive.py"
    script.write_text(DRIVE)
    cases = _cases()
    paths = {name: tmp / name / "trace.jsonl" for name in cases}
    runs = {name: {"jsonl": str(paths[name]), "config": config.to_dict(), "seed": 0,
                   "requests": [dataclasses.asdict(r) for r in workload.requests]}
            for name, (config, workload) in cases.items()}
    # Recording breaks at step 30: the run goes on, the log says so.
    paths["failing"] = tmp / "failing" / "trace.jsonl"
    runs["failing"] = dict(runs["eos-stop-abort"], jsonl=str(paths["failing"]), fail_at_step=30)
    # vLLM's update_from_output raises at step 5 (injected): the log keeps the step up to it.
    paths["update-crash"] = tmp / "update-crash" / "trace.jsonl"
    runs["update-crash"] = dict(runs["fcfs-tight"], jsonl=str(paths["update-crash"]), raise_in_update_at_step=5)
    (tmp / "runs.json").write_text(json.dumps(runs))
    # PYTHONHASHSEED: vLLM frees a batch of aborts in set order; pin it.
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHED_HARNESS_STRICT="1",
               VLLM_USE_V2_MODEL_RUNNER="0", PYTHONUNBUFFERED="1", PYTHONHASHSEED="0")
    proc = subprocess.run([str(python), str(script), str(tmp / "runs.json")], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, (
        f"drive script failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = json.loads(line[len("RESULTS "):])
    print(f"vLLM import {results['import_s']:.1f} s, drive total {results['total_s']:.1f} s",
          file=sys.stderr)
    runs = {name: (paths[name], results["runs"][name], *cases[name]) for name in cases}
    runs["failing"] = (paths["failing"], results["runs"]["failing"], *cases["eos-stop-abort"])
    runs["update-crash"] = (paths["update-crash"], results["runs"]["update-crash"], *cases["fcfs-tight"])
    return {"runs": runs, "resolved": results["resolved"], "async_refused": results["async_refused"],
            "resolved_async": results["resolved_async"]}


_VIRTUAL = ("clock_s", "arrival_time_s", "abort_time_s", "scripted_output_len")


def _rows(path: Path) -> list[dict]:
    table = pq.read_table(path)
    return table.drop_columns([c for c in _VIRTUAL if c in table.column_names]).to_pylist()


def _harness_json(*args: str) -> dict:
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.output)


@pytest.mark.vllm
@pytest.mark.parametrize("name", [*CASES, HYBRID, HYBRID_MAMBA])
def test_recorded_run_converts_checks_and_replays_identically(recorded, tmp_path, name):
    from harness.candidates.vllm.recording_convert import convert

    jsonl, info, config, workload = recorded["runs"][name]
    assert jsonl.is_file() and not list(jsonl.parent.glob(".*.tmp")), "temp file not renamed"
    # vLLM has no value for the harness's own keys (the scripted proposer's rate...).
    overrides = {k: v for k, v in config.to_dict().items() if k in HARNESS_ONLY}
    trace = tmp_path / f"{name}.parquet"
    summary = convert(jsonl, trace, overrides=overrides)

    # The server-side idle steps (schedule() with nothing unfinished) were dropped.
    assert summary["dropped_idle_steps"] >= 1
    assert summary["dropped_idle_steps"] <= info["idle_steps"]
    assert summary["warnings"] == []

    # The reference engine's own recording of the same workload: the same
    # rows but for the virtual times (and EOS scripts vLLM never reached) --
    # unless vLLM freed a batch of aborts in another order than the
    # reference's (abort_time, request id) order: the converted trace keeps
    # vLLM's order (ulp-spaced abort times), so only its replay can agree.
    ref = tmp_path / f"{name}.reference.parquet"
    record(workload, config, ref)
    if summary["reordered_abort_steps"] == 0:
        assert _rows(trace) == _rows(ref)
    else:
        assert _rows(trace) != _rows(ref)

    check = _harness_json("check", str(trace))
    assert check["ok"], check["violations"][:3]
    if name == "abort-burst":
        assert summary["reordered_abort_steps"] >= 1  # vLLM's free order replayed via ulps
    engine = info["summary"]
    for key in ("steps", "requests", "finished", "aborted", "preemptions", "prefix_hit_tokens"):
        assert check[key] == engine[key], (key, check[key], engine[key])
        if key in summary:
            assert summary[key] == engine[key], key

    replay = _harness_json("replay", str(trace), "--candidate", "reference")
    assert replay["divergence"] is None, replay["divergence"]
    assert replay["ok"] == check["ok"]  # replay's ok includes the checks

    # Metadata: engine, mapped config, live workload; the requests as the workload gave them.
    meta = json.loads(pq.read_schema(trace).metadata[b"sched_harness"])
    assert meta["engine"] == f"vllm@{VERSION}" and meta["seed"] == 0
    assert meta["workload"]["source"] == "live" and len(meta["workload"]["sha256"]) == 64
    expected_config = json.loads(json.dumps(config.to_dict()))  # layer_types: a JSON list
    assert meta["config"] == expected_config
    unmapped = meta["vllm_recording"]["unmapped_config"]
    assert "cache_config.gpu_memory_utilization" in unmapped  # captured, not ours
    assert not {k.split(".", 1)[-1] for k in unmapped} & set(expected_config)
    rows = pq.read_table(trace, filters=[("kind", "=", "arrival")]).to_pylist()
    specs = {r.request_id: r for r in workload.requests}
    assert meta["workload"]["params"]["vllm_request_ids"] == [r["request_id"] for r in rows]
    for row in rows:
        spec = specs[row["request_id"]]
        assert tuple(row["prompt_token_ids"]) == spec.prompt_token_ids
        assert (row["max_tokens"], row["min_tokens"], row["priority"], row["ignore_eos"]) == \
            (spec.max_tokens, spec.min_tokens, spec.priority, spec.ignore_eos)
        assert tuple(row["stop_token_ids"]) == spec.stop_token_ids
        if row["scripted_output_len"] is not None:  # learnt from an EOS stop
            assert row["scripted_output_len"] == spec.scripted_output_len


@pytest.mark.vllm
@pytest.mark.parametrize("name", CASES)
def test_vllm_recording_extracts_to_a_scenario_with_the_same_decisions(recorded, tmp_path, name):
    """`harness scenario extract` of a converted vLLM recording: the tokens vLLM's run sampled are
    fixed (output_token_ids from the output rows), the config is the recording's (vLLM names);
    `harness record` of the file on the reference gives vLLM's decisions, block ids included. The
    one warning: vLLM config keys the format cannot carry (the recording's unmapped_config)."""
    import tomllib

    from harness.cli import main as cli
    from harness.scenario_extract import decisions
    from harness.trace import open_trace
    from harness.candidates.vllm.recording_convert import convert

    jsonl, _, config, workload = recorded["runs"][name]
    overrides = {k: v for k, v in config.to_dict().items() if k in HARNESS_ONLY}
    trace = tmp_path / f"{name}.parquet"
    convert(jsonl, trace, overrides=overrides)
    res = CliRunner().invoke(cli, ["scenario", "extract", str(trace), "-o", str(tmp_path / "s.toml")])
    assert res.exit_code == 0, res.output
    warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: vLLM config key(s) the scenario format cannot express: "), warnings
    assert "cache_config.gpu_memory_utilization" in warnings[0]
    doc = tomllib.loads((tmp_path / "s.toml").read_text())
    outputs = [r for r in doc["requests"] if "output_token_ids" in r]
    assert outputs and len(doc["requests"]) == len(workload.requests)
    again = tmp_path / "again.parquet"
    res = CliRunner().invoke(cli, ["record", str(tmp_path / "s.toml"), "-o", str(again)])
    assert res.exit_code == 0, res.output
    ids = {r.request_id for r in workload.requests}
    assert decisions(list(open_trace(again).iter_steps()), ids, block_ids=True, relative=False) == \
        decisions(list(open_trace(trace).iter_steps()), ids, block_ids=True, relative=False)


@pytest.mark.vllm
def test_a_killed_server_leaves_a_convertible_log(recorded, tmp_path):
    """Flushed per step: a log cut mid-line (no end record) still converts."""
    from harness.candidates.vllm.recording_convert import convert

    jsonl = recorded["runs"]["eos-stop-abort"][0]
    data = jsonl.read_text().splitlines(keepends=True)
    cut = tmp_path / ".trace.jsonl.1234.tmp"
    cut.write_text("".join(data[: len(data) // 2]) + data[len(data) // 2][:20])
    trace = tmp_path / "cut.parquet"
    summary = convert(cut, trace)
    assert 0 < summary["steps"]
    assert any("no end record" in w for w in summary["warnings"])
    result = CliRunner().invoke(main, ["replay", str(trace), "--candidate", "reference", "--json"])
    replay = json.loads(result.output)
    # The inputs are complete up to the cut: the reference agrees step by step
    # until the trace ends (its unfinished requests are then LIVENESS findings).
    assert replay["divergence"] is None or replay["divergence"]["step"] >= summary["steps"] - 1
    # Issue 26: a cut-off recording never passes as a complete run (exit 3 when nothing else is found).
    assert replay["incomplete"] == "a vLLM recording without its end record (the server was cut off)"
    assert result.exit_code == (3 if replay["ok"] is False and not replay["violations"]
                                and replay["divergence"] is None else 1), result.output


@pytest.mark.vllm
def test_a_format_2_recording_converts_to_the_same_rows(recorded, tmp_path):
    """Format 3 numbers the batches (async scheduling); a format 2 log (no ``batch``,
    no placeholders) still converts, its one batch in flight implicit."""
    from harness.candidates.vllm.recording_convert import convert
    from harness.candidates.vllm.recording_scheduler import FORMAT

    jsonl = recorded["runs"]["eos-stop-abort"][0]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert FORMAT == 3 and records[0]["format"] == 3
    assert [r["batch"] for r in records if r["t"] == "update"] == \
        list(range(sum(r["t"] == "schedule" for r in records)))
    old = tmp_path / "format2.jsonl"
    shown: dict[str, list] = {}
    for r in records:
        r.pop("batch", None)
        r.pop("placeholders", None)
        # Format 2 writes every snapshot whole (format 3 leaves out an unchanged queue).
        for snap in (r.get("before"), r.get("after")):
            if snap is not None:
                for key in ("waiting", "running"):
                    shown[key] = snap.setdefault(key, shown.get(key))
                snap.setdefault("request_states", [])
    records[0]["format"] = 2
    old.write_text("".join(json.dumps(r) + "\n" for r in records))
    convert(jsonl, tmp_path / "new.parquet")
    convert(old, tmp_path / "old.parquet")
    assert pq.read_table(tmp_path / "old.parquet").equals(pq.read_table(tmp_path / "new.parquet"))


@pytest.mark.vllm
def test_a_recording_error_stops_recording_not_the_server(recorded, tmp_path):
    from harness.candidates.vllm.recording_convert import convert

    jsonl, info, *_ = recorded["runs"]["failing"]
    assert info["summary"]["steps"] > 30 and info["summary"]["finished"] > 0  # the run went on
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["t"] for r in records[-2:]] == ["error", "end"]
    assert "injected recording failure" in records[-2]["error"]
    summary = convert(jsonl, tmp_path / "failing.parquet")
    assert summary["steps"] <= 30
    assert any("recording stopped early" in w for w in summary["warnings"])


@pytest.mark.vllm
def test_scheduler_cls_resolves_and_async_is_refused(recorded):
    assert recorded["resolved"] == [True, True]
    assert recorded["resolved_async"] == [True, "AsyncRecordingScheduler", False]
    assert recorded["async_refused"] == (
        "vLLM enabled async scheduling (its default on GPU): use --scheduler-cls "
        "harness.candidates.vllm.recording_scheduler.AsyncRecordingScheduler, or start the server "
        "with --no-async-scheduling")


def test_module_imports_without_vllm():
    """Our venv has no vLLM: convert() is importable, the scheduler class is built lazily."""
    import harness.candidates.vllm.recording_convert as rc
    import harness.candidates.vllm.recording_scheduler as mod

    assert callable(rc.convert)
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            mod.RecordingScheduler  # noqa: B018


@pytest.mark.vllm
def test_a_vllm_crash_is_logged_converted_and_checked_as_engine_crash(recorded, tmp_path):
    """vLLM's assert inside ``schedule()``: the recording scheduler writes a
    ``crash`` record (vLLM's exception type, message, innermost vLLM frame,
    the queues before the call) and re-raises, so the engine fails as a
    server would; the log is closed (``end``). ``convert`` turns it into the
    trace's ``crash`` row, and ``harness check`` reports ENGINE-CRASH."""
    from harness.candidates.vllm.recording_convert import convert

    jsonl, info, config, _ = recorded["runs"]["crash"]
    assert info["crashed"] == ("candidate raised AssertionError in schedule() at step 3: `assert "
                               "num_new_tokens == 1 + self.num_spec_tokens` (at "
                               "vllm/v1/core/sched/scheduler.py:1579)")
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["t"] for r in records[-2:]] == ["crash", "end"]
    crash = records[-2]
    assert {k: crash[k] for k in ("step", "call", "exc_type", "exc_message", "where", "throttle_prefills")} == {
        "step": 3, "call": "schedule", "exc_type": "AssertionError",
        "exc_message": "AssertionError: `assert num_new_tokens == 1 + self.num_spec_tokens`",
        "where": "vllm/v1/core/sched/scheduler.py:1579", "throttle_prefills": False}
    # Format 3: a queue is left out of a snapshot when it is the previous snapshot's (r0 ran
    # in step 2 too); r1 arrived, so waiting is written. Resolved in file order, as convert does:
    assert crash["before"]["waiting"] == ["r1"] and "running" not in crash["before"]
    shown = {}
    for r in records:
        snaps = [r["before"], r["after"]] if r["t"] == "schedule" else [r.get("before") or {}]
        for snap in snaps:
            shown.update({k: snap[k] for k in ("waiting", "running") if k in snap})
    assert shown == {"waiting": ["r1"], "running": ["r0"]}
    overrides = {k: v for k, v in config.to_dict().items() if k in HARNESS_ONLY}
    trace = tmp_path / "crash.parquet"
    summary = convert(jsonl, trace, overrides=overrides)
    line = ("candidate raised AssertionError in schedule() at step 3: `assert num_new_tokens == 1 + "
            "self.num_spec_tokens` (at vllm/v1/core/sched/scheduler.py:1579)")
    assert (summary["steps"], summary["crashed"], summary["warnings"]) == (4, line, [])
    # The reader's rows: schema 8 stores the queues as changes of the previous snapshot.
    from harness.trace import open_trace
    rows = dict(open_trace(trace).iter_steps())[3]
    assert [(r["kind"], r["request_id"]) for r in rows] == [("arrival", "r000001"), ("schedule_begin", None),
                                                            ("crash", None)]
    assert (rows[1]["waiting"], rows[1]["running"]) == (["r000001"], ["r000000"])
    assert {k: rows[2][k] for k in ("status", "message", "stop_reason")} == {
        "status": "schedule", "message": "AssertionError: `assert num_new_tokens == 1 + self.num_spec_tokens`",
        "stop_reason": "vllm/v1/core/sched/scheduler.py:1579"}
    check = _harness_json("check", str(trace))
    assert not check["ok"] and check["violations_by_invariant"] == {"ENGINE-CRASH": 1}
    assert (check["violations"][0]["step"], check["violations"][0]["message"]) == (
        3, "schedule() raised AssertionError: `assert num_new_tokens == 1 + self.num_spec_tokens` at "
           "vllm/v1/core/sched/scheduler.py:1579")


@pytest.mark.vllm
def test_a_crash_in_update_from_output_keeps_the_schedule_and_the_tokens(recorded, tmp_path):
    """An exception out of vLLM's ``update_from_output`` (injected at step 5):
    the converted trace's step 5 is the reference's up to the model output
    (schedule_begin, decisions, schedule_end, update_begin, output rows), then
    the ``crash`` row; ``harness check`` reports ENGINE-CRASH only."""
    from harness.candidates.vllm.recording_convert import convert

    jsonl, info, config, workload = recorded["runs"]["update-crash"]
    crash = json.loads(jsonl.read_text().splitlines()[-2])
    assert (crash["t"], crash["step"], crash["call"], crash["exc_message"]) == (
        "crash", 5, "update_from_output", "RuntimeError: injected update failure")
    assert crash["where"].startswith("drive.py:")  # no vLLM frame: the injected raise
    trace = tmp_path / "update-crash.parquet"
    summary = convert(jsonl, trace, overrides={k: v for k, v in config.to_dict().items() if k in HARNESS_ONLY})
    assert summary["steps"] == 6 and summary["crashed"].startswith(
        "candidate raised RuntimeError in update_from_output() at step 5: injected update failure (at drive.py:")
    assert info["crashed"].startswith("candidate raised RuntimeError in update_from_output() at step 5: "
                                      "injected update failure (at ")
    ref = tmp_path / "ref.parquet"
    record(workload, config, ref)
    got = [r for r in _rows(trace) if r["step"] == 5]
    want = [r for r in _rows(ref) if r["step"] == 5]
    assert [r["kind"] for r in want][-1] == "update_end" and "output" in [r["kind"] for r in want]
    assert got[:-1] == want[:-1] and got[-1]["kind"] == "crash"
    assert (got[-1]["status"], got[-1]["message"]) == ("update_from_output", "RuntimeError: injected update failure")
    check = _harness_json("check", str(trace))
    assert check["violations_by_invariant"] == {"ENGINE-CRASH": 1}


@pytest.mark.vllm
def test_a_hybrid_recording_carries_every_group_and_checks_with_no_rule_skipped(recorded, tmp_path):
    """Issue 28: the recorder reads every KV-cache group's blocks and the
    sliding window's frees; the converter names the groups as the config's
    ``sliding_window``/``layer_types`` (schema 9), so no block rule is
    skipped for "kv_cache_groups" (regression: group 0's blocks only, and
    BLOCK-CONSERVATION, ALLOC-FROM-HEAD, BLOCKS-COVER fired on correct vLLM)."""
    from harness.candidates.vllm.recording_convert import convert
    from harness.check import check_steps
    from harness.trace import open_trace

    jsonl, _, config, _ = recorded["runs"][HYBRID]
    meta_rec = json.loads(jsonl.read_text().splitlines()[0])
    assert meta_rec["kv_cache_groups"] == [["SlidingWindowSpec", 8, 4, 1], ["FullAttentionSpec", None, 4, 1]]
    assert meta_rec["unmodelled"] == {} and meta_rec["warnings"] == []
    trace = tmp_path / "hybrid.parquet"
    convert(jsonl, trace)
    tr = open_trace(trace)
    assert tr.meta["schema_version"] == 9 and tr.meta["vllm_recording"]["unmodelled"] == {}
    assert (tr.meta["config"]["sliding_window"], tr.meta["config"]["layer_types"]) == (
        8, ["sliding_attention", "full_attention"])
    rows = [r for _, rs in tr.iter_steps() for r in rs]
    # The golden's step-12 window free (tests/test_hybrid_trace.py), as vLLM recorded it.
    assert [(r["request_id"], r["block_ids"], r["group_block_ids"]) for r in rows
            if r["kind"] == "skipped_free" and r["step"] == 12] == [("r000001", [43], [[43], []])]
    assert sum(r["kind"] == "skipped_free" for r in rows) == 108  # as many as the golden holds
    first = next(r for r in rows if r["kind"] == "schedule")
    assert first["group_block_ids"] == [list(range(1, 17)), list(range(17, 33))]
    from harness.check.checker import unjudged_rules

    assert unjudged_rules(tr.meta) == {}  # every block rule judged
    result = check_steps(tr.meta["config"], tr.iter_steps())
    assert result.ok and result.by_invariant == {}, result.by_invariant


@pytest.mark.vllm
def test_a_mamba_recording_names_its_groups_as_linear_attention_layers(recorded, tmp_path):
    """Issue 28: vLLM's MambaSpec groups (mamba_cache_mode "none", one state block of
    max_model_len tokens) are recorded with their mode and converted to the config's
    ``linear_attention`` layers, on the attention groups' block size (vLLM scheduled on
    lcm(96, 4) = 96); no rule is skipped (regression: "unmodelled-kv_cache_spec")."""
    from harness.candidates.vllm.recording_convert import convert
    from harness.check.checker import check_trace, unjudged_rules
    from harness.trace import open_trace

    jsonl, _, _, _ = recorded["runs"][HYBRID_MAMBA]
    meta_rec = json.loads(jsonl.read_text().splitlines()[0])
    mamba = ["MambaSpec", None, 96, 1, {"mamba_cache_mode": "none", "num_speculative_blocks": 0,
                                        "num_prefill_checkpoint_blocks": 0}]
    assert meta_rec["kv_cache_groups"] == [mamba] * 3 + [["FullAttentionSpec", None, 4, 1]]
    assert meta_rec["config"]["block_size"] == 96
    assert meta_rec["unmodelled"] == {} and meta_rec["warnings"] == []
    trace = tmp_path / "mamba.parquet"
    convert(jsonl, trace)
    tr = open_trace(trace)
    assert tr.meta["schema_version"] == 9 and tr.meta["vllm_recording"]["unmodelled"] == {}
    assert (tr.meta["config"]["block_size"], tr.meta["config"]["layer_types"]) == (
        4, ["linear_attention"] * 3 + ["full_attention"])
    assert unjudged_rules(tr.meta) == {}
    first = next(r for _, rs in tr.iter_steps() for r in rs if r["kind"] == "schedule")
    # A state block in each Mamba group, then the full-attention blocks (the golden's first row).
    assert first["group_block_ids"] == [[1], [2], [3], list(range(4, 20))]
    for semantics in ("auto", "safety"):
        result = check_trace(tr, semantics)
        assert result.ok and result.by_invariant == {}, (semantics, result.by_invariant)
