"""Drive a hybrid KV-cache manager through a list of operations and report
its state after each: the differential test of ``reference.kv`` against
vLLM 0.33.0's own ``KVCacheManager`` (``tests/test_kv_hybrid.py``).

Standalone: run as a script in a vLLM environment (``python hybrid_ops.py``,
operations as JSON on stdin, states as JSON on stdout) it drives vLLM's
``vllm.v1.core.kv_cache_manager.KVCacheManager``; imported, ``run_ops`` drives
any manager through the same steps. The operations are what the scheduler
does, synchronously (each step's tokens settle before the next operation):

* ``{"op": "admit", "req": id, "prompt": [...], "num_new_tokens": n}``:
  prefix lookup, ``allocate_slots`` with the hit and the full-sequence gate;
  on success the request runs with ``hit + n`` computed tokens (a running
  request's admission does nothing: ``"new": "running"``);
* ``{"op": "step", "req": id, "num_new_tokens": n, "append": [tokens]}``:
  ``allocate_slots`` for a running request, then ``n`` more computed tokens
  and the sampled ``append`` tokens;
* ``"in_flight": true`` on a step: its tokens stay in flight (computed,
  not processed: ``num_in_flight_tokens``) until ``{"op": "settle", "req":
  id, "num_tokens": n, "append": [tokens]}`` returns them (async scheduling);
* ``{"op": "free", "req": id}`` (finished) and ``{"op": "preempt", "req": id}``
  (freed, back to 0 computed tokens, PREEMPTED).

Each state: the operation's result (hit tokens and per-group hit ids, new
block ids per group or None, freed), every live request's per-group table,
and the free queue head first.
"""

from __future__ import annotations

import json
import math
import sys


def run_ops(manager, make_request, ops, *, block_ids, free_queue, running, preempted) -> list[dict]:
    """Apply ``ops`` to ``manager``; ``make_request(id, prompt)`` builds a
    request; ``block_ids(manager, id)`` its per-group ids; ``free_queue(manager)``
    the free block ids head first; ``running`` / ``preempted`` the status values."""
    requests: dict = {}
    states = []
    for op in ops:
        kind, req_id = op["op"], op["req"]
        result: dict = {}
        if kind == "admit" and req_id in requests and requests[req_id].status == running:
            new = "running"  # admitted before: nothing to do
        elif kind == "admit":
            request = requests.get(req_id) or make_request(req_id, op["prompt"])
            requests[req_id] = request
            found, num_hit = manager.get_computed_blocks(request)[:2]
            hits = getattr(found, "blocks", found)  # vLLM's KVCacheBlocks
            result["hit"] = [num_hit, [[b.block_id for b in g] for g in hits]]
            new = manager.allocate_slots(request, op["num_new_tokens"], num_new_computed_tokens=num_hit,
                                         new_computed_blocks=found,
                                         full_sequence_must_fit=True)
            if new is not None:
                request.status = running
                request.num_computed_tokens = num_hit + op["num_new_tokens"]
        elif kind == "step":
            request = requests[req_id]
            new = manager.allocate_slots(request, op["num_new_tokens"])
            if new is not None:
                request.num_computed_tokens += op["num_new_tokens"]
                if op.get("in_flight"):
                    request.num_in_flight_tokens += op["num_new_tokens"]
                for token in op.get("append", ()):
                    request.append_output_token_ids(token)
        elif kind == "settle":
            request = requests[req_id]
            request.num_in_flight_tokens -= op["num_tokens"]
            for token in op.get("append", ()):
                request.append_output_token_ids(token)
            new = None
        else:
            request = requests[req_id]
            manager.free(request)
            new = None
            if kind == "preempt":
                request.status = preempted
                request.num_computed_tokens = 0
            else:
                del requests[req_id]
        if kind in ("admit", "step"):
            new = getattr(new, "blocks", new)
            result["new"] = new if new in (None, "running") else [[b.block_id for b in g] for g in new]
        states.append({"op": kind, "req": req_id, "result": result,
                       "tables": {r: block_ids(manager, r) for r in sorted(requests)},
                       "free": free_queue(manager)})
    return states


def _vllm_main() -> None:
    cases = json.load(sys.stdin)
    if "--all" in sys.argv:
        json.dump({name: _vllm_states(case) for name, case in cases.items()}, sys.stdout, indent=None)
    else:
        json.dump(_vllm_states(cases), sys.stdout)


def _vllm_states(case: dict) -> list[dict]:
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            MambaSpec, SlidingWindowSpec)
    from vllm.v1.request import Request, RequestStatus

    block_size = case["block_size"]
    groups = []
    for i, window in enumerate(case["groups"]):  # None: full attention; "mamba": Mamba, mode "none"
        spec = (FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
                if window is None else
                MambaSpec(block_size=case["max_model_len"], shapes=((1,),), dtypes=(torch.float32,),
                          mamba_cache_mode="none", num_speculative_blocks=case.get("num_speculative_blocks", 0))
                if window == "mamba" else
                SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32,
                                  sliding_window=window))
        groups.append(KVCacheGroupSpec([f"layer{i}"], spec))
    config = KVCacheConfig(num_blocks=case["num_gpu_blocks"], kv_cache_tensors=[], kv_cache_groups=groups)
    # vLLM's resolve_kv_cache_block_sizes: the LCM of the group block sizes
    # (a Mamba group's is max_model_len), hashing at it too without prefix caching.
    scheduler_block_size = math.lcm(*(g.kv_cache_spec.block_size for g in groups))
    manager = KVCacheManager(config, max_model_len=case["max_model_len"], scheduler_block_size=scheduler_block_size,
                             hash_block_size=scheduler_block_size, max_in_flight_tokens=case["max_in_flight_tokens"],
                             enable_caching=case.get("enable_caching", True))
    init_none_hash(sha256)
    hasher = get_request_block_hasher(block_size, sha256)

    def make_request(req_id, prompt):
        return Request(req_id, list(prompt), SamplingParams(max_tokens=case["max_model_len"]), None,
                       None, block_hasher=hasher)

    return run_ops(manager, make_request, case["ops"],
                   block_ids=lambda m, r: [list(g) for g in m.get_block_ids(r)],
                   free_queue=lambda m: [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()],
                   running=RequestStatus.RUNNING, preempted=RequestStatus.PREEMPTED)


if __name__ == "__main__":
    _vllm_main()
