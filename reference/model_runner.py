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
            end = rec.num_computed_tokens + rec.num_scheduled_tokens
            if end < self._num_tokens[rec.request_id]:
                sampled[rec.request_id] = []  # partial prefill chunk: no token
                continue
            index = self._num_outputs[rec.request_id]
            token = scripted_token(self.seed, rec.request_id, index, self._scripts[rec.request_id])
            sampled[rec.request_id] = [token]
            self._num_outputs[rec.request_id] = index + 1
            self._num_tokens[rec.request_id] += 1
        return sampled

    def finish(self, request_id: str) -> None:
        """Forget a request (finished or aborted)."""
        self._drop(request_id)

    def _drop(self, request_id: str) -> None:
        self._scripts.pop(request_id, None)
        self._num_tokens.pop(request_id, None)
        self._num_outputs.pop(request_id, None)
