"""Regression (found by `harness fuzz --hybrid`, issue 28): with a hybrid model
(a sliding-window group) and encoder inputs, a request's allocation writes a
``skipped_free`` row (vLLM 0.33.0's ``allocate_slots`` calls
``remove_skipped_blocks``) between its ``encoder_plan`` row
(``_try_schedule_encoder_inputs``, before the allocation) and its ``schedule``
row. The checker took any row but the request's own ``schedule`` (or a
preemption or withdrawal) to mean the allocation had failed, dropped the plan
there, and ENCODER-INPUTS fired on the reference: "window [1, 2) overlaps
encoder input(s) [0] without an encoder plan"."""

from __future__ import annotations

from harness.fuzz import FuzzCase, run_case
from reference.scheduler import Scheduler
from reference.workload import RequestSpec

# The fuzzer's shrunk case (hybrid strategy, seed 0): eight 1-token prompts, then one whose
# second token is a 1-embed encoder input; window 1, blocks of 1 token, 3 tokens a step.
CONFIG = {"num_gpu_blocks": 8, "block_size": 1, "max_model_len": 3, "max_num_seqs": 3,
          "max_num_batched_tokens": 3, "policy": "fcfs", "enable_prefix_caching": True,
          "enable_chunked_prefill": False, "long_prefill_token_threshold": 1, "watermark": 0.0,
          "scheduler_reserve_full_isl": False, "draft_acceptance_rate": 0.0,
          "sliding_window": 1, "layer_types": ["sliding_attention", "full_attention"]}
REQUESTS = tuple(RequestSpec(request_id=f"r{i:06d}", arrival_time=0.0, prompt_token_ids=(1000 + 100 * i,),
                             max_tokens=1, ignore_eos=True) for i in range(8)) + (
    RequestSpec(request_id="r000008", arrival_time=0.0, prompt_token_ids=(1800, 20000), max_tokens=1,
                ignore_eos=True, mm_positions=((1, 1),)),)


def test_regression_encoder_plan_dropped_at_skipped_free() -> None:
    run = run_case(Scheduler, FuzzCase(CONFIG, REQUESTS))
    assert run.ended == "" and run.result.by_invariant == {}, run.result.by_invariant
    step_3 = [(r["kind"], r["request_id"], r.get("num_computed_tokens"), r.get("num_scheduled_tokens"),
               r.get("group_block_ids"))
              for s, rows in run.steps if s == 3 for r in rows
              if r["kind"] in ("encoder_plan", "skipped_free", "schedule")]
    # The plan, the window's free of group 0's block of token 0 (in the allocation), the schedule
    # (the freed block, unhashed with a window of 1, goes to the free queue's head and is taken again).
    assert step_3 == [("encoder_plan", "r000008", 1, 1, None),
                      ("skipped_free", "r000008", None, None, [[3], []]),
                      ("schedule", "r000008", 1, 1, [[3], [5]])]
