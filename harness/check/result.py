"""Catalogue records (``Invariant``) and what a check returns: ``Violation``
witnesses and the ``CheckResult`` counts.

Kept apart from the model and the families so both can import it without a
cycle. Counts are recomputed from the trace's rows alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Witnesses kept per invariant (the count goes on), so one noisy rule cannot
# hide another.
MAX_PER_INVARIANT = 10


#: The three layers of the catalogue (``Invariant.layer``).
SAFETY = "safety"        # every correct engine, whatever its version: nothing corrupts
PROGRESS = "progress"    # every correct engine, whatever its version: it makes the progress it can
SEMANTICS = "semantics"  # one vLLM version's design (see harness.check.profiles)
LAYERS = (SAFETY, PROGRESS, SEMANTICS)


@dataclass(frozen=True)
class Invariant:
    """A catalogue entry: stable id, one-line statement, spec section(s), its
    layer and why it is in that layer.

    ``layer`` is SAFETY for a property every correct engine has whatever its
    version (``why``: the argument that it holds for every version: what
    breaks otherwise), PROGRESS for a rule every correct engine keeps about
    making the progress it can (``why``: the public vLLM report of the bug
    class it catches; the statement names its exceptions), or SEMANTICS for a rule of one vLLM version's design
    (``why``: the design choice it encodes; the profiles say which versions
    have it, ``harness.check.profiles``).
    """

    id: str
    statement: str
    spec: str
    layer: str = ""
    why: str = ""


@dataclass
class Violation:
    """One broken invariant, with the evidence: the step, the request (None for
    a step-level rule), the contradicting values and the request's last events."""

    invariant: str
    step: int
    request: str | None
    message: str
    history: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "step": self.step, "request": self.request,
                "message": self.message, "history": self.history}


@dataclass
class CheckResult:
    """Outcome of ``check_steps``: counts over the whole trace, recomputed from its rows
    (deliberately not shared with the engine's ``EngineSummary``: the checker trusts
    only the trace, and tests compare the two)."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    draft_tokens: int = 0  # drafts sent for verification (incl. -1 padding)
    rejected_draft_tokens: int = 0
    deferred_frees: int = 0          # frees held behind a fence (and drained later)
    deferred_prefill_steps: int = 0  # steps that deferred prefill compute
    remote_kv_loads: int = 0         # async KV loads started
    failed_kv_loads: int = 0         # ... reported with invalid blocks
    events: int = 0
    violations: list[Violation] = field(default_factory=list)
    num_violations: int = 0
    by_invariant: dict[str, int] = field(default_factory=dict)
    profile: str = ""  # the semantics profile checked under (harness.check.profiles)
    # Why that profile (e.g. "recorded by vLLM 0.29.0").
    profile_reason: str = ""
    # What could not be checked, one line each (e.g. "PREEMPTED-NO-DRAFTS:
    # not checkable on schema 5 (...)"): not violations.
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.num_violations == 0
