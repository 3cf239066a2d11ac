"""A recorded KV connector: the connector's answers are inputs, replayed as recorded.

A recording of vLLM running its own connector (vLLM's ``MockKVConnector`` in
its scheduler tests) stores what ``get_num_new_matched_tokens`` answered for
each request, call by call, and the ``KVConnectorOutput`` each batch's model
output carried (config ``kv_connector_matches`` / ``kv_connector_outputs``;
``reference.kv_connector.RecordedKVConnector`` / ``RecordedKVWorker``). The
reference answers as recorded, so the run replays identical; a mutated answer
diverges at the step where it was given. Exact values throughout.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.replay import replay
from harness.trace import open_trace
from harness.trace.recorder import record
from reference.config import ConfigError, EngineConfig
from reference.kv_connector import KV_MATCH_PENDING, RecordedKVConnector, RecordedKVWorker
from reference.output import RemoteLoad, ScheduledRequest, Skip
from reference.request import Request, SamplingParams
from reference.scheduler import Scheduler
from reference.workload import RequestSpec, Workload

BS = 4
#: r0: the connector cannot tell at first (None), then 8 tokens, async.
#: r1: 4 tokens, synchronous (computed at once, no WAITING_FOR_REMOTE_KVS).
MATCHES = (("r0", ((None, False), (8, True))), ("r1", ((4, False),)))
#: r0's load (started by the batch of step 1) reports done with that batch.
OUTPUTS = ((1, ("r0",), ()),)


def recorded_config(matches=MATCHES, outputs=OUTPUTS) -> EngineConfig:
    return EngineConfig(num_gpu_blocks=21, block_size=BS, max_model_len=64, max_num_seqs=4,
                        max_num_batched_tokens=64, kv_connector=True,
                        kv_connector_matches=matches, kv_connector_outputs=outputs)


def workload() -> Workload:
    return Workload(source="synthetic", sha256="0" * 64, params={}, requests=(
        RequestSpec("r0", 0.0, tuple(range(100, 108)), max_tokens=2, ignore_eos=True),
        RequestSpec("r1", 0.0, tuple(range(200, 212)), max_tokens=2, ignore_eos=True)))


def test_recorded_connector_answers_in_call_order_per_request() -> None:
    connector = RecordedKVConnector(recorded_config())
    r0 = Request("r0", list(range(8)), SamplingParams(max_tokens=1), block_size=BS)
    other = Request("x", list(range(8)), SamplingParams(max_tokens=1), block_size=BS)
    # k-th call, k-th answer; past the recorded ones the last repeats; none recorded: (0, False).
    assert [connector.get_num_new_matched_tokens(r0, 0) for _ in range(3)] == [(None, False), (8, True),
                                                                                (8, True)]
    assert connector.get_num_new_matched_tokens(other, 0) == (0, False)
    worker = RecordedKVWorker(recorded_config())
    assert worker.busy and not worker.poll(0) and worker.busy
    assert worker.poll(1).finished_recving == ("r0",) and not worker.busy


def test_none_answer_skips_then_async_and_sync_loads() -> None:
    """Exact decisions: step 0 skips r0 (None) and admits r1 with 4 external
    tokens computed at once; step 1 decodes r1 and starts r0's async load of
    8 tokens (the connector asked again: its second answer)."""
    sched = Scheduler(recorded_config())
    for spec in workload().requests:
        sched.add_request(Request(spec.request_id, list(spec.prompt_token_ids),
                                  SamplingParams(max_tokens=2, ignore_eos=True), block_size=BS))
    out = sched.schedule()
    assert out.events == [Skip("r0", KV_MATCH_PENDING), ScheduledRequest("r1", "new", 4, 8, 0, [1, 2, 3])]
    sched.update_from_output(out, {"r1": [7]})
    out = sched.schedule()
    assert out.events == [ScheduledRequest("r1", "running", 12, 1, 0, [4]), RemoteLoad("r0", 0, 8, [5, 6], 0)]


def test_recorded_connector_trace_replays_identical_and_config_round_trips(tmp_path) -> None:
    path = tmp_path / "kv-recorded.parquet"
    summary = record(workload(), recorded_config(), path)
    assert (summary.finished, summary.remote_kv_loads) == (2, 1)
    trace = open_trace(path)
    assert trace.config == recorded_config()
    assert trace.meta["config"]["kv_connector_matches"] == [["r0", [[None, False], [8, True]]],
                                                            ["r1", [[4, False]]]]
    rows = pq.read_table(path, columns=["step", "kind", "request_id", "num_computed_tokens", "message"]
                         ).to_pylist()
    kv = [(r["step"], r["kind"], r["request_id"]) for r in rows
          if r["kind"] in ("skip", "kv_load", "kv_finished", "kv_promote")]
    assert kv == [(0, "skip", "r0"), (1, "kv_load", "r0"), (1, "kv_finished", "r0"), (2, "kv_promote", "r0")]
    assert replay(trace, Scheduler) == (None, summary.steps)


@pytest.mark.parametrize("mutant, where", [
    # r1's sync answer 4 -> 8: its admission at step 0 computes 8 tokens.
    (dict(matches=(MATCHES[0], ("r1", ((8, False),)))), (0, "r1", "num_computed_tokens", 4, 8)),
    # r0 answered at once (no None first): it loads at step 0, not skips.
    (dict(matches=(("r0", ((8, True),)), MATCHES[1])), (0, "r0", "event", "skip r0", "kv_load r0")),
])
def test_mutated_answer_diverges_at_the_step_it_was_given(tmp_path, mutant, where) -> None:
    path = tmp_path / "kv-recorded.parquet"
    record(workload(), recorded_config(), path)
    trace = open_trace(path)

    def mutated(config: EngineConfig) -> Scheduler:
        return Scheduler(dataclasses.replace(config, kv_connector_matches=mutant["matches"]))

    divergence, _ = replay(trace, mutated)
    assert divergence is not None
    assert (divergence.step, divergence.request, divergence.field, divergence.expected,
            divergence.actual) == where


def test_worker_output_is_taken_as_recorded(tmp_path) -> None:
    """The load reported done with the batch of step 2 instead of step 1: the
    promotion moves from step 2 to step 3, and that run replays identical."""
    late = tmp_path / "late.parquet"
    record(workload(), recorded_config(outputs=((2, ("r0",), ()),)), late)
    rows = pq.read_table(late, columns=["step", "kind", "request_id"]).to_pylist()
    assert [(r["step"], r["kind"]) for r in rows if r["kind"] in ("kv_load", "kv_finished", "kv_promote")] == [
        (1, "kv_load"), (2, "kv_finished"), (3, "kv_promote")]
    trace = open_trace(late)
    assert replay(trace, Scheduler)[0] is None


def test_recorded_connector_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="go together"):
        EngineConfig(kv_connector=True, kv_connector_matches=MATCHES)
    with pytest.raises(ConfigError, match="go together"):
        EngineConfig(kv_connector_matches=MATCHES, kv_connector_outputs=OUTPUTS)
    with pytest.raises(ConfigError, match="kv_connector_matches: each item"):
        EngineConfig(kv_connector=True, kv_connector_matches=(("r0", ((-1, True),)),),
                     kv_connector_outputs=())
    with pytest.raises(ConfigError, match="kv_connector_outputs: each item"):
        EngineConfig(kv_connector=True, kv_connector_matches=(), kv_connector_outputs=((0, "r0", ()),))
    # Left out of the metadata at their default (old fingerprints hold); JSON round trip.
    assert "kv_connector_matches" not in EngineConfig().to_dict()
    data = json.loads(json.dumps(recorded_config().to_dict()))
    assert EngineConfig.from_dict(data) == recorded_config()


# -- a real recording: vLLM 0.33.0's test_kv_connector_basic[True] under the recorder ----------------
#
# ``tests/data/vllm-0.33.0-kv-connector-async.jsonl.gz`` was written by the recording scheduler
# (``harness vllm-tests 0.33.0 -k test_kv_connector_basic``): vLLM's MockKVConnector(matched_tokens=32,
# is_async=True) answers (32, async) for each of two 64-token requests; both loads report done with
# the model output of the second batch; the test then adds the same ids again (a protocol break:
# the trace keeps the 5 steps before it).

RECORDING = Path(__file__).with_name("data") / "vllm-0.33.0-kv-connector-async.jsonl.gz"


def _recording(tmp_path, edit=None) -> Path:
    records = [json.loads(line) for line in gzip.decompress(RECORDING.read_bytes()).decode().splitlines()]
    if edit is not None:
        edit(records)
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_recorded_answers_convert_into_the_config_and_rows(tmp_path) -> None:
    from harness.candidates.vllm.recording_convert import convert

    summary = convert(_recording(tmp_path), tmp_path / "rec.parquet")
    assert summary["steps"] == 5 and "request id '0' added again" in summary["protocol"]
    trace = open_trace(tmp_path / "rec.parquet")
    assert trace.config.kv_connector and trace.config.kv_connector_matches == (
        ("r000000", ((32, True),)), ("r000001", ((32, True),)))
    assert trace.config.kv_connector_outputs == ((1, ("r000000", "r000001"), ()),)
    rows = pq.read_table(tmp_path / "rec.parquet", columns=["step", "kind", "request_id"]).to_pylist()
    assert [(r["step"], r["kind"], r["request_id"]) for r in rows
            if r["kind"] in ("kv_load", "kv_finished", "kv_promote")] == [
        (0, "kv_load", "r000000"), (0, "kv_load", "r000001"), (1, "kv_finished", "r000000"),
        (1, "kv_finished", "r000001"), (2, "kv_promote", "r000000"), (2, "kv_promote", "r000001")]
    # The connector's rules stay unjudged (sync external tokens are not followed by the checker
    # yet), but the trace is replayed: identical on the reference.
    from harness.vllm_tests_report import replay_blocked_by
    assert replay_blocked_by(trace) == []
    assert replay(trace, Scheduler) == (None, 5)


def _answer(records, req_id: str, answer) -> None:
    for r in records:
        for m in r.get("kv_matches") or ():
            if m[0] == req_id:
                m[2:] = answer


def _no_worker_output(records) -> None:
    for r in records:
        r.pop("kv", None)


@pytest.mark.parametrize("edit, where", [
    # vLLM's connector said 32 tokens for request "1"; a recording that says 16 (vLLM's decisions
    # unchanged) is replayed with 16: r000001's load at step 0 takes one block, not two.
    (lambda rs: _answer(rs, "1", [16, True]), (0, "r000001", "block_ids", [3, 4], [3])),
    # Synchronous instead of async: r000001 is scheduled at once.
    (lambda rs: _answer(rs, "1", [32, False]), (0, "r000001", "event", "kv_load r000001", "schedule r000001")),
    # No worker output recorded (nor its kv_finished rows): the loads never report done, and where
    # vLLM promoted r000000 at step 2 the reference still skips it (a load in flight keeps it stepping).
    (_no_worker_output, (2, "r000000", "event", "kv_promote r000000", "skip r000000")),
])
def test_a_mutated_recorded_answer_diverges_at_its_step(tmp_path, edit, where) -> None:
    from harness.candidates.vllm.recording_convert import convert

    convert(_recording(tmp_path, edit), tmp_path / "rec.parquet")
    trace = open_trace(tmp_path / "rec.parquet")
    # The trace's rows are vLLM's decisions, its config the (edited) answers.
    divergence, _ = replay(trace, Scheduler)
    assert divergence is not None
    assert (divergence.step, divergence.request, divergence.field, divergence.expected,
            divergence.actual) == where


def test_a_recording_without_answers_is_not_replayed(tmp_path) -> None:
    """Recorded before the answers were (no meta ``kv_answers``): the connector stays unmodelled."""
    from harness.candidates.vllm.recording_convert import convert
    from harness.vllm_tests_report import replay_blocked_by

    def old(records) -> None:
        records[0].pop("kv_answers")
        for r in records:
            r.pop("kv_matches", None)
            r.pop("kv", None)

    convert(_recording(tmp_path, old), tmp_path / "rec.parquet")
    trace = open_trace(tmp_path / "rec.parquet")
    assert trace.config.kv_connector_matches is None and not trace.config.kv_connector
    assert replay_blocked_by(trace) == ["kv_connector"]


def test_a_load_never_reported_keeps_the_engine_stepping_then_stops() -> None:
    """Regression (vLLM's test_pause_new_drains_async_kv_loads[load-in-flight]): a recording that
    ends with a load in flight replayed as "engine stalled" at step 0; vLLM keeps stepping while a
    load is in flight. Outside a replay the unreported load stops counting after
    PENDING_LOAD_STEPS steps, so the run ends (stalled) instead of spinning."""
    from reference.engine import Engine
    from reference.kv_connector import PENDING_LOAD_STEPS

    from reference.engine import EngineStalled

    config = recorded_config(matches=(("r0", ((8, True),)),), outputs=())
    engine = Engine(config)
    with pytest.raises(EngineStalled, match=f"^step {PENDING_LOAD_STEPS}: 1 unfinished requests but "
                                            f"nothing scheduled"):
        engine.run(Workload(source="synthetic", sha256="0" * 64, params={},
                            requests=workload().requests[:1]))
    assert engine.summary.remote_kv_loads == 1 and engine.summary.finished == 0


def test_a_step_cut_off_by_the_break_is_matched_as_far_as_it_goes(tmp_path) -> None:
    """Regression (vLLM's test_delayed_kv_connector_free_keeps_scheduler_active, recorded): the test
    adds a request, then calls ``update_from_output()`` with a hand-built output (a protocol break).
    The trace's one step holds that arrival only; replay reported the reference's schedule() of the
    step as a divergence ("expected None, actual schedule_begin") instead of stopping where the
    recording does."""
    from harness.candidates.vllm.recording_convert import convert

    src = tmp_path / "rec.jsonl"
    src.write_bytes(gzip.decompress((Path(__file__).with_name("data")
                                     / "vllm-0.33.0-kv-delayed-free-cut-off.jsonl.gz").read_bytes()))
    summary = convert(src, tmp_path / "rec.parquet")
    assert summary["steps"] == 1 and "update_from_output() without a schedule()" in summary["protocol"]
    trace = open_trace(tmp_path / "rec.parquet")
    kinds = pq.read_table(tmp_path / "rec.parquet", columns=["kind"]).column("kind").to_pylist()
    assert kinds == ["arrival"]
    assert replay(trace, Scheduler) == (None, 1)
