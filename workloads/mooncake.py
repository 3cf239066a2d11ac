"""The Mooncake FAST'25 traces (JSONL: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

Token ids are synthesised per 512-token block from the block's hash id, so
requests that share their first k hash ids share exactly their first
``k * MOONCAKE_BLOCK_TOKENS`` prompt tokens (prefix caching hits).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random

from reference.workload import RequestSpec, Workload, WorkloadError, is_int, is_real
from workloads._common import (MOONCAKE_BLOCK_TOKENS, MOONCAKE_KEYS, PROMPT_TOKENS, check_common, common_params,
                               iter_lines, read_file, request_id_for, seeded_priority, sorted_requests)

# --------------------------------------------------------------------------


def _mooncake_block(seed: int, hash_id: int) -> tuple[int, ...]:
    """The 512 tokens of block ``hash_id``; depends only on ``(seed, hash_id)``."""
    return tuple(random.Random(f"mooncake:{seed}:{hash_id}").choices(PROMPT_TOKENS, k=MOONCAKE_BLOCK_TOKENS))


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
    check_common(limit, time_scale, seed, priority_levels)
    p, data = read_file(path)
    blocks: dict[int, tuple[int, ...]] = {}  # per-call cache; shared blocks reuse one tuple
    reqs: list[RequestSpec] = []
    t0: int | float | None = None
    for lineno, text in iter_lines(p, data):
        if limit is not None and len(reqs) >= limit:
            break
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from exc
        if not isinstance(obj, dict):
            raise WorkloadError(f"{p}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        for key in MOONCAKE_KEYS:
            if key not in obj:
                raise WorkloadError(f"{p}:{lineno}: missing key {key!r}")
        ts = obj["timestamp"]
        if not is_real(ts) or not math.isfinite(ts):
            raise WorkloadError(f"{p}:{lineno}: timestamp must be a number (ms), got {ts!r}")
        if ts < 0:
            raise WorkloadError(f"{p}:{lineno}: timestamp must be non-negative, got {ts!r}")
        counts = {}
        for key in ("input_length", "output_length"):
            v = obj[key]
            if not is_int(v):
                raise WorkloadError(f"{p}:{lineno}: {key} must be an integer, got {v!r}")
            if v < 0:
                raise WorkloadError(f"{p}:{lineno}: {key} must be non-negative, got {v}")
            counts[key] = v
        n_in, n_out = counts["input_length"], counts["output_length"]
        if n_in == 0:
            raise WorkloadError(f"{p}:{lineno}: input_length is 0 (a request needs at least one prompt token)")
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list) or not all(is_int(h) for h in hash_ids):
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
                request_id=request_id_for(index),
                arrival_time=(ts - t0) / 1000 / time_scale,
                prompt_token_ids=tuple(prompt),
                max_tokens=max(n_out, 1),
                ignore_eos=True,
                priority=seeded_priority(seed, index, priority_levels),
                scripted_output_len=None,
            )
        )
    if not reqs:  # pragma: no cover - read_file rejects blank files
        raise WorkloadError(f"{p}: no requests in file")
    return Workload(
        source=f"mooncake:{p.name}",
        sha256=hashlib.sha256(data).hexdigest(),
        params=common_params(limit, time_scale, seed, priority_levels),
        requests=sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Synthetic
