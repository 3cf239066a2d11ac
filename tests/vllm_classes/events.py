"""A user module named like one of the vLLM driver's own files
(harness/candidates/vllm/events.py): the driver must import this one, as
``vllm serve --scheduler-cls events.NamedLikeADriverFile`` would
(tests/test_vllm_scheduler_cls.py)."""

from vllm.v1.core.sched.scheduler import Scheduler


class NamedLikeADriverFile(Scheduler):
    """vLLM's Scheduler, unchanged."""
