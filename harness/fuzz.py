"""Property-based fuzzing of a candidate scheduler (issue 7).

Hypothesis generates small engine configs and workloads whose correct
decisions are unambiguous (tiny pools, block-boundary prompt lengths, shared
prefixes of whole and partial blocks, priority ties broken by distinct request
ids, arrival bursts, ``max_tokens`` 1, aborts, scripted EOS, speculative
decoding, async scheduling, deferred frees, prefill cadence, ...). Each case
runs in memory on the reference and on the candidate; every invariant is
checked (``harness.check.check_steps``) and, for a candidate other than the
reference, its rows are compared step by step with the reference's
(``harness.replay.first_difference``). The first failure is shrunk by
hypothesis and written to a folder as a replayable Parquet trace plus a JSON
description. ``fuzz_parallel`` runs several such searches in worker processes
(worker i seeded with ``worker_seed(seed, i)``, an equal share of the
examples each) and ``write_witnesses`` writes each worker's shrunk case.
With speculative decoding the scripted proposer's acceptance is drawn too
(``DRAFT_BEHAVIOURS``: all, none, random, rejection at draft 1 or 2, a
cycling rejection position).

About a third of the configs turn the simulated KV connector on
(``reference.kv_connector``): store fraction 1.0 (whole prompts held) or a
fraction that holds partial prefixes (``KV_STORE_FRACTIONS``), loads of 1-4
steps, a failure rate of 0 up to 0.75 under the "recompute" policy and up to
1 under "fail" (``KV_LOAD_FAILURE_RATES``), with any async depth; the aborts
drawn for every request then also land while loads are in flight. About a
third of the cases get encoder inputs (``encoder_setups``): a catalogue of
one to four items (their content fixed per case, so requests carrying the
same item share its encoder-cache entry), placed at block boundaries +-1 in
the prompts, with an encoder compute budget and cache sized around the
largest item (so windows are cut and entries evicted; an item larger than
either is refused at arrival, which is a valid outcome) and
``disable_chunked_mm_input`` on some. Not generated, as livelocks of the
simulator by construction (see the comments where they are avoided): rate
1.0 under "recompute", and a 1-token prompt with block size 1 under the
connector. The reference's known findings, which these dimensions reach, are
recognised by ``known_reference_finding`` (``fuzz(known=...)``, the CLI
unless ``--report-known``).

Only valid configs are generated (``reference.config.EngineConfig``
validation): chunked prefill off implies ``max_num_batched_tokens >=
max_model_len``; ``long_prefill_token_threshold`` is 0 or >= 1 +
``num_speculative_tokens``; more than one batch in flight (and so async
scheduling) never with speculative decoding;
``defer_block_free`` only with ``max_concurrent_batches >= 2``, and always
with the KV connector when ``max_concurrent_batches >= 2`` (vLLM's gate).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import multiprocessing
import os
import queue as queue_module
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hyp_seed, settings
from hypothesis import strategies as st

from reference.candidate import CandidateError, CandidateFactory
from reference.config import EngineConfig
from reference.engine import EngineStalled
from reference.kv_connector import held_prefix_tokens
from reference.scheduler import Scheduler
from reference.workload import EOS_TOKEN_ID, RequestSpec, Workload

from harness.check import CheckResult, check_steps
from harness.trace.recorder import Row, record, run_to_rows
from harness.replay import first_difference

MAX_REQUESTS = 12
MAX_PROMPT = 64
# The scripted proposer's behaviours drawn, as (draft_acceptance_rate,
# draft_acceptance_pattern): all rejected, random, all accepted, rejection at
# draft 1 or 2 of every proposal, and a rejection position that cycles over
# every draft. (The rate matters only for "random".)
DRAFT_BEHAVIOURS = ((0.0, "random"), (0.5, "random"), (1.0, "random"), (0.5, "cycle"),
                    (0.5, "prefix-1"), (0.5, "prefix-2"))
# Arrival / abort times are multiples of this (seconds); a step lasts at least
# step_fixed_s = 5 ms, so equal multiples make bursts and small ones interleave.
TIME_QUANTUM = 0.004
# KV connector: store fractions (1.0: every prompt held whole; the others
# hold partial prefixes, block by block by content; 0.0: nothing) and load
# failure rates drawn. Rate 1.0 (every load fails) only under the "fail"
# policy: under "recompute" a load that fails at its first block leaves
# nothing valid, the request is looked up again, the store offers the same
# blocks and the new load fails too, forever (vLLM's retry, by construction
# a livelock, not a finding).
KV_STORE_FRACTIONS = (1.0, 0.5, 0.8, 0.3, 0.0)
KV_LOAD_FAILURE_RATES = (0.0, 0.0, 0.25, 0.5, 0.75, 1.0)
# Token ids of encoder input k (its content, hence its identifier): k never
# collides with prompt tokens (100.., 1000..) nor EOS.
MM_ITEM_BASE = 20000


# ----------------------------------------------------------------- the case

@dataclass(frozen=True)
class FuzzCase:
    """One generated scenario: an engine config, requests and the engine seed."""

    config: dict[str, Any]
    requests: tuple[RequestSpec, ...]
    seed: int = 0

    def engine_config(self) -> EngineConfig:
        """The validated config (ConfigError if ``config`` is not one)."""
        return EngineConfig(**self.config)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``from_dict`` reads it back to an equal case)."""
        return {"config": dict(self.config), "seed": self.seed,
                "requests": [_spec_dict(r) for r in self.requests]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FuzzCase:
        """Inverse of ``to_dict``; a config without a key later added to
        EngineConfig (e.g. ``draft_acceptance_pattern``) gets its default."""
        specs = tuple(RequestSpec(**{**r, "prompt_token_ids": tuple(r["prompt_token_ids"]),
                                     "stop_token_ids": tuple(r.get("stop_token_ids", ()))})
                      for r in data["requests"])
        return cls(dict(data["config"]), specs, int(data.get("seed", 0)))

    def workload(self) -> Workload:
        """The requests as a Workload (source ``fuzz``, sha256 of the case)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        reqs = tuple(sorted(self.requests, key=lambda r: (r.arrival_time, r.request_id)))
        return Workload(source="fuzz", sha256=hashlib.sha256(canonical.encode()).hexdigest(),
                        params={"fuzz": True, "num_requests": len(reqs)}, requests=reqs)

    def describe(self) -> str:
        """One line: request count and the config's notable settings."""
        c = self.config
        flags = [f"bs={c['block_size']}", f"blocks={c['num_gpu_blocks']}", f"mml={c['max_model_len']}",
                 f"seqs={c['max_num_seqs']}", f"budget={c['max_num_batched_tokens']}", c["policy"]]
        for key in ("num_speculative_tokens", "max_concurrent_batches", "prefill_schedule_interval",
                    "long_prefill_token_threshold"):
            default = EngineConfig.__dataclass_fields__[key].default
            if c.get(key, default) != default:
                flags.append(f"{key}={c[key]}")
        if c.get("num_speculative_tokens") and c.get("draft_acceptance_pattern", "random") != "random":
            flags.append(f"drafts={c['draft_acceptance_pattern']}")
        for key in ("async_scheduling", "defer_block_free"):
            if c.get(key):
                flags.append(key)
        if c.get("kv_connector"):
            flags.append(f"kv_connector(store={c.get('kv_store_fraction', 1.0)}, "
                         f"steps={c.get('kv_load_steps', 1)}, fail={c.get('kv_load_failure_rate', 0.0)}"
                         f"/{c.get('kv_load_failure_policy', 'recompute')})")
        items = sum(len(r.mm_positions) for r in self.requests)
        if items:
            flags.append(f"encoder_inputs={items}(budget={c.get('max_num_encoder_input_tokens')}, "
                         f"cache={c.get('encoder_cache_size')})")
        if c.get("disable_chunked_mm_input"):
            flags.append("disable_chunked_mm_input")
        for key in ("enable_chunked_prefill", "enable_prefix_caching", "scheduler_reserve_full_isl"):
            if not c.get(key, True):
                flags.append(f"no-{key}")
        return f"{len(self.requests)} requests; " + " ".join(flags)


def _spec_dict(spec: RequestSpec) -> dict[str, Any]:
    d = dataclasses.asdict(spec)
    d["prompt_token_ids"] = list(spec.prompt_token_ids)
    d["stop_token_ids"] = list(spec.stop_token_ids)
    d["mm_positions"] = [list(p) for p in spec.mm_positions]
    return d


# ----------------------------------------------------------------- strategies

@st.composite
def engine_configs(draw: st.DrawFn) -> dict[str, Any]:
    """A small, valid EngineConfig as a dict (``EngineConfig(**d)`` accepts it)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_blocks_per_seq = draw(st.integers(1, max(1, 72 // block_size)))
    max_model_len = block_size * max_blocks_per_seq + draw(st.sampled_from([0, 0, -1, 1]))
    max_model_len = max(2, min(max_model_len, 72))
    needed = -(-max_model_len // block_size)
    # Tiny pools: just enough blocks for one max_model_len request, plus a few.
    num_gpu_blocks = needed + 1 + draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8]))
    max_num_seqs = draw(st.integers(1, 4))
    spec_tokens = draw(st.sampled_from([0, 0, 0, 1, 2, 3]))
    # Speculative decoding is modelled only with one batch in flight.
    mcb = 1 if spec_tokens else draw(st.sampled_from([1, 1, 1, 2, 3]))
    async_sched = mcb >= 2 and spec_tokens == 0 and draw(st.booleans())
    defer = mcb >= 2 and draw(st.booleans())
    chunked = draw(st.booleans()) or max_model_len > 64
    if chunked:
        budget = draw(st.integers(max(max_num_seqs, 1 + spec_tokens), 64))
    else:
        budget = draw(st.integers(max(max_model_len, max_num_seqs), max(max_model_len, max_num_seqs) + 16))
    # One draw for both (rate, pattern): rate 0 / 1 are all rejected / all
    # accepted. Without drafts the pattern stays at its default.
    rate, pattern = draw(st.sampled_from(DRAFT_BEHAVIOURS))
    pattern = pattern if spec_tokens else "random"
    threshold = 0
    if draw(st.booleans()) and max_model_len >= 1 + spec_tokens:
        threshold = draw(st.integers(1 + spec_tokens, min(max_model_len, 1 + spec_tokens + 12)))
    config = {
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_prefix_caching": draw(st.sampled_from([True, True, True, False])),
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
        "watermark": draw(st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.1])),
        "scheduler_reserve_full_isl": draw(st.booleans()),
        "num_speculative_tokens": spec_tokens,
        "draft_acceptance_rate": rate,
        "draft_acceptance_pattern": pattern,
        "max_concurrent_batches": mcb,
        "async_scheduling": async_sched,
        "defer_block_free": defer,
        "prefill_schedule_interval": draw(st.integers(1, 3)),
        "data_parallel_size": draw(st.sampled_from([1, 1, 1, 2])),
    }
    # Drawn last, so the draws above are those of a config without it (and
    # shrinking turns it off first).
    if draw(st.sampled_from([False, False, True])):
        config.update(kv_connector_settings(draw, mcb))
    return config


def kv_connector_settings(draw: st.DrawFn, max_concurrent_batches: int) -> dict[str, Any]:
    """The simulated KV connector's keys: store fraction (whole or partial
    holdings), 1-4 load steps, failure policy and rate (1.0 only under
    "fail", see ``KV_LOAD_FAILURE_RATES``). With more than one batch in flight
    block frees are deferred (EngineConfig's rule, vLLM's gate)."""
    fraction = draw(st.sampled_from(KV_STORE_FRACTIONS))
    steps = draw(st.integers(1, 4))
    policy = draw(st.sampled_from(["recompute", "fail"]))
    rates = KV_LOAD_FAILURE_RATES if policy == "fail" else KV_LOAD_FAILURE_RATES[:-1]
    settings_ = {
        "kv_connector": True,
        "kv_store_fraction": fraction,
        "kv_load_steps": steps,
        "kv_load_failure_rate": draw(st.sampled_from(rates)),
        "kv_load_failure_policy": policy,
    }
    if max_concurrent_batches >= 2:
        settings_["defer_block_free"] = True
    return settings_


def _item_lengths(block_size: int) -> list[int]:
    """Encoder input lengths drawn: block boundaries +-1, up to two blocks + 1
    (at most 17 tokens)."""
    return _boundary_lengths(block_size, min(2 * block_size + 1, 17))


@st.composite
def encoder_setups(draw: st.DrawFn, config: dict[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """Encoder inputs for ``config``: ``(config with the encoder keys, the
    catalogue)``. The catalogue holds the lengths of one to three items (item
    k's tokens are ``MM_ITEM_BASE + 1000 k + j``); ``request_specs`` places
    them. Budget and cache are left at their default (max_num_batched_tokens)
    or sized around the largest item: exactly it, room for two items, or one
    token short (that item is refused at arrival)."""
    lengths = _item_lengths(config["block_size"])
    catalogue = tuple(draw(st.lists(st.sampled_from(lengths), min_size=1, max_size=4)))
    big, small = max(catalogue), min(catalogue)
    short = [big - 1] if big > 1 else []
    # Budget: one item per step (big), a little more, or the default; cache:
    # room for two items or just one (evictions), or the default.
    budget = draw(st.sampled_from([None, big, big, big + small, big + 1, 2 * big] + short))
    cache = draw(st.sampled_from([None, big + small, 2 * big, big, 3 * big] + short))
    return {**config,
            "max_num_encoder_input_tokens": budget,
            "encoder_cache_size": cache,
            "disable_chunked_mm_input": draw(st.booleans())}, catalogue


def mm_item_tokens(k: int, length: int) -> list[int]:
    """The placeholder tokens (the content) of catalogue item ``k``."""
    return [MM_ITEM_BASE + 1000 * k + j for j in range(length)]


def _boundary_lengths(block_size: int, limit: int) -> list[int]:
    """Prompt lengths at block boundaries +-1, within [1, limit]."""
    out = set()
    for k in range(0, limit // block_size + 2):
        for d in (-1, 0, 1):
            n = k * block_size + d
            if 1 <= n <= limit:
                out.add(n)
    return sorted(out)


@st.composite
def request_specs(draw: st.DrawFn, config: dict[str, Any],
                  catalogue: tuple[int, ...] = ()) -> tuple[RequestSpec, ...]:
    """Up to MAX_REQUESTS requests for ``config``: mostly prompts that fit
    (a prompt of max_model_len tokens or more is rejected, sometimes on purpose).
    With a ``catalogue`` (item lengths, ``encoder_setups``) each request
    carries zero to three of its items, a catalogue item possibly in several
    requests or twice in one, each starting at a block boundary +-1 and
    written over the prompt's tokens there (``mm_positions``)."""
    bs, mml = config["block_size"], config["max_model_len"]
    n = draw(st.integers(1, MAX_REQUESTS))
    limit = min(MAX_PROMPT, mml)  # == mml: rejected at arrival
    lengths = _boundary_lengths(bs, limit)
    # One shared base sequence; each request takes a prefix of it (whole or
    # partial blocks) and then its own tokens.
    base = [100 + i for i in range(MAX_PROMPT)]
    specs = []
    t = 0
    for i in range(n):
        length = draw(st.sampled_from(lengths))
        if length >= mml and draw(st.integers(0, 3)):  # keep rejections rare
            length = max(1, mml - 1)
        if length == 1 and bs == 1 and config.get("kv_connector"):
            # Not modelled: the simulated store would offer a held 1-token
            # prompt again after its promotion (which leaves it 0 computed
            # tokens, the last token being recomputed), reloading it forever;
            # a P/D connector offers a prompt once, LMCache never the whole of it.
            length = 2
        shared = draw(st.sampled_from([0, 0] + [x for x in _boundary_lengths(bs, length)]))
        own = [1000 + 100 * i + j for j in range(length - shared)]
        prompt = base[:shared] + own
        t += draw(st.sampled_from([0, 0, 0, 1, 2, 5]))  # bursts: equal arrival times
        arrival = t * TIME_QUANTUM
        max_tokens = draw(st.sampled_from([1, 1, 2, 3, 5, 8]))
        eos = draw(st.sampled_from([None, None, 1, 2, 4]))
        abort = draw(st.sampled_from([None, None, None, 0, 1, 3, 8]))
        priority = draw(st.integers(0, 2)) if config["policy"] == "priority" else 0
        # Drawn last: without a catalogue the draws are those of a text-only request.
        positions = _place_items(draw, prompt, catalogue, bs) if catalogue else ()
        specs.append(RequestSpec(
            request_id=f"r{i:06d}",
            arrival_time=arrival,
            prompt_token_ids=tuple(prompt),
            max_tokens=max_tokens,
            ignore_eos=eos is None,
            eos_token_id=EOS_TOKEN_ID,
            priority=priority,
            scripted_output_len=eos,
            abort_time=None if abort is None else arrival + abort * TIME_QUANTUM,
            mm_positions=positions,
        ))
    return tuple(specs)


def _place_items(draw: st.DrawFn, prompt: list[int], catalogue: tuple[int, ...],
                 block_size: int) -> tuple[tuple[int, int], ...]:
    """Place zero to three catalogue items in ``prompt`` (overwritten in
    place with their tokens), in order, non-overlapping, each at an offset
    that is a block boundary +-1; an item that no longer fits ends the list.
    Returns the ``mm_positions``."""
    positions: list[tuple[int, int]] = []
    cursor = 0
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 2, 3]))):
        k = draw(st.integers(0, len(catalogue) - 1))
        length = catalogue[k]
        starts = [s for s in [0] + _boundary_lengths(block_size, len(prompt))
                  if s >= cursor and s + length <= len(prompt)]
        if not starts:
            break
        start = draw(st.sampled_from(starts))
        prompt[start:start + length] = mm_item_tokens(k, length)
        positions.append((start, length))
        cursor = start + length
    return tuple(positions)


