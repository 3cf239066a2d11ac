"""The Azure LLM inference trace 2023 (``TIMESTAMP,ContextTokens,GeneratedTokens`` CSV).

Token ids are synthesised per request from the seed; there is no prefix
sharing between requests.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import random
import re
from pathlib import Path

from reference.workload import RequestSpec, Workload, WorkloadError
from workloads._common import (AZURE_HEADER, PROMPT_TOKENS, check_common, common_params, iter_lines, read_file,
                               request_id_for, seeded_priority, sorted_requests)

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
    check_common(limit, time_scale, seed, priority_levels)
    p, data = read_file(path)
    lines = iter_lines(p, data)
    header = next(lines, None)
    if header is None:  # pragma: no cover - read_file rejects blank files
        raise WorkloadError(f"{p}: workload file is empty")
    hno, htext = header
    fields = tuple(f.strip() for f in htext.split(","))
    if fields != AZURE_HEADER:
        raise WorkloadError(
            f"{p}:{hno}: bad header {htext!r}; expected {','.join(AZURE_HEADER)!r}"
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
        prompt = tuple(random.Random(f"azure:{seed}:{index}").choices(PROMPT_TOKENS, k=ctx))
        reqs.append(
            RequestSpec(
                request_id=request_id_for(index),
                arrival_time=(ts_ns - t0_ns) / 1_000_000_000 / time_scale,
                prompt_token_ids=prompt,
                max_tokens=max(gen, 1),
                ignore_eos=True,
                priority=seeded_priority(seed, index, priority_levels),
                scripted_output_len=None,
            )
        )
    if not reqs:
        raise WorkloadError(f"{p}: no data rows after the header")
    return Workload(
        source=f"azure:{p.name}",
        sha256=hashlib.sha256(data).hexdigest(),
        params=common_params(limit, time_scale, seed, priority_levels),
        requests=sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Mooncake
