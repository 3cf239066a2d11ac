"""A broken fork (not correct): its 30th ``schedule()`` call raises
``ValueError('boom')``, in the middle of every golden (step 29). A crash is
never a decision that differs: no ``--semantics`` excuses it."""

from __future__ import annotations

from reference.scheduler import Scheduler


class RaiseMidRunScheduler(Scheduler):
    """The reference, raising at its 30th schedule() call."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._calls = 0

    def schedule(self, throttle_prefills: bool = False):
        self._calls += 1
        if self._calls == 30:
            raise ValueError("boom")
        return super().schedule(throttle_prefills)


def make(config):
    """The candidate factory (``forks.raise_mid_run:make``)."""
    return RaiseMidRunScheduler(config)
