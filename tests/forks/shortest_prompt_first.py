"""A correct fork: new requests wait shortest prompt first (ties: arrival).

Changes one thing in the reference (vLLM 0.33.0's ``Scheduler.add_request``,
``vllm/v1/core/sched/scheduler.py``): under FCFS a new request is placed
before the first fresh waiting request (none of its tokens computed, status
WAITING) with a longer prompt, in tokens; preempted requests keep vLLM's
place at the head. Under PRIORITY (a heap, ``PriorityRequestQueue``) it keeps
vLLM's order. Not FCFS, so it deviates from vLLM's design (ADMISSION-ORDER
under ``--semantics 0.33.0``), and breaks no safety or progress rule: the fork
gate passes it on every canonical golden.
"""

from __future__ import annotations

from reference.request_queue import FCFSRequestQueue
from reference.scheduler import Scheduler


class ShortestPromptFirst(Scheduler):
    """New requests wait shortest prompt first (ties: arrival); preempted ones
    still go to the head. Correct, not FCFS."""

    def add_request(self, request):
        super().add_request(request)
        if not isinstance(self.waiting, FCFSRequestQueue):
            return  # PRIORITY: vLLM's (priority, arrival) order
        queue = self.waiting._queue
        queue.remove(request)
        at = next((i for i, r in enumerate(queue) if r.num_computed_tokens == 0
                   and r.status.name == "WAITING" and len(r.prompt_token_ids) > len(request.prompt_token_ids)),
                  len(queue))
        queue.insert(at, request)


def make(config):
    """The candidate factory (``forks.shortest_prompt_first:make``)."""
    return ShortestPromptFirst(config)
