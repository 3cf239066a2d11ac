"""Requests, their statuses and the stop rule.

Mirrors ``vllm/v1/request.py`` (``Request``, ``RequestStatus``) and
``vllm/v1/core/sched/utils.py::check_stop`` of vLLM 0.33.0, restricted to what a
single full-attention KV group with a text-only decoder needs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from reference.encoder_cache_manager import mm_identifier
from reference.kv_cache_utils import hash_request_blocks


class RequestStatus(enum.IntEnum):
    """Request status, ordered exactly as vLLM's enum: order matters.

    ``is_finished`` is "ordinal > PREEMPTED" (spec section 2.1).
    """

    WAITING = enum.auto()
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    WAITING_FOR_STREAMING_REQ = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()
    FINISHED_ERROR = enum.auto()
    FINISHED_REPETITION = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        """The OpenAI-style finish reason of a finished status, else None."""
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_IGNORED: "length",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.FINISHED_REPETITION: "repetition",
    RequestStatus.WAITING_FOR_STREAMING_REQ: "stop",
}


@dataclass(frozen=True)
class SamplingParams:
    """The subset of ``vllm.SamplingParams`` that drives scheduling decisions.

    ``eos_token_id`` is what vLLM's input processor copies from the generation
    config; with ``ignore_eos`` it is treated as absent (``check_stop`` never
    fires on it). Units: tokens.

    Raises ValueError on ``max_tokens < 1``, ``min_tokens < 0`` or
    ``min_tokens > max_tokens`` (vLLM's ``SamplingParams._verify_args``).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    @property
    def effective_eos_token_id(self) -> int | None:
        return None if self.ignore_eos else self.eos_token_id


@dataclass(eq=False)
class Request:
    """One generation request, as the scheduler sees it.

    Token counts are in tokens. ``block_hashes`` holds one hash per *full*
    block of ``all_token_ids`` and is extended as tokens are appended (vLLM's
    ``Request.block_hasher``). Identity semantics (``eq=False``): two requests
    are equal only if they are the same object, as in vLLM.

    Encoder inputs (vLLM ``mm_features``): ``mm_positions`` are ``(offset,
    length)`` items of the prompt (sorted, non-overlapping), ``mm_hashes``
    their identifiers (vLLM ``MultiModalFeatureSpec.identifier``):
    ``mm_identifiers`` when given (a recording of vLLM: one per item), else a
    hash of the covered prompt tokens; an item has ``length`` embeds.

    ``resumable``: a streaming-input session (vLLM ``Request.resumable``):
    when it stops it is not finished but parked in
    ``WAITING_FOR_STREAMING_REQ``, holding its blocks, until its next input
    chunk (``Scheduler._handle_stopped_request``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    block_size: int = 16
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    is_prefill_chunk: bool = False
    last_sched_seq: int = 0
    stop_reason: int | str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[bytes] = field(default_factory=list)
    mm_positions: tuple[tuple[int, int], ...] = ()
    mm_identifiers: tuple[str, ...] = ()
    # vLLM LoRARequest.lora_int_id of its adapter (0: no LoRA).
    lora_int_id: int = 0
    resumable: bool = False
    mm_hashes: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.max_tokens = self.sampling_params.max_tokens
        self.mm_positions = tuple((int(o), int(n)) for o, n in self.mm_positions)
        if self.mm_identifiers:
            if len(self.mm_identifiers) != len(self.mm_positions):
                raise ValueError(f"request {self.request_id}: {len(self.mm_identifiers)} mm_identifiers "
                                 f"for {len(self.mm_positions)} mm_positions")
            self.mm_hashes = tuple(self.mm_identifiers)
        else:
            self.mm_hashes = tuple(mm_identifier(self.prompt_token_ids[o:o + n]) for o, n in self.mm_positions)
        self._update_block_hashes()

    # vLLM's PRIORITY heap order: priority, then arrival, then id.
    def __lt__(self, other: Request) -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_positions)

    def get_num_encoder_embeds(self, input_id: int) -> int:
        """Embeds of item ``input_id``: its length (no ``is_embed`` mask)."""
        return self.mm_positions[input_id][1]

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        all_token_ids = self.all_token_ids
        all_token_ids.append(token_id)
        if len(all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:
            self._update_block_hashes()  # a block just filled (else there is nothing to hash)

    def _update_block_hashes(self) -> None:
        # One hash per full block; partial tails and drafts are never hashed.
        hash_request_blocks(self.all_token_ids, self.block_size, self.block_hashes,
                            self.mm_positions, self.mm_hashes)


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set a finished status on ``request`` if its last output token stops it.

    Order (vLLM 0.33.0 ``check_stop``, spec section 10.8): EOS, then a stop token
    (``stop_reason`` = that token), then length (``num_tokens >= max_model_len``
    or ``num_output_tokens >= max_tokens``). In 0.33.0 ``min_tokens`` only
    suppresses repetition detection, which the reference does not model; the
    sampler (here: the scripted model) is what keeps stop tokens out before
    ``min_tokens``. Returns True when the request stopped.
    """
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    last = output_token_ids[-1]
    if last == (None if params.ignore_eos else params.eos_token_id):  # effective_eos_token_id
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last in params.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last
        return True
    # num_tokens, num_output_tokens
    if len(request.all_token_ids) >= max_model_len or len(output_token_ids) >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
