"""Workload types: the request stream the engine is fed (loaders live in ``workloads/``).

A :class:`Workload` is an immutable, sorted tuple of :class:`RequestSpec` plus
provenance (source name, sha256, loader parameters). The loaders that build
them from the Azure and Mooncake traces and the synthetic generator are in the
top-level ``workloads`` package, which imports this module (never the
reverse): the engine needs only the types.

Module constants
----------------
``VOCAB_SIZE``
    Token ids are in ``[0, VOCAB_SIZE)``.
``EOS_TOKEN_ID``
    The end-of-sequence token id.

Time units: all times (``arrival_time``, ``abort_time``) are in seconds on
the engine's clock, which starts at 0 at the first request of the workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VOCAB_SIZE", "EOS_TOKEN_ID", "WorkloadError", "RequestSpec", "Workload"]

VOCAB_SIZE = 32000  # token ids are in [0, VOCAB_SIZE)
EOS_TOKEN_ID = 2


class WorkloadError(ValueError):
    """A workload could not be built.

    Raised for a missing, unreadable, empty or corrupt workload file (the
    message names the file, the 1-based line number where relevant, and the
    problem), for invalid loader/generator arguments, and for an invalid
    :class:`RequestSpec`.  Subclass of :class:`ValueError`.
    """


# --------------------------------------------------------------------------
# Data classes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload (immutable).

    Attributes:
        request_id: ``"r000000"``, ``"r000001"``, ... -- the 0-based index of
            the request in its source (file row order / generation order),
            zero-padded to 6 digits, so lexicographic order equals numeric
            order.
        arrival_time: seconds since the first request of the workload,
            already divided by the loader's ``time_scale``; finite and >= 0
            (an int is accepted and stored as float).
        prompt_token_ids: the prompt, a non-empty tuple of ints in
            ``[0, VOCAB_SIZE)`` (a list is accepted and converted).
        max_tokens: maximum number of output tokens, >= 1.
        min_tokens: minimum number of output tokens before EOS/stop tokens
            are honoured, in ``[0, max_tokens]``.
        ignore_eos: if true the engine does not stop on ``eos_token_id``.
        eos_token_id: the EOS token id, or None for no EOS.
        stop_token_ids: extra token ids that stop the request (tuple).
        priority: scheduling priority; smaller = more important (vLLM
            convention).
        scripted_output_len: the scripted model emits EOS as output token
            number ``scripted_output_len`` (1-based, >= 1); None = never.
        abort_time: seconds on the same clock as ``arrival_time`` (and
            >= it); the engine aborts the request when its clock passes this.
            None = never aborted.
        mm_positions: encoder inputs (multimodal items) as ``(offset,
            length)`` pairs of prompt token positions: sorted by offset,
            non-overlapping (adjacent is fine), each ``length >= 1`` and inside
            the prompt (a list of lists is accepted and converted). An item's
            encoder output has ``length`` embeds; its identifier (vLLM
            ``mm_hash``) is a hash of the prompt tokens it covers, so equal
            items of different requests share encoder-cache entries. Empty =
            a text-only request.

    Raises:
        WorkloadError: (from construction) if any field violates the
            constraints above.  Token ids are range-checked with min/max;
            their type is not checked element by element.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = True
    eos_token_id: int | None = EOS_TOKEN_ID
    stop_token_ids: tuple[int, ...] = ()
    priority: int = 0
    scripted_output_len: int | None = None
    abort_time: float | None = None
    mm_positions: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        if not (isinstance(self.mm_positions, tuple)
                and all(isinstance(p, tuple) for p in self.mm_positions)):
            try:
                object.__setattr__(self, "mm_positions", tuple(tuple(p) for p in self.mm_positions))
            except TypeError:
                raise WorkloadError(f"RequestSpec {self.request_id}: mm_positions must be a sequence "
                                    f"of (offset, length) pairs, got {self.mm_positions!r}") from None
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise WorkloadError(f"RequestSpec: request_id must be a non-empty str, got {rid!r}")
        where = f"RequestSpec {rid}"
        if not is_real(self.arrival_time) or not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise WorkloadError(f"{where}: arrival_time must be a finite number >= 0, got {self.arrival_time!r}")
        toks = self.prompt_token_ids
        if not toks:
            raise WorkloadError(f"{where}: prompt_token_ids must be non-empty")
        if min(toks) < 0 or max(toks) >= VOCAB_SIZE:
            raise WorkloadError(f"{where}: prompt_token_ids must lie in [0, {VOCAB_SIZE})")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise WorkloadError(f"{where}: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise WorkloadError(
                f"{where}: min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise WorkloadError(f"{where}: ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.eos_token_id is not None and (
            not is_int(self.eos_token_id) or not 0 <= self.eos_token_id < VOCAB_SIZE
        ):
            raise WorkloadError(f"{where}: eos_token_id must be None or an int in [0, {VOCAB_SIZE})")
        for t in self.stop_token_ids:
            if not is_int(t) or not 0 <= t < VOCAB_SIZE:
                raise WorkloadError(f"{where}: stop_token_ids must be ints in [0, {VOCAB_SIZE}), got {t!r}")
        if not is_int(self.priority):
            raise WorkloadError(f"{where}: priority must be an int, got {self.priority!r}")
        if self.scripted_output_len is not None and (
            not is_int(self.scripted_output_len) or self.scripted_output_len < 1
        ):
            raise WorkloadError(f"{where}: scripted_output_len must be None or an int >= 1")
        if self.abort_time is not None and (
            not is_real(self.abort_time)
            or not math.isfinite(self.abort_time)
            or self.abort_time < self.arrival_time
        ):
            raise WorkloadError(
                f"{where}: abort_time must be None or a finite number >= arrival_time={self.arrival_time}"
            )
        _check_mm_positions(where, self.mm_positions, len(toks))
        # Normalise ints to floats so equal specs compare and serialise identically.
        object.__setattr__(self, "arrival_time", float(self.arrival_time))
        if self.abort_time is not None:
            object.__setattr__(self, "abort_time", float(self.abort_time))


@dataclass(frozen=True)
class Workload:
    """An immutable request stream plus its provenance.

    Attributes:
        source: where it came from, e.g. ``"azure:AzureLLMInferenceTrace_code.csv"``,
            ``"mooncake:conversation_trace.jsonl"`` or ``"synthetic"`` (file
            sources carry the file's base name only, so the value does not
            depend on where the checkout lives).
        sha256: lowercase sha256 hex digest of the source file's bytes; for
            synthetic workloads, of the canonical JSON (sorted keys, no
            spaces) of ``params``.
        params: the loader/generator arguments (``limit``, ``time_scale``,
            ``seed``, ``priority_levels``, ...) as plain JSON-able values.
            Excluded from ``hash()`` (a dict is unhashable) but compared by
            ``==``.
        requests: the requests sorted by ``(arrival_time, request_id)``;
            never empty when built by this module's loaders.
    """

    source: str
    sha256: str
    params: dict = field(hash=False)
    requests: tuple[RequestSpec, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_mm_positions(where: str, positions: tuple, num_prompt_tokens: int) -> None:
    """Raise WorkloadError unless ``positions`` are sorted, non-overlapping
    ``(offset, length)`` int pairs with ``length >= 1`` inside the prompt."""
    end = 0
    for i, pos in enumerate(positions):
        if len(pos) != 2 or not all(is_int(v) for v in pos):
            raise WorkloadError(f"{where}: mm_positions[{i}] must be an (offset, length) pair of ints, "
                                f"got {pos!r}")
        offset, length = pos
        if offset < 0 or length < 1:
            raise WorkloadError(f"{where}: mm_positions[{i}] = {pos!r} needs offset >= 0 and length >= 1")
        if offset < end:
            raise WorkloadError(f"{where}: mm_positions[{i}] = {pos!r} starts before the previous item "
                                f"ends (token {end}): items must be sorted and non-overlapping")
        end = offset + length
        if end > num_prompt_tokens:
            raise WorkloadError(f"{where}: mm_positions[{i}] = {pos!r} ends at token {end}, past the "
                                f"{num_prompt_tokens}-token prompt")
