"""Regression (issue 22): a streaming-input session that stops is parked, not finished.

vLLM 0.33.0's ``test_streaming_pause_does_not_over_admit_worker_slot``
(``test_worker_slot_overflow.py``) and ``test_pause_new_ignores_streaming_session_waiting_for_input``
(``test_scheduler.py``) add a request with ``resumable = True`` that samples its stop token at
once. vLLM does not finish it (``Scheduler._handle_stopped_request``): it is parked in
``WAITING_FOR_STREAMING_REQ`` with its blocks, in ``kv_holding_waiting``, and keeps its worker
slot (``num_waiting_for_streaming_input`` counts toward ``max_num_seqs``). Both traces checked
clean but were not replayed ("unmodelled: streaming_input"); the worker-slot one also ended at a
false "preempted by hand" break (the session entered the waiting queue inside the update). Now
the recorder writes the arrival's ``resumable`` and the update's ``continued`` sessions, the
converter names them in the config (``resumable_request_ids``) and the reference parks them.
A streaming update (``add_request`` of a live session) stays a protocol break, named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm.recording_convert import convert
from harness.check.checker import check_trace
from harness.replay import replay
from harness.trace.reader import open_trace
from harness.vllm_tests_report import replay_blocked_by
from reference.config import ConfigError, EngineConfig
from reference.output import ScheduledRequest, Skip
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import STREAMING_INPUT_PENDING, Scheduler

STOP = 7


def _config(**overrides) -> EngineConfig:
    values = dict(num_gpu_blocks=200, block_size=16, max_model_len=2048, max_num_seqs=1,
                  max_num_batched_tokens=8192)
    values.update(overrides)
    return EngineConfig(**values)


def _request(request_id: str, resumable: bool = False) -> Request:
    return Request(request_id, [0, 0, 0, 0], SamplingParams(max_tokens=16, stop_token_ids=(STOP,)),
                   block_size=16, resumable=resumable)


def _stop_session(sched: Scheduler, session: Request):
    sched.add_request(session)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"session": 4}
    return sched.update_from_output(out, {"session": [STOP]})


def test_a_stopped_session_is_parked_with_its_blocks_and_slot() -> None:
    sched = Scheduler(_config())
    session = _request("session", resumable=True)
    free = sched.kv_cache_manager.num_free_blocks
    result = _stop_session(sched, session)
    assert result.new_token_ids == {"session": [STOP]}
    assert result.finished == []
    assert session.status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert session.num_computed_tokens == 4 and session.stop_reason == STOP
    assert sched.running == [] and list(sched.kv_holding_waiting) == [session] and not sched.waiting
    assert sched.num_waiting_for_streaming_input == 1
    assert sched.kv_cache_manager.num_free_blocks == free - 1 == 198  # its one block is kept
    # The parked session holds the one slot (max_num_seqs=1): the newcomer waits.
    sched.add_request(_request("other"))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {} and out.events == []
    assert [r.request_id for r in (*sched.kv_holding_waiting, *sched.waiting)] == ["session", "other"]
    assert out.prefill_capacity_bound is True  # 2 waiting, 1 deferred (the session), as vLLM


def test_with_a_free_slot_the_session_is_skipped_and_the_newcomer_admitted() -> None:
    sched = Scheduler(_config(max_num_seqs=2))
    _stop_session(sched, _request("session", resumable=True))
    sched.add_request(_request("other"))
    out = sched.schedule()
    assert [(type(e).__name__, e.request_id) for e in out.events] == [("Skip", "session"),
                                                                      ("ScheduledRequest", "other")]
    assert [e.reason for e in out.events if isinstance(e, Skip)] == [STREAMING_INPUT_PENDING]
    assert next(e for e in out.events if isinstance(e, ScheduledRequest)).new_block_ids == [2]
    assert out.num_scheduled_tokens == {"other": 4}
    assert list(sched.kv_holding_waiting)[0].request_id == "session"


def test_aborting_a_parked_session_frees_its_slot_and_blocks() -> None:
    sched = Scheduler(_config())
    free = sched.kv_cache_manager.num_free_blocks
    _stop_session(sched, _request("session", resumable=True))
    (fin,) = sched.finish_requests(["session"], RequestStatus.FINISHED_ABORTED)
    assert (fin.request_id, fin.status, fin.freed_block_ids) == ("session", RequestStatus.FINISHED_ABORTED, [1])
    assert sched.num_waiting_for_streaming_input == 0 and not sched.kv_holding_waiting
    assert sched.kv_cache_manager.num_free_blocks == free == 199


def test_a_request_that_is_not_resumable_finishes_as_before() -> None:
    """The mutant: the same run without ``resumable`` finishes the request and frees its block."""
    sched = Scheduler(_config())
    result = _stop_session(sched, _request("session"))
    assert [(f.request_id, f.status, f.freed_block_ids) for f in result.finished] == [
        ("session", RequestStatus.FINISHED_STOPPED, [1])]
    assert sched.num_waiting_for_streaming_input == 0 and not sched.kv_holding_waiting


def test_resumable_request_ids_are_validated_and_left_out_at_their_default() -> None:
    assert "resumable_request_ids" not in _config().to_dict()
    config = _config(resumable_request_ids=("r000000",))
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError, match=r"^resumable_request_ids: distinct request ids"):
        _config(resumable_request_ids=("a", "a"))


# -- a recording of vLLM 0.33.0 (the recorder's JSONL, as it writes it for the worker-slot test) ----

_CONFIG = {"num_gpu_blocks": 10000, "block_size": 16, "max_model_len": 2048, "max_num_seqs": 1,
           "max_num_batched_tokens": 8192, "max_num_scheduled_tokens": None, "policy": "fcfs",
           "enable_prefix_caching": False, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
           "num_speculative_tokens": 0, "pipeline_parallel_size": 1, "async_scheduling": False,
           "defer_block_free": False, "watermark": 0.0, "scheduler_reserve_full_isl": True,
           "prefill_schedule_interval": 1, "disable_chunked_mm_input": False}


def _arrival(rid: str, t: float, resumable: bool) -> dict:
    rec = {"t": "arrival", "request_id": rid, "prompt_token_ids": [0, 0, 0, 0], "max_tokens": 16,
           "min_tokens": 0, "ignore_eos": False, "eos_token_id": 50256,
           "stop_token_ids": [STOP] if resumable else [], "priority": 0, "arrival_time": t}
    if resumable:
        rec.update(unsupported=["streaming_input"], resumable=True)
    return rec


def _recording(path: Path, *, continued: bool = True, streaming_update: bool = False) -> Path:
    update = {"t": "update", "step": 0, "batch": 0, "sampled": [["session", [STOP]]], "finished": [],
              "num_free_blocks": 9998}
    if continued:
        update["continued"] = ["session"]
    records = [
        {"t": "meta", "format": 3, "vllm_version": "0.33.0", "pid": 1, "started_unix": 1000.0,
         "path": str(path), "config": _CONFIG, "vllm_config": {}, "warnings": [], "unmodelled": {}},
        _arrival("session", 1000.1, True),
        {"t": "schedule", "step": 0, "batch": 0,
         "before": {"num_free_blocks": 9999, "waiting": ["session"], "running": []},
         "output": {"events": [{"type": "schedule", "request_id": "session", "kind": "new",
                                "num_computed_tokens": 0, "num_scheduled_tokens": 4,
                                "num_prefix_hit_tokens": 0, "new_block_ids": [1], "spec_token_ids": []}],
                    "num_scheduled_tokens": [["session", 4]], "total_num_scheduled_tokens": 4,
                    "preempted_req_ids": [], "finished_req_ids": [], "token_budget": 8188,
                    "request_data_ids": ["session"], "throttle_prefills": False, "defer_prefills": False,
                    "prefill_capacity_bound": False},
         "after": {"num_free_blocks": 9998, "waiting": [], "running": ["session"]}},
        update,
        _arrival("other", 1000.2, False),
    ]
    if streaming_update:
        records.append({"t": "note", "what": "streaming_update", "request_id": "session"})
    records += [
        {"t": "schedule", "step": 1, "batch": 1,
         "before": {"num_free_blocks": 9998, "waiting": ["session", "other"], "running": []},
         "output": {"events": [], "num_scheduled_tokens": [], "total_num_scheduled_tokens": 0,
                    "preempted_req_ids": [], "finished_req_ids": [], "token_budget": 8192,
                    "request_data_ids": [], "throttle_prefills": False, "defer_prefills": False,
                    "prefill_capacity_bound": True},
         "after": {"num_free_blocks": 9998}},
        {"t": "end", "steps": 1, "ended_unix": 1000.3, "by": "driver"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _convert(tmp_path: Path, **kwargs):
    out = tmp_path / "t.parquet"
    convert(_recording(tmp_path / "rec.jsonl", **kwargs), out)
    return open_trace(out)


def test_the_recording_replays_identically_with_the_session_parked(tmp_path) -> None:
    trace = _convert(tmp_path)
    assert trace.config.resumable_request_ids == ("r000000",)
    assert trace.meta["vllm_recording"]["unmodelled"] == {
        "streaming_input": "1 request(s) with streaming input"}
    # The session entered the waiting queue inside the update: no protocol break there, the
    # run was stopped by the test (regression: "'session' entered the waiting queue outside
    # schedule() and add_request() (by hand: a preemption ...)").
    assert "entered the waiting queue" not in (trace.summary.get("protocol") or "")
    assert all(check_trace(trace, s).ok for s in ("auto", "safety"))
    assert replay_blocked_by(trace) == []
    divergence, compared = replay(trace, resolve_candidate("reference"))
    assert (divergence, compared) == (None, 1)


def test_without_resumable_ids_the_reference_finishes_the_session_and_diverges(tmp_path) -> None:
    """The mutant: the same trace with ``resumable_request_ids`` left out of its config."""
    import dataclasses

    trace = _convert(tmp_path)
    trace.config = dataclasses.replace(trace.config, resumable_request_ids=None)
    divergence, _ = replay(trace, resolve_candidate("reference"))
    assert divergence is not None
    assert (divergence.step, divergence.field, divergence.expected, divergence.actual) == (
        0, "event", "update_end", "finish r000000")


def test_a_recording_before_continued_was_written_ends_at_the_queue_break(tmp_path) -> None:
    trace = _convert(tmp_path, continued=False)
    assert "'session' entered the waiting queue outside schedule()" in trace.summary["protocol"]
    assert replay(trace, resolve_candidate("reference")) == (None, 1)


def test_a_streaming_update_is_a_named_protocol_break(tmp_path) -> None:
    trace = _convert(tmp_path, streaming_update=True)
    assert "a streaming-input update of request 'session' (add_request() of a live resumable request: " \
           "vLLM appends the chunk to its session, _update_request_as_session" in trace.summary["protocol"]
    assert replay(trace, resolve_candidate("reference")) == (None, 1)
