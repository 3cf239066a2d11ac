"""Helpers every loader shares: argument checks, provenance params, file reading
with 1-based line numbers, seeded priorities, request ids, the prompt-token
population.

All randomness comes from ``random.Random`` instances seeded with strings
(``random.Random(str)`` hashes the string with SHA-512, so seeding is stable
across processes and Python versions); there is no global mutable state.
"""

from __future__ import annotations

import io
import math
import os
import random
from pathlib import Path
from typing import Any, Iterator

from reference.words import missing_file_hint
from reference.workload import VOCAB_SIZE, RequestSpec, WorkloadError, is_int, is_real

FIRST_PROMPT_TOKEN_ID = 10  # synthesised prompt tokens are in [FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE)
MOONCAKE_BLOCK_TOKENS = 512

# Immutable population of prompt token ids.  Sampling from this tuple (rather
# than from a range) makes every synthesised token a reference to one of these
# shared int objects, which keeps multi-million-token workloads small in memory.
PROMPT_TOKENS: tuple[int, ...] = tuple(range(FIRST_PROMPT_TOKEN_ID, VOCAB_SIZE))

AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
DEFAULT_SYNTHETIC_REQUESTS = 20
#: The most requests ``synthetic:N`` generates: a workload is held in memory whole
#: (1,000,000 requests of up to 64 prompt tokens: about 1 GB), and
#: ``synthetic:99999999999999999999`` grew until the machine killed it (issue 17).
MAX_SYNTHETIC_REQUESTS = 1_000_000
DEFAULT_SYNTHETIC_RATE = 10.0
MAX_ABORT_DELAY_S = 0.5


def request_id_for(index: int) -> str:
    return f"r{index:06d}"


def seeded_priority(seed: int, index: int, priority_levels: int) -> int:
    """Priority of request ``index``: 0 if one level, else seeded uniform in [0, levels)."""
    if priority_levels == 1:
        return 0
    return random.Random(f"priority:{seed}:{index}").randrange(priority_levels)


def check_common(limit: Any, time_scale: Any, seed: Any, priority_levels: Any) -> None:
    if limit is not None and (not is_int(limit) or limit < 1):
        raise WorkloadError(f"limit must be None or an int >= 1, got {limit!r}")
    if not is_real(time_scale) or not math.isfinite(time_scale) or time_scale <= 0:
        raise WorkloadError(f"time_scale must be a finite number > 0, got {time_scale!r}")
    if not is_int(seed):
        raise WorkloadError(f"seed must be an int, got {seed!r}")
    if not is_int(priority_levels) or priority_levels < 1:
        raise WorkloadError(f"priority_levels must be an int >= 1, got {priority_levels!r}")


def common_params(limit: Any, time_scale: Any, seed: int, priority_levels: int) -> dict:
    return {
        "limit": limit,
        "time_scale": float(time_scale),
        "seed": seed,
        "priority_levels": priority_levels,
    }


def read_file(path: Any) -> tuple[Path, bytes]:
    """Read the whole file (needed for its sha256); map OS errors to WorkloadError."""
    try:
        p = Path(os.fspath(path))
    except TypeError as exc:
        raise WorkloadError(f"workload path must be str or os.PathLike, got {path!r}") from exc
    try:
        data = p.read_bytes()
    except FileNotFoundError as exc:
        raise WorkloadError(f"{p}: workload file not found{missing_file_hint(p)}") from exc
    except OSError as exc:
        raise WorkloadError(f"{p}: cannot read workload file: {exc.strerror or exc}") from exc
    if not data.strip():
        raise WorkloadError(f"{p}: workload file is empty")
    return p, data


def iter_lines(p: Path, data: bytes) -> Iterator[tuple[int, str]]:
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


def sorted_requests(reqs: list[RequestSpec]) -> tuple[RequestSpec, ...]:
    reqs.sort(key=lambda r: (r.arrival_time, r.request_id))
    return tuple(reqs)


# --------------------------------------------------------------------------
# Azure
