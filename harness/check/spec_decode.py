"""Speculative decoding: which drafts are stored, scheduled and accepted.

vLLM 0.33.0 ``Scheduler.schedule`` / ``update_from_output`` /
``update_draft_token_ids`` (spec 3.2 step 13, 6 d, 10.6, 10.8). The pending
drafts are ``ReqShadow.spec_token_ids``; a batch's drafts are in ``Batch.drafts``.

Under async scheduling (``AsyncScheduler._update_after_schedule``) the
scheduler never receives draft ids: every request it schedules past its
prefill gets ``num_speculative_tokens`` placeholders ``-1`` as pending drafts,
so its next step schedules ``-1`` drafts, which the worker fills with its own
(``reference.async_spec``); the trace has no ``draft`` rows, and which of the
worker's drafts matched is not in it. What the trace does show is checked
exactly: the ``-1`` drafts ride on the positions past ``num_tokens +
num_output_placeholders`` (SPEC-TOKENS), 1 to 1 + drafts tokens come back
(OUTPUT-ONLY-COMPLETE), and the rejections (drafts - tokens + 1) roll back the
computed count and the placeholders one step later, except for the stale
output of a preempted request (COMPUTED-CONTINUITY, ASYNC-PLACEHOLDERS at the
next schedule; STALE-OUTPUT).
"""

from __future__ import annotations

from harness.check.model import ReqShadow, TraceModel
from harness.check.result import SAFETY, Invariant

INVARIANTS = [
    Invariant("SPEC-TOKENS", "Drafts are stored only for decoding requests (num_speculative_tokens of them), scheduled only on the positions past num_tokens (the first k pending drafts, never for a prefill chunk), cleared by every scheduling and by preemption; a request admitted from waiting carries no real draft, only the -1 padding of a new decode; under async scheduling every request scheduled past its prefill holds num_speculative_tokens placeholders -1 instead (no real drafts reach the scheduler).", "3.2 step 13, 3.4, 4.3, 10.6, 8 #19-20",
              SAFETY, "Drafts are verified against the tokens they follow: stored only for a decoding request, at most num_speculative_tokens, scheduled only past num_tokens, never for a prefill chunk, consumed when scheduled and never carried by a request coming from waiting (a preempted request recomputes; its old drafts would be verified against the wrong position) (mission invariant 3)."),
    Invariant("SPEC-ACCEPTANCE", "The model returns the accepted drafts plus one token; rejected drafts roll num_computed_tokens back (and, async, the placeholders that covered them, one step later; never for the stale output of a preempted request).", "6 d, 10.8, 8 #21",
              SAFETY, "Accepted drafts are a prefix of the sampled tokens and rejected ones are rolled back from num_computed_tokens, or KV of rejected tokens is treated as valid."),
]


def check_running_drafts(m: TraceModel, req: ReqShadow, computed: int, n: int, drafts: list[int]) -> None:
    """SPEC-TOKENS for a running request: drafts ride on the tokens past
    num_tokens, exactly the first k of the pending drafts, none for a prefill
    chunk. Clears the pending drafts (scheduling consumes them)."""
    k = computed + n - req.num_tokens - req.placeholders
    expected = req.spec_token_ids[:k] if k > 0 else []
    if drafts != expected:
        m.violate("SPEC-TOKENS", req.request_id,
                  f"scheduled drafts {drafts} but its pending drafts were {req.spec_token_ids} "
                  f"and {max(k, 0)} draft positions were scheduled")
    req.spec_token_ids = []


def check_admission_drafts(m: TraceModel, req: ReqShadow, computed: int, n: int, drafts: list[int]) -> None:
    """SPEC-TOKENS for an admission: no real draft (a request admitted from
    waiting has none to verify since it last ran), and -1 padding only for a
    new decode, num_speculative_tokens of them (anything else puts draft
    positions on a prefill chunk). Clears the pending drafts."""
    if not drafts:
        return
    hit = computed
    if any(t != -1 for t in drafts):
        m.violate("SPEC-TOKENS", req.request_id,
                  f"admitted with draft tokens {drafts} ({n} tokens, hit {hit} of {req.num_tokens}): "
                  f"a request coming from waiting holds no drafts to verify")
    elif not (m.num_spec > 0 and n == 1 + m.num_spec and hit + 1 == req.num_tokens
              and len(drafts) == m.num_spec):
        m.violate("SPEC-TOKENS", req.request_id,
                  f"admitted with drafts {drafts} ({n} tokens, hit {hit} of {req.num_tokens}); "
                  f"only a new decode may be padded with {m.num_spec} x -1")
    req.spec_token_ids = []


def check_stored_drafts(m: TraceModel, rid: str, req: ReqShadow | None, drafts: list[int]) -> bool:
    """SPEC-TOKENS at a ``draft`` row: for a live decoding request, 0 to
    num_speculative_tokens of them (vLLM stores what the proposer gives, its
    -1 padding stripped: the n-gram proposer gives fewer near the end of the
    context, ``ngram_proposer.py``); none while prefilling. False for an
    unknown request.

    Regression: exactly num_speculative_tokens were required, a false alarm
    on real vLLM (its own test_scheduler.py spec-decode tests)."""
    if req is None:
        m.violate("SPEC-TOKENS", rid, "drafts stored for an unknown or finished request")
        return False
    if (req.prefill_chunk and drafts) or len(drafts) > m.num_spec:
        m.violate("SPEC-TOKENS", rid,
                  f"stored {len(drafts)} drafts (num_speculative_tokens {m.num_spec}) "
                  f"while {'prefilling' if req.prefill_chunk else 'decoding'}")
    return True


def set_async_draft_placeholders(m: TraceModel, req: ReqShadow) -> None:
    """Async scheduling: a request scheduled past its prefill holds
    num_speculative_tokens placeholders -1 as its pending drafts
    (``AsyncScheduler._spec_token_placeholders``)."""
    req.spec_token_ids = [-1] * m.num_spec


def check_acceptance(m: TraceModel, rid: str, tokens: list[int], drafts: list[int]) -> None:
    """SPEC-ACCEPTANCE at an ``output`` row: the sampled tokens start with the
    accepted drafts (all but the last token). A -1 draft is the padding of a
    new decode, never accepted; under async scheduling it is a placeholder the
    worker filled with a draft the trace does not hold, so it matches any
    token."""
    accepted = len(tokens) - 1
    if m.async_scheduling:
        drafts = [t if d == -1 else d for d, t in zip(drafts, tokens)] + drafts[len(tokens):]
    if tokens[:accepted] != drafts[:accepted]:
        m.violate("SPEC-ACCEPTANCE", rid, f"sampled {tokens} does not start with the accepted drafts {drafts[:accepted]}")
