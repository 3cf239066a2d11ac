"""Hybrid models on real vLLM (issue 28 stage 4): the driver builds vLLM
0.33.0's scheduler over a hybrid ``KVCacheConfig`` (its own
``get_kv_cache_groups`` of the config's ``sliding_window``/``layer_types``),
and the hybrid goldens replay on it step for step, every group's block ids
and every window free included. The recording scheduler's side is in
``tests/test_vllm_recording.py`` (one shared vLLM process); the unmarked
tests need no vLLM.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm.events import flat_block_ids
from harness.candidates.vllm.recording_convert import hybrid_config
from harness.golden import CHECKOUT_DIR
from harness.replay import replay
from harness.trace import open_trace
from reference.config import EngineConfig

VERSION = "0.33.0"
SPEC = f"vllm@{VERSION}"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"


@pytest.fixture(scope="module")
def vllm_env():
    from harness.candidates.vllm.env import ensure_env

    return ensure_env(VERSION, log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))


@pytest.mark.vllm
@pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")
@pytest.mark.parametrize("name, steps", [("hybrid-alternating", 192), ("hybrid-five-to-one", 244), ("hybrid-mamba", 153)])
def test_the_hybrid_goldens_replay_identically_on_vllm(vllm_env, name, steps):
    trace = open_trace(CHECKOUT_DIR / "hybrid" / f"{name}.parquet")
    divergence, replayed = replay(trace, resolve_candidate(SPEC))
    gc.collect()  # the driver goes back to the pool for the next case
    assert divergence is None, divergence
    assert replayed == steps


@pytest.mark.vllm
@pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")
def test_the_driver_answers_vllms_own_grouping_of_the_layers(vllm_env):
    from harness.candidates.vllm.candidate import VLLMCandidate

    # 125 blocks: one max_model_len request's need over the six groups (5 x 20 + 24) plus the null block.
    config = EngineConfig(num_gpu_blocks=125, block_size=4, max_model_len=96, max_num_seqs=4,
                          max_num_batched_tokens=64, sliding_window=12,
                          layer_types=("sliding_attention",) * 5 + ("full_attention",))
    candidate = VLLMCandidate(config, VERSION)
    candidate.snapshot()
    # Five local layers to one global: five sliding-window groups of one layer, then full attention.
    assert candidate.info["kv_cache_groups"] == [["SlidingWindowSpec", 12, [i]] for i in range(5)] + [
        ["FullAttentionSpec", None, [5]]]
    candidate.close()
    plain = VLLMCandidate(EngineConfig(num_gpu_blocks=40, block_size=4, max_model_len=96,
                                       max_num_seqs=4, max_num_batched_tokens=64), VERSION)
    plain.snapshot()
    assert plain.info["kv_cache_groups"] is None  # the one full-attention group, as before
    plain.close()
    gc.collect()


def test_a_hybrid_admission_lists_every_groups_hit_first_then_the_new_blocks():
    # The reference's order (HybridKVCacheManager.admission_block_ids): the
    # hit blocks of every group leave the free queue first; null blocks (0) are not blocks.
    assert flat_block_ids([[0, 20, 21, 30], [23, 24, 25, 31]], [3, 3]) == [20, 21, 23, 24, 25, 30, 31]
    assert flat_block_ids([[5], [6, 7]]) == [5, 6, 7]


def test_recorded_groups_map_onto_the_config_only_where_vllms_grouping_gives_them_back():
    sw, fa = ["SlidingWindowSpec", 8, 4, 1], ["FullAttentionSpec", None, 4, 1]
    assert hybrid_config([sw, fa], 4) == ({"sliding_window": 8,
                                           "layer_types": ["sliding_attention", "full_attention"]}, {})
    assert hybrid_config([["SlidingWindowSpec", 16, 16, 1]], 16) == ({"sliding_window": 16}, {})
    assert hybrid_config(None, 4) == ({}, {})
    # [SW, FA, SW]: vLLM puts the two sliding groups first; not a config's shape.
    assert hybrid_config([sw, fa, sw], 4)[1] == {"kv_cache_groups": (
        "groups ['SlidingWindowSpec', 'FullAttentionSpec', 'SlidingWindowSpec'] in an order vLLM's "
        "grouping does not give")}
    assert hybrid_config([["ChunkedLocalAttentionSpec", None, 4, 1], fa], 4) == (
        {}, {"kv_cache_spec": "KV-cache spec ChunkedLocalAttentionSpec is not modelled"})
    assert hybrid_config([sw, ["SlidingWindowSpec", 4, 4, 1]], 4) == (
        {}, {"kv_cache_groups": "sliding windows [4, 8] (the model has one)"})
    assert hybrid_config([["FullAttentionSpec", None, 8, 1], sw], 4) == (
        {}, {"kv_cache_groups": "block sizes [8, 4] per group (the model has one, 4)"})
