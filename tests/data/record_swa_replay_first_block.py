"""Drive vLLM's own ``Scheduler`` with a bounded-replay sliding window and
print where the replay starts and what the window group's table holds there.

Run with a vLLM 0.33.0 environment's Python, from the extracted sdist tests
(``$HARNESS_VLLM_ENVS/sdists/vllm-0.33.0-tests``: ``tests.v1.core.utils`` is
vLLM's own ``create_scheduler``) and with this checkout on ``PYTHONPATH``::

    cd $HARNESS_VLLM_ENVS/sdists/vllm-0.33.0-tests
    HF_HOME=$HARNESS_VLLM_ENVS/sdists/hf-home HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \\
      PYTHONPATH=$PWD:/path/to/sched-harness $HARNESS_VLLM_ENVS/0.33.0/bin/python \\
      /path/to/sched-harness/tests/data/record_swa_replay_first_block.py [--record OUT.jsonl]

The layout is vLLM's ``tests/v1/core/test_prefix_replay.py``: a full-attention
group and a ``SlidingWindowMLASpec(bounded_replay=True)`` group, blocks of 16
tokens; request a prefills a 100-token prompt, request b sends the same prompt
and hits its 6 full blocks (96 tokens). One line per window: the replay start
(``Request.replay_start``, hit - window), the window group's table (0: the
null block), the slot of the first replayed token, and how many replayed
tokens read a null slot (a token at position p reads max(p - window + 1,
replay_start) .. p: ``sparse_swa.py``'s SWA index kernel).

``--record OUT.jsonl`` runs window 17 once more under the harness's
``RecordingScheduler`` (recording format 3) and writes its JSONL to OUT: the
recording ``tests/data/vllm-0.33.0-swa-replay-window-17.jsonl`` was made so.
"""

from __future__ import annotations

import os
import sys

import torch
from tests.v1.core.utils import create_requests, create_scheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowMLASpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

BLOCK = 16
PROMPT = 100  # 6 full blocks of 16: a 96-token hit for the same prompt


def make_scheduler(window: int, cls: type = Scheduler, threshold: int = 0):
    """vLLM 0.33.0's Scheduler over [full attention, bounded-replay SWA] groups of 200 blocks."""
    base = create_scheduler(block_size=BLOCK, enable_prefix_caching=True,
                            long_prefill_token_threshold=threshold)
    config = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1,
                                                     dtype=torch.float32)),
        KVCacheGroupSpec(["swa"], SlidingWindowMLASpec(block_size=BLOCK, num_kv_heads=1, head_size=64,
                                                       dtype=torch.bfloat16, sliding_window=window,
                                                       bounded_replay=True))])
    sched = cls(vllm_config=base.vllm_config, kv_cache_config=config, block_size=BLOCK, log_stats=False,
                structured_output_manager=StructuredOutputManager(base.vllm_config))
    sched.use_v2_model_runner = True  # as test_prefix_replay.py: the runner that replays
    return sched


def step_output(out, requests) -> ModelRunnerOutput:
    """A token for each scheduled request whose prefill is done."""
    ran = [r for r in requests if r.request_id in out.num_scheduled_tokens]
    return ModelRunnerOutput(req_ids=[r.request_id for r in ran],
                             req_id_to_index={r.request_id: i for i, r in enumerate(ran)},
                             sampled_token_ids=[[1000] if r.num_computed_tokens >= r.num_prompt_tokens else []
                                                for r in ran],
                             logprobs=None, prompt_logprobs_dict={}, pooler_output=None)


def probe(window: int, cls: type = Scheduler, threshold: int = 0) -> str:
    """Prefill a, admit b on a's 96-token hit, run both to their end (2
    tokens each); one line on b's window table at its admission."""
    sched = make_scheduler(window, cls, threshold)
    a, b = create_requests(num_requests=2, num_tokens=PROMPT, same_prompt=True, block_size=BLOCK,
                           max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    out = sched.schedule()
    sched.update_from_output(out, step_output(out, [a]))
    sched.add_request(b)
    out = sched.schedule()
    new = next(r for r in out.scheduled_new_reqs if r.req_id == b.request_id)
    scheduled = out.num_scheduled_tokens[b.request_id]
    table = [0 if blk.is_null else blk.block_id for blk in sched.kv_cache_manager.get_blocks(b.request_id).blocks[1]]
    start = new.replay_start
    hit = start + window
    first = start // BLOCK
    reading_null = [p for p in range(start, hit) if table[max(p - window + 1, start) // BLOCK] == 0]
    sched.update_from_output(out, step_output(out, [a, b]))
    while sched.has_unfinished_requests():  # to the end: both finish (2 tokens each)
        out = sched.schedule()
        sched.update_from_output(out, step_output(out, [a, b]))
    sched.shutdown()
    return (f"window {window} block {BLOCK} threshold {threshold}: hit {hit} replay_start {start} "
            f"num_computed_tokens {new.num_computed_tokens} scheduled {scheduled} "
            f"window table {table} nulls {table.count(0)} = (hit - window + 1) // block {(hit - window + 1) // BLOCK}; "
            f"first replayed token in slot {first}: {'NULL' if table[first] == 0 else table[first]}; "
            f"replayed tokens reading a null slot: {len(reading_null)}")


def main(argv: list[str]) -> int:
    for window in (16, 17, 18, 32, 33, 49):
        print(probe(window))
    print(probe(17, threshold=8))
    if argv[:1] == ["--record"]:
        from harness.candidates.vllm.recording_scheduler import RecordingScheduler

        out = os.path.abspath(argv[1])
        os.environ["SCHED_HARNESS_TRACE"] = out
        os.environ["SCHED_HARNESS_STRICT"] = "1"
        print("recorded:", probe(17, RecordingScheduler))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