@st.composite
def fuzz_cases(draw: st.DrawFn) -> FuzzCase:
    """A whole case: a valid config, its requests and an engine seed (0 or 1)."""
    config = draw(engine_configs())
    catalogue: tuple[int, ...] = ()
    if draw(st.sampled_from([False, False, True])):  # encoder inputs
        config, catalogue = draw(encoder_setups(config))
    EngineConfig(**config)  # the strategy only generates valid configs
    return FuzzCase(config, draw(request_specs(config, catalogue)), draw(st.sampled_from([0, 0, 1])))


# ----------------------------------------------------------------- evaluation

@dataclass
class Run:
    """One in-memory run: its steps (rows), how it ended, its check result."""

    steps: list[tuple[int, list[Row]]]
    ended: str  # "" normally, "stalled: ...", or "exception: ..."
    result: CheckResult


@dataclass
class Failure:
    """Why a case fails. ``kind``: reference-violation, violation, divergence,
    exception or stall."""

    kind: str
    message: str
    invariants: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "invariants": self.invariants,
                "step": self.step, **self.details}


def run_case(factory: CandidateFactory, case: FuzzCase) -> Run:
    """Run ``case`` in memory with ``factory``'s scheduler and check the rows.
    A stall or a candidate exception ends the run (``Run.ended``), never raises."""
    steps: list[tuple[int, list[Row]]] = []
    ended = ""
    config = case.engine_config()
    try:
        run_to_rows(case.workload(), config, seed=case.seed, candidate_factory=factory,
                    on_step_rows=lambda s, rows: steps.append((s, rows)))
    except EngineStalled as exc:
        ended = f"stalled: {exc}"
    except CandidateError as exc:
        ended = f"exception: {exc}"
    return Run(steps, ended, check_steps(config.to_dict(), steps))


