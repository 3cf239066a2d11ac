"""A broken fork (not correct): with nothing running, every other
``schedule()`` call admits nothing although its whole token budget and the
pool are free (the running cap is set to 0 for that call). The step records
its full budget, so IDLE-ADMISSION (safety) must still fire on it."""

from __future__ import annotations

from reference.scheduler import Scheduler


class IdleStallScheduler(Scheduler):
    """The reference, stalling every other idle step."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._idle_calls = 0

    def schedule(self, throttle_prefills: bool = False):
        cap = self.max_num_running_reqs
        if not self.running and self.waiting:
            self._idle_calls += 1
            if self._idle_calls % 2:
                self.max_num_running_reqs = 0
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs = cap


def make(config):
    """The candidate factory (``forks.idle_stall:make``)."""
    return IdleStallScheduler(config)
