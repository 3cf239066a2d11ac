"""A correct fork: both FCFS waiting queues kept as heaps on (prompt tokens,
arrival time, request id), as a fork gets that patches vLLM's
``create_request_queue`` (``vllm/v1/core/sched/request_queue.py``): vLLM
builds ``waiting`` and ``skipped_waiting`` (our ``kv_holding_waiting``) from
that one function. A skipped or preempted request is pushed back to its sorted
place, as vLLM's own ``PriorityRequestQueue`` does. Not FCFS (it breaks
ADMISSION-ORDER under ``--semantics 0.33.0``), and breaks no safety or
progress rule (new-user trial: it failed the fork gate with STATE-CONTINUITY).
"""

from __future__ import annotations

import heapq

from reference.scheduler import Scheduler


class PromptHeap:
    """A waiting queue ordered by (prompt tokens, arrival time, request id);
    the methods the reference's scheduler calls on a request queue."""

    def __init__(self) -> None:
        self._heap: list = []

    @staticmethod
    def _key(request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_time, request.request_id)

    def add_request(self, request) -> None:
        heapq.heappush(self._heap, (self._key(request), request))

    prepend_request = add_request  # a skipped or preempted request: back to its sorted place

    def pop_request(self):
        return heapq.heappop(self._heap)[1]

    def peek_request(self):
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][1]

    def remove_requests(self, requests) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self):
        return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])


class PromptHeapScheduler(Scheduler):
    """FCFS's two waiting queues replaced by ``PromptHeap``s (PRIORITY unchanged)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        if config.policy == "fcfs":
            self.waiting = PromptHeap()
            self.kv_holding_waiting = PromptHeap()


def make(config):
    """The candidate factory (``forks.shortest_prompt_heap:make``)."""
    return PromptHeapScheduler(config)
