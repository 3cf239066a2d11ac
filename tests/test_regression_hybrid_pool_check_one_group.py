"""Regression (issue 28, left-over defect): the start-up pool check counted one
KV-cache group's blocks for a max_model_len request, cdiv(max_model_len,
block_size), while a hybrid model's groups all take their blocks from the one
pool. An undersized hybrid pool was accepted, and the reference then stalled
on a request of max_model_len tokens: IDLE-ADMISSION and LIVENESS fired on a
correct engine. vLLM 0.33.0 refuses such a pool at start-up
(kv_cache_planning.py::get_kv_cache_configs, _check_enough_kv_cache_memory
over _max_memory_usage_bytes_from_groups): the check now sums every group's
need (EngineConfig._check_enough_kv_cache_blocks), and these tests pin its
boundary, which is exactly where the reference stops stalling."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from harness.check import check_steps
from harness.trace.recorder import run_to_rows
from reference.config import ConfigError, EngineConfig
from reference.engine import EngineStalled
from reference.kv.kv_cache_spec import FullAttentionSpec, MambaSpec, max_memory_usage_blocks_from_groups
from reference.workload import RequestSpec, Workload

BASE = dict(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64)
# Window 8, 64 tokens in flight: cdiv(min(8 - 1 + 64, 96), 4) + 1 = 19; full: cdiv(96, 4) = 24.
ALTERNATING = dict(BASE, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
# Window 12, 32 tokens in flight: cdiv(11 + 32, 4) + 1 = 12 per sliding group, five of them.
FIVE_TO_ONE = dict(BASE, max_num_batched_tokens=32, sliding_window=12,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"])
# Mamba (mode "none"): 1 + num_speculative_tokens blocks per group.
MAMBA = dict(BASE, enable_prefix_caching=False, layer_types=["linear_attention"] * 3 + ["full_attention"])
SLIDING_ONLY = dict(BASE, sliding_window=8)

# (config, per-group blocks, smallest num_gpu_blocks accepted)
CASES = {
    "alternating": (ALTERNATING, (19, 24), 44),
    "five-to-one": (FIVE_TO_ONE, (12, 12, 12, 12, 12, 24), 85),
    "mamba": (MAMBA, (1, 1, 1, 24), 28),
    "mamba-spec-2": (dict(MAMBA, num_speculative_tokens=2), (3, 3, 3, 24), 34),
    # One sliding-window group needs less than a full one (the old check asked 25 blocks).
    "sliding-only": (SLIDING_ONLY, (19,), 20),
}


def _run_one_max_len_request(config: EngineConfig) -> tuple[str, dict[str, int]]:
    """A 95-token prompt and 1 output token (max_model_len 96) alone: how the
    run ended and the invariants that fired."""
    spec = RequestSpec(request_id="a", arrival_time=0.0, prompt_token_ids=tuple(range(100, 195)),
                       max_tokens=1, ignore_eos=True)
    steps: list = []
    try:
        run_to_rows(Workload(source="t", sha256="0" * 64, params={}, requests=(spec,)), config,
                    on_step_rows=lambda s, rows: steps.append((s, rows)))
        ended = f"{len(steps)} steps"
    except EngineStalled:
        ended = "stalled"
    return ended, dict(check_steps(config.to_dict(), steps).by_invariant)


@pytest.mark.parametrize("name", sorted(CASES))
def test_pool_check_sums_every_group(name):
    data, per_group, smallest = CASES[name]
    config = EngineConfig.from_dict({**data, "num_gpu_blocks": smallest})
    assert max_memory_usage_blocks_from_groups(config.kv_cache_groups, max_model_len=96,
                                               max_in_flight_tokens=config.max_num_batched_tokens) == per_group
    assert smallest == sum(per_group) + 1  # the null block
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict({**data, "num_gpu_blocks": smallest - 1})
    assert f"needs {sum(per_group)} KV blocks across its {len(per_group)} KV-cache groups" in str(err.value)
    assert f"raise num_gpu_blocks to {smallest} or lower max_model_len" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_boundary_is_where_the_reference_stops_stalling(name):
    """One block fewer (accepted only as a trace's config, what vLLM's
    Scheduler ran): a max_model_len request never runs, and the progress rules
    fire; at the check's smallest pool it runs clean."""
    data, _per_group, smallest = CASES[name]
    data = {**data, "scheduler_reserve_full_isl": True}
    small = EngineConfig.from_dict({**data, "num_gpu_blocks": smallest - 1}, accept_vllm_crash=True)
    assert _run_one_max_len_request(small) == ("stalled", {"IDLE-ADMISSION": 1, "LIVENESS": 1})
    ended, fired = _run_one_max_len_request(EngineConfig.from_dict({**data, "num_gpu_blocks": smallest}))
    assert ended != "stalled" and fired == {}