def _violation_failure(kind: str, result: CheckResult) -> Failure:
    first = result.violations[0]
    return Failure(kind, f"{first.invariant} at step {first.step}"
                   + (f", request {first.request}" if first.request else "") + f": {first.message}",
                   dict(result.by_invariant), first.step,
                   {"violations": [v.to_dict() for v in result.violations[:5]]})


def evaluate(factory: CandidateFactory | None, case: FuzzCase) -> Failure | None:
    """None if ``case`` passes; ``factory`` None or Scheduler means the reference alone."""
    ref = run_case(Scheduler, case)
    if not ref.result.ok:
        return _violation_failure("reference-violation", ref.result)
    if ref.ended.startswith("exception"):
        return Failure("reference-violation", f"the reference raised: {ref.ended}")
    if factory is None or factory is Scheduler:
        return None
    cand = run_case(factory, case)
    if cand.ended.startswith("exception"):
        return Failure("exception", cand.ended, step=cand.steps[-1][0] + 1 if cand.steps else 0)
    if cand.ended and cand.ended != ref.ended:
        return Failure("stall", cand.ended, dict(cand.result.by_invariant),
                       cand.steps[-1][0] if cand.steps else 0)
    if not cand.result.ok:
        return _violation_failure("violation", cand.result)
    for (rs, rrows), (cs, crows) in zip(ref.steps, cand.steps):
        if rs != cs:
            return Failure("divergence", f"step numbers differ: reference {rs}, candidate {cs}", step=rs)
        d = first_difference(rs, rrows, crows)
        if d is not None:
            return Failure("divergence", f"step {d.step}, event #{d.event_index} ({d.kind or '-'}), "
                           f"request {d.request or '-'}, field {d.field}: expected {d.expected!r}, "
                           f"got {d.actual!r}", step=d.step, details={"divergence": d.to_dict()})
    if len(ref.steps) != len(cand.steps):
        return Failure("divergence", f"reference ran {len(ref.steps)} steps, candidate {len(cand.steps)}",
                       step=min(len(ref.steps), len(cand.steps)))
    return None


