"""Operation lists for ``tests/hybrid_kv/hybrid_ops.py`` (see there): hybrid shapes
driven through vLLM 0.33.0's KV-cache manager and the reference's.
``tests/hybrid_kv/vllm_0_33_0_states.json`` holds vLLM's answers, recorded by
``python tests/hybrid_kv/cases.py | VLLM_PYTHON tests/hybrid_kv/hybrid_ops.py --all``."""

from __future__ import annotations

import json

A = list(range(1, 23))              # 22 tokens: 5 full blocks of 4
B = A[:20] + list(range(200, 210))  # shares A's first 5 blocks

# group windows: None is full attention, "mamba" a Mamba group (mamba_cache_mode
# "none": blocks of max_model_len tokens, prefix caching off); block size 4 throughout.
_SHARING = [
    {"op": "admit", "req": "a", "prompt": A, "num_new_tokens": 16},
    {"op": "step", "req": "a", "num_new_tokens": 6, "append": [100]},
    {"op": "step", "req": "a", "num_new_tokens": 1, "append": [101]},
    {"op": "step", "req": "a", "num_new_tokens": 1, "append": [102]},
    {"op": "admit", "req": "b", "prompt": B, "num_new_tokens": 10},
    {"op": "free", "req": "a"},
    {"op": "admit", "req": "c", "prompt": A, "num_new_tokens": 2},
    {"op": "preempt", "req": "b"},
    {"op": "admit", "req": "b", "prompt": B, "num_new_tokens": 10},
    {"op": "step", "req": "b", "num_new_tokens": 1, "append": [300]},
    {"op": "admit", "req": "d", "prompt": list(range(500, 560)), "num_new_tokens": 16},
    {"op": "free", "req": "c"},
    {"op": "admit", "req": "d", "prompt": list(range(500, 560)), "num_new_tokens": 16},
]

# Async scheduling: a step in flight while the next is scheduled; blocks
# leave the window only once the tokens that read them are processed.
_IN_FLIGHT = [
    {"op": "admit", "req": "a", "prompt": A, "num_new_tokens": 16},
    {"op": "step", "req": "a", "num_new_tokens": 6, "in_flight": True},
    {"op": "step", "req": "a", "num_new_tokens": 1, "in_flight": True},
    {"op": "settle", "req": "a", "num_tokens": 6, "append": [100]},
    {"op": "step", "req": "a", "num_new_tokens": 1, "in_flight": True},
    {"op": "settle", "req": "a", "num_tokens": 1, "append": [101]},
    {"op": "admit", "req": "b", "prompt": B, "num_new_tokens": 10},
    {"op": "step", "req": "a", "num_new_tokens": 1, "in_flight": True},
    {"op": "settle", "req": "a", "num_tokens": 1, "append": [102]},
    {"op": "step", "req": "a", "num_new_tokens": 1},
    {"op": "preempt", "req": "a"},
    {"op": "admit", "req": "a", "prompt": A, "num_new_tokens": 8},
]

CASES = {
    # alternating sliding-window / full layers: [SWA, full]
    "swa-full": {"block_size": 4, "num_gpu_blocks": 30, "max_model_len": 64, "max_in_flight_tokens": 64,
                 "groups": [8, None], "ops": _SHARING},
    # five local to one global, grouped as vLLM does: several SWA groups, one full
    "swa5-full": {"block_size": 4, "num_gpu_blocks": 60, "max_model_len": 64, "max_in_flight_tokens": 64,
                  "groups": [6, 6, 6, 6, 6, None], "ops": _SHARING},
    # frees behind the window wait for the tokens in flight
    "swa-full-in-flight": {"block_size": 4, "num_gpu_blocks": 30, "max_model_len": 64,
                           "max_in_flight_tokens": 128, "groups": [8, None], "ops": _IN_FLIGHT},
    # prefix caching off: no hits, every free to the queue's head
    "swa-full-no-caching": {"block_size": 4, "num_gpu_blocks": 30, "max_model_len": 64,
                            "max_in_flight_tokens": 64, "groups": [8, None], "ops": _SHARING,
                            "enable_caching": False},
    # Mamba beside full attention (mode "none": caching off, one state block each)
    "mamba-full": {"block_size": 4, "num_gpu_blocks": 30, "max_model_len": 64, "max_in_flight_tokens": 64,
                   "groups": ["mamba", None], "ops": _SHARING, "enable_caching": False},
    # three Mamba groups to one full (Qwen3-Next's 3:1), two speculative state blocks each
    "mamba3-full-spec": {"block_size": 4, "num_gpu_blocks": 40, "max_model_len": 64, "max_in_flight_tokens": 64,
                         "groups": ["mamba", "mamba", "mamba", None], "ops": _SHARING, "enable_caching": False,
                         "num_speculative_blocks": 2},
    # every layer sliding-window: the unitary coordinator
    "swa-only": {"block_size": 4, "num_gpu_blocks": 20, "max_model_len": 64, "max_in_flight_tokens": 16,
                 "groups": [8], "ops": _SHARING},
}

if __name__ == "__main__":
    print(json.dumps(CASES))
