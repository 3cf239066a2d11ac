"""Waiting queues: FCFS deque and PRIORITY heap.

Mirrors ``vllm/v1/core/sched/request_queue.py`` of vLLM 0.33.0 (spec 3.4, 4.4).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from reference.request import Request


class FCFSRequestQueue:
    """Arrival order; ``prepend_request`` puts a preempted request at the head.

    ``mutations`` counts the calls that change the queue (not in vLLM): its
    contents change only through these methods, so an unchanged count means
    the same requests in the same order (``Scheduler.snapshot`` reuses its
    ids)."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()
        self.mutations = 0

    def add_request(self, request: Request) -> None:
        self.mutations += 1
        self._queue.append(request)

    def pop_request(self) -> Request:
        self.mutations += 1
        return self._queue.popleft()

    def peek_request(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty queue")
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self.mutations += 1
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.mutations += 1
        gone = set(map(id, requests))
        self._queue = deque(r for r in self._queue if id(r) not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue:
    """Min-heap on ``Request.__lt__``: (priority, arrival_time, request_id).

    "Prepend" is a plain insert: a preempted request goes back to its place by
    priority, not to the head. Iteration yields requests in pop order
    (``Request.__lt__`` reads fields that never change). ``mutations``: as
    ``FCFSRequestQueue``'s.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []
        self.mutations = 0

    def add_request(self, request: Request) -> None:
        self.mutations += 1
        heapq.heappush(self._heap, request)

    def pop_request(self) -> Request:
        self.mutations += 1
        return heapq.heappop(self._heap)

    def peek_request(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty heap")
        return self._heap[0]

    prepend_request = add_request

    def remove_requests(self, requests: Iterable[Request]) -> None:
        self.mutations += 1
        gone = set(map(id, requests))
        self._heap = [r for r in self._heap if id(r) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


def create_request_queue(policy: str) -> FCFSRequestQueue | PriorityRequestQueue:
    """Queue for ``policy`` ("fcfs" or "priority"); ValueError otherwise."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
