"""vLLM ``Scheduler`` subclasses for ``harness serve-record --candidate-class``
(tests/test_serve_candidate_class.py), each with one deliberate change.

Imported only inside the serving env's processes (this folder on
``PYTHONPATH``): the class check's vLLM driver and the engine process, where
the recording scheduler subclasses the class (``SCHED_HARNESS_BASE_CLS``).
Never by the harness's own test process: vLLM is not installed there.
"""

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler


class NewestVictimScheduler(Scheduler):
    """Under PRIORITY, preempts the tail of running (the request admitted last,
    FCFS's victim) instead of vLLM's choice, the request with the largest
    ``(priority, arrival_time)``. Safe (a victim is still a running request the
    step has not scheduled), but not vLLM's design: ``harness check --semantics
    0.33.0`` reports PRIORITY-VICTIM-MAX, and the reference replayed on the
    recording preempts another request at the first preemption where the two
    choices differ."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # vLLM's schedule() picks the victim by ``self.policy``; the waiting
        # queues, built above from the config's policy, stay priority queues.
        self.policy = SchedulingPolicy.FCFS


class CrashAtStepScheduler(Scheduler):
    """Raises in its ``CRASH_STEP + 1``-th ``schedule()`` call (trace step
    ``CRASH_STEP``, counted from 0), before vLLM's own ``schedule()`` runs:
    the injected engine crash."""

    CRASH_STEP = 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.schedule_calls = 0

    def schedule(self, *args, **kwargs):
        if self.schedule_calls == self.CRASH_STEP:
            raise RuntimeError(f"injected crash in schedule() call {self.schedule_calls}")
        self.schedule_calls += 1
        return super().schedule(*args, **kwargs)


class CrashInUpdateScheduler(Scheduler):
    """Raises in its ``CRASH_STEP + 1``-th ``update_from_output()`` call, after
    vLLM's own update ran (the tokens of the step were handed over): the
    injected crash, one call later in the step."""

    CRASH_STEP = 20

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.update_calls = 0

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self.update_calls == self.CRASH_STEP:
            raise RuntimeError(f"injected crash in update_from_output() call {self.update_calls}")
        self.update_calls += 1
        return outputs


class HangInScheduleScheduler(Scheduler):
    """Its 10th ``schedule()`` call never returns (sleeps an hour): ``serve-record
    --time-limit`` must still end the run (tests/test_serve_record_time_limit_ignored_by_hang.py)."""

    def schedule(self, *args, **kwargs):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 10:
            import time

            time.sleep(3600)
        return super().schedule(*args, **kwargs)
