"""Forks of the reference scheduler that walk ``running`` in another order
than vLLM's (which walks its running queue in order and never reorders it:
``vllm/v1/core/sched/scheduler.py`` ``Scheduler.schedule``). The first two
are correct, only not vLLM's design: they break RUNNING-ORDER under
``--semantics 0.33.0`` and no safety or progress rule (two trials: the first
failed the fork gate with STATE-CONTINUITY on 20 of 20 goldens, both with
PROGRESS-RUNNING and PROGRESS-PREEMPT-NEEDED). The others are broken: a lost
or doubled running request (STATE-CONTINUITY) and a runnable request skipped
(PROGRESS-RUNNING), each on top of a reorder.
"""

from __future__ import annotations

from reference.scheduler import Scheduler


def _remaining(request) -> tuple:
    """Fewest output tokens left first (tokens), then arrival."""
    return (request.max_tokens - request.num_output_tokens, request.arrival_time)


class ShortestRemainingRunning(Scheduler):
    """Correct: ``self.running`` sorted by fewest remaining tokens before each
    step (so the FCFS victim, the tail, is the longest remaining job); vLLM's
    loop then walks that order, and the queue keeps it."""

    def schedule(self, throttle_prefills: bool = False):
        self.running.sort(key=_remaining)
        return super().schedule(throttle_prefills)


class RoundRobinServed(Scheduler):
    """Correct: the running loop starts one request further each step (round
    robin for the token budget), and ``self.running`` is put back in its
    order after the step (admissions at the end): the walk order shows in no
    queue row, only in the ``schedule`` rows."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.steps = 0  # steps scheduled: where the walk starts

    def schedule(self, throttle_prefills: bool = False):
        running = self.running
        order = {id(r): i for i, r in enumerate(running)}
        if len(running) > 1:
            start = self.steps % len(running)
            running[:] = running[start:] + running[:start]
        self.steps += 1
        try:
            return super().schedule(throttle_prefills)
        finally:
            running[:] = sorted(running, key=lambda r: order.get(id(r), len(order)))


class DecodeFirstDropsBoundary(Scheduler):
    """Broken: decode first, but a request whose computed tokens are exactly
    its prompt (its first decode) is in neither list: it is lost from
    running, never scheduled again."""

    def schedule(self, throttle_prefills: bool = False):
        running = self.running
        running[:] = ([r for r in running if r.num_computed_tokens > r.num_prompt_tokens]
                      + [r for r in running if r.num_computed_tokens < r.num_prompt_tokens])
        return super().schedule(throttle_prefills)


class ShortestRemainingDoubles(ShortestRemainingRunning):
    """Broken: after a step that admitted, the first running request is in
    the queue twice (a bookkeeping slip); the copy is dropped again before
    the next step, so only the ``schedule_end`` row shows it."""

    def schedule(self, throttle_prefills: bool = False):
        running = self.running
        seen: set[int] = set()
        running[:] = [r for r in running if not (id(r) in seen or seen.add(id(r)))]
        admitted_before = len(running)
        output = super().schedule(throttle_prefills)
        if len(running) > admitted_before and running:
            running.append(running[0])
        return output


class ShortestRemainingSkipsTail(ShortestRemainingRunning):
    """Broken: shortest remaining first, and every fifth step the last
    running request is left out although there is room (a progress bug)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.steps = 0

    def schedule(self, throttle_prefills: bool = False):
        self.steps += 1
        if self.steps % 5 or len(self.running) < 2:
            return super().schedule(throttle_prefills)
        self.running.sort(key=_remaining)
        tail = self.running.pop()
        try:
            return Scheduler.schedule(self, throttle_prefills)
        finally:
            self.running.insert(len(self.running), tail)


def make(config):
    """``forks.running_order:make``: shortest remaining first (correct)."""
    return ShortestRemainingRunning(config)


def make_round_robin(config):
    """``forks.running_order:make_round_robin``: round robin, order kept (correct)."""
    return RoundRobinServed(config)


def make_drops(config):
    """``forks.running_order:make_drops``: loses a running request (broken)."""
    return DecodeFirstDropsBoundary(config)


def make_doubles(config):
    """``forks.running_order:make_doubles``: a running request twice (broken)."""
    return ShortestRemainingDoubles(config)


def make_skips(config):
    """``forks.running_order:make_skips``: skips a runnable request (broken)."""
    return ShortestRemainingSkipsTail(config)
