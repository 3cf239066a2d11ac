"""Regression (issue 22, vLLM 0.33.0's whole tests/v1/core): two false alarms on
``tests/v1/core/test_async_scheduler.py::test_no_spec_decode_padding_up_to_max_model_len``.

The test builds ``create_scheduler(async_scheduling=True, num_speculative_tokens=1,
speculative_method="ngram_gpu", max_model_len=32)``, runs a request ``filler`` for a
step, then adds ``boundary`` (31 prompt tokens) after setting its
``num_computed_tokens = 30`` by hand (a disaggregated decode worker). Its recording
(below: the real one, its ``vllm_config`` cut to the keys the converter reads)
checked with two violations at step 1:

* COMPUTED-CONTINUITY "admitted with num_computed_tokens 30 != prefix hit 0": the
  recording did not say the test set 30 by hand (EngineCore adds every request with
  none computed);
* SPEC-TOKENS "scheduled drafts [-1] but its pending drafts were []": vLLM's CPU
  platform turns ``scheduler_config.async_scheduling`` off
  (``vllm/platforms/cpu.py``), so the trace said synchronous while the scheduler was
  an ``AsyncScheduler``, whose ``_update_after_schedule`` gave ``filler`` a -1
  placeholder draft.

Now the recorder writes both facts (the arrival's ``num_computed_tokens``, the
meta's ``async_scheduler_sync_config``) and the converter ends the trace on the
first of them as a protocol break (kinds ``computed-set-by-hand``,
``async-scheduler-sync-config``), keeping the complete steps before it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from harness.candidates.vllm import recording_convert as rc
from harness.candidates.vllm.recording_scheduler import _Recorder
from harness.check.checker import check_trace
from harness.trace.reader import open_trace
from harness.vllm_tests_report import protocol_kind

CONFIG = {"num_gpu_blocks": 10000, "block_size": 16, "max_model_len": 32, "max_num_seqs": 16,
          "max_num_batched_tokens": 8192, "max_num_scheduled_tokens": None, "policy": "fcfs",
          "enable_prefix_caching": False, "enable_chunked_prefill": True, "long_prefill_token_threshold": 0,
          "num_speculative_tokens": 1, "pipeline_parallel_size": 1, "async_scheduling": False,
          "defer_block_free": False, "watermark": 0.0, "scheduler_reserve_full_isl": True,
          "prefill_schedule_interval": 1}
VLLM_CONFIG = {"scheduler_config.async_scheduling": False, "cache_config.mamba_cache_mode": "none",
               "speculative_config.method": "ngram_gpu", "speculative_config.num_speculative_tokens": 1,
               "vllm_config.max_concurrent_batches": 1}


def _arrival(request_id: str, n: int, t: float) -> dict:
    return {"t": "arrival", "request_id": request_id, "prompt_token_ids": [0] * n, "max_tokens": 16,
            "min_tokens": 0, "ignore_eos": False, "eos_token_id": 50256, "stop_token_ids": [], "priority": 0,
            "arrival_time": t}


def _event(request_id: str, kind: str, computed: int, scheduled: int, blocks: list[int],
           drafts: list[int]) -> dict:
    return {"type": "schedule", "request_id": request_id, "kind": kind, "num_computed_tokens": computed,
            "num_scheduled_tokens": scheduled, "num_prefix_hit_tokens": 0, "new_block_ids": blocks,
            "spec_token_ids": drafts}


def _records(*, computed_recorded: bool, async_fact: bool) -> list[dict]:
    """The recording of vLLM 0.33.0's test_no_spec_decode_padding_up_to_max_model_len."""
    meta = {"t": "meta", "format": 3, "vllm_version": "0.33.0", "pid": 8317, "started_unix": 1796396065.4451077,
            "path": "rec.jsonl", "config": CONFIG, "vllm_config": VLLM_CONFIG,
            "warnings": ["speculative method 'ngram_gpu' (the reference models n-gram drafts)"],
            "unmodelled": {}}
    if async_fact:
        meta["async_scheduler_sync_config"] = True
    boundary = _arrival("boundary", 31, 1796396065.4527855)
    if computed_recorded:
        boundary["num_computed_tokens"] = 30
    flags = {"throttle_prefills": False, "defer_prefills": False, "prefill_capacity_bound": False}
    return [
        meta,
        _arrival("filler", 4, 1796396065.4522965),
        {"t": "schedule", "step": 0, "batch": 0,
         "before": {"num_free_blocks": 9999, "waiting": ["filler"], "running": []},
         "output": {"events": [_event("filler", "new", 0, 4, [1], [])], "num_scheduled_tokens": [["filler", 4]],
                    "total_num_scheduled_tokens": 4, "preempted_req_ids": [], "finished_req_ids": [],
                    "token_budget": 8188, "request_data_ids": ["filler"], **flags},
         "after": {"num_free_blocks": 9998, "waiting": [], "running": ["filler"]}},
        {"t": "update", "step": 0, "batch": 0, "sampled": [["filler", [0]]], "finished": [],
         "num_free_blocks": 9998},
        boundary,
        {"t": "schedule", "step": 1, "batch": 1, "before": {"num_free_blocks": 9998, "waiting": ["boundary"]},
         "output": {"events": [_event("filler", "running", 4, 2, [], [-1]),
                               _event("boundary", "new", 30, 1, [2, 3], [])],
                    "num_scheduled_tokens": [["filler", 2], ["boundary", 1]], "total_num_scheduled_tokens": 3,
                    "preempted_req_ids": [], "finished_req_ids": [], "token_budget": 8189,
                    "request_data_ids": ["boundary", "filler"], **flags},
         "after": {"num_free_blocks": 9996, "waiting": [], "running": ["filler", "boundary"]}},
        {"t": "update", "step": 1, "batch": 1, "sampled": [["filler", [0]], ["boundary", [1]]],
         "finished": [{"request_id": "boundary", "status": "FINISHED_LENGTH_CAPPED", "finish_reason": "length",
                       "stop_reason": None, "num_output_tokens": 1, "freed_block_ids": [3, 2], "fence": None}],
         "num_free_blocks": 9998},
        {"t": "end", "steps": 2, "ended_unix": 1796396065.4580255, "by": "driver"},
    ]


