"""Workloads: deterministic request streams fed to the reference engine.

A :class:`Workload` is an immutable, sorted tuple of :class:`RequestSpec` plus
provenance (source name, sha256, loader parameters).  Three sources exist:

* :func:`load_azure` -- the Azure LLM inference trace 2023 CSV files
  (``TIMESTAMP,ContextTokens,GeneratedTokens``).  Token ids are synthesised
  per request; there is no prefix sharing between requests.
* :func:`load_mooncake` -- the Mooncake FAST'25 JSONL traces
  (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).  Token
  ids are synthesised per 512-token block from the block's hash id, so
  requests that share their first k hash ids share exactly their first
  ``k * MOONCAKE_BLOCK_TOKENS`` prompt tokens.
* :func:`synthetic` -- a seeded random generator (Poisson arrivals, optional
  shared prefix, EOS scripting, aborts and priorities).

:func:`load_workload` dispatches on a spec string.

Everything is deterministic: the same arguments (and, for files, the same file
bytes) give an identical :class:`Workload`.  All randomness comes from
``random.Random`` instances seeded with strings (``random.Random(str)`` hashes
the string with SHA-512, so seeding is stable across processes and Python
versions); there is no global mutable state.

Module constants
----------------
``VOCAB_SIZE``
    Token ids are in ``[0, VOCAB_SIZE)``.
``EOS_TOKEN_ID``
    The end-of-sequence token id.
``FIRST_PROMPT_TOKEN_ID``
    Synthesised prompt tokens are in ``[FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE)``;
    ids below it (EOS included) never appear in a synthesised prompt.
``MOONCAKE_BLOCK_TOKENS``
    Tokens per Mooncake ``hash_ids`` block (512).

Time units: all times (``arrival_time``, ``abort_time``) are in seconds on
the engine's clock, which starts at 0 at the first request of the workload.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import io
import json
import math
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

__all__ = [
    "VOCAB_SIZE",
    "EOS_TOKEN_ID",
    "FIRST_PROMPT_TOKEN_ID",
    "MOONCAKE_BLOCK_TOKENS",
    "WorkloadError",
    "RequestSpec",
    "Workload",
    "load_azure",
    "load_mooncake",
    "synthetic",
    "load_workload",
]

VOCAB_SIZE = 32000  # token ids are in [0, VOCAB_SIZE)
EOS_TOKEN_ID = 2
FIRST_PROMPT_TOKEN_ID = 10  # synthesised prompt tokens are in [FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE)
MOONCAKE_BLOCK_TOKENS = 512

# Immutable population of prompt token ids.  Sampling from this tuple (rather
# than from a range) makes every synthesised token a reference to one of these
# shared int objects, which keeps multi-million-token workloads small in memory.
_PROMPT_TOKENS: tuple[int, ...] = tuple(range(FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE))

_AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
_DEFAULT_SYNTHETIC_REQUESTS = 20
_DEFAULT_SYNTHETIC_RATE = 10.0
_MAX_ABORT_DELAY_S = 0.5


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
        if not _is_real(self.arrival_time) or not math.isfinite(self.arrival_time) or self.arrival_time < 0:
            raise WorkloadError(f"{where}: arrival_time must be a finite number >= 0, got {self.arrival_time!r}")
        toks = self.prompt_token_ids
        if not toks:
            raise WorkloadError(f"{where}: prompt_token_ids must be non-empty")
        if min(toks) < 0 or max(toks) >= VOCAB_SIZE:
            raise WorkloadError(f"{where}: prompt_token_ids must lie in [0, {VOCAB_SIZE})")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise WorkloadError(f"{where}: max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise WorkloadError(
                f"{where}: min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise WorkloadError(f"{where}: ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.eos_token_id is not None and (
            not _is_int(self.eos_token_id) or not 0 <= self.eos_token_id < VOCAB_SIZE
        ):
            raise WorkloadError(f"{where}: eos_token_id must be None or an int in [0, {VOCAB_SIZE})")
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t < VOCAB_SIZE:
                raise WorkloadError(f"{where}: stop_token_ids must be ints in [0, {VOCAB_SIZE}), got {t!r}")
        if not _is_int(self.priority):
            raise WorkloadError(f"{where}: priority must be an int, got {self.priority!r}")
        if self.scripted_output_len is not None and (
            not _is_int(self.scripted_output_len) or self.scripted_output_len < 1
        ):
            raise WorkloadError(f"{where}: scripted_output_len must be None or an int >= 1")
        if self.abort_time is not None and (
            not _is_real(self.abort_time)
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


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _request_id(index: int) -> str:
    return f"r{index:06d}"


def _priority(seed: int, index: int, priority_levels: int) -> int:
    """Priority of request ``index``: 0 if one level, else seeded uniform in [0, levels)."""
    if priority_levels == 1:
        return 0
    return random.Random(f"priority:{seed}:{index}").randrange(priority_levels)


def _check_mm_positions(where: str, positions: tuple, num_prompt_tokens: int) -> None:
    """Raise WorkloadError unless ``positions`` are sorted, non-overlapping
    ``(offset, length)`` int pairs with ``length >= 1`` inside the prompt."""
    end = 0
    for i, pos in enumerate(positions):
        if len(pos) != 2 or not all(_is_int(v) for v in pos):
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


def _check_common(limit: Any, time_scale: Any, seed: Any, priority_levels: Any) -> None:
    if limit is not None and (not _is_int(limit) or limit < 1):
        raise WorkloadError(f"limit must be None or an int >= 1, got {limit!r}")
    if not _is_real(time_scale) or not math.isfinite(time_scale) or time_scale <= 0:
        raise WorkloadError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    if not _is_int(seed):
        raise WorkloadError(f"seed must be an int, got {seed!r}")
    if not _is_int(priority_levels) or priority_levels < 1:
        raise WorkloadError(f"priority_levels must be an int >= 1, got {priority_levels!r}")


def _common_params(limit: Any, time_scale: Any, seed: int, priority_levels: int) -> dict:
    return {
        "limit": limit,
        "time_scale": float(time_scale),
        "seed": seed,
        "priority_levels": priority_levels,
    }


def _read_file(path: Any) -> tuple[Path, bytes]:
    """Read the whole file (needed for its sha256); map OS errors to WorkloadError."""
    try:
        p = Path(os.fspath(path))
    except TypeError as exc:
        raise WorkloadError(f"workload path must be str or os.PathLike, got {path!r}") from exc
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise WorkloadError(f"{p}: workload file not found") from exc
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read workload file: {exc.strerror or exc}") from exc
    if not data.strip():
        raise WorkloadError(f"{p}: workload file is empty")
    return p, data


def _lines(p: Path, data: bytes) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, decoded line without EOL)`` lazily, skipping blank lines."""
    for lineno, raw in enumerate(io.BytesIO(data), start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{p}:{lineno}: not valid UTF-8 ({exc.reason})") from exc
        line = line.rstrip("\r\n")
        if line.strip():
            yield lineno, line


def _sorted_requests(reqs: list[RequestSpec]) -> tuple[RequestSpec, ...]:
    reqs.sort(key=lambda r: (r.arrival_time, r.request_id))
    return tuple(reqs)


# --------------------------------------------------------------------------
# Azure
# --------------------------------------------------------------------------

_TS_RE = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
)
_INT_RE = re.compile(r"[+-]?\d+")


