"""The deterministic scripted model runner.

Plays the role of vLLM's GPU worker for the decisions the scheduler needs: for
each scheduled request it returns the sampled token ids (one token when the
step reaches the end of the request's known tokens, none for a partial
prefill chunk). The token at output position i of request r is a pure function
of (seed, r, i) and of r's script (where it emits EOS), never of the batch, so
any candidate engine can be re-driven with the same outputs.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from reference.output import SchedulerOutput

VOCAB_SIZE = 32000
FIRST_SAMPLED_TOKEN_ID = 10


@dataclass(frozen=True)
class RequestScript:
    """What the scripted model does for one request.

    ``num_prompt_tokens`` in tokens; ``eos_at``: 1-based output position at
    which it emits ``eos_token_id`` (None: never). ``output_token_ids``: the
    tokens fixed for the first output positions (a scenario's
    ``output_token_ids``; they win over ``eos_at``); ``draft_acceptance_pattern``:
    this request's proposer pattern instead of the config's (None: the config's).
    """

    num_prompt_tokens: int
    eos_at: int | None = None
    eos_token_id: int | None = None
    output_token_ids: tuple[int, ...] | None = None
    draft_acceptance_pattern: str | None = None


def scripted_token(seed: int, request_id: str, output_index: int, script: RequestScript) -> int:
    """Token sampled at 0-based ``output_index`` of ``request_id``."""
    fixed = script.output_token_ids
    if fixed is not None and output_index < len(fixed):
        return fixed[output_index]
    if script.eos_at is not None and output_index + 1 == script.eos_at and script.eos_token_id is not None:
        return script.eos_token_id
    digest = hashlib.blake2b(f"{seed}:{request_id}:{output_index}".encode(), digest_size=8).digest()
    return FIRST_SAMPLED_TOKEN_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_SAMPLED_TOKEN_ID)


#: The scripted proposer's acceptance patterns (``EngineConfig.draft_acceptance_pattern``);
#: ``prefix-N`` stands for any N >= 0 (``prefix-0`` is ``none``, ``prefix-1`` "first only").
DRAFT_ACCEPTANCE_PATTERNS = ("random", "all", "none", "prefix-N", "cycle")
_PREFIX_PATTERN = re.compile(r"prefix-(0|[1-9][0-9]{0,5})")


def parse_draft_acceptance_pattern(pattern: object) -> tuple[str, int]:
    """Split a draft acceptance pattern into (kind, N): ``("random", 0)``,
    ``("cycle", 0)`` or ``("prefix", N)`` where the first N drafts of a
    proposal match (``all`` is N = 10**6, more drafts than any proposal has;
    ``none`` is N = 0). Raises ValueError naming the known patterns for
    anything else (including a non-string or N above 999999)."""
    if pattern in ("random", "cycle"):
        return str(pattern), 0
    if pattern == "all":
        return "prefix", 10**6
    if pattern == "none":
        return "prefix", 0
    match = _PREFIX_PATTERN.fullmatch(pattern) if isinstance(pattern, str) else None
    if match is None:
        raise ValueError(f"draft_acceptance_pattern must be one of {', '.join(DRAFT_ACCEPTANCE_PATTERNS)} "
                         f"(N an integer >= 0, e.g. prefix-1), got {pattern!r}")
    return "prefix", int(match.group(1))


def _coin(seed: int, request_id: str, position: int) -> float:
    """A seeded uniform number in [0, 1) for the proposer's accept/reject choice."""
    digest = hashlib.blake2b(f"draft:{seed}:{request_id}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class ScriptedModelRunner:
    """Keeps, like a worker, each request's token count; samples by script.

    ``execute`` returns {request_id: sampled token ids} for every scheduled
    request. Raises KeyError for a request it was never told about.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._scripts: dict[str, RequestScript] = {}
        self._num_tokens: dict[str, int] = {}
        self._num_outputs: dict[str, int] = {}
        self._num_proposals: dict[str, int] = {}  # proposals made per request (pattern "cycle")

    def add_request(self, request_id: str, script: RequestScript) -> None:
        self._scripts[request_id] = script
        self._num_tokens[request_id] = script.num_prompt_tokens
        self._num_outputs[request_id] = 0

    def execute(self, output: SchedulerOutput) -> dict[str, list[int]]:
        for req_id in output.finished_req_ids:
            self._drop(req_id)
        sampled: dict[str, list[int]] = {}
        for rec in output.scheduled:
            req_id = rec.request_id
            end = rec.num_computed_tokens + rec.num_scheduled_tokens - len(rec.spec_token_ids)
            if end < self._num_tokens[req_id]:
                sampled[req_id] = []  # partial prefill chunk: no token
                continue
            # Greedy verification: each draft is accepted while it equals the
            # token the model samples at its position; the first mismatch (or
            # the position after the last draft) yields the bonus token.
            index = self._num_outputs[req_id]
            tokens: list[int] = []
            for draft in rec.spec_token_ids:
                token = scripted_token(self.seed, req_id, index + len(tokens), self._scripts[req_id])
                tokens.append(token)
                if token != draft:
                    break
            else:
                tokens.append(scripted_token(self.seed, req_id, index + len(tokens), self._scripts[req_id]))
            sampled[req_id] = tokens
            self._num_outputs[req_id] = index + len(tokens)
            self._num_tokens[req_id] += len(tokens)
        return sampled

    def propose_drafts(self, request_ids: list[str], num_speculative_tokens: int,
                       acceptance_rate: float, pattern: str = "random") -> dict[str, list[int]]:
        """The scripted proposer: ``num_speculative_tokens`` drafts for the
        next positions of each request (requests it does not know are
        skipped). A draft "matches" when it equals the scripted model's token
        at its position (greedy verification then accepts it); a mismatching
        draft is a token the model never samples there. Which drafts match is
        set by ``pattern`` (``EngineConfig.draft_acceptance_pattern``, see
        ``DRAFT_ACCEPTANCE_PATTERNS``):

        - ``random``: draft j matches with probability ``acceptance_rate``
          (a seeded coin per (request, output position));
        - ``all`` / ``none``: every draft matches / none does;
        - ``prefix-N``: the first N drafts of each proposal match, the rest
          do not (the first rejection is at draft N);
        - ``cycle``: the i-th proposal made to a request (0-based, counted
          by this runner) has its first ``i mod (K + 1)`` drafts matching, so a
          request in turn rejects at draft 0, 1, ..., K-1 and accepts all K.

        A request whose script has its own ``draft_acceptance_pattern``
        uses it instead of ``pattern``.
        ``acceptance_rate`` (in [0, 1]) matters only for ``random``. Raises
        ValueError for a pattern ``parse_draft_acceptance_pattern`` refuses.
        """
        drafts: dict[str, list[int]] = {}
        for req_id in request_ids:
            if req_id not in self._scripts:
                continue
            # A request's own pattern (a scenario's draft_acceptance_pattern) wins.
            kind, prefix = parse_draft_acceptance_pattern(
                self._scripts[req_id].draft_acceptance_pattern or pattern)
            index = self._num_outputs[req_id]
            if kind == "cycle":
                count = self._num_proposals.get(req_id, 0)
                self._num_proposals[req_id] = count + 1
                prefix = count % (num_speculative_tokens + 1)
            proposal = []
            for j in range(num_speculative_tokens):
                token = scripted_token(self.seed, req_id, index + j, self._scripts[req_id])
                if kind == "random":
                    matches = _coin(self.seed, req_id, index + j) < acceptance_rate
                else:
                    matches = j < prefix
                if not matches:
                    token = FIRST_SAMPLED_TOKEN_ID + (token - FIRST_SAMPLED_TOKEN_ID + 1) % (
                        VOCAB_SIZE - FIRST_SAMPLED_TOKEN_ID)
                proposal.append(token)
            drafts[req_id] = proposal
        return drafts

    def finish(self, request_id: str) -> None:
        """Forget a request (finished or aborted)."""
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self._scripts.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._num_outputs.pop(request_id, None)
        self._num_proposals.pop(request_id, None)
