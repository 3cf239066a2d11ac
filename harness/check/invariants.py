"""The invariant catalogue: stable ids, one-line statements, spec sections.

Each id is what ``harness check`` reports; ``harness invariants`` lists them.
Every entry is in one of two layers (``Invariant.layer``): *safety*, what
every correct engine satisfies whatever its version (its ``why`` says why),
and *semantics*, a rule of one vLLM version's design, checked only under a
profile of a version that has it (``harness.check.profiles``).
The entries live next to their checks, one module per family (``FAMILIES``);
this module only gathers them. Statements say what must hold, not what vLLM
happens to do: where real vLLM breaks one, that is a finding.
"""

from __future__ import annotations

from reference.words import did_you_mean

from harness.check import (
    blocks,
    budget,
    data_parallel,
    encoder,
    fences,
    kv_connector,
    lifecycle,
    preemption,
    queues,
    spec_decode,
)
from harness.check.result import LAYERS, SAFETY, SEMANTICS, Invariant

__all__ = ["FAMILIES", "INVARIANTS", "SAFETY_IDS", "SEMANTICS_IDS", "Invariant", "describe", "family_of"]

# Family modules, in the order of the spec's sections.
FAMILIES = (queues, preemption, budget, blocks, spec_decode, fences, kv_connector, encoder, data_parallel,
            lifecycle)

# The order ``harness invariants`` has always listed (it is stable output).
# An id not named here (a new invariant) is listed after these, in family order.
_LISTING = (
    "ARRIVAL-ADMISSIBLE", "STATE-CONTINUITY", "BUDGET-TOKENS", "BUDGET-THRESHOLD", "MAX-NUM-SEQS",
    "PREEMPT-ONLY-RUNNING", "NO-ADMIT-AFTER-PREEMPT", "PREEMPT-EFFECTS", "PREEMPT-WAITING-HEAD",
    "FCFS-VICTIM-TAIL", "PRIORITY-VICTIM-MAX", "PRIORITY-GIVE-BACK", "RUNNING-ORDER", "ADMISSION-ORDER",
    "COMPUTED-CONTINUITY", "SCHEDULED-SPAN", "PREFIX-HIT-RULES", "HIT-UNCOMPUTED-BLOCK", "BLOCKS-COVER",
    "BLOCK-EXCLUSIVE", "ALLOC-FROM-HEAD", "BLOCK-CONSERVATION", "FREE-ORDER", "OUTPUT-ONLY-COMPLETE",
    "SPEC-TOKENS", "SPEC-ACCEPTANCE", "ASYNC-PLACEHOLDERS", "STALE-OUTPUT", "DEFERRED-FREE-FENCED",
    "PREFILL-DEFER", "REMOTE-KV-LOADING", "REMOTE-KV-RESERVATION", "REMOTE-KV-ABORT-HOLDS",
    "ENCODER-BUDGET", "ENCODER-INPUTS", "ENCODER-CACHE", "DP-ROUTING", "STOP-RULES", "FINISHED-IDS",
    "WAITING-NEVER-PREEMPTS", "IDLE-ADMISSION", "NO-PROGRESS", "LIVENESS",
)


def _gather() -> tuple[dict[str, Invariant], dict[str, str]]:
    by_id: dict[str, Invariant] = {}
    family: dict[str, str] = {}
    for module in FAMILIES:
        for inv in module.INVARIANTS:
            # One id, one home: the file a newcomer opens for it.
            assert inv.id not in by_id, f"{inv.id} is in {family[inv.id]} and {module.__name__}"
            # Every entry says which layer it is in and why (safety: why it
            # holds for every version; semantics: the design it encodes).
            assert inv.layer in LAYERS and inv.why, f"{inv.id}: no layer or no why"
            by_id[inv.id] = inv
            family[inv.id] = module.__name__
    missing = [i for i in _LISTING if i not in by_id]
    assert not missing, f"listed but in no family: {missing}"
    ordered = {i: by_id[i] for i in _LISTING}
    ordered.update((i, inv) for i, inv in by_id.items() if i not in ordered)
    return ordered, family


INVARIANTS, _FAMILY = _gather()
#: The ids of each layer, in listing order.
SAFETY_IDS = tuple(i for i, inv in INVARIANTS.items() if inv.layer == SAFETY)
SEMANTICS_IDS = tuple(i for i, inv in INVARIANTS.items() if inv.layer == SEMANTICS)


def describe(invariant_id: str) -> Invariant:
    """The catalogue entry; KeyError for an unknown id (its message names the close ids)."""
    _known(invariant_id)
    return INVARIANTS[invariant_id]


def family_of(invariant_id: str) -> str:
    """The module holding the invariant's checks (e.g. ``harness.check.preemption``);
    KeyError for an unknown id (its message names the close ids)."""
    _known(invariant_id)
    return _FAMILY[invariant_id]


def _known(invariant_id: str) -> None:
    if invariant_id not in INVARIANTS:
        raise KeyError(f"unknown invariant {invariant_id!r}"
                       + (did_you_mean(invariant_id, INVARIANTS) or " (`harness invariants` lists them)"))