# ----------------------------------------------------------------- known findings

#: Reference findings the strategy reaches, each mirroring vLLM 0.33.0 (see
#: ``known_reference_finding`` and the regression tests named).
KNOWN_REFERENCE_FINDINGS = {
    "give-back-uncomputed-hit": "tests/test_finding_give_back_uncomputed_hit.py",
    "priority-tie-preemption-livelock": "tests/regressions/fuzz-finding-priority-tie-preemption-livelock.json",
    "kv-failed-load-wedge": "tests/regressions/fuzz-finding-kv-failed-load-wedge.json",
    "kv-spec-reservation-wedge": "tests/regressions/fuzz-finding-kv-spec-reservation-wedge.json",
}
_WEDGE_INVARIANTS = frozenset({"IDLE-ADMISSION", "LIVENESS", "NO-PROGRESS"})


def known_reference_finding(case: FuzzCase, failure: Failure) -> str | None:
    """The name (a key of ``KNOWN_REFERENCE_FINDINGS``) of the known finding
    ``failure`` is, or None. Only reference violations are findings; each is
    recognised by its invariants and what caused the first of them:

    * ``give-back-uncomputed-hit``: PRIORITY, HIT-UNCOMPUTED-BLOCK only (a
      prefix hit on a block a withdrawn chunk registered but never computed);
    * ``priority-tie-preemption-livelock``: PRIORITY, LIVENESS only, two
      requests with equal priority and arrival time;
    * ``kv-failed-load-wedge``: KV connector, IDLE-ADMISSION (plus LIVENESS /
      NO-PROGRESS at most), and the first request not admitted was just
      promoted from a load that failed with nothing valid: its new load must
      leave the reservation of ``_inflight_prefills``, which still holds the
      request itself (and finished loads queued behind it), so it waits,
      until something else frees blocks or forever;
    * ``kv-spec-reservation-wedge``: KV connector and speculative decoding,
      the same invariants, and the first request not admitted never ran: its
      held prefix plus one speculative step of blocks (the async-load
      reservation) is more than the whole pool, so it is never admitted.
    """
    if failure.kind != "reference-violation":
        return None
    invariants = set(failure.invariants)
    config = case.config
    if invariants == {"HIT-UNCOMPUTED-BLOCK"} and config["policy"] == "priority":
        return "give-back-uncomputed-hit"
    if invariants == {"LIVENESS"} and config["policy"] == "priority":
        keys = [(r.priority, r.arrival_time) for r in case.requests]
        return "priority-tie-preemption-livelock" if len(set(keys)) < len(keys) else None
    if not (config.get("kv_connector") and "IDLE-ADMISSION" in invariants
            and invariants <= _WEDGE_INVARIANTS):
        return None
    result = run_case(Scheduler, case).result
    first = next(v for v in result.violations if v.invariant == "IDLE-ADMISSION")
    if first.history and first.history[-1].endswith("promoted (load failed): 0 computed tokens"):
        return "kv-failed-load-wedge"
    spec = config.get("num_speculative_tokens", 0)
    request = next((r for r in case.requests if r.request_id == first.request), None)
    if spec and request is not None and len(first.history) == 1 and ": arrived," in first.history[0]:
        bs = config["block_size"]
        held = held_prefix_tokens(request.prompt_token_ids, bs, config.get("kv_store_fraction", 1.0))
        if held and -(-held // bs) + -(-(1 + spec) // bs) > config["num_gpu_blocks"] - 1:
            return "kv-spec-reservation-wedge"
    return None


# ----------------------------------------------------------------- the search

class _StopFuzz(Exception):
    """Raised inside the property to end generation when the time budget is spent."""


class _Found(AssertionError):
    pass


@dataclass
class FuzzResult:
    """Outcome of ``fuzz``: examples generated, wall seconds, the minimal
    failing case and its failure (None when nothing was found), shrinking
    runs, and whether generation stopped on the time budget."""

    examples: int
    elapsed_s: float
    case: FuzzCase | None = None
    failure: Failure | None = None
    shrink_calls: int = 0
    budget_exhausted: bool = False
    #: Generated examples passed over as known reference findings (``fuzz``'s
    #: ``known``), by name.
    known: dict[str, int] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        """True if a failing case was found (``case``/``failure`` are set)."""
        return self.failure is not None


def fuzz(factory: CandidateFactory | None, *, max_examples: int = 200, seed: int = 0,
         time_budget_s: float | None = None,
         on_example: Callable[[int, bool], None] | None = None,
         known: Callable[[FuzzCase, Failure], str | None] | None = None) -> FuzzResult:
    """Search for a failing case; deterministic for a given ``seed`` (no
    database, no deadline). On a failure hypothesis shrinks it and the
    returned ``case`` is the minimal one. ``max_examples`` (>= 1) bounds the
    generated examples, ``time_budget_s`` (seconds of wall time, None: no
    limit) the generation phase (a found failure is still shrunk).
    ``on_example(n, shrinking)`` is called after each example, ``n`` the
    examples generated so far. ``factory`` None means the reference alone.
    ``known`` (e.g. ``known_reference_finding``): a case whose failure it
    names is passed over as a known finding (counted in ``FuzzResult.known``)
    instead of ending the search; None (the default, and the CLI's) reports
    every failure."""
    start = time.monotonic()
    state = {"n": 0, "found": False, "last": None, "shrink": 0, "stopped": False}
    known_counts: dict[str, int] = {}

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=[Phase.generate, Phase.shrink], print_blob=False, verbosity=Verbosity.quiet)
    @hyp_seed(seed)
    @given(fuzz_cases())
    def prop(case: FuzzCase) -> None:
        if not state["found"] and time_budget_s is not None \
                and time.monotonic() - start > time_budget_s:
            state["stopped"] = True
            raise _StopFuzz()
        if state["found"]:
            state["shrink"] += 1
        else:
            state["n"] += 1
        failure = evaluate(factory, case)
        if failure is not None and known is not None:
            name = known(case, failure)
            if name is not None:
                failure = None
                if not state["found"]:
                    known_counts[name] = known_counts.get(name, 0) + 1
        if on_example is not None:
            on_example(state["n"], state["found"])
        if failure is not None:
            state["found"] = True
            state["last"] = (case, failure)
            raise _Found(failure.message)

    try:
        prop()
    except _StopFuzz:
        return FuzzResult(state["n"], time.monotonic() - start, budget_exhausted=True, known=known_counts)
    except _Found:
        case, failure = state["last"]
        return FuzzResult(state["n"], time.monotonic() - start, case, failure, state["shrink"],
                          state["stopped"], known_counts)
    return FuzzResult(state["n"], time.monotonic() - start, known=known_counts)


