"""A seeded random workload generator: Poisson arrivals, optional shared prefix,
EOS scripting, aborts, priorities and encoder items.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any

from reference.workload import EOS_TOKEN_ID, RequestSpec, Workload, WorkloadError, is_int, is_real
from workloads._common import (DEFAULT_SYNTHETIC_RATE, DEFAULT_SYNTHETIC_REQUESTS, MAX_ABORT_DELAY_S, PROMPT_TOKENS,
                               request_id_for, seeded_priority, sorted_requests)

# --------------------------------------------------------------------------


def _check_range(value: Any, name: str, low: int) -> tuple[int, int]:
    try:
        lo, hi = value
    except (TypeError, ValueError) as exc:
        raise WorkloadError(f"{name} must be a (low, high) pair of ints, got {value!r}") from exc
    if not is_int(lo) or not is_int(hi) or lo < low or lo > hi:
        raise WorkloadError(f"{name} must be ints with {low} <= low <= high, got {value!r}")
    return lo, hi


def _check_fraction(value: Any, name: str) -> float:
    if not is_real(value) or not 0.0 <= value <= 1.0:
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
        item = random.Random(f"synthetic:{seed}:mm-item:{key}").choices(PROMPT_TOKENS, k=item_len)
        positions.append((len(tokens), item_len))
        tokens += item
    tokens += own[previous:]
    return tokens, tuple(positions)


def synthetic(
    num_requests: int = DEFAULT_SYNTHETIC_REQUESTS,
    *,
    seed: int = 0,
    prompt_len: tuple[int, int] = (1, 64),
    output_len: tuple[int, int] = (1, 16),
    arrival_rate: float = DEFAULT_SYNTHETIC_RATE,
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
    if not is_int(num_requests) or num_requests < 1:
        raise WorkloadError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not is_int(seed):
        raise WorkloadError(f"seed must be an int, got {seed!r}")
    p_lo, p_hi = _check_range(prompt_len, "prompt_len", 1)
    o_lo, o_hi = _check_range(output_len, "output_len", 1)
    if not is_real(arrival_rate) or math.isnan(arrival_rate) or arrival_rate <= 0:
        raise WorkloadError(f"arrival_rate must be a number > 0 (req/s), got {arrival_rate!r}")
    if not is_int(shared_prefix_len) or shared_prefix_len < 0:
        raise WorkloadError(f"shared_prefix_len must be an int >= 0, got {shared_prefix_len!r}")
    sp_frac = _check_fraction(shared_prefix_fraction, "shared_prefix_fraction")
    if not is_int(priority_levels) or priority_levels < 1:
        raise WorkloadError(f"priority_levels must be an int >= 1, got {priority_levels!r}")
    eos_frac = _check_fraction(eos_fraction, "eos_fraction")
    abort_frac = _check_fraction(abort_fraction, "abort_fraction")
    mm_frac = _check_fraction(mm_fraction, "mm_fraction")
    for name, value, low in (("mm_item_len", mm_item_len, 1), ("mm_items_per_request", mm_items_per_request, 1),
                             ("mm_distinct_items", mm_distinct_items, 0)):
        if not is_int(value) or value < low:
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
    prefix = tuple(rng("prefix").choices(PROMPT_TOKENS, k=shared_prefix_len))
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
        own = random.Random(f"synthetic:{seed}:prompt:{i}").choices(PROMPT_TOKENS, k=plen)
        mm_positions: tuple[tuple[int, int], ...] = ()
        if i in mm_set:
            own, mm_positions = _insert_mm_items(own, mm_rng, seed, i, mm_item_len, mm_items_per_request,
                                                 mm_distinct_items)
            if i in sharing:
                mm_positions = tuple((offset + len(prefix), length) for offset, length in mm_positions)
        prompt = prefix + tuple(own) if i in sharing else tuple(own)
        scripted = eos_rng.randint(1, max_tokens) if i in eos_set else None
        abort_time = arrivals[i] + abort_rng.uniform(0.0, MAX_ABORT_DELAY_S) if i in abort_set else None
        reqs.append(
            RequestSpec(
                request_id=request_id_for(i),
                arrival_time=arrivals[i],
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                ignore_eos=i not in eos_set,
                eos_token_id=EOS_TOKEN_ID,
                priority=seeded_priority(seed, i, priority_levels),
                scripted_output_len=scripted,
                abort_time=abort_time,
                mm_positions=mm_positions,
            )
        )
    return Workload(
        source="synthetic",
        sha256=hashlib.sha256(canonical.encode("utf-8")).hexdigest(),
        params=params,
        requests=sorted_requests(reqs),
    )


# --------------------------------------------------------------------------
# Dispatch