def _parse_timestamp_ns(text: str, p: Path, lineno: int) -> int:
    """Parse ``YYYY-MM-DD HH:MM:SS[.f{1,9}]`` to integer nanoseconds (naive clock).

    ``datetime.fromisoformat`` is avoided: the Azure files carry 7 fractional
    digits, which Python 3.11 accepts only by truncating; integer nanoseconds
    keep differences exact.
    """
    m = _TS_RE.fullmatch(text.strip())
    if m is None:
        raise WorkloadError(f"{p}:{lineno}: bad TIMESTAMP {text!r} (expected 'YYYY-MM-DD HH:MM:SS[.fffffff]')")
    y, mo, d, hh, mi, ss, frac = m.groups()
    try:
        day = _dt.date(int(y), int(mo), int(d)).toordinal()
        _dt.time(int(hh), int(mi), int(ss))
    except ValueError as exc:
        raise WorkloadError(f"{p}:{lineno}: bad TIMESTAMP {text!r}: {exc}") from exc
    seconds = day * 86400 + int(hh) * 3600 + int(mi) * 60 + int(ss)
    frac_ns = int(frac.ljust(9, "0")) if frac else 0
    return seconds * 1_000_000_000 + frac_ns


def _parse_count(text: str, name: str, p: Path, lineno: int) -> int:
    s = text.strip()
    if not _INT_RE.fullmatch(s):
        raise WorkloadError(f"{p}:{lineno}: {name} must be a non-negative integer, got {text!r}")
    v = int(s)
    if v < 0:
        raise WorkloadError(f"{p}:{lineno}: {name} must be non-negative, got {v}")
    return v


