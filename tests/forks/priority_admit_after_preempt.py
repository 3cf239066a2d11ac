"""A correct fork: under PRIORITY the waiting loop also runs in a step whose
running loop preempted (SGLang-style priority admission: a newly arrived
request may take the blocks a lower-priority victim gave back). The step's
own victims are kept out of it (parked while the step schedules, back in
``waiting`` before ``schedule()`` returns), so no victim is re-admitted in the
step that preempted it. vLLM gates the waiting loop on no preemption (spec
3.1 step 5), an anti-thrashing design: this corrupts nothing (adversarial
trial, finding 6: it failed NO-ADMIT-AFTER-PREEMPT, then a safety rule, on
golden priority-tight).

Built as a fork author would: one line of the reference's ``schedule()``
changed (``if not preempted:`` -> ``if not preempted or self._admit_after_preempt:``),
compiled in the reference module's namespace; an import-time error if that
line moves."""

from __future__ import annotations

import inspect
import textwrap

import reference.scheduler as base

_GATE = "    if not preempted:\n"
_SOURCE = textwrap.dedent(inspect.getsource(base.Scheduler.schedule))
if _SOURCE.count(_GATE) != 1:
    raise ImportError("reference Scheduler.schedule no longer has one `if not preempted:` gate")
_NAMESPACE: dict = {}
exec(compile(_SOURCE.replace(_GATE, "    if not preempted or self._admit_after_preempt:\n"),
             base.__file__, "exec"), vars(base), _NAMESPACE)


class PriorityAdmitAfterPreemptScheduler(base.Scheduler):
    """The reference, admitting after a preemption under PRIORITY."""

    _schedule_ungated = _NAMESPACE["schedule"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self._admit_after_preempt = config.policy == "priority"
        self._parked: list = []

    def _preempt_request(self, request):
        preemption = super()._preempt_request(request)
        if self._admit_after_preempt:
            self.waiting.remove_requests([request])  # not re-admitted in this step
            self._parked.append(request)
        return preemption

    def schedule(self, throttle_prefills: bool = False):
        try:
            return self._schedule_ungated(throttle_prefills)
        finally:
            for request in self._parked:
                self.waiting.prepend_request(request)
            self._parked = []


def make(config):
    """The candidate factory (``forks.priority_admit_after_preempt:make``)."""
    return PriorityAdmitAfterPreemptScheduler(config)
