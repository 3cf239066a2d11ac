"""Resolve a candidate spec to a factory: the harness's plug-in point.

Specs: ``reference`` (the reference scheduler), ``mutant:NAME`` (a
deliberately broken one from ``harness/candidates/mutants/``), ``vllm@VERSION``
(real vLLM's scheduler in a subprocess, ``harness/candidates/vllm/candidate.py``),
``vllm@PATH`` (the vLLM importable by the Python interpreter or venv at PATH),
either with ``,scheduler_cls=package.module:Class`` (a vLLM ``Scheduler``
subclass built instead of vLLM's, ``harness/candidates/vllm/spec.py``), or
``package.module:factory`` where ``factory(config: EngineConfig)`` returns an
object satisfying ``reference.candidate.Candidate``.
"""

from __future__ import annotations

import importlib
import os
import sys

from reference.candidate import CandidateFactory
from harness.candidates.mutants import MUTANTS
from reference.scheduler import Scheduler
from reference.guard import TRUSTED_MODULES
from reference.words import did_you_mean


class CandidateSpecError(ValueError):
    """A candidate spec that names nothing loadable; the message says why."""


def resolve_candidate(spec: str, *, step_timeout: float | None = None, isolate: bool = True) -> CandidateFactory:
    """Factory for ``spec``. Raises CandidateSpecError (unknown mutant, module
    that does not import, missing or non-callable attribute, bad syntax).

    A ``module:factory`` candidate runs in its own process
    (``harness.candidates.isolated``), each call bounded by ``step_timeout``
    seconds (None: its default; a ``vllm@`` candidate's ops too), unless its
    module is ours (under ``reference.guard.TRUSTED_MODULES``:
    ``reference.scheduler:Scheduler``); its module is imported only in that
    process (``probe_spec``), never here. ``isolate=False`` imports it here and
    gives the factory itself (what that process calls)."""
    if spec == "reference":
        return Scheduler
    if spec.startswith("mutant:"):
        name = spec.split(":", 1)[1]
        if name not in MUTANTS:
            raise CandidateSpecError(f"unknown mutant {name!r}" + (did_you_mean(name, MUTANTS) or
                                                                   " (`harness mutants --list` lists them)"))
        return MUTANTS[name]
    if spec.startswith("vllm@"):
        return _vllm_factory(spec, step_timeout)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        close = did_you_mean(spec, ["reference"], list_whole=False) if "@" not in spec and not sep else ""
        raise CandidateSpecError(
            f"unknown candidate {spec!r}" + (close + " (" if close else ": use ")
            + "'reference', 'mutant:NAME', 'vllm@VERSION' or 'package.module:factory'" + (")" if close else ""))
    if isolate and not (module_name + ".").startswith(TRUSTED_MODULES):
        # Someone else's module: imported only inside its own process (its
        # import may os._exit(0), hang or print), checked there before any run.
        from harness.candidates.isolated import isolated_factory, probe_spec

        error = probe_spec(spec)
        if error is not None:
            raise CandidateSpecError(error)
        return isolated_factory(spec, step_timeout)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # an import can fail in any way
        raise CandidateSpecError(f"cannot import {module_name!r} for candidate {spec!r}: "
                                 f"{type(exc).__name__}: {exc}{_cwd_not_on_path_hint(module_name, exc)}") from None
    factory = module
    for part in attr.split("."):
        owner, factory = factory, getattr(factory, part, None)
        if factory is None:
            names = [n for n in dir(owner) if not n.startswith("_") and callable(getattr(owner, n, None))]
            raise CandidateSpecError(f"module {module_name!r} has no attribute {attr!r}" + did_you_mean(part, names))
    if not callable(factory):
        raise CandidateSpecError(f"{spec!r} is not callable")
    return factory


def _cwd_not_on_path_hint(module_name: str, exc: BaseException) -> str:
    """For ``No module named 'mysched'`` where ``mysched.py`` (or a
    ``mysched/`` package) is in the current folder but the current folder is
    not on ``sys.path`` (the ``harness`` script puts its own folder there, not
    the current one): ``"; mysched.py is in the current folder, which is not
    on the import path: run with PYTHONPATH=."``; else ``""``."""
    top = module_name.split(".")[0]
    if not isinstance(exc, ModuleNotFoundError) or exc.name != top:
        return ""
    cwd = os.path.realpath(os.getcwd())
    if any(os.path.realpath(p or os.curdir) == cwd for p in sys.path):
        return ""
    found = [name for name in (f"{top}.py", f"{top}/") if os.path.exists(name)]
    if not found:
        return ""
    return f"; {found[0]} is in the current folder, which is not on the import path: run with PYTHONPATH=."


def _vllm_factory(spec: str, step_timeout: float | None = None) -> CandidateFactory:
    """``vllm@VERSION`` / ``vllm@PATH`` (``,scheduler_cls=...``): real vLLM
    behind a driver subprocess; a release's env must be built, a path must
    import vllm. A scheduler class is built once here (on the default config)
    so that one that does not import, is not a ``Scheduler`` or raises in
    ``__init__`` is a CandidateSpecError before any run."""
    from harness.candidates.vllm.spec import VLLMSpecError, parse_vllm_spec

    try:
        target = parse_vllm_spec(spec)
    except VLLMSpecError as exc:
        raise CandidateSpecError(str(exc)) from None
    from harness.candidates.vllm.candidate import (VLLMDriverError, VLLMRefused, VLLMSchedulerClassError,
                                                   make_factory, probe_scheduler_class)

    if target.scheduler_cls is not None:
        from harness.candidates.vllm.class_precheck import precheck_scheduler_class

        typo = precheck_scheduler_class(target)  # under a second, before vLLM's minute of import
        if typo is not None:
            raise CandidateSpecError(f"candidate {spec!r}: {typo}")
        try:
            probe_scheduler_class(target)
        except VLLMSchedulerClassError as exc:
            raise CandidateSpecError(f"candidate {spec!r}: {exc}") from None
        except VLLMRefused:
            pass  # the default config is not one this vLLM expresses; the class loaded
        except VLLMDriverError as exc:
            raise CandidateSpecError(f"candidate {spec!r}: {exc}") from None
    return make_factory(target, step_timeout)
