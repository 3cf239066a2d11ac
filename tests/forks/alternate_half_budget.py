"""A correct fork: every other ``schedule()`` call runs on half the token
budget (``max_num_scheduled_tokens // 2``, at least 1), a tighter cap of its
own, recorded as the step's ``token_budget``. With chunked prefill off a
prompt over the halved budget waits one step (vLLM 0.33.0
``Scheduler.schedule`` ends the waiting loop on a prompt over the budget
left) and is admitted the next; nothing corrupts and every request finishes
(adversarial trial, finding 4: it failed IDLE-ADMISSION ×3 on golden
no-chunked-prefill)."""

from __future__ import annotations

from reference.scheduler import Scheduler


class AlternateHalfBudgetScheduler(Scheduler):
    """The reference with the token budget halved on even-numbered calls."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._full_budget = self.max_num_scheduled_tokens
        self._calls = 0

    def schedule(self, throttle_prefills: bool = False):
        self._calls += 1
        self.max_num_scheduled_tokens = (self._full_budget if self._calls % 2
                                         else max(1, self._full_budget // 2))
        return super().schedule(throttle_prefills)


def make(config):
    """The candidate factory (``forks.alternate_half_budget:make``)."""
    return AlternateHalfBudgetScheduler(config)
