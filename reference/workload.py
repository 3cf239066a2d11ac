"""Workload types: the request stream the engine is fed (loaders live in ``workloads/``).

A :class:`Workload` is an immutable, sorted tuple of :class:`RequestSpec` plus
provenance (source name, sha256, loader parameters). The loaders that build
them from the Azure and Mooncake traces and the synthetic generator are in the
top-level ``workloads`` package, which imports this module (never the
reverse): the engine needs only the types.

Module constants
----------------
``VOCAB_SIZE``
    The scripted model's vocabulary: synthesised prompt tokens and sampled
    tokens are in ``[0, VOCAB_SIZE)``. It is not a limit on workload token
    ids (vocabulary size is a model matter: GPT-2's EOS is 50256).
``MAX_TOKEN_ID``
    The largest token id a workload may carry, ``2**31 - 1``: traces store
    token ids as int32 (``harness/trace/schema.py``).
``EOS_TOKEN_ID``
    The end-of-sequence token id.

Time units: all times (``arrival_time``, ``abort_time``) are in seconds on
the engine's clock, which starts at 0 at the first request of the workload;
``arrival_step`` and ``abort_step`` are engine step numbers (0-based
``schedule()`` calls, see ``reference.engine``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from reference.runners.scripted import parse_draft_acceptance_pattern

__all__ = ["VOCAB_SIZE", "MAX_TOKEN_ID", "EOS_TOKEN_ID", "WorkloadError", "RequestSpec", "Workload", "Action",
           "ACTION_KINDS"]

VOCAB_SIZE = 32000  # the scripted model's vocabulary (not a workload limit)
# Traces store token ids as int32: a larger id could not be recorded.
MAX_TOKEN_ID = 2**31 - 1
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
            ``[0, MAX_TOKEN_ID]`` (a list is accepted and converted).
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
        arrival_step: arrive just before the engine's ``arrival_step``-th
            ``schedule()`` (0-based engine step) instead of at
            ``arrival_time`` (then ignored; keep it 0.0). None = by time.
        after: arrive just before the first ``schedule()`` after the step in
            which request ``after`` ended (finished, aborted or rejected).
            None = by time or step. At most one of ``arrival_step``/``after``.
        abort_step: abort just before the ``abort_step``-th ``schedule()``
            (or at arrival if it arrives later: ``after`` requests); >=
            ``arrival_step`` when that is set. None = never by step.
        output_token_ids: what the model samples for this request, output
            position i -> ``output_token_ids[i]`` (beyond it, the scripted
            model's tokens); None = the scripted model's.
        draft_acceptance_pattern: this request's scripted draft acceptance
            (``EngineConfig.draft_acceptance_pattern`` syntax) instead of the
            config's; None = the config's.

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
    arrival_step: int | None = None
    after: str | None = None
    abort_step: int | None = None
    output_token_ids: tuple[int, ...] | None = None
    draft_acceptance_pattern: str | None = None

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
        if self.output_token_ids is not None and not isinstance(self.output_token_ids, tuple):
            object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise WorkloadError(f"RequestSpec: request_id must be a non-empty str, got {rid!r}")
        where = f"RequestSpec {rid}"
        if not is_real(self.arrival_time) or not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise WorkloadError(f"{where}: arrival_time must be a finite number >= 0, got {self.arrival_time!r}")
        toks = self.prompt_token_ids
        if not toks:
            raise WorkloadError(f"{where}: prompt_token_ids must be non-empty")
        if min(toks) < 0 or max(toks) > MAX_TOKEN_ID:
            raise WorkloadError(f"{where}: prompt_token_ids must lie in [0, 2**31) (traces store int32)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise WorkloadError(f"{where}: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise WorkloadError(
                f"{where}: min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise WorkloadError(f"{where}: ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.eos_token_id is not None and (
            not is_int(self.eos_token_id) or not 0 <= self.eos_token_id <= MAX_TOKEN_ID
        ):
            raise WorkloadError(f"{where}: eos_token_id must be None or an int in [0, 2**31)")
        for name in ("stop_token_ids", "output_token_ids"):
            for t in getattr(self, name) or ():
                if not is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
                    raise WorkloadError(f"{where}: {name} must be ints in [0, 2**31), got {t!r}")
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
        self._check_steps(where)
        # Every int the trace stores goes to an int32 column: a larger one
        # could not be recorded (pyarrow refuses it at the first row group).
        for name in ("max_tokens", "min_tokens", "priority", "scripted_output_len", "arrival_step", "abort_step"):
            value = getattr(self, name)
            if value is not None and not -(2**31) <= value <= MAX_TOKEN_ID:
                raise WorkloadError(f"{where}: {name} {value} does not fit the trace's int32 columns "
                                    f"(at most {MAX_TOKEN_ID})")
        # Normalise ints to floats so equal specs compare and serialise identically.
        object.__setattr__(self, "arrival_time", float(self.arrival_time))
        if self.abort_time is not None:
            object.__setattr__(self, "abort_time", float(self.abort_time))


    def _check_steps(self, where: str) -> None:
        """Validate the step-indexed fields (arrival_step, after, abort_step,
        draft_acceptance_pattern)."""
        for name in ("arrival_step", "abort_step"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 0):
                raise WorkloadError(f"{where}: {name} must be None or an int >= 0, got {value!r}")
        if self.after is not None and (not isinstance(self.after, str) or not self.after):
            raise WorkloadError(f"{where}: after must be None or a request id, got {self.after!r}")
        if self.arrival_step is not None and self.after is not None:
            raise WorkloadError(f"{where}: give at most one of arrival_step and after")
        if self.after == self.request_id:
            raise WorkloadError(f"{where}: after names the request itself")
        if self.abort_step is not None and self.arrival_step is not None \
                and self.abort_step < self.arrival_step:
            raise WorkloadError(f"{where}: abort_step {self.abort_step} is before arrival_step "
                                f"{self.arrival_step}")
        if self.draft_acceptance_pattern is not None:
            try:
                parse_draft_acceptance_pattern(self.draft_acceptance_pattern)
            except ValueError as exc:
                raise WorkloadError(f"{where}: {exc}") from None

    @property
    def by_time(self) -> bool:
        """True when the request arrives by ``arrival_time`` (no step, no after)."""
        return self.arrival_step is None and self.after is None


#: The ``[[actions]]`` kinds (docs/scenario-format.md).
ACTION_KINDS = ("reset_prefix_cache", "abort")


@dataclass(frozen=True)
class Action:
    """An engine-level event at a step (a scenario's ``[[actions]]``).

    Applied just before step ``step``'s ``schedule()``, after that step's
    arrivals and request aborts, actions of one step in workload order; an
    action whose step the engine skips (an idle or stuck stretch) applies at
    the next step it runs. Kinds: ``reset_prefix_cache`` (vLLM
    ``Scheduler.reset_prefix_cache(reset_running_requests)``, on every
    data-parallel rank) and ``abort`` (vLLM ``finish_requests(request_ids,
    FINISHED_ABORTED)``; ids already ended or not yet arrived are ignored).

    Raises WorkloadError for an unknown kind, a negative step, or keys of
    the other kind.
    """

    step: int
    kind: str
    reset_running_requests: bool = False
    request_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "request_ids", tuple(self.request_ids))
        if self.kind not in ACTION_KINDS:
            raise WorkloadError(f"action kind must be one of {', '.join(ACTION_KINDS)}, got {self.kind!r}")
        if not isinstance(self.step, int) or self.step < 0:
            raise WorkloadError(f"action step must be an int >= 0, got {self.step!r}")
        if self.kind == "abort" and (self.reset_running_requests or not self.request_ids):
            raise WorkloadError("an abort action takes request_ids (non-empty) only")
        if self.kind == "reset_prefix_cache" and self.request_ids:
            raise WorkloadError("a reset_prefix_cache action takes no request_ids")

    def to_dict(self) -> dict:
        """The JSON form (trace metadata ``workload.params.actions``; the scenario keys)."""
        out: dict = {"step": self.step, "kind": self.kind}
        if self.kind == "abort":
            out["request_ids"] = list(self.request_ids)
        else:
            out["reset_running_requests"] = self.reset_running_requests
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Action":
        return cls(step=d["step"], kind=d["kind"],
                   reset_running_requests=d.get("reset_running_requests", False),
                   request_ids=tuple(d.get("request_ids", ())))


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
        actions: engine-level events at steps (:class:`Action`, a
            scenario's ``[[actions]]``), in file order; () for every loader
            but scenarios. A scenario also lists them in
            ``params["actions"]`` (``Action.to_dict``), so a trace's
            metadata carries them for replay.
    """

    source: str
    sha256: str
    params: dict = field(hash=False)
    requests: tuple[RequestSpec, ...]
    actions: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.requests, tuple):
            object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "actions", tuple(self.actions))


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
