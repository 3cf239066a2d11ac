"""vLLM 0.33.0's own scheduler with the change of ``tests/forks/shortest_prompt_first.py``
(new requests wait shortest prompt first under FCFS), for
``vllm@0.33.0,scheduler_cls=fork_schedulers:ShortestPromptFirst``: the reference fork's
own run must replay on it with identical decisions (it is what vLLM does with that policy;
tests/test_regression_progress_running_fired_on_a_correct_fork_deferred_frees_step_114_r000030.py).

An ``AsyncScheduler`` subclass, so it also runs async configs (vLLM's ``add_request`` is the
same in both). Imported only inside a vLLM driver process (this folder on ``PYTHONPATH``).
"""

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import FCFSRequestQueue
from vllm.v1.request import RequestStatus


class ShortestPromptFirst(AsyncScheduler):
    """vLLM 0.33.0 ``Scheduler.add_request``, then the new request moved before the first
    fresh waiting request (none of its tokens computed, WAITING) with a longer prompt."""

    def add_request(self, request):
        super().add_request(request)
        queue = self.waiting
        if not isinstance(queue, FCFSRequestQueue) or request not in queue:
            return
        queue.remove(request)
        at = next((i for i, r in enumerate(queue) if r.num_computed_tokens == 0
                   and r.status == RequestStatus.WAITING and len(r.prompt_token_ids) > len(request.prompt_token_ids)),
                  len(queue))
        queue.insert(at, request)
