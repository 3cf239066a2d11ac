"""Regression (issue 22): a drafter's prefill look-ahead set by hand is recorded and replayed.

vLLM 0.33.0's ``test_drafter_lookahead_encoder_cache_cap_makes_progress[1]`` and ``[3]`` (and the
six ``..._respects_token_budget`` cases) set ``scheduler.num_prefill_lookahead`` after building the
scheduler. The recorder took it for a derived flag set by hand (a protocol break before the first
step: "no complete step (scheduler-flag-set-by-hand)"). Set before the first ``schedule()`` it is
now a ``config`` record, and the reference models what vLLM's ``Scheduler`` does with it
(config ``num_prefill_lookahead``): the encoder window reaches that far past a step's tokens
(``_try_schedule_encoder_inputs``' ``shift_computed_tokens``) and a prefill chunk never ends within
it of the prefill's end (``_reserve_prefill_lookahead``; a waiting request cut to 0 tokens is
skipped). The checker's encoder rules know the shift and the cut. Exact decisions throughout;
each has its mutant (look-ahead 0) deciding otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm.recording_convert import convert
from harness.check.checker import check_steps, check_trace
from harness.check.profiles import resolve as resolve_profile
from harness.replay import replay
from harness.trace.reader import open_trace
from harness.trace.recorder import record
from reference.config import ConfigError, EngineConfig
from reference.request import Request, SamplingParams
from reference.scheduler import PREFILL_LOOKAHEAD_RESERVED, Scheduler
from reference.workload import RequestSpec, Workload


def _config(lookahead: int, **overrides) -> EngineConfig:
    values = dict(num_gpu_blocks=300, block_size=16, max_model_len=2048, max_num_seqs=4,
                  num_prefill_lookahead=lookahead)
    values.update(overrides)
    return EngineConfig(**values)


def _steps(sched: Scheduler, requests: list[Request], n: int) -> list[list[tuple]]:
    for r in requests:
        sched.add_request(r)
    out = []
    for _ in range(n):
        o = sched.schedule()
        out.append([(type(e).__name__, e.request_id, getattr(e, "num_scheduled_tokens", None),
                     getattr(e, "encoder_input_ids", None) or getattr(e, "reason", None)) for e in o.events])
        sched.update_from_output(o, {})
    return out


def _prompt(request_id: str, n: int, **kwargs) -> Request:
    return Request(request_id, list(range(n)), SamplingParams(max_tokens=2, ignore_eos=True), block_size=16,
                   **kwargs)


def test_a_prefill_chunk_never_ends_within_the_lookahead() -> None:
    """100-token prompt, 98 tokens a step: 98 would leave 2 < 3, so the chunk stops at 97."""
    assert _steps(Scheduler(_config(3, max_num_batched_tokens=98)), [_prompt("a", 100)], 2) == [
        [("ScheduledRequest", "a", 97, None)], [("ScheduledRequest", "a", 3, None)]]
    assert _steps(Scheduler(_config(0, max_num_batched_tokens=98)), [_prompt("a", 100)], 2) == [
        [("ScheduledRequest", "a", 98, None)], [("ScheduledRequest", "a", 2, None)]]


def test_the_encoder_window_reaches_the_lookahead_further() -> None:
    """An item at [100, 150) just past a 100-token step is encoded in that step with a look-ahead
    of 3 (the drafter reads its embeddings), in the next one without."""
    def run(lookahead):
        sched = Scheduler(_config(lookahead, max_num_batched_tokens=100, max_num_encoder_input_tokens=200,
                                  encoder_cache_size=200))
        return _steps(sched, [_prompt("a", 200, mm_positions=((100, 50),))], 2)

    assert run(3) == [[("EncoderPlan", "a", 100, [0]), ("ScheduledRequest", "a", 100, [0])],
                      [("EncoderPlan", "a", 100, None), ("ScheduledRequest", "a", 100, None)]]
    assert run(0) == [[("ScheduledRequest", "a", 100, None)],
                      [("EncoderPlan", "a", 100, [0]), ("ScheduledRequest", "a", 100, [0])]]


def test_a_waiting_request_cut_to_zero_is_skipped() -> None:
    """9 of 10 tokens go to "a"; "b" (2 tokens) would get 1, leaving 1 < 3: skipped."""
    def run(lookahead):
        sched = Scheduler(_config(lookahead, max_num_batched_tokens=10, max_num_seqs=2))
        return _steps(sched, [_prompt("a", 9), _prompt("b", 2)], 1)

    assert run(3) == [[("ScheduledRequest", "a", 9, None), ("Skip", "b", None, PREFILL_LOOKAHEAD_RESERVED)]]
    assert run(0) == [[("ScheduledRequest", "a", 9, None), ("ScheduledRequest", "b", 1, None)]]


def test_num_prefill_lookahead_is_validated_and_left_out_at_its_default() -> None:
    assert "num_prefill_lookahead" not in _config(0).to_dict()
    assert EngineConfig.from_dict(json.loads(json.dumps(_config(3).to_dict()))) == _config(3)
    with pytest.raises(ConfigError, match=r"^num_prefill_lookahead must be an integer >= 0, got -1$"):
        _config(-1)


def _encoder_trace(tmp_path: Path, lookahead: int):
    spec = RequestSpec(request_id="a", arrival_time=0.0, prompt_token_ids=tuple(range(200)), max_tokens=2,
                       ignore_eos=True, mm_positions=((100, 50),))
    config = _config(lookahead, max_num_batched_tokens=100, max_num_encoder_input_tokens=200,
                     encoder_cache_size=200)
    out = tmp_path / f"la{lookahead}.parquet"
    record(Workload(source="t", sha256="0" * 64, params={}, requests=(spec,)), config, out)
    return open_trace(out)


def test_the_checker_judges_the_shift_and_fires_on_a_scheduler_without_it(tmp_path) -> None:
    assert check_trace(_encoder_trace(tmp_path, 3), "auto").ok
    # The mutant: a scheduler that ignores the look-ahead, held to a config that has one.
    trace = _encoder_trace(tmp_path, 0)
    config = {**trace.meta["config"], "num_prefill_lookahead": 3}
    result = check_steps(config, list(trace.iter_steps()), resolve_profile("auto", trace.meta)[0])
    assert [(v.invariant, v.step) for v in result.violations][:1] == [("ENCODER-INPUTS", 0)]
    assert result.violations[0].message == ("window [0, 100) overlaps encoder input(s) [0] without an encoder "
                                            "plan (its look-ahead of 3 tokens included)")


# -- a recording of vLLM 0.33.0 (the recorder's JSONL for test_drafter_lookahead_*[3], step 0) -----

def _recording(path: Path, config_record: bool) -> Path:
    config = {"num_gpu_blocks": 10000, "block_size": 16, "max_model_len": 2048, "max_num_seqs": 16,
              "max_num_batched_tokens": 900, "max_num_scheduled_tokens": None, "policy": "fcfs",
              "enable_prefix_caching": False, "enable_chunked_prefill": True,
              "long_prefill_token_threshold": 0, "num_speculative_tokens": 0, "pipeline_parallel_size": 1,
              "async_scheduling": False, "defer_block_free": False, "watermark": 0.0,
              "scheduler_reserve_full_isl": True, "prefill_schedule_interval": 1,
              "max_num_encoder_input_tokens": 900, "encoder_cache_size": 900, "disable_chunked_mm_input": False}
    records = [
        {"t": "meta", "format": 3, "vllm_version": "0.33.0", "pid": 1, "started_unix": 1000.0, "path": str(path),
         "config": config, "vllm_config": {}, "warnings": [], "unmodelled": {}},
        {"t": "arrival", "request_id": "req", "prompt_token_ids": [0] * 1220, "max_tokens": 1, "min_tokens": 0,
         "ignore_eos": False, "eos_token_id": 50256, "stop_token_ids": [], "priority": 0, "arrival_time": 1000.1,
         "mm_features": [[10, 600, "hash0_0", 600], [610, 600, "hash0_1", 600]]},
    ]
    if config_record:
        records.append({"t": "config", "config": {"num_prefill_lookahead": 3}})
    else:
        records.append({"t": "protocol", "step": 0, "what": "Scheduler.num_prefill_lookahead set to 3 by hand "
                                                           "(vLLM derived 0 from the config)"})
    records += [
        {"t": "schedule", "step": 0, "batch": 0, "before": {"num_free_blocks": 9999, "waiting": ["req"], "running": []},
         "output": {"events": [{"type": "encoder_plan", "request_id": "req", "num_computed_tokens": 0,
                                "num_scheduled_tokens": 610, "encoder_input_ids": [0]},
                               {"type": "schedule", "request_id": "req", "kind": "new", "num_computed_tokens": 0,
                                "num_scheduled_tokens": 610, "num_prefix_hit_tokens": 0,
                                "new_block_ids": list(range(1, 40)), "spec_token_ids": [], "encoder_input_ids": [0]}],
                    "num_scheduled_tokens": [["req", 610]], "total_num_scheduled_tokens": 610,
                    "preempted_req_ids": [], "finished_req_ids": [], "token_budget": 290,
                    "request_data_ids": ["req"], "throttle_prefills": False, "defer_prefills": False,
                    "prefill_capacity_bound": False},
         "after": {"num_free_blocks": 9960, "waiting": [], "running": ["req"]}},
        {"t": "update", "step": 0, "batch": 0, "sampled": [], "finished": [], "num_free_blocks": 9960},
        {"t": "end", "steps": 1, "ended_unix": 1000.3, "by": "driver"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_recorded_lookahead_is_the_config_and_the_step_replays(tmp_path) -> None:
    out = tmp_path / "t.parquet"
    convert(_recording(tmp_path / "rec.jsonl", config_record=True), out)
    trace = open_trace(out)
    assert trace.config.num_prefill_lookahead == 3
    assert all(check_trace(trace, s).ok for s in ("auto", "safety"))
    assert replay(trace, resolve_candidate("reference")) == (None, 1)


def test_a_recording_before_the_config_record_has_no_complete_step(tmp_path) -> None:
    out = tmp_path / "t.parquet"
    summary = convert(_recording(tmp_path / "rec.jsonl", config_record=False), out)
    assert summary["steps"] == 0