def load_azure(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    priority_levels: int = 1,
) -> Workload:
    """Load an Azure LLM inference trace 2023 CSV file as a :class:`Workload`.

    The file must start with the header ``TIMESTAMP,ContextTokens,GeneratedTokens``
    followed by one row per request; blank lines are skipped and a missing
    trailing newline is fine.  For data row ``i`` (0-based, file order):

    * ``request_id`` = ``f"r{i:06d}"``;
    * ``arrival_time`` (s) = (TIMESTAMP - first row's TIMESTAMP) / ``time_scale``,
      computed from exact integer nanoseconds (up to 9 fractional digits);
    * ``prompt_token_ids`` = ``ContextTokens`` ids drawn from
      ``random.Random(f"azure:{seed}:{i}")`` uniformly in
      ``[FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE)`` -- no prefix sharing;
    * ``max_tokens`` = ``GeneratedTokens`` (0 becomes 1), ``ignore_eos=True``,
      ``scripted_output_len=None``;
    * ``priority`` = 0, or if ``priority_levels > 1`` a uniform integer in
      ``[0, priority_levels)`` from ``random.Random(f"priority:{seed}:{i}")``.

    Args:
        path: the CSV file.
        limit: keep only the first ``limit`` data rows (>= 1); rows after
            them are not parsed or validated.  None = all rows.
        time_scale: > 0; arrival times are divided by it (10 = 10x faster).
        seed: int seed for token (and priority) synthesis.
        priority_levels: >= 1 number of priority levels.

    Returns:
        A Workload with ``source="azure:<file name>"``, ``sha256`` of the
        whole file's bytes and ``params`` = {limit, time_scale, seed,
        priority_levels}.

    Raises:
        WorkloadError: invalid arguments; file missing/unreadable/empty/not
            UTF-8; wrong header; a row without exactly 3 fields, with a bad
            timestamp, a timestamp earlier than the first row's, a
            non-integer or negative count, or ContextTokens == 0; no data
            rows.  File-related messages name the file and line number.
    """
    _check_common(limit, time_scale, seed, priority_levels)
    p, data = _read_file(path)
    lines = _lines(p, data)
    header = next(lines, None)
    if header is None:  # pragma: no cover - _read_file rejects blank files
        raise WorkloadError(f"{p}: workload file is empty")
    hno, htext = header
    fields = tuple(f.strip() for f in htext.split(","))
    if fields != _AZURE_HEADER:
        raise WorkloadError(
            f"{p}:{hno}: bad header {htext!r}; expected {','.join(_AZURE_HEADER)!r}"
        )
    reqs: list[RequestSpec] = []
    t0_ns: int | None = None
    for lineno, text in lines:
        if limit is not None and len(reqs) >= limit:
            break
        parts = text.split(",")
        if len(parts) != 3:
            raise WorkloadError(f"{p}:{lineno}: expected 3 comma-separated fields, got {len(parts)}: {text!r}")
        ts_ns = _parse_timestamp_ns(parts[0], p, lineno)
        ctx = _parse_count(parts[1], "ContextTokens", p, lineno)
        gen = _parse_count(parts[2], "GeneratedTokens", p, lineno)
        if ctx == 0:
            raise WorkloadError(f"{p}:{lineno}: ContextTokens is 0 (a request needs at least one prompt token)")
        if t0_ns is None:
            t0_ns = ts_ns
        if ts_ns < t0_ns:
            raise WorkloadError(f"{p}:{lineno}: TIMESTAMP {parts[0].strip()!r} is earlier than the first row's")
        index = len(reqs)
        prompt = tuple(random.Random(f"azure:{seed}:{index}").choices(_PROMPT_TOKENS, k=ctx))
        reqs.append(
            RequestSpec(
                request_id=_request_id(index),
                arrival_time=(ts_ns - t0_ns) / 1_000_000_000 / time_scale,
                prompt_token_ids=prompt,
                max_tokens=max(gen, 1),
                ignore_eos=True,
                priority=_priority(seed, index, priority_levels),
                scripted_output_len=None,
            )
        )
    if not reqs:
        raise WorkloadError(f"{p}: no data rows after the header")
    return Workload(
        source=f"azure:{p.name}",
        sha256=hashlib.sha256(data).hexdigest(),
        params=_common_params(limit, time_scale, seed, priority_levels),
        requests=_sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Mooncake
# --------------------------------------------------------------------------


def _mooncake_block(seed: int, hash_id: int) -> tuple[int, ...]:
    """The 512 tokens of block ``hash_id``; depends only on ``(seed, hash_id)``."""
    return tuple(random.Random(f"mooncake:{seed}:{hash_id}").choices(_PROMPT_TOKENS, k=MOONCAKE_BLOCK_TOKENS))


def load_mooncake(
    path: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    priority_levels: int = 1,
) -> Workload:
    """Load a Mooncake FAST'25 JSONL trace as a :class:`Workload`.

    Each non-blank line is a JSON object with integer ``timestamp`` (ms;
    a finite non-negative float is also accepted), ``input_length``,
    ``output_length`` and ``hash_ids`` (list of ints, one per 512-token block
    of the prompt, the last block possibly partial); extra keys are ignored.
    For request ``i`` (0-based, file order):

    * ``request_id`` = ``f"r{i:06d}"``;
    * ``arrival_time`` (s) = (timestamp - first request's timestamp) / 1000
      / ``time_scale`` (the published traces start at timestamp 0, so this
      is ``timestamp / 1000 / time_scale``);
    * ``prompt_token_ids`` = the concatenation, over ``hash_ids``, of each
      block's ``MOONCAKE_BLOCK_TOKENS`` tokens -- drawn from
      ``random.Random(f"mooncake:{seed}:{hash_id}")`` and so depending only on
      ``(seed, hash_id)`` -- truncated to ``input_length`` (the tail block
      partial).  Requests whose first k hash ids agree therefore share
      exactly their first ``k * 512`` tokens (prefix-cache hits);
    * ``max_tokens`` = ``output_length`` (0 becomes 1), ``ignore_eos=True``,
      ``scripted_output_len=None``;
    * ``priority`` as in :func:`load_azure`.

    Args:
        path: the JSONL file.
        limit: keep only the first ``limit`` requests (>= 1); later lines are
            not parsed or validated.  None = all.
        time_scale: > 0; arrival times are divided by it.
        seed: int seed for token (and priority) synthesis.
        priority_levels: >= 1 number of priority levels.

    Returns:
        A Workload with ``source="mooncake:<file name>"``, ``sha256`` of the
        whole file's bytes and ``params`` = {limit, time_scale, seed,
        priority_levels}.

    Raises:
        WorkloadError: invalid arguments; file missing/unreadable/empty/not
            UTF-8; a line that is not a JSON object, lacks a key, has a
            non-integer or negative count, a bad timestamp or one earlier
            than the first request's, ``input_length == 0``, non-integer
            hash ids, or ``len(hash_ids) != ceil(input_length / 512)``.
            Messages name the file and line number.
    """
    _check_common(limit, time_scale, seed, priority_levels)
    p, data = _read_file(path)
    blocks: dict[int, tuple[int, ...]] = {}  # per-call cache; shared blocks reuse one tuple
    reqs: list[RequestSpec] = []
    t0: int | float | None = None
    for lineno, text in _lines(p, data):
        if limit is not None and len(reqs) >= limit:
            break
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from exc
        if not isinstance(obj, dict):
            raise WorkloadError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        for key in _MOONCAKE_KEYS:
            if key not in obj:
                raise WorkloadError(f"{p}:{lineno}: missing key {key!r}")
        ts = obj["timestamp"]
        if not _is_real(ts) or not math.isfinite(ts):
            raise WorkloadError(f"{p}:{lineno}: timestamp must be a number (ms), got {ts!r}")
        if ts < 0:
            raise WorkloadError(f"{p}:{lineno}: timestamp must be non-negative, got {ts!r}")
        counts = {}
        for key in ("input_length", "output_length"):
            v = obj[key]
            if not _is_int(v):
                raise WorkloadError(f"{p}:{lineno}: {key} must be an integer, got {v!r}")
            if v < 0:
                raise WorkloadError(f"{p}:{lineno}: {key} must be non-negative, got {v}")
            counts[key] = v
        n_in, n_out = counts["input_length"], counts["output_length"]
        if n_in == 0:
            raise WorkloadError(f"{p}:{lineno}: input_length is 0 (a request needs at least one prompt token)")
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
            raise WorkloadError(f"{p}:{lineno}: hash_ids must be a list of integers")
        n_blocks = -(-n_in // MOONCAKE_BLOCK_TOKENS)
        if len(hash_ids) != n_blocks:
            raise WorkloadError(
                f"{p}:{lineno}: len(hash_ids)={len(hash_ids)} but input_length={n_in} needs "
                f"ceil({n_in}/{MOONCAKE_BLOCK_TOKENS})={n_blocks} blocks"
            )
        if t0 is None:
            t0 = ts
        if ts < t0:
            raise WorkloadError(f"{p}:{lineno}: timestamp {ts!r} is earlier than the first request's ({t0!r})")
        prompt: list[int] = []
        for h in hash_ids:
            block = blocks.get(h)
            if block is None:
                block = blocks[h] = _mooncake_block(seed, h)
            prompt.extend(block)
        del prompt[n_in:]
        index = len(reqs)
        reqs.append(
            RequestSpec(
                request_id=_request_id(index),
                arrival_time=(ts - t0) / 1000 / time_scale,
                prompt_token_ids=tuple(prompt),
                max_tokens=max(n_out, 1),
                ignore_eos=True,
                priority=_priority(seed, index, priority_levels),
                scripted_output_len=None,
            )
        )
    if not reqs:  # pragma: no cover - _read_file rejects blank files
        raise WorkloadError(f"{p}: no requests in file")
    return Workload(
        source=f"mooncake:{p.name}",
        sha256=hashlib.sha256(data).hexdigest(),
        params=_common_params(limit, time_scale, seed, priority_levels),
        requests=_sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Synthetic
# --------------------------------------------------------------------------


def _check_range(value: Any, name: str, low: int) -> tuple[int, int]:
    try:
        lo, hi = value
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{name} must be a (low, high) pair of ints, got {value!r}") from exc
    if not _is_int(lo) or not _is_int(hi) or lo < low or lo > hi:
        raise WorkloadError(f"{name} must be ints with {low} <= low <= high, got {value!r}")
    return lo, hi


def _check_fraction(value: Any, name: str) -> float:
    if not _is_real(value) or not 0.0 <= value <= 1.0:
        raise WorkloadError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _chosen(rng: random.Random, n: int, fraction: float) -> frozenset[int]:
    """Exactly ``floor(fraction * n + 0.5)`` distinct indices in [0, n), seeded."""
    k = min(n, math.floor(fraction * n + 0.5))
    return frozenset(rng.sample(range(n), k))


def _insert_mm_items(own: list[int], rng: random.Random, seed: int, index: int, item_len: int,
                     num_items: int, num_distinct: int) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Insert ``num_items`` items of ``item_len`` tokens into ``own`` at seeded
    gaps (sorted, possibly adjacent). Item content: pool item ``k`` (seeded
    by ``k``) with a pool of ``num_distinct`` > 0, else unique to (request,
    item). Returns (tokens, item positions in them)."""
    gaps = sorted(rng.randint(0, len(own)) for _ in range(num_items))
    tokens: list[int] = []
    positions: list[tuple[int, int]] = []
    previous = 0
    for j, gap in enumerate(gaps):
        tokens += own[previous:gap]
        previous = gap
        key = f"pool:{rng.randrange(num_distinct)}" if num_distinct else f"own:{index}:{j}"
        item = random.Random(f"synthetic:{seed}:mm-item:{key}").choices(_PROMPT_TOKENS, k=item_len)
        positions.append((len(tokens), item_len))
        tokens += item
    tokens += own[previous:]
    return tokens, tuple(positions)


def synthetic(
    num_requests: int = _DEFAULT_SYNTHETIC_REQUESTS,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (1, 64),
    output_len: tuple[int, int] = (1, 16),
    arrival_rate: float = _DEFAULT_SYNTHETIC_RATE,
    shared_prefix_len: int = 0,
    shared_prefix_fraction: float = 0.0,
    priority_levels: int = 1,
    eos_fraction: float = 0.0,
    abort_fraction: float = 0.0,
    mm_fraction: float = 0.0,
    mm_item_len: int = 16,
    mm_items_per_request: int = 1,
    mm_distinct_items: int = 0,
) -> Workload:
    """Generate a seeded random :class:`Workload`.

    Request ``i`` (0-based, ``request_id=f"r{i:06d}"``, in arrival order):

    * arrivals: a Poisson process of ``arrival_rate`` requests/s: request 0
      arrives at 0.0 s, each later one an exponential gap (mean
      ``1/arrival_rate`` s) after the previous; ``arrival_rate=math.inf``
      puts every arrival at 0.0;
    * ``max_tokens`` uniform in the inclusive ``output_len`` range;
    * prompt: ``L`` tokens, ``L`` uniform in the inclusive ``prompt_len``
      range, each uniform in ``[FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE)`` (so never
      EOS).  Exactly ``floor(shared_prefix_fraction * num_requests + 0.5)``
      seeded-chosen requests instead get the common ``shared_prefix_len``
      prefix tokens followed by their ``L`` own tokens (length
      ``shared_prefix_len + L``);
    * EOS: exactly ``floor(eos_fraction * num_requests + 0.5)`` chosen
      requests get ``ignore_eos=False``, ``eos_token_id=EOS_TOKEN_ID`` and
      ``scripted_output_len`` uniform in ``[1, max_tokens]``; the rest
      ``ignore_eos=True``, ``scripted_output_len=None``;
    * aborts: exactly ``floor(abort_fraction * num_requests + 0.5)`` chosen
      requests get ``abort_time = arrival_time + U(0, 0.5)`` s; the rest None;
    * ``priority`` as in :func:`load_azure` (``random.Random(f"priority:{seed}:{i}")``);
    * encoder inputs (multimodal items): exactly ``floor(mm_fraction *
      num_requests + 0.5)`` chosen requests get ``mm_items_per_request`` items
      of ``mm_item_len`` tokens each, inserted into their own tokens (after
      any shared prefix) at seeded positions, so their prompt grows by
      ``mm_items_per_request * mm_item_len`` tokens; ``mm_positions`` records
      where. An item's tokens are its content: with ``mm_distinct_items`` K >
      0 each item is one of K seeded items (so identical items recur across
      requests and share encoder-cache entries), with 0 every item is unique.
      The rest get none (``mm_fraction`` 0, the default, changes nothing).

    Each aspect draws from its own string-seeded ``random.Random``, so e.g.
    changing ``eos_fraction`` does not change arrivals or prompts.

    Args:
        num_requests: number of requests, >= 1.
        seed: int seed.
        prompt_len: inclusive (low, high) prompt length range, 1 <= low <= high.
        output_len: inclusive (low, high) ``max_tokens`` range, 1 <= low <= high.
        arrival_rate: mean arrivals per second, > 0 (``math.inf`` allowed).
        shared_prefix_len: tokens in the shared prefix, >= 0.
        shared_prefix_fraction: share of requests with the prefix, in [0, 1].
        priority_levels: >= 1 number of priority levels.
        eos_fraction: share of requests with a scripted EOS, in [0, 1].
        abort_fraction: share of requests aborted after arrival, in [0, 1].
        mm_fraction: share of requests with encoder inputs, in [0, 1].
        mm_item_len: tokens (= embeds) per item, >= 1.
        mm_items_per_request: items per chosen request, >= 1.
        mm_distinct_items: size of the item pool, >= 0 (0: all unique).

    Returns:
        A Workload with ``source="synthetic"``, ``params`` = all the
        arguments above (ranges as 2-element lists, rates/fractions as
        floats, an infinite rate as the string ``"inf"``; the four ``mm_*``
        keys only when ``mm_fraction`` > 0, so workloads without encoder
        inputs keep their params and sha256) and ``sha256`` =
        sha256 of ``json.dumps(params, sort_keys=True, separators=(",", ":"))``.

    Raises:
        WorkloadError: if any argument is out of range or of the wrong type.
    """
    if not _is_int(num_requests) or num_requests < 1:
        raise WorkloadError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not _is_int(seed):
        raise WorkloadError(f"seed must be an int, got {seed!r}")
    p_lo, p_hi = _check_range(prompt_len, "prompt_len", 1)
    o_lo, o_hi = _check_range(output_len, "output_len", 1)
    if not _is_real(arrival_rate) or math.isnan(arrival_rate) or arrival_rate <= 0:
        raise WorkloadError(f"arrival_rate must be a number > 0 (req/s), got {arrival_rate!r}")
    if not _is_int(shared_prefix_len) or shared_prefix_len < 0:
        raise WorkloadError(f"shared_prefix_len must be an int >= 0, got {shared_prefix_len!r}")
    sp_frac = _check_fraction(shared_prefix_fraction, "shared_prefix_fraction")
    if not _is_int(priority_levels) or priority_levels < 1:
        raise WorkloadError(f"priority_levels must be an int >= 1, got {priority_levels!r}")
    eos_frac = _check_fraction(eos_fraction, "eos_fraction")
    abort_frac = _check_fraction(abort_fraction, "abort_fraction")
    mm_frac = _check_fraction(mm_fraction, "mm_fraction")
    for name, value, low in (("mm_item_len", mm_item_len, 1), ("mm_items_per_request", mm_items_per_request, 1),
                             ("mm_distinct_items", mm_distinct_items, 0)):
        if not _is_int(value) or value < low:
            raise WorkloadError(f"{name} must be an int >= {low}, got {value!r}")

    rate = float(arrival_rate)
    params = {
        "num_requests": num_requests,
        "seed": seed,
        "prompt_len": [p_lo, p_hi],
        "output_len": [o_lo, o_hi],
        "arrival_rate": rate if math.isfinite(rate) else "inf",
        "shared_prefix_len": shared_prefix_len,
        "shared_prefix_fraction": sp_frac,
        "priority_levels": priority_levels,
        "eos_fraction": eos_frac,
        "abort_fraction": abort_frac,
    }
    if mm_frac > 0:
        params.update(mm_fraction=mm_frac, mm_item_len=mm_item_len,
                      mm_items_per_request=mm_items_per_request, mm_distinct_items=mm_distinct_items)
    canonical = json.dumps(params, sort_keys=True, separators=(",", ":"))

    def rng(aspect: str) -> random.Random:
        return random.Random(f"synthetic:{seed}:{aspect}")

    n = num_requests
    arr_rng = rng("arrivals")
    arrivals = [0.0]
    for _ in range(n - 1):
        gap = 0.0 if math.isinf(rate) else arr_rng.expovariate(rate)
        arrivals.append(arrivals[-1] + gap)
    len_rng = rng("lengths")
    lengths = [(len_rng.randint(p_lo, p_hi), len_rng.randint(o_lo, o_hi)) for _ in range(n)]
    prefix = tuple(rng("prefix").choices(_PROMPT_TOKENS, k=shared_prefix_len))
    sharing = _chosen(rng("prefix-choice"), n, sp_frac) if shared_prefix_len > 0 else frozenset()
    eos_set = _chosen(rng("eos-choice"), n, eos_frac)
    abort_set = _chosen(rng("abort-choice"), n, abort_frac)
    eos_rng = rng("eos-len")
    abort_rng = rng("abort-delay")
    mm_set = _chosen(rng("mm-choice"), n, mm_frac) if mm_frac > 0 else frozenset()
    mm_rng = rng("mm-items")

    reqs: list[RequestSpec] = []
    for i in range(n):
        plen, max_tokens = lengths[i]
        own = random.Random(f"synthetic:{seed}:prompt:{i}").choices(_PROMPT_TOKENS, k=plen)
        mm_positions: tuple[tuple[int, int], ...] = ()
        if i in mm_set:
            own, mm_positions = _insert_mm_items(own, mm_rng, seed, i, mm_item_len, mm_items_per_request,
                                                 mm_distinct_items)
            if i in sharing:
                mm_positions = tuple((offset + len(prefix), length) for offset, length in mm_positions)
        prompt = prefix + tuple(own) if i in sharing else tuple(own)
        scripted = eos_rng.randint(1, max_tokens) if i in eos_set else None
        abort_time = arrivals[i] + abort_rng.uniform(0.0, _MAX_ABORT_DELAY_S) if i in abort_set else None
        reqs.append(
            RequestSpec(
                request_id=_request_id(i),
                arrival_time=arrivals[i],
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=i not in eos_set,
                eos_token_id=EOS_TOKEN_ID,
                priority=_priority(seed, i, priority_levels),
                scripted_output_len=scripted,
                abort_time=abort_time,
                mm_positions=mm_positions,
            )
        )
    return Workload(
        source="synthetic",
        sha256=hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
        params=params,
        requests=_sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------


def load_workload(
    spec: str | os.PathLike,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    seed: int = 0,
    priority_levels: int = 1,
) -> Workload:
    """Build a workload from a spec string.

    * a path ending in ``.csv`` (case-insensitive) -> :func:`load_azure`;
    * a path ending in ``.jsonl`` -> :func:`load_mooncake`;
    * ``"synthetic"`` or ``"synthetic:N"`` (N an int >= 1; default 20) ->
      :func:`synthetic` with ``num_requests=N`` capped at ``limit`` if given,
      ``seed``, ``priority_levels`` and ``arrival_rate = 10.0 * time_scale``
      req/s (so arrivals are compressed by ``time_scale`` as for the traces;
      abort delays are not scaled).

    Args:
        spec: the spec (str or os.PathLike).
        limit: >= 1 or None; keep only the first ``limit`` requests.
        time_scale: > 0; arrival times are divided by it.
        seed: int seed.
        priority_levels: >= 1 number of priority levels.

    Returns:
        The Workload.

    Raises:
        WorkloadError: for an unrecognised spec, a bad ``synthetic:N``, bad
            arguments, or any error of the selected loader.
    """
    try:
        s = os.fspath(spec)
    except TypeError as exc:
        raise WorkloadError(f"workload spec must be str or os.PathLike, got {spec!r}") from exc
    if not isinstance(s, str):
        raise WorkloadError(f"workload spec must be a str path, got {spec!r}")
    kwargs = dict(limit=limit, time_scale=time_scale, seed=seed, priority_levels=priority_levels)
    lower = s.lower()
    if lower.endswith(".csv"):
        return load_azure(s, **kwargs)
    if lower.endswith(".jsonl"):
        return load_mooncake(s, **kwargs)
    if s == "synthetic" or s.startswith("synthetic:"):
        _check_common(limit, time_scale, seed, priority_levels)
        n = _DEFAULT_SYNTHETIC_REQUESTS
        if s != "synthetic":
            count = s[len("synthetic:"):]
            if not re.fullmatch(r"\d+", count) or int(count) < 1:
                raise WorkloadError(f"bad workload spec {s!r}: N in 'synthetic:N' must be an int >= 1")
            n = int(count)
        if limit is not None:
            n = min(n, limit)
        return synthetic(
            n,
            seed=seed,
            priority_levels=priority_levels,
            arrival_rate=_DEFAULT_SYNTHETIC_RATE * time_scale,
        )
    raise WorkloadError(
        f"unrecognised workload spec {s!r}: expected a .csv (Azure) or .jsonl (Mooncake) path, "
        f"'synthetic' or 'synthetic:N'"
    )


def with_eos_stops(workload: Workload) -> Workload:
    """The same workload, but requests end the way real ones do: on EOS.

    Each request that ignored EOS gets ``ignore_eos=False``,
    ``eos_token_id=EOS_TOKEN_ID``, ``scripted_output_len`` = its old
    ``max_tokens`` (the trace's output length: the scripted model emits EOS
    there) and ``max_tokens`` doubled, so it stops on EOS, not on length.
    Async scheduling then over-schedules one step past the EOS, as in vLLM.
    """
    requests = tuple(
        dataclasses.replace(r, ignore_eos=False, eos_token_id=EOS_TOKEN_ID,
                            scripted_output_len=r.max_tokens, max_tokens=2 * r.max_tokens)
        if r.ignore_eos else r
        for r in workload.requests)
    return dataclasses.replace(workload, requests=requests,
                               params={**workload.params, "stop_on_eos": True})
