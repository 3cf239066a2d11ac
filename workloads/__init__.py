"""Workloads: the request streams fed to an engine, from real traces or a generator.

- ``azure``: :func:`load_azure`, the Azure LLM inference trace 2023 CSVs.
- ``mooncake``: :func:`load_mooncake`, the Mooncake FAST'25 JSONL traces.
- ``synthetic``: :func:`synthetic`, a seeded generator.
- :func:`load_workload` dispatches on a spec string (a path or ``synthetic[:N]``);
  :func:`with_eos_stops` makes requests end on EOS as real ones do.

Everything is deterministic: the same arguments (and, for files, the same file
bytes) give an identical :class:`~reference.workload.Workload`. May import
``reference`` (the types); never ``harness``.
"""

from __future__ import annotations

import dataclasses
import os
import re

from reference.words import close_matches
from reference.workload import EOS_TOKEN_ID, Workload, WorkloadError
from workloads._common import (DEFAULT_SYNTHETIC_RATE, DEFAULT_SYNTHETIC_REQUESTS, FIRST_PROMPT_TOKEN_ID,
                               MAX_SYNTHETIC_REQUESTS, MOONCAKE_BLOCK_TOKENS, check_common)
from workloads.azure import load_azure
from workloads.mooncake import load_mooncake
from workloads.synthetic import synthetic

__all__ = ["FIRST_PROMPT_TOKEN_ID", "MOONCAKE_BLOCK_TOKENS", "load_azure", "load_mooncake", "load_workload",
           "synthetic", "with_eos_stops"]

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
    * ``"synthetic"`` or ``"synthetic:N"`` (N an int, 1 to 1,000,000; default 20) ->
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
        check_common(limit, time_scale, seed, priority_levels)
        n = DEFAULT_SYNTHETIC_REQUESTS
        if s != "synthetic":
            count = s[len("synthetic:"):]
            digits = count.lstrip("0")
            if not re.fullmatch(r"[0-9]+", count) or not digits:  # ASCII: \d took "５"
                raise WorkloadError(f"bad workload spec {s[:60]!r}: N in 'synthetic:N' must be an int >= 1")
            if len(digits) > 7 or int(digits) > MAX_SYNTHETIC_REQUESTS:
                raise WorkloadError(f"bad workload spec {s[:60]!r}: N in 'synthetic:N' must be at most "
                                    f"{MAX_SYNTHETIC_REQUESTS:,} (the workload is held in memory)")
            n = int(digits)
        if limit is not None:
            n = min(n, limit)
        return synthetic(
            n,
            seed=seed,
            priority_levels=priority_levels,
            arrival_rate=DEFAULT_SYNTHETIC_RATE * time_scale,
        )
    head, sep, tail = s.partition(":")
    close = close_matches(head, ["synthetic"], n=1)
    if close:
        raise WorkloadError(f"unrecognised workload spec {s!r}; did you mean '{close[0]}{sep}{tail}'?")
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
