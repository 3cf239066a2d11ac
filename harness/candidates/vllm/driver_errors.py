"""The two refusals of the vLLM driver, as ``candidate.py`` tells them apart.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library only. ``candidate.py``
matches the class names in an error answer (``exc_type``): ``DriverError``
becomes ``VLLMRefused`` at ``init`` (a config this vLLM cannot express) and
``SchedulerClassError`` becomes ``VLLMSchedulerClassError``. Mirrors no vLLM
file: vLLM raises its own errors, which the driver reports as they are.
"""

from __future__ import annotations


class DriverError(Exception):
    """A request the driver cannot honour (bad op, unsupported config, ...)."""


class SchedulerClassError(Exception):
    """The ``scheduler_cls`` of ``init`` cannot be used: its module does not
    import, it is not a subclass of vLLM's ``Scheduler`` (the hooks need its
    internals), or its ``__init__`` raised. The harness reports it in one line."""
