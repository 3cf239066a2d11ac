"""Regression (issue 22, "Replay identical on every trace that checks clean"):
vLLM 0.33.0's own ``tests/v1/core/test_prefix_replay.py`` builds a hybrid KV
cache of a full-attention group and a ``SlidingWindowMLASpec`` group with
``bounded_replay`` (DeepSeek-V4.1's "SWA bounded replay"). Its 11 recordings
that check clean were "not replayed (11): unmodelled: kv_cache_spec: KV-cache
spec SlidingWindowMLASpec": the recorder marked the spec unmodelled and the
reference had no such group.

What vLLM 0.33.0 does (``kv_cache_interface.py::SlidingWindowMLASpec``,
``single_type_kv_cache_manager.py`` registering it to ``SlidingWindowManager``,
``kv_cache_coordinator.py::verify_and_split_kv_cache_groups``,
``sched/scheduler.py::_mark_prefix_replay``): without bounded replay the group
schedules as a plain sliding window. With it, the group is not
``prefix_cacheable`` (never cached, never looked up: its hit is empty, its
skipped slots null, the rest new blocks), and after a prefix hit of the other
groups the scheduler recomputes the hit's last ``sliding_window`` tokens
(``num_computed_tokens`` = hit - window, no new slots for the replayed part); a
hit no longer than the window is not taken. The recorder now describes the
spec's fields (``events.SWA_MLA_SPEC_FIELDS``) and each
``_load_restores_replay_window`` answer; the converter maps them onto
``swa_bounded_replay`` (and ``kv_connector_window_loads``); the reference and
the checker follow them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm import recording_convert as rc
from harness.candidates.vllm.recording_config import hybrid_config
from harness.check.checker import check_trace, unjudged_rules
from harness.replay import replay
from harness.trace.reader import open_trace
from harness.fuzz import FuzzCase, run_case
from reference.scheduler import Scheduler
from reference.workload import RequestSpec

WINDOW = 32
#: Recordings of vLLM 0.33.0's RecordingScheduler under its own
#: tests/v1/core/test_prefix_replay.py (``harness vllm-tests 0.33.0 --files ...``):
#: test_hit_replays_window_without_reallocating ("hit"),
#: test_replay_only_chunks_make_progress ("chunks") and
#: test_kv_load_zeroing_respects_loaded_groups[True-True] ("connector": a
#: MockKVConnector answering 0 in the one complete step).
DATA = Path(__file__).resolve().parent / "data"
PROMPT = (0,) * 100  # 6 full blocks of 16: a 96-token hit for the same prompt


def _config(threshold: int = 0) -> dict:
    return {"num_gpu_blocks": 40, "block_size": 16, "max_model_len": 256, "max_num_seqs": 4,
            "max_num_batched_tokens": 256, "sliding_window": WINDOW,
            "layer_types": ["full_attention", "sliding_attention"], "swa_bounded_replay": True,
            "enable_prefix_caching": True, "long_prefill_token_threshold": threshold}


def _case(threshold: int = 0) -> FuzzCase:
    def one(rid: str, prompt: tuple[int, ...], at: float, max_tokens: int) -> RequestSpec:
        return RequestSpec(request_id=rid, arrival_time=at, prompt_token_ids=prompt, max_tokens=max_tokens,
                           ignore_eos=True)

    # b: the same prompt while a decodes (a 96-token hit); c: 32 shared tokens,
    # a hit no longer than the window.
    return FuzzCase(_config(threshold), (one("a", PROMPT, 0.0, 3), one("b", PROMPT, 0.001, 2),
                                         one("c", PROMPT[:32] + (5,) * 68, 1.0, 1)))


def _rows(run) -> list[tuple]:
    return [(s, r["kind"], r["request_id"], r.get("num_computed_tokens"), r.get("num_scheduled_tokens"),
             r.get("num_prefix_hit_tokens"), r["group_block_ids"])
            for s, rows in run.steps for r in rows if r["kind"] in ("schedule", "skipped_free")]


def test_a_hit_replays_its_last_window_and_the_window_group_never_hits() -> None:
    run = run_case(Scheduler, _case())
    assert run.ended == "" and run.result.by_invariant == {}, run.result.violations[:3]
    assert _rows(run) == [
        (0, "schedule", "a", 0, 100, 0, [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]),
        (1, "skipped_free", "a", None, None, None, [[], [11, 10, 9, 8]]),
        (1, "schedule", "a", 100, 1, 0, [[], []]),
        # 96-token hit, replay from 64: the full-attention hit shared plus one new
        # block; the window group 4 null slots then new blocks (freed by a's window).
        (1, "schedule", "b", 64, 36, 96, [[1, 2, 3, 4, 5, 6, 11], [0, 0, 0, 0, 10, 9, 8]]),
        (2, "schedule", "a", 101, 1, 0, [[], []]),
        (2, "schedule", "b", 100, 1, 0, [[], []]),
        # A 32-token hit (the window) is not taken: c starts at 0.
        (3, "schedule", "c", 0, 100, 0, [[8, 9, 10, 11, 14, 13, 12], [7, 15, 16, 17, 18, 19, 20]]),
    ]


def test_replay_only_chunks_allocate_nothing_new() -> None:
    run = run_case(Scheduler, _case(threshold=16))
    assert run.ended == "" and run.result.by_invariant == {}, run.result.violations[:3]
    assert [r for r in _rows(run) if r[2] == "b"] == [
        (1, "schedule", "b", 64, 16, 96, [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 11, 10]]),
        (2, "schedule", "b", 80, 16, 0, [[], []]),
        (3, "schedule", "b", 96, 4, 0, [[14], [13]]),
        (4, "schedule", "b", 100, 1, 0, [[], []]),
    ]


class _NoReplay(Scheduler):
    """A mutant: the bounded-replay group is modelled, the replay is not."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.prefix_replay_tokens = 0


