"""vLLM ``Scheduler`` subclasses with deliberate changes, for the
``vllm@VERSION,scheduler_cls=custom_schedulers:Class`` candidate tests
(tests/test_vllm_scheduler_cls.py).

Imported only inside a vLLM driver process (this folder on ``PYTHONPATH``),
never by the harness's own test process: vLLM is not installed there.
"""

from vllm.v1.core.sched.scheduler import Scheduler


class _CapMixin:
    """Set the running-request cap (``max_num_running_reqs``, and
    ``max_num_active_reqs`` where the release has that admission cap) to
    ``cap(max_num_seqs)``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cap = self.cap(self.scheduler_config.max_num_seqs)
        self.max_num_running_reqs = cap
        if hasattr(self, "max_num_active_reqs"):
            self.max_num_active_reqs = cap


class LowerSeqCapScheduler(_CapMixin, Scheduler):
    """Admits at most 2 running requests whatever max_num_seqs says: legal
    (max_num_seqs is a maximum), so replay reports a divergence, not a violation."""

    @staticmethod
    def cap(max_num_seqs: int) -> int:
        return min(2, max_num_seqs)


class HigherSeqCapScheduler(_CapMixin, Scheduler):
    """Runs up to max_num_seqs + 2 requests: MAX-NUM-SEQS must fire."""

    @staticmethod
    def cap(max_num_seqs: int) -> int:
        return max_num_seqs + 2


class PlainScheduler(Scheduler):
    """No change at all: must replay every golden identically."""


class RaisingScheduler(Scheduler):
    """Its constructor raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("deliberately broken constructor")


class NotAScheduler:
    """Not a vLLM Scheduler."""


class HangingScheduler(Scheduler):
    """Its third schedule() call never returns (sleeps for an hour): the run
    must end as a hang at that step once --step-timeout passes."""

    def schedule(self, *args, **kwargs):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls == 3:
            import time

            time.sleep(3600)
        return super().schedule(*args, **kwargs)


from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402


class AsyncPlainScheduler(AsyncScheduler):
    """vLLM's AsyncScheduler unchanged: runs only under async scheduling; a
    synchronous config is refused in one line (issue 23: it was run and
    misjudged, SCHEDULED-SPAN x346 on pipeline-3)."""
