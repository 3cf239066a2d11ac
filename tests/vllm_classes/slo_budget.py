"""A correct fork of vLLM 0.33.0's scheduler that sets its own token cap per step, for
``vllm@0.33.0,scheduler_cls=slo_budget:SloBudgetScheduler`` (a new user's trial: the
vLLM driver read ``Scheduler.max_num_scheduled_tokens`` once at build and recorded the
step's ``token_budget`` from that stale cap, so ``--semantics fork`` reported
PROGRESS-ADMIT on 7 goldens; tests/test_regression_fork_per_step_token_cap.py).

Imported only inside a vLLM driver process (this folder on ``PYTHONPATH``).
"""

from vllm.v1.core.sched.scheduler import Scheduler


class SloBudgetScheduler(Scheduler):
    """Correct: when two or more running requests are decoding (not a prefill chunk), the
    step's cap ``max_num_scheduled_tokens`` (tokens) is halved (at least 1); otherwise it is
    the full cap vLLM derived. Then vLLM 0.33.0's own ``Scheduler.schedule``, which reads
    ``self.max_num_scheduled_tokens`` as the step's token budget."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._full_budget = self.max_num_scheduled_tokens

    def schedule(self, throttle_prefills: bool = False):
        decoding = sum(1 for r in self.running if not r.is_prefill_chunk)
        self.max_num_scheduled_tokens = (max(self._full_budget // 2, 1) if decoding >= 2
                                         else self._full_budget)
        return super().schedule(throttle_prefills)



class SloBudgetLeavesBudgetScheduler(SloBudgetScheduler):
    """BUG: schedules on a quarter of the full cap but leaves the step's cap
    (``max_num_scheduled_tokens``, read after ``schedule()``) at the half (or the full cap),
    so up to a quarter of the full cap (16 of 64 tokens) is left unused while a request
    that fits it waits: PROGRESS-ADMIT must fire."""

    def schedule(self, throttle_prefills: bool = False):
        decoding = sum(1 for r in self.running if not r.is_prefill_chunk)
        cap = max(self._full_budget // 2, 1) if decoding >= 2 else self._full_budget
        self.max_num_scheduled_tokens = max(cap // 2, 1)
        try:
            return Scheduler.schedule(self, throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = cap
