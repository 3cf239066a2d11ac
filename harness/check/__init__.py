"""Checking a trace's invariants from the trace alone (``harness check``).

Layout (from an invariant id, ``harness.check.invariants.family_of(id)`` or
``grep -l ID harness/check`` names the one file holding its catalogue entry
and every check of it):

- ``model``: ``TraceModel``, the shadow of what the trace implies (requests,
  queues, block ownership, free-queue order, cached contents, batches in
  flight, fences, KV loads, the encoder cache) and its update methods; with
  ``encoder_cache`` (the shadow encoder cache) and ``result`` (``Invariant``,
  ``Violation``, ``CheckResult``).
- one module per invariant family, each with its ``INVARIANTS`` entries and
  its check functions: ``queues`` (arrivals, queue continuity, running and
  admission order, computed tokens), ``preemption``, ``budget`` (tokens,
  threshold, max_num_seqs, span, prefill deferral), ``blocks`` (tables,
  ownership, free queue, prefix hits), ``spec_decode``, ``fences`` (async
  placeholders, stale output, deferred frees), ``kv_connector``, ``encoder``,
  ``data_parallel``, ``lifecycle`` (outputs, stop rules, reported ids,
  liveness).
- ``invariants``: the aggregated catalogue (``INVARIANTS``, ``describe``).
- ``checker``: ``TraceChecker`` (the model plus one ``_on_<kind>`` handler per
  row kind) and ``check_steps`` (per-rank checkers plus DP routing).

Interface between model and families: a family check is a function
``check_*(m, ...)`` taking the model (and the step state ``st``, the row or
the values it needs), reading the model as it stands *before* the update the
check guards, and reporting through ``m.violate(id, request, message)``; it
returns a bool only where a failed check means the handler must stop or
resynchronise. It updates nothing, except where its id's rule needs it: a
check that stops itself (ALLOC-FROM-HEAD's ``free_queue_known``, the
encoder's ``enc_known``), NO-PROGRESS's ``zero_step_state``, consumed drafts
and the clamp of ASYNC-PLACEHOLDERS; the encoder family's hooks drive the
shadow encoder cache (the window vLLM must choose is the expected value).
Each handler in ``checker`` is the fixed sequence for its row: checks, then
the model update, in the order vLLM takes the decisions; violations are
reported in that order, so a new check goes where its data is first known.

May import ``reference`` (types only) and ``harness.trace``; never
``harness.candidates`` or the tools: a verdict depends on the trace, not on
which engine made it.
"""

from harness.check.checker import TraceChecker, check_steps, check_trace
from harness.check.profiles import PROFILES, Profile, ProfileError
from harness.check.result import MAX_PER_INVARIANT, CheckResult, Violation

__all__ = ["MAX_PER_INVARIANT", "PROFILES", "CheckResult", "Profile", "ProfileError", "TraceChecker",
           "Violation", "check_steps", "check_trace"]
