"""Regression (found by `harness fuzz --hybrid --candidate vllm@0.33.0`, issue 28):
a sliding window of 1 token (``sliding_window = 1``). A prefix hit ends on the
window's last ``cdiv(sliding_window - 1, block_size)`` cached blocks, none for
a window of 1, so vLLM 0.33.0 caches none of that group's blocks
(``SlidingWindowManager.reachable_block_mask``, the coordinator's hit
alignment of one block): they stay unhashed, are freed to the free queue's
head, and the group never hits (nor, across groups, does the request). The
reference cached them and freed them to the tail; on vLLM's trace ALLOC-FROM-HEAD
fired ("allocated block 1 but the free queue starts [3, 4, 5, 1, 2]")."""

from __future__ import annotations

import os

import pytest

from harness.fuzz import FuzzCase, run_case
from reference.scheduler import Scheduler
from reference.workload import RequestSpec

# The fuzzer's shrunk witness: two 1-token prompts, one at a time.
WITNESS = {"num_gpu_blocks": 6, "block_size": 1, "max_model_len": 2, "max_num_seqs": 1,
           "max_num_batched_tokens": 2, "enable_chunked_prefill": False, "scheduler_reserve_full_isl": False,
           "draft_acceptance_rate": 0.0, "sliding_window": 1,
           "layer_types": ["sliding_attention", "full_attention"]}


def _one(rid: str, prompt: tuple[int, ...], at: float = 0.0) -> RequestSpec:
    return RequestSpec(request_id=rid, arrival_time=at, prompt_token_ids=prompt, max_tokens=1, ignore_eos=True)


def _rows(case: FuzzCase) -> list[tuple]:
    run = run_case(Scheduler, case)
    assert run.ended == "" and run.result.by_invariant == {}, run.result.by_invariant
    return [(s, r["kind"], r["request_id"], r.get("num_prefix_hit_tokens"), r["group_block_ids"])
            for s, rows in run.steps for r in rows if r["kind"] in ("schedule", "finish")]


def test_regression_window_of_one_token_cached_its_blocks() -> None:
    rows = _rows(FuzzCase(WITNESS, (_one("r000000", (1000,)), _one("r000001", (1100,)))))
    # Group 0's block 1 was freed unhashed, to the head: the next request takes it first
    # (full attention's block 2 was cached and went to the tail).
    assert rows == [(0, "schedule", "r000000", 0, [[1], [2]]), (0, "finish", "r000000", None, [[1], [2]]),
                    (1, "schedule", "r000001", 0, [[1], [3]]), (1, "finish", "r000001", None, [[1], [3]])]


def test_a_window_of_one_token_never_hits_a_window_of_two_does() -> None:
    """The same 8-token prompt twice, blocks of 4 tokens: with a window of 1 the
    second request hits nothing (the window group has no cached block), with
    a window of 2 it hits both blocks (its last cdiv(2 - 1, 4) = 1 block cached)."""
    prompt = tuple(range(100, 108))
    requests = (_one("a", prompt), _one("b", prompt + (7,), at=1.0))
    for window, hit in ((1, 0), (2, 8)):
        config = {"num_gpu_blocks": 12, "block_size": 4, "max_model_len": 16, "max_num_seqs": 1,
                  "max_num_batched_tokens": 16, "sliding_window": window,
                  "layer_types": ["sliding_attention", "full_attention"]}
        rows = _rows(FuzzCase(config, requests))
        assert [r[3] for r in rows if r[1] == "schedule" and r[2] == "b"] == [hit], window


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
@pytest.mark.parametrize("window", [1, 2])
def test_the_reference_replays_identically_on_vllm(tmp_path, window) -> None:
    import gc

    from harness.candidates.resolve import resolve_candidate
    from harness.replay import replay
    from harness.trace import open_trace
    from harness.trace.recorder import record

    prompt = tuple(range(100, 108))
    config = {"num_gpu_blocks": 12, "block_size": 4, "max_model_len": 16, "max_num_seqs": 1,
              "max_num_batched_tokens": 16, "sliding_window": window,
              "layer_types": ["sliding_attention", "full_attention"]}
    case = FuzzCase(config, (_one("a", prompt), _one("b", prompt + (7,), at=1.0), _one("c", (5,), at=2.0)))
    path = tmp_path / "t.parquet"
    record(case.workload(), case.engine_config(), path)
    divergence, replayed = replay(open_trace(path), resolve_candidate("vllm@0.33.0"))
    gc.collect()
    assert divergence is None, divergence
    assert replayed == 3
