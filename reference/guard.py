"""The engine's side of the candidate boundary: every call into a candidate.

``Guarded`` wraps one rank's candidate for the engine loop
(``reference/engine.py``, vLLM's ``EngineCore`` calling its ``Scheduler``):
whatever the candidate raises becomes ``CandidateCrash`` naming the call and
the step, its return values are checked (``reference/validate.py``) and
what it prints goes to stderr. ``harness.candidates.isolated`` adds the
process boundary (exits, signals, hangs) for candidates that are not ours.
"""

from __future__ import annotations

import sys
from typing import Any

from reference.candidate import Candidate, CandidateCrash, CandidateError, CandidateRefused, is_user_interrupt
from reference.validate import check_return

#: Modules whose schedulers' return values are not checked (``_Guarded``):
#: the reference and the harness's mutants (deliberately wrong decisions, in
#: the right types). Every other candidate's are, including one subclassing
#: the reference.
TRUSTED_MODULES = ("reference.", "harness.candidates.mutants.")


class Guarded:
    """Calls rank ``rank``'s candidate, turning anything it raises into
    CandidateCrash naming the method (so the engine's own errors and the
    caller's callbacks pass through).

    The boundary between the engine and untrusted candidate code:

    * every BaseException is caught: a candidate's ``sys.exit(0)``,
      ``GeneratorExit`` or ``KeyboardInterrupt`` is a crash, never a
      successful (or interrupted) end of the command. Only the user's own
      interrupt passes: a ``UserInterrupt`` (the harness's SIGINT/SIGTERM
      handler raises it, ``reference.candidate``), or any KeyboardInterrupt
      while Python's default SIGINT handler is in place (a library caller
      that installed none: Ctrl-C must still stop it);
    * every return value is checked (``reference.validate.check_return``:
      types, integrality, int32 ranges, request ids this rank was given)
      before the engine or the trace sees it: ``schedule()`` returning None
      or 114.5 computed tokens is a crash row naming the value, not a
      traceback a line later or a silently truncated count (not for the
      schedulers of ``TRUSTED_MODULES``: ours);
    * whatever the candidate prints goes to stderr (``sys.stdout`` is
      redirected during each call), so ``--json`` output stays parseable.

    A CandidateRefused (the candidate cannot run this config) is a
    CandidateError, not a crash, if it comes before the candidate's first
    decision (its first ``schedule()`` returned); after it, a crash (a
    refusal would otherwise let it skip the step where it diverges)."""

    def __init__(self, candidate: Candidate, engine: Any, rank: int = 0) -> None:
        """``engine``: anything with ``current_step`` (the step a crash is named at)."""
        self._candidate = candidate
        self._engine = engine
        self._rank = rank
        self._known: set[str] = set()  # request ids given to add_request
        self._decided = False  # schedule() has returned once: too late to refuse the run
        # Our own schedulers (the reference, the mutants) return our own types:
        # checking them would cost ~20 % of a golden replay for nothing.
        self._check = not type(candidate).__module__.startswith(TRUSTED_MODULES)

    def __getattr__(self, name: str):
        getattr(self._candidate, name)  # AttributeError for a name the candidate lacks
        candidate = self._candidate

        def call(*args, **kwargs):
            try:
                # contextlib.redirect_stdout's swap, without building its object per call.
                stdout, sys.stdout = sys.stdout, sys.stderr
                try:
                    result = getattr(candidate, name)(*args, **kwargs)
                finally:
                    sys.stdout = stdout
                if name == "add_request" and args:
                    self._known.add(getattr(args[0], "request_id", None))
                if self._check:
                    check_return(name, result, self._known)
                if name == "schedule":
                    self._decided = True
                return result
            except KeyboardInterrupt as exc:
                if is_user_interrupt(exc):
                    raise
                raise CandidateCrash(self._engine.current_step, exc, name, self._rank, skip=1) from exc
            except CandidateRefused as exc:
                if self._decided:
                    # Regression (issue 17): refusing once decisions were made
                    # (at the step it would diverge) turned a failure into a skip.
                    raise CandidateCrash(self._engine.current_step, exc, name, self._rank, skip=1) from exc
                # It cannot run this config: not a crash of the engine.
                raise CandidateError(self._engine.current_step, exc) from exc
            except BaseException as exc:
                # skip=1: this frame is the engine's, not the candidate's.
                raise CandidateCrash(self._engine.current_step, exc, name, self._rank, skip=1) from exc
        # Kept: the next access of ``name`` finds it without __getattr__ (one
        # closure per method, not per call); each call still looks the method up.
        self.__dict__[name] = call
        return call
