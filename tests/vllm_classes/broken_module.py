"""A scheduler module that does not import (a missing dependency)."""

import sched_harness_no_such_dependency  # noqa: F401

from vllm.v1.core.sched.scheduler import Scheduler


class BrokenScheduler(Scheduler):
    pass
