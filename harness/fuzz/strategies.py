"""Hypothesis strategies over engine configs and workloads (``fuzz_cases``),
and the case they generate (``FuzzCase``).

The configs and workloads are small and their correct decisions
unambiguous: tiny pools, block-boundary prompt lengths, shared prefixes of
whole and partial blocks, priority ties broken by distinct request ids,
arrival bursts, ``max_tokens`` 1, aborts, scripted EOS, speculative
decoding, async scheduling, deferred frees, prefill cadence, ... With
speculative decoding the scripted proposer's acceptance is drawn too
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
connector.

Only valid configs are generated (``reference.config.EngineConfig``
validation): chunked prefill off implies ``max_num_batched_tokens >=
max_model_len``; ``long_prefill_token_threshold`` is 0 or >= 1 +
``num_speculative_tokens``; more than one batch in flight (and so async
scheduling) never with speculative decoding, except in the strategy
restricted to it (``async_spec``, ``harness fuzz --async-spec``);
``defer_block_free`` only with more than one batch in flight, and always
with the KV connector then (vLLM's gate). Batches in flight are drawn as a
count (1, 2 or 3) and written as the vLLM keys that derive it
(``pipeline_parallel_size``, ``async_scheduling``: 2 batches with async
scheduling are ``pipeline_parallel_size`` 1), so the draws, hence the
examples, are those of the strategy that wrote ``max_concurrent_batches``.

With ``hybrid`` (``harness fuzz --hybrid``) every config is a hybrid
model's (``hybrid_settings``): sliding-window or Mamba (``linear_attention``)
layers beside full attention in the shapes of ``HYBRID_SHAPES``, a window at
block boundaries +-1, prefix caching off with Mamba layers, no KV connector
(a hybrid config refuses it), and a pool of what one ``max_model_len``
request takes over every KV-cache group (vLLM's start-up check) plus the few
spare blocks drawn. The default strategy does not draw them, so every
seed's examples stay what they were.

The order of the draws is part of the behaviour: the same hypothesis seed
generates the same cases only while every draw stays where it is (features
added later are drawn last, so older draws are unchanged).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from reference.config import EngineConfig, pipeline_parallel_size_for, upgrade_config_keys
from reference.workload import EOS_TOKEN_ID, RequestSpec, Workload

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
# Hybrid models' layer types drawn by ``engine_configs(hybrid=True)``, as the
# hybrid scenarios' (harness/scenarios/hybrid/): alternating sliding-window and
# full attention (2 KV-cache groups); five sliding to one full (6 groups);
# three sliding to two full (group size 2: the sliding bucket splits into a
# group of two layers and a padded one of one, 3 groups); a window alone (one
# sliding-window group, ``layer_types`` left out); three Mamba to one full
# (Qwen3-Next's 3:1, 4 groups) and one Mamba to one full (2 groups), both
# with prefix caching off (the reference models mamba_cache_mode "none" only).
HYBRID_SHAPES = (("sliding_attention", "full_attention"),
                 ("sliding_attention",) * 5 + ("full_attention",),
                 ("sliding_attention",) * 3 + ("full_attention",) * 2,
                 None,
                 ("linear_attention",) * 3 + ("full_attention",),
                 ("linear_attention", "full_attention"))
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
        return EngineConfig.from_dict(self.config)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (``from_dict`` reads it back to an equal case)."""
        return {"config": dict(self.config), "seed": self.seed,
                "requests": [_spec_dict(r) for r in self.requests]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> FuzzCase:
        """Inverse of ``to_dict``; a config without a key later added to
        EngineConfig (e.g. ``draft_acceptance_pattern``) gets its default; an
        older case's ``max_concurrent_batches`` becomes the
        ``pipeline_parallel_size`` it stands for (``upgrade_config_keys``)."""
        specs = tuple(RequestSpec(**{**r, "prompt_token_ids": tuple(r["prompt_token_ids"]),
                                     "stop_token_ids": tuple(r.get("stop_token_ids", ()))})
                      for r in data["requests"])
        return cls(upgrade_config_keys(data["config"]), specs, int(data.get("seed", 0)))

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
        for key in ("num_speculative_tokens", "pipeline_parallel_size", "prefill_schedule_interval",
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
        if c.get("sliding_window") is not None:
            flags.append(f"sliding_window={c['sliding_window']}")
        if c.get("layer_types"):
            flags.append("layer_types=" + ",".join(c["layer_types"]))
        for key in ("enable_chunked_prefill", "enable_prefix_caching", "scheduler_reserve_full_isl"):
            if not c.get(key, True):
                flags.append(f"no-{key}")
        return f"{len(self.requests)} requests; " + " ".join(flags)


#: RequestSpec's fields, in order (``_spec_dict``).
_SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(RequestSpec))


def _spec_dict(spec: RequestSpec) -> dict[str, Any]:
    """``spec`` as ``dataclasses.asdict`` gives it, its token and position
    tuples as lists. Read field by field: ``asdict``'s deep copy of every
    token was most of a fuzz example's set-up (issue 24); the other values
    are immutable (str, numbers, None, a tuple of ints), so sharing them is
    copying them."""
    d = {name: getattr(spec, name) for name in _SPEC_FIELDS}
    d["prompt_token_ids"] = list(spec.prompt_token_ids)
    d["stop_token_ids"] = list(spec.stop_token_ids)
    d["mm_positions"] = [list(p) for p in spec.mm_positions]
    return d


# ----------------------------------------------------------------- strategies

# The strategies drawn from, built once (issue 24: a strategy built per draw
# cost hypothesis its validation and label on every draw, about a third of
# a fuzz run's CPU). Each is the strategy the draw wrote before, so its
# label, hence hypothesis's choices and shrinking, are unchanged.
_BLOCK_SIZES = st.sampled_from((1, 2, 4, 8))
_MODEL_LEN_OFFSETS = st.sampled_from((0, 0, -1, 1))
_SPARE_BLOCKS = st.sampled_from((0, 0, 1, 2, 3, 5, 8))
_SPEC_TOKENS = st.sampled_from((0, 0, 0, 1, 2, 3))
_ASYNC_SPEC_TOKENS = st.sampled_from((1, 2, 3))
_BATCHES = st.sampled_from((1, 1, 1, 2, 3))
_BOOLEANS = st.booleans()
_DRAFT_BEHAVIOURS = st.sampled_from(DRAFT_BEHAVIOURS)
_POLICIES = st.sampled_from(("fcfs", "priority"))
_PREFIX_CACHING = st.sampled_from((True, True, True, False))
_WATERMARKS = st.sampled_from((0.0, 0.0, 0.01, 0.05, 0.1))
_DATA_PARALLEL_SIZES = st.sampled_from((1, 1, 1, 2))
_ONE_IN_THREE = st.sampled_from((False, False, True))
_HYBRID_SHAPES = st.sampled_from(HYBRID_SHAPES)
_KV_STORE_FRACTIONS = st.sampled_from(KV_STORE_FRACTIONS)
_KV_POLICIES = st.sampled_from(("recompute", "fail"))
_KV_FAIL_RATES = st.sampled_from(KV_LOAD_FAILURE_RATES)
_KV_RECOMPUTE_RATES = st.sampled_from(KV_LOAD_FAILURE_RATES[:-1])
_ARRIVAL_GAPS = st.sampled_from((0, 0, 0, 1, 2, 5))
_MAX_TOKENS = st.sampled_from((1, 1, 2, 3, 5, 8))
_SCRIPTED_EOS = st.sampled_from((None, None, 1, 2, 4))
_ABORT_QUANTA = st.sampled_from((None, None, None, 0, 1, 3, 8))
_ITEMS_PER_REQUEST = st.sampled_from((0, 1, 1, 2, 2, 3))
_ENGINE_SEEDS = st.sampled_from((0, 0, 1))


@functools.lru_cache(maxsize=4096, typed=True)
def _sampled(*elements: Any) -> st.SearchStrategy[Any]:
    """``st.sampled_from(elements)`` for elements computed per case, built
    once per distinct tuple (a memo of immutable strategies; ``typed``: 0
    and False are different elements)."""
    return st.sampled_from(elements)


@functools.lru_cache(maxsize=4096, typed=True)
def _integers(min_value: int, max_value: int) -> st.SearchStrategy[int]:
    """``st.integers(min_value, max_value)``, built once per range (a memo)."""
    return st.integers(min_value, max_value)


@functools.lru_cache(maxsize=None)
def _catalogues(block_size: int) -> st.SearchStrategy[list[int]]:
    """One to four encoder input lengths (``_item_lengths``), built once per block size."""
    return st.lists(_sampled(*_item_lengths(block_size)), min_size=1, max_size=4)


@st.composite
def engine_configs(draw: st.DrawFn, async_spec: bool = False, hybrid: bool = False) -> dict[str, Any]:
    """A small, valid EngineConfig as a dict (``EngineConfig(**d)`` accepts it).
    ``hybrid``: a hybrid model's KV cache on every config (``hybrid_settings``;
    ``harness fuzz --hybrid``), never with the KV connector, which a hybrid
    config refuses.
    ``async_spec``: only async scheduling with speculative decoding (1-3
    drafts, two batches in flight; ``harness fuzz --async-spec``, the vLLM
    sweep of ``bench/vllm_async_spec_sweep.py``). Off, the draws are those of
    the strategy before async scheduling with drafts was modelled: any new
    draw would shift every example hypothesis generates after it, and with
    them every fuzz figure the tests pin."""
    block_size = draw(_BLOCK_SIZES)
    max_blocks_per_seq = draw(_integers(1, max(1, 72 // block_size)))
    max_model_len = block_size * max_blocks_per_seq + draw(_MODEL_LEN_OFFSETS)
    max_model_len = max(2, min(max_model_len, 72))
    needed = -(-max_model_len // block_size)
    # Tiny pools: just enough blocks for one max_model_len request, plus a few.
    num_gpu_blocks = needed + 1 + draw(_SPARE_BLOCKS)
    max_num_seqs = draw(_integers(1, 4))
    spec_tokens = draw(_ASYNC_SPEC_TOKENS if async_spec else _SPEC_TOKENS)
    # Speculative decoding with batches in flight: only async_spec.
    batches = 1 if spec_tokens else draw(_BATCHES)
    async_sched = batches >= 2 and spec_tokens == 0 and draw(_BOOLEANS)
    defer = batches >= 2 and draw(_BOOLEANS)
    # The vLLM keys deriving that many batches (async alone gives 2).
    pipeline_parallel_size = pipeline_parallel_size_for(batches, async_sched)
    chunked = draw(_BOOLEANS) or max_model_len > 64
    if chunked:
        budget = draw(_integers(max(max_num_seqs, 1 + spec_tokens), 64))
    else:
        budget = draw(_integers(max(max_model_len, max_num_seqs), max(max_model_len, max_num_seqs) + 16))
    # One draw for both (rate, pattern): rate 0 / 1 are all rejected / all
    # accepted. Without drafts the pattern stays at its default.
    rate, pattern = draw(_DRAFT_BEHAVIOURS)
    pattern = pattern if spec_tokens else "random"
    threshold = 0
    if draw(_BOOLEANS) and max_model_len >= 1 + spec_tokens:
        threshold = draw(_integers(1 + spec_tokens, min(max_model_len, 1 + spec_tokens + 12)))
    config = {
        "num_gpu_blocks": num_gpu_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": budget,
        "policy": draw(_POLICIES),
        "enable_prefix_caching": draw(_PREFIX_CACHING),
        "enable_chunked_prefill": chunked,
        "long_prefill_token_threshold": threshold,
        "watermark": draw(_WATERMARKS),
        "scheduler_reserve_full_isl": draw(_BOOLEANS),
        "num_speculative_tokens": spec_tokens,
        "draft_acceptance_rate": rate,
        "draft_acceptance_pattern": pattern,
        "pipeline_parallel_size": pipeline_parallel_size,
        "async_scheduling": async_sched,
        "defer_block_free": defer,
        "prefill_schedule_interval": draw(_integers(1, 3)),
        "data_parallel_size": draw(_DATA_PARALLEL_SIZES),
    }
    # Drawn last, so the draws above are those of a config without it (and
    # shrinking turns it off first).
    if not hybrid and draw(_ONE_IN_THREE):
        config.update(kv_connector_settings(draw, batches))
    if async_spec:
        # Two batches in flight (reference.async_spec); a KV consumer then
        # defers its frees (vLLM's gate), otherwise either way.
        config.update(async_scheduling=True, pipeline_parallel_size=1,
                      defer_block_free=bool(config.get("kv_connector")) or draw(_BOOLEANS))
    if hybrid:
        config.update(hybrid_settings(draw, config, num_gpu_blocks - needed - 1))
    return config


def hybrid_settings(draw: st.DrawFn, config: dict[str, Any], spare_blocks: int) -> dict[str, Any]:
    """A hybrid model's keys for ``config``: a shape of ``HYBRID_SHAPES``, a
    window at block boundaries +-1 (1 to 2 blocks + 1, or 12 tokens) for the
    sliding ones, prefix caching off for the Mamba ones, and the pool resized
    to what one max_model_len request takes over every KV-cache group
    (``EngineConfig``'s start-up check, vLLM's) plus the ``spare_blocks``
    the config was drawn with: tight pools, preemptions."""
    from reference.kv.kv_cache_spec import max_memory_usage_blocks_from_groups

    layer_types = draw(_HYBRID_SHAPES)
    settings_: dict[str, Any] = {}
    if layer_types is None or "sliding_attention" in layer_types:
        bs = config["block_size"]
        windows = sorted({w for w in (1, 2, bs - 1, bs, bs + 1, 2 * bs, 2 * bs + 1, 12) if w >= 1})
        settings_["sliding_window"] = draw(_sampled(*windows))
    if layer_types is not None:
        settings_["layer_types"] = list(layer_types)
        if "linear_attention" in layer_types:
            settings_["enable_prefix_caching"] = False
    shaped = EngineConfig.from_dict({**config, **settings_}, accept_vllm_crash=True)
    needed = sum(max_memory_usage_blocks_from_groups(
        shaped.kv_cache_groups, max_model_len=shaped.max_model_len,
        max_in_flight_tokens=shaped.max_concurrent_batches * shaped.max_num_batched_tokens))
    settings_["num_gpu_blocks"] = needed + 1 + spare_blocks
    return settings_


def kv_connector_settings(draw: st.DrawFn, max_concurrent_batches: int) -> dict[str, Any]:
    """The simulated KV connector's keys: store fraction (whole or partial
    holdings), 1-4 load steps, failure policy and rate (1.0 only under
    "fail", see ``KV_LOAD_FAILURE_RATES``). With more than one batch in flight
    block frees are deferred (EngineConfig's rule, vLLM's gate)."""
    fraction = draw(_KV_STORE_FRACTIONS)
    steps = draw(_integers(1, 4))
    policy = draw(_KV_POLICIES)
    settings_ = {
        "kv_connector": True,
        "kv_store_fraction": fraction,
        "kv_load_steps": steps,
        "kv_load_failure_rate": draw(_KV_FAIL_RATES if policy == "fail" else _KV_RECOMPUTE_RATES),
        "kv_load_failure_policy": policy,
    }
    if max_concurrent_batches >= 2:
        settings_["defer_block_free"] = True
    return settings_


def _item_lengths(block_size: int) -> tuple[int, ...]:
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
    catalogue = tuple(draw(_catalogues(config["block_size"])))
    big, small = max(catalogue), min(catalogue)
    short = [big - 1] if big > 1 else []
    # Budget: one item per step (big), a little more, or the default; cache:
    # room for two items or just one (evictions), or the default.
    budget = draw(_sampled(None, big, big, big + small, big + 1, 2 * big, *short))
    cache = draw(_sampled(None, big + small, 2 * big, big, 3 * big, *short))
    return {**config,
            "max_num_encoder_input_tokens": budget,
            "encoder_cache_size": cache,
            "disable_chunked_mm_input": draw(_BOOLEANS)}, catalogue


def mm_item_tokens(k: int, length: int) -> list[int]:
    """The placeholder tokens (the content) of catalogue item ``k``."""
    return [MM_ITEM_BASE + 1000 * k + j for j in range(length)]


@functools.lru_cache(maxsize=1024)
def _boundary_lengths(block_size: int, limit: int) -> tuple[int, ...]:
    """Prompt lengths at block boundaries +-1, within [1, limit], ascending
    (a memo: a tuple, so no caller can change another's)."""
    out = set()
    for k in range(0, limit // block_size + 2):
        for d in (-1, 0, 1):
            n = k * block_size + d
            if 1 <= n <= limit:
                out.add(n)
    return tuple(sorted(out))


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
    n = draw(_integers(1, MAX_REQUESTS))
    limit = min(MAX_PROMPT, mml)  # == mml: rejected at arrival
    lengths = _boundary_lengths(bs, limit)
    # One shared base sequence; each request takes a prefix of it (whole or
    # partial blocks) and then its own tokens.
    base = [100 + i for i in range(MAX_PROMPT)]
    specs = []
    t = 0
    for i in range(n):
        length = draw(_sampled(*lengths))
        if length >= mml and draw(_integers(0, 3)):  # keep rejections rare
            length = max(1, mml - 1)
        if length == 1 and bs == 1 and config.get("kv_connector"):
            # Not modelled: the simulated store would offer a held 1-token
            # prompt again after its promotion (which leaves it 0 computed
            # tokens, the last token being recomputed), reloading it forever;
            # a P/D connector offers a prompt once, LMCache never the whole of it.
            length = 2
        shared = draw(_sampled(0, 0, *_boundary_lengths(bs, length)))
        own = [1000 + 100 * i + j for j in range(length - shared)]
        prompt = base[:shared] + own
        t += draw(_ARRIVAL_GAPS)  # bursts: equal arrival times
        arrival = t * TIME_QUANTUM
        max_tokens = draw(_MAX_TOKENS)
        eos = draw(_SCRIPTED_EOS)
        abort = draw(_ABORT_QUANTA)
        priority = draw(_integers(0, 2)) if config["policy"] == "priority" else 0
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
    for _ in range(draw(_ITEMS_PER_REQUEST)):
        k = draw(_integers(0, len(catalogue) - 1))
        length = catalogue[k]
        starts = [s for s in (0, *_boundary_lengths(block_size, len(prompt)))
                  if s >= cursor and s + length <= len(prompt)]
        if not starts:
            break
        start = draw(_sampled(*starts))
        prompt[start:start + length] = mm_item_tokens(k, length)
        positions.append((start, length))
        cursor = start + length
    return tuple(positions)


@st.composite
def fuzz_cases(draw: st.DrawFn, async_spec: bool = False, hybrid: bool = False) -> FuzzCase:
    """A whole case: a valid config, its requests and an engine seed (0 or 1).
    ``async_spec``: configs of ``engine_configs(async_spec=True)`` only;
    ``hybrid``: of ``engine_configs(hybrid=True)`` only (both: both)."""
    config = draw(engine_configs(async_spec, hybrid))
    catalogue: tuple[int, ...] = ()
    if draw(_ONE_IN_THREE):  # encoder inputs
        config, catalogue = draw(encoder_setups(config))
    EngineConfig(**config)  # the strategy only generates valid configs
    return FuzzCase(config, draw(request_specs(config, catalogue)), draw(_ENGINE_SEEDS))


def request_subsets(base: FuzzCase) -> st.SearchStrategy[FuzzCase]:
    """``base`` with a non-empty subset of its requests (``harness fuzz --scenario``):
    the same config and seed, the kept requests in their order. A kept request
    keeps the requests its ``after`` names (transitively), so no request waits
    on one that never arrives. Hypothesis shrinks toward fewer requests: the
    minimal subset that still fails is a bug report's workload cut down."""
    by_id = {r.request_id: r for r in base.requests}

    def with_dependencies(keep: list[bool]) -> FuzzCase:
        kept = {r.request_id for r, k in zip(base.requests, keep) if k}
        stack = list(kept)
        while stack:
            after = by_id[stack.pop()].after
            if after is not None and after not in kept:
                kept.add(after)
                stack.append(after)
        return FuzzCase(base.config, tuple(r for r in base.requests if r.request_id in kept), base.seed)

    n = len(base.requests)
    return st.lists(st.booleans(), min_size=n, max_size=n).filter(any).map(with_dependencies)