def test_old_hybrid_scenario_pool_refused_in_one_line():
    """hybrid-alternating's former pool of 40 blocks (39 usable for 43)."""
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_dict({**ALTERNATING, "num_gpu_blocks": 40, "max_num_seqs": 4})
    assert str(err.value) == (
        "max_model_len 96 needs 43 KV blocks across its 2 KV-cache groups sharing the pool "
        "(sliding-window 19, full 24) but the pool has only 39 usable blocks (vLLM 0.33.0 refuses "
        "this at start-up): raise num_gpu_blocks to 44 or lower max_model_len")


def test_batches_in_flight_widen_the_window_need():
    """Two batches in flight (async scheduling): 128 tokens in flight, the
    window's need is capped at max_model_len: cdiv(min(7 + 128, 96), 4) + 1 = 25."""
    config = EngineConfig.from_dict({**ALTERNATING, "async_scheduling": True, "num_gpu_blocks": 50})
    assert max_memory_usage_blocks_from_groups(config.kv_cache_groups, max_model_len=96,
                                               max_in_flight_tokens=128) == (25, 24)
    with pytest.raises(ConfigError, match="needs 49 KV blocks"):
        EngineConfig.from_dict({**ALTERNATING, "async_scheduling": True, "num_gpu_blocks": 49})


def test_one_full_attention_group_unchanged():
    """Not hybrid: the message and the boundary are the single group's, as before."""
    EngineConfig(block_size=16, max_model_len=160, num_gpu_blocks=11, max_num_batched_tokens=256)
    with pytest.raises(ConfigError) as err:
        EngineConfig(block_size=16, max_model_len=160, num_gpu_blocks=10, max_num_batched_tokens=256)
    assert str(err.value) == ("max_model_len 160 needs 10 KV blocks of 16 tokens but the pool has only "
                              "9 usable blocks: raise num_gpu_blocks or lower max_model_len")


@pytest.mark.vllm
def test_each_groups_need_is_vllm_0_33_0s_own():
    """vLLM 0.33.0's specs (tests/hybrid_kv/pool_need.py, run in its
    environment) count the same blocks per group as the reference, for every
    case above and with two batches in flight."""
    from harness.candidates.vllm.env import env_python

    configs = {name: EngineConfig.from_dict({**data, "num_gpu_blocks": smallest})
               for name, (data, _, smallest) in CASES.items()}
    configs["async"] = EngineConfig.from_dict({**ALTERNATING, "async_scheduling": True, "num_gpu_blocks": 50})
    kinds = {FullAttentionSpec: "full", MambaSpec: "mamba"}
    query = {name: {"block_size": c.block_size, "max_model_len": c.max_model_len,
                    "max_in_flight_tokens": c.max_concurrent_batches * c.max_num_batched_tokens,
                    "sliding_window": c.sliding_window, "num_speculative_tokens": c.num_speculative_tokens,
                    "groups": [kinds.get(type(g.kv_cache_spec), "sliding") for g in c.kv_cache_groups]}
             for name, c in configs.items()}
    out = subprocess.run([str(env_python("0.33.0")), str(Path(__file__).parent / "hybrid_kv" / "pool_need.py")],
                         input=json.dumps(query), capture_output=True, text=True, check=True, timeout=600)
    assert json.loads(out.stdout) == {
        name: list(max_memory_usage_blocks_from_groups(
            c.kv_cache_groups, max_model_len=c.max_model_len,
            max_in_flight_tokens=c.max_concurrent_batches * c.max_num_batched_tokens))
        for name, c in configs.items()} == {
        "alternating": [19, 24], "five-to-one": [12] * 5 + [24], "mamba": [1, 1, 1, 24],
        "mamba-spec-2": [3, 3, 3, 24], "sliding-only": [19], "async": [25, 24]}
