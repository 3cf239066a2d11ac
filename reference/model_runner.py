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
from dataclasses import dataclass

from reference.output import SchedulerOutput

VOCAB_SIZE = 32000
FIRST_SAMPLED_TOKEN_ID = 10


@dataclass(frozen=True)
class RequestScript:
    """What the scripted model does for one request.

    ``num_prompt_tokens`` in tokens; ``eos_at``: 1-based output position at
    which it emits ``eos_token_id`` (None: never).
    """

    num_prompt_tokens: int
    eos_at: int | None = None
    eos_token_id: int | None = None


def scripted_token(seed: int, request_id: str, output_index: int, script: RequestScript) -> int:
    """Token sampled at 0-based ``output_index`` of ``request_id``."""
    if script.eos_at is not None and output_index + 1 == script.eos_at and script.eos_token_id is not None:
        return script.eos_token_id
    digest = hashlib.blake2b(f"{seed}:{request_id}:{output_index}".encode(), digest_size=8).digest()
    return FIRST_SAMPLED_TOKEN_ID + int.from_bytes(digest, "little") % (VOCAB_SIZE - FIRST_SAMPLED_TOKEN_ID)


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
                       acceptance_rate: float) -> dict[str, list[int]]:
        """The scripted proposer: ``num_speculative_tokens`` drafts for the
        next positions of each request. Draft j equals the scripted model's
        token there with probability ``acceptance_rate`` (a seeded coin per
        (request, position)), else a token the model never samples there.
        """
        drafts: dict[str, list[int]] = {}
        for req_id in request_ids:
            if req_id not in self._scripts:
                continue
            index = self._num_outputs[req_id]
            proposal = []
            for j in range(num_speculative_tokens):
                token = scripted_token(self.seed, req_id, index + j, self._scripts[req_id])
                if _coin(self.seed, req_id, index + j) >= acceptance_rate:
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
