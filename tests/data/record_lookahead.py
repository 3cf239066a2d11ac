"""Record vLLM 0.33.0's own ``Scheduler`` with a drafter's look-ahead KV slots
(``Scheduler.num_lookahead_tokens = 4``, what vLLM derives for an EAGLE drafter
of 4 speculative tokens) under the harness's ``RecordingScheduler``.

Run with a vLLM 0.33.0 environment's Python, from the extracted sdist tests
(``tests.v1.core.utils`` is vLLM's own ``create_scheduler``) and with this
checkout on ``PYTHONPATH``::

    cd $HARNESS_VLLM_ENVS/sdists/vllm-0.33.0-tests
    HF_HOME=$HARNESS_VLLM_ENVS/sdists/hf-home HF_HUB_OFFLINE=1 VLLM_TARGET_DEVICE=cpu \\
      PYTHONPATH=$PWD:/path/to/sched-harness $HARNESS_VLLM_ENVS/0.33.0/bin/python \\
      /path/to/sched-harness/tests/data/record_lookahead.py OUT.jsonl

Three requests of 30 prompt tokens and 20 output tokens each on a pool of 12
blocks of 16, so each table holds the look-ahead's extra block at block
boundaries and a request is preempted. The look-ahead is set by hand before the
first ``schedule()``, as vLLM's own unit tests set scheduler knobs (the
recorder writes it as a ``config`` record): the recording
``tests/data/vllm-0.33.0-lookahead-4.jsonl`` was made so.
"""

from __future__ import annotations

import os
import sys

from tests.v1.core.utils import create_requests, create_scheduler
from vllm.v1.outputs import ModelRunnerOutput


def main(argv: list[str]) -> int:
    out = os.path.abspath(argv[0])
    os.environ["SCHED_HARNESS_TRACE"] = out
    os.environ["SCHED_HARNESS_STRICT"] = "1"
    from harness.candidates.vllm.recording_scheduler import RecordingScheduler

    base = create_scheduler(block_size=16, num_blocks=12, max_num_batched_tokens=64,
                            enable_prefix_caching=True)
    from vllm.v1.structured_output import StructuredOutputManager
    sched = RecordingScheduler(vllm_config=base.vllm_config, kv_cache_config=base.kv_cache_config,
                               block_size=16, log_stats=False,
                               structured_output_manager=StructuredOutputManager(base.vllm_config))
    sched.num_lookahead_tokens = 4
    requests = create_requests(num_requests=3, num_tokens=30, max_tokens=20, ignore_eos=True)
    for r in requests:
        sched.add_request(r)
    steps = 0
    while sched.has_unfinished_requests() and steps < 200:
        so = sched.schedule()
        ran = [r for r in requests if r.request_id in so.num_scheduled_tokens]
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=[r.request_id for r in ran], req_id_to_index={r.request_id: i for i, r in enumerate(ran)},
            sampled_token_ids=[[1000] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in ran],
            logprobs=None, prompt_logprobs_dict={}, pooler_output=None))
        steps += 1
    sched.shutdown()
    print(f"wrote {out}: {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