def test_the_checker_fires_on_an_engine_that_does_not_replay() -> None:
    run = run_case(_NoReplay, _case())
    # b admitted at its 96-token hit, c at a 32-token hit it should not take.
    assert run.result.by_invariant == {"COMPUTED-CONTINUITY": 2}, run.result.by_invariant
    assert [v.request for v in run.result.violations] == ["b", "c"]


FULL = ["FullAttentionSpec", None, 16, 1]


def _mla(**fields) -> list:
    return ["SlidingWindowMLASpec", WINDOW, 16, 1, {"bounded_replay": True, "prefix_cacheable": False,
                                                     "prefix_replay_tokens": WINDOW, "extra_retained_tokens": 0,
                                                     **fields}]


def test_the_recorded_spec_maps_onto_swa_bounded_replay() -> None:
    assert hybrid_config([FULL, _mla()], 16, max_model_len=256, enable_prefix_caching=True) == (
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW,
         "swa_bounded_replay": True}, {})
    # Without bounded replay it is a plain sliding window (vLLM's SlidingWindowManager).
    plain = _mla(bounded_replay=False, prefix_cacheable=True, prefix_replay_tokens=0)
    assert hybrid_config([FULL, plain], 16, max_model_len=256) == (
        {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": WINDOW}, {})
    assert hybrid_config([_mla()], 16) == ({"sliding_window": WINDOW, "swa_bounded_replay": True}, {})


def test_what_the_model_cannot_follow_stays_unmodelled() -> None:
    old = ["SlidingWindowMLASpec", WINDOW, 16, 1]  # a recorder before its fields were described
    assert hybrid_config([FULL, old], 16) == ({}, {"kv_cache_spec": "KV-cache spec SlidingWindowMLASpec "
                                                                      "recorded without its fields (a recorder "
                                                                      "before its bounded replay was described)"})
    assert hybrid_config([FULL, _mla(extra_retained_tokens=3)], 16) == (
        {}, {"kv_cache_spec": "SlidingWindowMLASpec extra_retained_tokens [3] (the model's window has none)"})
    assert hybrid_config([FULL, _mla(prefix_replay_tokens=16)], 16)[1] == {
        "kv_cache_spec": "SlidingWindowMLASpec bounded replay with prefix_cacheable False, prefix_replay_tokens "
                         "16 (the model has no prefix cache and a replay of the window, 32)"}
    assert hybrid_config([FULL, ["SlidingWindowSpec", WINDOW, 16, 1], _mla()], 16)[1] == {
        "kv_cache_groups": "SlidingWindowSpec and SlidingWindowMLASpec groups (the model has one "
                           "sliding-window spec)"}


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
@pytest.mark.parametrize("threshold", [0, 16])
def test_the_reference_replays_identically_on_vllm(tmp_path, threshold) -> None:
    import gc

    from harness.candidates.resolve import resolve_candidate
    from harness.replay import replay
    from harness.trace import open_trace
    from harness.trace.recorder import record

    case = _case(threshold)
    path = tmp_path / "t.parquet"
    record(case.workload(), case.engine_config(), path)
    divergence, replayed = replay(open_trace(path), resolve_candidate("vllm@0.33.0"))
    gc.collect()
    assert divergence is None, divergence
    assert replayed == (4 if threshold == 0 else 6)


def _convert(tmp_path: Path, name: str):
    summary = rc.convert(DATA / f"vllm-0.33.0-prefix-replay-{name}.jsonl", tmp_path / f"{name}.parquet")
    return summary, open_trace(tmp_path / f"{name}.parquet")


def test_the_recorder_describes_the_spec() -> None:
    meta = json.loads((DATA / "vllm-0.33.0-prefix-replay-hit.jsonl").read_text().splitlines()[0])
    assert meta["kv_cache_groups"] == [FULL, _mla()]
    assert meta["unmodelled"] == {} and meta["warnings"] == []


@pytest.mark.parametrize("name, steps", [("hit", 2), ("chunks", 4), ("connector", 1)])
def test_vllms_recordings_convert_check_clean_and_replay_identically(tmp_path: Path, name: str,
                                                                     steps: int) -> None:
    summary, trace = _convert(tmp_path, name)
    assert summary["steps"] == steps
    config = trace.meta["config"]
    assert (config["layer_types"], config["sliding_window"], config["swa_bounded_replay"]) == (
        ["full_attention", "sliding_attention"], WINDOW, True)
    assert "kv_cache_spec" not in trace.meta["vllm_recording"]["unmodelled"]
    assert unjudged_rules(trace.meta) == {}  # every rule judged
    for semantics in ("auto", "safety"):
        assert check_trace(trace, semantics).by_invariant == {}, semantics
    assert replay(trace, resolve_candidate("reference")) == (None, steps)


def test_vllms_replay_rows_are_the_references(tmp_path: Path) -> None:
    _, trace = _convert(tmp_path, "chunks")
    rows = [(r["step"], r["kind"], r["request_id"], r.get("num_computed_tokens"), r.get("num_scheduled_tokens"),
             r.get("num_prefix_hit_tokens"), r["group_block_ids"])
            for _, rs in trace.iter_steps() for r in rs if r["kind"] == "schedule" and r["request_id"] == "r000001"]
    # The hit's last 32 tokens in two replay-only chunks of 16 (the hit's 6 blocks
    # held, nothing new in the full-attention group), then the 4 new tokens.
    assert rows == [(1, "schedule", "r000001", 64, 16, 96, [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 11, 10]]),
                    (2, "schedule", "r000001", 80, 16, 0, [[], []]),
                    (3, "schedule", "r000001", 96, 4, 0, [[9], [8]])]
    _, trace = _convert(tmp_path, "connector")
    # A recorded connector that never offers external tokens replays on a hybrid KV cache.
    assert trace.meta["config"]["kv_connector_matches"] == [["r000000", [[0, False]]]]
