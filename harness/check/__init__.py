"""Checking a trace's invariants from the trace alone (``harness check``).

- ``invariants``: the catalogue (ids, statements, spec sections).
- ``checker``: ``TraceChecker``, one streaming pass keeping a shadow of what the
  trace implies, and ``check_steps`` (per-rank checkers plus DP routing).
- ``encoder``: the encoder-input checks.

May import ``reference`` (types only) and ``harness.trace``; never
``harness.candidates`` or the tools: a verdict depends on the trace, not on
which engine made it.
"""

from harness.check.checker import MAX_PER_INVARIANT, CheckResult, TraceChecker, Violation, check_steps

__all__ = ["MAX_PER_INVARIANT", "CheckResult", "TraceChecker", "Violation", "check_steps"]