def _convert(tmp_path: Path, records: list[dict]):
    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = rc.convert(src, tmp_path / "rec.parquet")
    return summary, open_trace(tmp_path / "rec.parquet")


def test_the_old_recording_still_shows_both_alarms(tmp_path: Path) -> None:
    """Without the two facts the trace is what it was: 2 steps, both violations at step 1."""
    summary, trace = _convert(tmp_path, _records(computed_recorded=False, async_fact=False))
    assert summary["steps"] == 2
    assert summary["protocol"] == ("stopped by the driver after step 1 with 1 request(s) live (the recording "
                                   "was closed by driver, not by shutdown())")
    found = sorted((v.invariant, v.step, v.request) for v in check_trace(trace, "auto").violations)
    assert found == [("COMPUTED-CONTINUITY", 1, "r000001"), ("SPEC-TOKENS", 1, "r000000")]


def test_a_request_added_with_computed_tokens_set_by_hand_is_a_protocol_break(tmp_path: Path) -> None:
    summary, trace = _convert(tmp_path, _records(computed_recorded=True, async_fact=False))
    assert summary["steps"] == 1
    assert summary["protocol"] == (
        "the recorded run left the trace's step protocol at rec.jsonl:line 5: request 'boundary' added with "
        "num_computed_tokens 30 set by hand (EngineCore adds a request with none computed): the driver "
        "left EngineCore's protocol")
    assert protocol_kind(summary["protocol"]) == "computed-set-by-hand"
    result = check_trace(trace, "auto")
    assert result.ok and result.steps == 1


def test_an_async_scheduler_under_a_sync_config_ends_on_its_placeholder_drafts(tmp_path: Path) -> None:
    summary, trace = _convert(tmp_path, _records(computed_recorded=False, async_fact=True))
    assert summary["steps"] == 1
    assert summary["protocol"] == (
        "the recorded run left the trace's step protocol at rec.jsonl:line 6: an AsyncScheduler under a synchronous "
        "config scheduled placeholder drafts -1 for 'filler' (EngineCore builds an AsyncScheduler only with "
        "async scheduling; here scheduler_config.async_scheduling was off, as vLLM's CPU platform sets it): "
        "the driver left EngineCore's protocol")
    assert protocol_kind(summary["protocol"]) == "async-scheduler-sync-config"
    assert check_trace(trace, "auto").ok


def test_the_recorder_writes_a_hand_set_num_computed_tokens_in_the_arrival() -> None:
    written: list[dict] = []
    rec = SimpleNamespace(_write=written.append)
    params = SimpleNamespace(stop_token_ids=[], eos_token_id=50256, min_tokens=0, ignore_eos=False)
    request = SimpleNamespace(request_id="boundary", sampling_params=params, prompt_token_ids=[0] * 31,
                              max_tokens=16, priority=0, arrival_time=5.0, num_computed_tokens=30)
    _Recorder.on_add(rec, request, existing=False)
    request.request_id, request.num_computed_tokens = "fresh", 0
    _Recorder.on_add(rec, request, existing=False)
    assert [(w["request_id"], w.get("num_computed_tokens")) for w in written] == [("boundary", 30), ("fresh", None)]