def _slug(spec: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", spec).strip("-") or "candidate"


def write_failure(out_dir: str | Path, spec: str, factory: CandidateFactory, result: FuzzResult,
                  seed: int, *, name: str | None = None,
                  extra: dict[str, Any] | None = None) -> tuple[Path, Path, str]:
    """Write the minimal case's trace and a JSON description; returns
    (trace path, JSON path, the replay command).

    Files are ``DIR/NAME.parquet`` and ``DIR/NAME.json``, NAME defaulting to
    ``fuzz-<candidate>-seed<seed>`` (an existing pair of that name is
    replaced); ``extra`` adds keys to the JSON (e.g. the worker).

    The trace is recorded with the candidate (engine=SPEC) when the candidate
    violates an invariant or stalls: replaying it checks it and fails. When
    the candidate only diverges from the reference, or raises, the trace is
    the reference's (engine=reference): replaying it with ``--candidate SPEC``
    reports the divergence.
    """
    assert result.case is not None and result.failure is not None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = name or f"fuzz-{_slug(spec)}-seed{seed}"
    trace_path = out / f"{base}.parquet"
    case, failure = result.case, result.failure
    engine, rec_factory = spec, factory
    if failure.kind in ("divergence", "exception", "reference-violation"):
        engine, rec_factory = "reference", Scheduler
    summary = record(case.workload(), case.engine_config(), trace_path, seed=case.seed,
                     engine=engine, candidate_factory=rec_factory)
    command = f"harness replay {trace_path} --candidate {spec}"
    info = {"candidate": spec, "fuzz_seed": seed, "trace": str(trace_path), "trace_engine": engine,
            "replay_command": command, "failure": failure.to_dict(),
            "examples_before_failure": result.examples, "shrink_calls": result.shrink_calls,
            "num_requests": len(case.requests), "num_steps": summary.steps,
            "summary": case.describe(), **(extra or {}), "scenario": case.to_dict()}
    json_path = out / f"{base}.json"
    json_path.write_text(json.dumps(info, indent=2, default=str) + "\n")
    return trace_path, json_path, command


# ----------------------------------------------------------------- parallel

#: Most worker processes ``fuzz_parallel`` starts.
MAX_WORKERS = 256


class FuzzWorkerError(RuntimeError):
    """A fuzz worker process failed (raised, or died without a result);
    the message names the worker and its last error line."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one,
    else ``os.cpu_count()``; at least 1): what ``--workers 0`` / ``auto`` uses."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def worker_seed(seed: int, worker: int) -> int:
    """Hypothesis seed of worker ``worker`` (0-based) of a run seeded ``seed``.

    Worker 0 uses ``seed`` itself, so a one-worker run is the plain
    ``fuzz(seed=seed)``; worker i > 0 uses a 64-bit number hashed from
    (seed, i), independent of the number of workers."""
    if worker == 0:
        return seed
    digest = hashlib.blake2b(f"sched-harness-fuzz:{seed}:{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def split_examples(max_examples: int, workers: int) -> list[int]:
    """Equal shares of ``max_examples`` for ``workers`` workers (the first
    ``max_examples % workers`` get one more); never more workers than
    examples, so every share is >= 1. Raises ValueError if either is < 1."""
    if max_examples < 1 or workers < 1:
        raise ValueError(f"need max_examples >= 1 and workers >= 1, got {max_examples} and {workers}")
    n = min(workers, max_examples)
    base, extra = divmod(max_examples, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


@dataclass(frozen=True)
class WorkerProgress:
    """Where one worker stands: ``examples`` generated so far (of its
    ``share``), whether it is ``shrinking`` a failure, whether it is ``done``."""

    examples: int = 0
    share: int = 0
    shrinking: bool = False
    done: bool = False


@dataclass
class WorkerResult:
    """One worker's outcome: its index, hypothesis seed, example share and result."""

    worker: int
    seed: int
    max_examples: int
    result: FuzzResult


@dataclass
class ParallelFuzzResult:
    """Merged outcome of ``fuzz_parallel``, workers in index order."""

    seed: int
    workers: list[WorkerResult]
    elapsed_s: float

    @property
    def examples(self) -> int:
        """Examples generated by all workers together (shrinking runs not counted)."""
        return sum(w.result.examples for w in self.workers)

    @property
    def shrink_calls(self) -> int:
        """Shrinking runs of all workers together."""
        return sum(w.result.shrink_calls for w in self.workers)

    @property
    def found(self) -> list[WorkerResult]:
        """The workers that found a failure, in index order."""
        return [w for w in self.workers if w.result.found]

    @property
    def budget_exhausted(self) -> bool:
        """True if some worker stopped generating because the time budget was spent."""
        return any(w.result.budget_exhausted for w in self.workers)

    @property
    def known(self) -> dict[str, int]:
        """Known reference findings passed over by all workers together, by name."""
        total: dict[str, int] = {}
        for w in self.workers:
            for name, n in w.result.known.items():
                total[name] = total.get(name, 0) + n
        return dict(sorted(total.items()))

    def smallest(self) -> WorkerResult | None:
        """The found witness with the fewest requests (then fewest prompt
        tokens, then lowest worker index); None if nothing was found."""
        found = self.found
        if not found:
            return None
        return min(found, key=lambda w: (len(w.result.case.requests),
                                         sum(len(r.prompt_token_ids) for r in w.result.case.requests),
                                         w.worker))


def _fuzz_worker(spec: str, worker: int, seed: int, max_examples: int, time_budget_s: float | None,
                 queue: Any, skip_known: bool = False) -> None:
    """Body of one worker process (top level, so ``spawn`` can import it).

    Resolves ``spec`` itself (factories need not pickle), runs ``fuzz`` and
    puts on ``queue``: ``("progress", worker, n, shrinking)`` at most every
    0.1 s and on every change of phase, then ``("done", worker, FuzzResult)``
    or ``("error", worker, message)``; on KeyboardInterrupt it exits with
    status 130 and puts nothing."""
    try:
        from harness.candidates.resolve import resolve_candidate

        factory = None if spec == "reference" else resolve_candidate(spec)
        last = {"t": 0.0, "shrinking": False}

        def on_example(n: int, shrinking: bool) -> None:
            now = time.monotonic()
            if now - last["t"] >= 0.1 or shrinking != last["shrinking"]:
                last["t"], last["shrinking"] = now, shrinking
                queue.put(("progress", worker, n, shrinking))

        result = fuzz(factory, max_examples=max_examples, seed=seed, time_budget_s=time_budget_s,
                      on_example=on_example, known=known_reference_finding if skip_known else None)
        queue.put(("done", worker, result))
    except KeyboardInterrupt:  # Ctrl-C reaches the whole group: the parent stops the run
        raise SystemExit(130) from None
    except Exception as exc:
        import traceback

        queue.put(("error", worker, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def fuzz_parallel(spec: str, *, workers: int = 1, max_examples: int = 200, seed: int = 0,
                  time_budget_s: float | None = None,
                  on_progress: Callable[[list[WorkerProgress]], None] | None = None,
                  skip_known: bool = False) -> ParallelFuzzResult:
    """Fuzz the candidate named ``spec`` (``reference``, ``mutant:NAME``,
    ``module:factory``, ...) on ``workers`` processes.

    Worker i runs ``fuzz`` with hypothesis seed ``worker_seed(seed, i)`` on its
    ``split_examples(max_examples, workers)`` share, each with the whole
    ``time_budget_s`` (seconds of wall time); at most ``max_examples``
    workers are used. Every worker runs to its own end (its first failure,
    shrunk, or its share), so without a time budget the result depends only
    on (spec, workers, max_examples, seed). One worker runs in this process;
    more are ``spawn``-ed processes, each resolving ``spec`` itself.
    ``on_progress`` gets every worker's ``WorkerProgress`` (index order) after
    each change. ``skip_known``: pass over the known reference findings
    (``fuzz(known=known_reference_finding)``). Raises ValueError for ``workers`` outside 1..MAX_WORKERS or
    ``max_examples`` < 1, CandidateSpecError for a bad ``spec`` (checked here
    first), FuzzWorkerError if a worker fails.
    """
    from harness.candidates.resolve import resolve_candidate

    if not isinstance(workers, int) or isinstance(workers, bool) or not 1 <= workers <= MAX_WORKERS:
        raise ValueError(f"workers must be an integer in 1..{MAX_WORKERS}, got {workers!r}")
    shares = split_examples(max_examples, workers)
    seeds = [worker_seed(seed, i) for i in range(len(shares))]
    factory = None if spec == "reference" else resolve_candidate(spec)
    progress = [WorkerProgress(0, share) for share in shares]
    start = time.monotonic()

    def report(i: int, **changes: Any) -> None:
        progress[i] = dataclasses.replace(progress[i], **changes)
        if on_progress is not None:
            on_progress(list(progress))

    if len(shares) == 1:
        result = fuzz(factory, max_examples=shares[0], seed=seeds[0], time_budget_s=time_budget_s,
                      on_example=lambda n, shrinking: report(0, examples=n, shrinking=shrinking),
                      known=known_reference_finding if skip_known else None)
        report(0, done=True)
        return ParallelFuzzResult(seed, [WorkerResult(0, seeds[0], shares[0], result)],
                                  time.monotonic() - start)

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fuzz_worker, name=f"harness-fuzz-{i}", daemon=True,
                         args=(spec, i, seeds[i], shares[i], time_budget_s, queue, skip_known))
             for i in range(len(shares))]
    results: dict[int, FuzzResult] = {}
    try:
        for p in procs:
            p.start()
        while len(results) < len(procs):
            try:
                msg = queue.get(timeout=0.5)
            except queue_module.Empty:
                for i, p in enumerate(procs):
                    if i not in results and p.exitcode is not None:
                        # Anything it put is readable by now; one more look, then give up.
                        try:
                            msg = queue.get(timeout=1.0)
                            break
                        except queue_module.Empty:
                            raise FuzzWorkerError(f"fuzz worker {i} died without a result "
                                                  f"(exit code {p.exitcode})") from None
                else:
                    continue
            kind, i = msg[0], msg[1]
            if kind == "progress":
                report(i, examples=msg[2], shrinking=msg[3])
            elif kind == "done":
                results[i] = msg[2]
                report(i, examples=msg[2].examples, done=True)
            else:
                lines = [line for line in msg[2].splitlines() if line.strip()]
                raise FuzzWorkerError(f"fuzz worker {i} (seed {seeds[i]}) failed: {lines[0]}")
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join()
        queue.close()
    return ParallelFuzzResult(seed, [WorkerResult(i, seeds[i], shares[i], results[i])
                                     for i in range(len(procs))], time.monotonic() - start)


@dataclass
class Witness:
    """A written failure: the worker that wrote it, every worker whose shrunk
    case is the same, and the files and replay command ``write_failure`` gave."""

    worker: WorkerResult
    found_by: list[int]
    trace: Path
    json: Path
    command: str


def write_witnesses(out_dir: str | Path, spec: str, factory: CandidateFactory,
                    result: ParallelFuzzResult) -> list[Witness]:
    """Write each distinct shrunk case found by ``result``'s workers (see
    ``write_failure``), in worker order; workers that shrank to the same case
    share one pair of files. One worker: ``fuzz-<candidate>-seed<S>.*``;
    N > 1 workers: ``fuzz-<candidate>-seed<S>-worker<i>of<N>.*`` (no clashes
    within a run, nor with runs of another worker count). Returns [] if
    nothing was found."""
    n = len(result.workers)
    groups: list[tuple[WorkerResult, list[int]]] = []
    for w in result.found:
        same = next((g for g in groups if g[0].result.case == w.result.case), None)
        if same is None:
            groups.append((w, [w.worker]))
        else:
            same[1].append(w.worker)
    out: list[Witness] = []
    for w, found_by in groups:
        name = None
        extra: dict[str, Any] = {}
        if n > 1:
            name = f"fuzz-{_slug(spec)}-seed{result.seed}-worker{w.worker}of{n}"
            extra = {"worker": w.worker, "workers": n, "worker_seed": w.seed,
                     "worker_max_examples": w.max_examples, "found_by_workers": found_by}
        trace, json_path, command = write_failure(out_dir, spec, factory, w.result, result.seed,
                                                  name=name, extra=extra)
        out.append(Witness(w, found_by, trace, json_path, command))
    return out
