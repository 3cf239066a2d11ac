"""Run in a vLLM 0.33.0 environment: each KV-cache group's blocks for one
request of max_model_len tokens, by vLLM's own specs, as its start-up check
counts them (``kv_cache_planning.py::_max_memory_usage_bytes_from_groups``:
``cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes)`` per
group, then times the pool's bytes per block, which the comparison with the
pool's memory cancels).

stdin: JSON ``{name: {block_size, max_model_len, max_in_flight_tokens,
sliding_window, num_speculative_tokens, groups: ["full" | "sliding" | "mamba", ...]}}``;
stdout: JSON ``{name: [blocks per group]}``. The specs are built as the vLLM
driver builds them (harness/candidates/vllm/driver.py); ``max_memory_usage_bytes``
reads only these fields of the config, given here as a namespace.
"""

import json
import sys
import types

import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec


def main() -> None:
    out = {}
    for name, c in json.load(sys.stdin).items():
        kwargs = dict(block_size=c["block_size"], num_kv_heads=1, head_size=8, dtype=torch.float16)
        full = FullAttentionSpec(**kwargs)
        vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(max_model_len=c["max_model_len"]),
            parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
            cache_config=types.SimpleNamespace(mamba_cache_mode="none"),
            max_in_flight_tokens=c["max_in_flight_tokens"])
        need = []
        for kind in c["groups"]:
            if kind == "full":
                spec = full
            elif kind == "sliding":
                spec = SlidingWindowSpec(**kwargs, sliding_window=c["sliding_window"])
            else:
                spec = MambaSpec(block_size=c["max_model_len"], shapes=((1,),), dtypes=(torch.float32,),
                                 page_size_padded=full.page_size_bytes, mamba_cache_mode="none",
                                 num_speculative_blocks=c["num_speculative_tokens"])
            need.append(cdiv(spec.max_memory_usage_bytes(vllm_config), spec.page_size_bytes))
        out[name] = need
    print(json.dumps(out))


if __name__ == "__main__":
    main()
