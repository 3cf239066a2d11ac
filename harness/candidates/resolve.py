"""Resolve a candidate spec to a factory: the harness's plug-in point.

Specs: ``reference`` (the reference scheduler), ``mutant:NAME`` (a
deliberately broken one from ``harness/candidates/mutants/``), ``vllm@VERSION``
(real vLLM's scheduler in a subprocess, ``harness/candidates/vllm/candidate.py``), or
``package.module:factory`` where ``factory(config: EngineConfig)`` returns an
object satisfying ``reference.candidate.Candidate``.
"""

from __future__ import annotations

import importlib

from reference.candidate import CandidateFactory
from harness.candidates.mutants import MUTANTS
from reference.scheduler import Scheduler
from reference.guard import TRUSTED_MODULES


class CandidateSpecError(ValueError):
    """A candidate spec that names nothing loadable; the message says why."""


def resolve_candidate(spec: str, *, step_timeout: float | None = None, isolate: bool = True) -> CandidateFactory:
    """Factory for ``spec``. Raises CandidateSpecError (unknown mutant, module
    that does not import, missing or non-callable attribute, bad syntax).

    A ``module:factory`` candidate runs in its own process
    (``harness.candidates.isolated``), each call bounded by ``step_timeout``
    seconds (None: its default), unless the factory is ours (defined in
    ``reference.guard.TRUSTED_MODULES``: ``reference.scheduler:Scheduler``);
    ``isolate=False`` gives the factory itself (what that process calls)."""
    if spec == "reference":
        return Scheduler
    if spec.startswith("mutant:"):
        name = spec.split(":", 1)[1]
        if name not in MUTANTS:
            raise CandidateSpecError(f"unknown mutant {name!r}; known: {', '.join(sorted(MUTANTS))}")
        return MUTANTS[name]
    if spec.startswith("vllm@"):
        return _vllm_factory(spec)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CandidateSpecError(
            f"unknown candidate {spec!r}: use 'reference', 'mutant:NAME' or 'package.module:factory'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail in any way
        raise CandidateSpecError(f"cannot import {module_name!r} for candidate {spec!r}: "
                                 f"{type(exc).__name__}: {exc}") from None
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise CandidateSpecError(f"module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise CandidateSpecError(f"{spec!r} is not callable")
    if isolate and not (getattr(factory, "__module__", None) or "").startswith(TRUSTED_MODULES):
        from harness.candidates.isolated import isolated_factory

        return isolated_factory(spec, step_timeout)
    return factory


def _vllm_factory(spec: str) -> CandidateFactory:
    """``vllm@VERSION``: real vLLM behind a driver subprocess; its env must be built."""
    from harness.candidates.vllm.env import VLLMEnvError, check_version, env_dir, is_ready

    version = spec.split("@", 1)[1]
    try:
        check_version(version)
    except VLLMEnvError as exc:
        raise CandidateSpecError(f"candidate {spec!r}: {exc}") from None
    if not is_ready(version):
        raise CandidateSpecError(f"candidate {spec!r}: the vLLM {version} env is not built "
                                 f"({env_dir(version)}); run `harness vllm-env {version}`")
    from harness.candidates.vllm.candidate import make_factory

    return make_factory(version)
