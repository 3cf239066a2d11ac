"""The invariant catalogue: stable ids, one-line statements, spec sections.

Each id is what ``harness check`` reports; ``harness invariants`` lists them.
Every entry is in one of three layers (``Invariant.layer``): *safety*, what
every correct engine satisfies whatever its version (its ``why`` says why:
nothing corrupts); *progress*, what every correct engine keeps about making
the progress it can (its ``why`` cites the public vLLM report of the bug
class; the statement names the exceptions: ``harness.check.progress``); and
*semantics*, a rule of one vLLM version's design, checked only under a
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
    hybrid,
    kv_connector,
    lifecycle,
    preemption,
    progress,
    queues,
    spec_decode,
)
from harness.check.result import LAYERS, PROGRESS, SAFETY, SEMANTICS, Invariant

__all__ = ["FAMILIES", "INVARIANTS", "PROGRESS_IDS", "SAFETY_IDS", "SEMANTICS_IDS", "Invariant", "describe",
           "family_of", "fork_hint", "root_cause_first"]

# Family modules, in the order of the spec's sections.
FAMILIES = (queues, preemption, budget, blocks, hybrid, spec_decode, fences, kv_connector, encoder, data_parallel,
            lifecycle, progress)

# The order ``harness invariants`` has always listed (it is stable output).
# An id not named here (a new invariant) is listed after these, in family order.
_LISTING = (
    "ARRIVAL-ADMISSIBLE", "STATE-CONTINUITY", "BUDGET-TOKENS", "BUDGET-LEFT", "BUDGET-THRESHOLD", "MAX-NUM-SEQS",
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
PROGRESS_IDS = tuple(i for i, inv in INVARIANTS.items() if inv.layer == PROGRESS)


def describe(invariant_id: str) -> Invariant:
    """The catalogue entry; KeyError for an unknown id (its message names the close ids)."""
    _known(invariant_id)
    return INVARIANTS[invariant_id]


def family_of(invariant_id: str) -> str:
    """The module holding the invariant's checks (e.g. ``harness.check.preemption``);
    KeyError for an unknown id (its message names the close ids)."""
    _known(invariant_id)
    return _FAMILY[invariant_id]


def fork_hint(invariant_ids, *, diverged: bool = False, option: str = "--semantics fork") -> str | None:
    """One line for a finding that a correct fork can give: every id in
    ``invariant_ids`` (an iterable of ids) is a version-semantics rule (a
    release's design: a fork whose policy differs on purpose breaks it), or the
    run only decided differently from the reference (``diverged``). None when a
    safety or progress rule fired (a bug in any engine) or an id is unknown.
    ``option``: how the command names the fork profile (the pytest plugin's is
    ``--harness-semantics fork``). Regression (new-user trial): fuzz, golden
    check and the plugin printed a bare "violation: ADMISSION-ORDER" for a
    correct shortest-prompt-first fork, with no word of the layer."""
    ids = sorted(set(invariant_ids))
    if ids and all(i in INVARIANTS and INVARIANTS[i].layer == SEMANTICS for i in ids):
        what = ", ".join(ids)
        return (f"{what} {'is a' if len(ids) == 1 else 'are'} version-semantics rule{'s' * (len(ids) > 1)} "
                f"(a release's design, not a safety or progress bug): for a fork whose policy differs "
                f"on purpose, {option} holds it to safety and progress only")
    if not ids and diverged:
        return (f"the candidate decides differently from the reference: for a fork whose policy differs "
                f"on purpose, {option} holds it to safety and progress only")
    return None


#: Ids that notice the effects of a decision made earlier (bookkeeping that no
#: longer adds up, a deferral computed from queues a wrong decision changed,
#: a request left behind): listed after the decision rules of the same
#: request and step. The progress layer comes last (lost progress is the
#: consequence of any of them).
CONSEQUENCE_IDS = frozenset({
    "COMPUTED-CONTINUITY", "STATE-CONTINUITY", "BLOCK-CONSERVATION", "SCHEDULED-SPAN", "BLOCKS-COVER",
    "BLOCKS-EXACT", "OUTPUT-ONLY-COMPLETE", "PREFILL-DEFER", "FINISHED-IDS", "SCHEDULED-HAS-DATA", "IDLE-ADMISSION",
    "NO-PROGRESS", "LIVENESS",
})


def _cause_rank(inv_id: str) -> int:
    inv = INVARIANTS.get(inv_id)
    if inv is not None and inv.layer == PROGRESS:
        return 2
    return 1 if inv_id in CONSEQUENCE_IDS else 0


def root_cause_first(violations: list) -> list:
    """``violations`` (``Violation``s in the order the checks ran, which is
    the order vLLM takes its decisions) with each (step, request) group's
    witnesses together, at the place of its first, ordered: the decision
    rules first (which request runs, is preempted or admitted, how much it
    gets, where its KV goes), then the ids that notice their effects
    (``CONSEQUENCE_IDS``), then the progress layer; ties keep check order.
    E.g. a PRIORITY victim left in num_scheduled_tokens: SCHEDULED-NOT-PREEMPTED
    before the COMPUTED-CONTINUITY it causes; a request admitted in a step
    that preempted: NO-ADMIT-AFTER-PREEMPT before PREFILL-DEFER. Step-level
    witnesses (request None) form their own group."""
    first: dict[tuple, int] = {}
    for index, v in enumerate(violations):
        first.setdefault((v.step, v.request), index)
    order = sorted(range(len(violations)),
                   key=lambda i: (first[(violations[i].step, violations[i].request)],
                                  _cause_rank(violations[i].invariant), i))
    return [violations[i] for i in order]


def _known(invariant_id: str) -> None:
    if invariant_id not in INVARIANTS:
        raise KeyError(f"unknown invariant {invariant_id!r}"
                       + (did_you_mean(invariant_id, INVARIANTS) or " (`harness invariants` lists them)"))


#: Rules the model cannot judge on a recording with a feature it does not follow,
#: by the ``unmodelled`` key of a trace's ``vllm_recording`` metadata
#: (``recording_convert``): the block rules, for what vLLM's KV manager does
#: there beyond the model's one pool of full-attention blocks. ``kv_cache_groups``
#: marks only groups the converter cannot name as ``sliding_window``/``layer_types``
#: (or a recording made before every group was recorded): a hybrid recording
#: whose groups it names is schema 9 and every block rule runs per group.
UNMODELLED_RULES: dict[str, tuple[str, ...]] = {
    "kv_connector": ("BLOCK-CONSERVATION", "ALLOC-FROM-HEAD", "BLOCKS-COVER", "BLOCKS-EXACT", "COMPUTED-CONTINUITY",
                     "BLOCK-EXCLUSIVE", "FREE-ORDER", "PREFIX-HIT-RULES", "HIT-UNCOMPUTED-BLOCK",
                     "REMOTE-KV-LOADING", "REMOTE-KV-RESERVATION", "REMOTE-KV-ABORT-HOLDS"),
    # A KV producer (finished_sending reports): a finished request's blocks stay
    # held until sent, freed by no row of the trace (its other block rules are
    # skipped with "kv_connector": its answers are then not followed either).
    "kv_connector_sending": ("FREE-WHOLE-TABLE",),
    "streaming_input": ("STOP-RULES", "LIVENESS"),
    "kv_cache_spec": ("BLOCK-CONSERVATION", "ALLOC-FROM-HEAD", "BLOCKS-COVER", "BLOCKS-EXACT", "COMPUTED-CONTINUITY",
                      "BLOCK-EXCLUSIVE", "FREE-ORDER", "PREFIX-HIT-RULES", "HIT-UNCOMPUTED-BLOCK"),
    "kv_cache_groups": ("BLOCK-CONSERVATION", "ALLOC-FROM-HEAD", "BLOCKS-COVER", "BLOCKS-EXACT", "COMPUTED-CONTINUITY",
                        "BLOCK-EXCLUSIVE", "FREE-ORDER", "PREFIX-HIT-RULES", "HIT-UNCOMPUTED-BLOCK"),
}

#: The rules a KV connector still keeps the model from judging when the trace
#: recorded the connector's answers (its config's ``kv_connector_matches`` and
#: ``kv_connector_outputs``, ``reference.kv_connector.RecordedKVConnector``):
#: the model then counts the external tokens of every admission (synchronous,
#: or an async load into WAITING_FOR_REMOTE_KVS), the loads' reports, their
#: failures and the frees they delay, so every other rule of
#: ``UNMODELLED_RULES["kv_connector"]`` is judged.
RECORDED_CONNECTOR_UNJUDGED: tuple[str, ...] = ()
