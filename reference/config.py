"""Engine configuration: one frozen dataclass, validated at the edge.

Field names are vLLM's (``SchedulerConfig``, ``CacheConfig``, ``ModelConfig``,
``ParallelConfig``); defaults are vLLM 0.33.0's ``SchedulerConfig`` defaults
(spec 10.1) except ``num_gpu_blocks`` and ``max_model_len``, which vLLM derives
from the GPU and the model and which we must be told.

Batches in flight are not a user key, as in vLLM: ``max_concurrent_batches``
is derived from ``pipeline_parallel_size`` and ``async_scheduling``
(``derive_max_concurrent_batches``, vLLM 0.33.0's
``VllmConfig.max_concurrent_batches``). Serialised configs (trace metadata,
the fingerprint) still store the derived ``max_concurrent_batches`` under that
name, in the place the old user key had, so the checker reads it and older
traces and goldens keep their bytes and fingerprints; ``from_dict`` maps a
stored ``max_concurrent_batches`` back to ``pipeline_parallel_size``
(``pipeline_parallel_size_for``).
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from reference.runners.scripted import parse_draft_acceptance_pattern
from reference.words import did_you_mean

POLICIES = ("fcfs", "priority")
#: Keys added after traces were first recorded: ``to_dict`` (trace metadata,
#: fingerprint) leaves them out at their default, so older traces and goldens
#: keep their fingerprints and bytes, and a missing key reads as the default.
OMITTED_AT_DEFAULT = ("draft_acceptance_pattern", "kv_connector", "kv_store_fraction",
                      "kv_load_steps", "kv_load_failure_rate", "kv_load_failure_policy",
                      "kv_connector_matches", "kv_connector_outputs",
                      "max_num_encoder_input_tokens", "encoder_cache_size", "disable_chunked_mm_input",
                      "sliding_window", "layer_types", "mm_identifiers", "max_loras", "lora_int_ids",
                      "resumable_request_ids", "num_prefill_lookahead", "num_lookahead_tokens",
                      "swa_bounded_replay", "kv_connector_window_loads")
#: Keys serialised by ``to_dict`` that are derived, not fields: accepted by
#: ``from_dict`` (checked against the fields), refused by ``with_overrides``.
DERIVED_KEYS = ("max_concurrent_batches",)
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
MAX_NUM_GPU_BLOCKS = 4_194_304
#: The largest int a trace column holds (int32): larger config values are refused.
INT32_MAX = 2**31 - 1


def _frozen(value: Any) -> Any:
    """``value`` (JSON: lists) as nested tuples (a frozen, hashable config)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


def _validate_recorded_connector(config: "EngineConfig") -> None:
    """ConfigError unless ``kv_connector_matches`` / ``kv_connector_outputs``
    (both or neither) are well formed and ``kv_connector`` is on."""
    matches, outputs = config.kv_connector_matches, config.kv_connector_outputs
    if matches is None and outputs is None:
        if config.kv_connector_window_loads is not None:
            raise ConfigError("kv_connector_window_loads goes with a recorded KV connector "
                              "(kv_connector_matches and kv_connector_outputs)")
        return
    if matches is None or outputs is None or not config.kv_connector:
        raise ConfigError("kv_connector_matches and kv_connector_outputs (a recorded KV connector) go "
                          "together, with kv_connector=true")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT32_MAX

    for item in matches:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], tuple)
                and all(isinstance(a, tuple) and len(a) == 2 and (a[0] is None or is_int(a[0]))
                        and isinstance(a[1], bool) for a in item[1])):
            raise ConfigError(f"kv_connector_matches: each item is [request_id, [[num_external_tokens "
                              f"or null, load_kv_async], ...]], got {item!r:.200}")
    for item in outputs:
        if not (isinstance(item, tuple) and len(item) == 3 and is_int(item[0])
                and isinstance(item[1], tuple) and all(isinstance(r, str) for r in item[1])
                and isinstance(item[2], tuple) and all(is_int(b) for b in item[2])):
            raise ConfigError(f"kv_connector_outputs: each item is [batch step, [finished_recving ids], "
                              f"[invalid_block_ids]], got {item!r:.200}")
    for item in config.kv_connector_window_loads or ():
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], tuple) and all(isinstance(a, bool) for a in item[1])):
            raise ConfigError(f"kv_connector_window_loads: each item is [request_id, [true or false, ...]], "
                              f"got {item!r:.200}")


class ConfigError(ValueError):
    """A bad engine configuration; the message names the field and the problem."""


class VLLMCrashConfig(ConfigError):
    """A config vLLM 0.33.0 accepts and then crashes on (an assertion of its
    own): the reference refuses to run it, but a trace recorded from vLLM with
    it, which ends on that crash, is still read
    (``EngineConfig.from_dict(..., accept_vllm_crash=True)``)."""


# Set by ``from_dict(accept_vllm_crash=True)`` while it builds the config.
_ACCEPT_VLLM_CRASH: contextvars.ContextVar[bool] = contextvars.ContextVar("accept_vllm_crash", default=False)


def derive_max_concurrent_batches(pipeline_parallel_size: int, async_scheduling: bool) -> int:
    """Batches in flight (``EngineCore.batch_queue_size``) for this parallelism,
    exactly as vLLM 0.33.0's ``VllmConfig.max_concurrent_batches`` with the V1
    model runner (vllm/config/vllm.py): pipeline parallelism needs
    ``pipeline_parallel_size`` batches to fill the pipeline; async scheduling
    needs 2 to overlap, and with PP > 1 the V1 runner keeps ``pp_size``.

    (vLLM's V2 model runner would give ``pp_size + 1`` with async scheduling
    and staggers decodes by ``pp_size`` steps; the reference mirrors the V1
    runner, the one the vLLM driver runs, ``VLLM_USE_V2_MODEL_RUNNER=0``.)
    """
    if async_scheduling and pipeline_parallel_size <= 1:
        return 2
    return pipeline_parallel_size


def pipeline_parallel_size_for(max_concurrent_batches: int, async_scheduling: bool) -> int:
    """The ``pipeline_parallel_size`` a stored ``max_concurrent_batches`` stands
    for (older traces, goldens and fuzz regressions, where it was a user key):
    the smallest size that ``derive_max_concurrent_batches`` maps to it, so
    ``derive_max_concurrent_batches(pipeline_parallel_size_for(n, a), a) == n``.

    Raises ConfigError for a value no vLLM config derives (not a positive
    integer, or 1 with async scheduling, which older harnesses refused too).
    """
    if not isinstance(max_concurrent_batches, int) or isinstance(max_concurrent_batches, bool) \
            or max_concurrent_batches < 1:
        raise ConfigError(f"max_concurrent_batches must be an integer >= 1, "
                          f"got {max_concurrent_batches!r}")
    if async_scheduling and max_concurrent_batches < 2:
        raise ConfigError("max_concurrent_batches 1 with async_scheduling: vLLM always runs "
                          "2 or more batches in flight with async scheduling")
    if async_scheduling and max_concurrent_batches == 2:
        return 1
    return max_concurrent_batches


def upgrade_config_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a serialised config) with a stored ``max_concurrent_batches``
    replaced, in place in the key order, by the ``pipeline_parallel_size`` it
    stands for; a dict without it is returned as a copy. When both are stored
    they must agree. Raises ConfigError naming the mismatch."""
    if "max_concurrent_batches" not in data:
        return dict(data)
    stored = data["max_concurrent_batches"]
    async_scheduling = data.get("async_scheduling", False)
    inferred = pipeline_parallel_size_for(stored, bool(async_scheduling))
    if "pipeline_parallel_size" in data:
        pp = data["pipeline_parallel_size"]
        if isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 \
                and derive_max_concurrent_batches(pp, bool(async_scheduling)) != stored:
            raise ConfigError(
                f"max_concurrent_batches {stored} does not match pipeline_parallel_size {pp} "
                f"with async_scheduling={bool(async_scheduling)} (which derive "
                f"{derive_max_concurrent_batches(pp, bool(async_scheduling))})")
        return {k: v for k, v in data.items() if k != "max_concurrent_batches"}
    return {("pipeline_parallel_size" if k == "max_concurrent_batches" else k):
            (inferred if k == "max_concurrent_batches" else v) for k, v in data.items()}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that drives the reference engine's decisions.

    Units: tokens unless stated; ``num_gpu_blocks`` in blocks (including the
    null block 0, as vLLM's ``num_gpu_blocks``); step costs in seconds of the
    virtual clock: a step that schedules T tokens lasts
    ``step_fixed_s + step_per_token_s * T``.
    """

    num_gpu_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_num_scheduled_tokens: int | None = None
    policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    scheduler_reserve_full_isl: bool = True
    # Speculative decoding with an n-gram-style proposer (no KV lookahead,
    # no draft slots). The scripted proposer's draft j matches the scripted
    # model with probability draft_acceptance_rate (seeded; harness key).
    num_speculative_tokens: int = 0
    draft_acceptance_rate: float = 0.7
    # Which drafts match (harness key; reference.runners.scripted.propose_drafts):
    # "random" (each with probability draft_acceptance_rate), "all", "none",
    # "prefix-N" (the first N of each proposal) or "cycle" (a request's i-th
    # proposal has its first i mod (K + 1) drafts matching).
    draft_acceptance_pattern: str = "random"
    # vLLM's ParallelConfig.pipeline_parallel_size: with it (and
    # async_scheduling) vLLM derives the batches in flight
    # (max_concurrent_batches, below). Only that count drives the scheduler's
    # decisions here: the stages themselves are not modelled. Declared where
    # the old max_concurrent_batches key was: to_dict() writes the derived
    # count in this place, so serialised configs keep their key order.
    pipeline_parallel_size: int = 1
    # AsyncScheduler: schedule the next decode before the previous output
    # returns, tracked with num_output_placeholders.
    async_scheduling: bool = False
    # Deferred, fenced block frees. vLLM turns this on only with a KV-consumer
    # connector and more than one batch in flight; here it is an explicit
    # switch (harness key) so the mechanism can be exercised alone.
    defer_block_free: bool = False
    # Prefill gating (spec 10.4): with decodes running, prefill compute runs
    # only on every prefill_schedule_interval-th executed step (local cadence;
    # with data parallelism the coordinator's throttle flag does it instead).
    prefill_schedule_interval: int = 1
    # Data-parallel ranks, each its own scheduler and KV pool of
    # num_gpu_blocks; a coordinator routes arrivals and throttles prefills.
    data_parallel_size: int = 1
    # A simulated KV-consumer connector (harness keys; reference.kv_connector):
    # an external store holding prompt prefixes (kv_store_fraction: the share
    # of prompt blocks held, by content), loaded asynchronously in
    # kv_load_steps steps (WAITING_FOR_REMOTE_KVS); a load fails with
    # probability kv_load_failure_rate and is then recomputed or fails the
    # request (vLLM's kv_load_failure_policy).
    kv_connector: bool = False
    kv_store_fraction: float = 1.0
    kv_load_steps: int = 1
    kv_load_failure_rate: float = 0.0
    kv_load_failure_policy: str = "recompute"
    # A recorded KV connector (reference.kv_connector.RecordedKVConnector /
    # RecordedKVWorker), chosen instead of the simulated one when these are
    # set (a recording of vLLM running its own connector: the connector's
    # answers are inputs from outside the scheduler, replayed as recorded).
    # kv_connector_matches: per request, in call order, what vLLM's
    # KVConnectorBase_V1.get_num_new_matched_tokens answered:
    # ((request_id, ((num_external_tokens or None, load_kv_async), ...)), ...)
    # (None: "cannot tell yet", the request is skipped that step).
    # kv_connector_outputs: the worker's KVConnectorOutput with the model
    # output of the batch scheduled at a step:
    # ((batch step, (finished_recving ids...), (invalid_block_ids...)), ...).
    kv_connector_matches: tuple | None = None
    kv_connector_outputs: tuple | None = None
    # kv_connector_window_loads: per request, in call order, whether the
    # recorded connector's load restored every bounded-replay window group
    # (vLLM 0.33.0 Scheduler._load_restores_replay_window, which reads the
    # connector's get_loaded_kv_cache_group_ids): ((request_id, (bool, ...)), ...).
    # Only with swa_bounded_replay; None: no load restores a window.
    kv_connector_window_loads: tuple | None = None
    # Encoder inputs (multimodal items; reference.encoder_cache_manager):
    # the encoder compute budget per step and the encoder cache size, both in
    # embeds. vLLM's SchedulerConfig sets both to max_num_batched_tokens (None
    # here means that) and its MultiModalBudget raises them to the model's
    # largest item; these are those effective values. An item of more embeds
    # than either is refused at arrival. disable_chunked_mm_input: a step
    # never covers part of an item only.
    max_num_encoder_input_tokens: int | None = None
    encoder_cache_size: int | None = None
    disable_chunked_mm_input: bool = False
    # A multi-module MTP drafter's prefill look-ahead (vLLM 0.33.0
    # Scheduler.num_prefill_lookahead, tokens): the encoder window reaches
    # this far past a step's tokens (_try_schedule_encoder_inputs'
    # shift_computed_tokens) and a prefill chunk never ends fewer than this
    # many tokens before the prefill's end (_reserve_prefill_lookahead).
    # Scheduler-side only: vLLM's KV cache manager also keeps look-ahead - 1
    # re-prefillable tokens, which is not modelled (a recording whose look-ahead
    # came from its config is not replayed; one a test set by hand after the
    # KV cache manager was built is).
    num_prefill_lookahead: int = 0
    # KV slots a drafter with its own forward pass (EAGLE, a draft model)
    # writes past the scheduled tokens, tokens: vLLM 0.33.0's
    # VllmConfig.num_lookahead_tokens (derived from the speculative config:
    # num_speculative_tokens for EAGLE and draft models, + 1 for DFlash, 0
    # for n-gram), read once into Scheduler.num_lookahead_tokens and passed to
    # every allocate_slots (0 for an async KV load's admission). A recording
    # carries the value the Scheduler used; the scripted proposer drafts as
    # an n-gram proposer either way (the slots change allocation only).
    num_lookahead_tokens: int = 0
    # Recorded encoder-input identifiers (a recording of vLLM: its
    # MultiModalFeatureSpec.identifier of each item, what the encoder cache and
    # the block hashes key on), per request, one per item of its mm_positions:
    # ((request_id, (identifier, ...)), ...). A request not named here (and
    # every request when None) gets identifiers derived from its prompt
    # tokens (reference.encoder_cache_manager.mm_identifier).
    mm_identifiers: tuple | None = None
    # LoRA (vLLM's LoRAConfig.max_loras: adapters one batch may use; None: no
    # LoRA config): a waiting request whose adapter would make more distinct
    # adapters scheduled than max_loras (every running request's counts) is
    # skipped. lora_int_ids: each LoRA request's adapter (vLLM
    # LoRARequest.lora_int_id, >= 1): ((request_id, lora_int_id), ...); a
    # request not named has none.
    max_loras: int | None = None
    lora_int_ids: tuple | None = None
    # Streaming-input sessions (vLLM Request.resumable, a recording of vLLM):
    # the ids of the requests that, when they stop, are parked in
    # WAITING_FOR_STREAMING_REQ with their blocks instead of finishing
    # (reference.scheduler.Scheduler._handle_stopped_request); None: none.
    # A parked session waits for an input chunk the workload cannot give:
    # a run holding one ends stalled.
    resumable_request_ids: tuple | None = None
    # A hybrid model's KV cache (reference.kv): the model config's
    # ``sliding_window`` (tokens a sliding-window layer attends, itself
    # included) and ``layer_types`` (one per layer: "full_attention",
    # "sliding_attention" or "linear_attention", a Mamba layer in vLLM's
    # mamba_cache_mode "none", which needs enable_prefix_caching off). A window
    # without layer types makes every layer a sliding-window layer. Both None:
    # one full-attention group.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    # DeepSeek-V4.1's SWA bounded replay (vLLM 0.33.0
    # cache_config.swa_bounded_replay, its sliding-window layers'
    # SlidingWindowMLASpec(bounded_replay=True)): the sliding-window groups keep
    # no prefix cache, and after a prefix hit of the other groups the scheduler
    # recomputes the hit's last sliding_window tokens (a hit no longer than
    # that is not taken). Needs sliding_attention layers.
    swa_bounded_replay: bool = False
    step_fixed_s: float = 0.005
    step_per_token_s: float = 0.0001

    def __post_init__(self) -> None:
        if isinstance(self.layer_types, list):  # from JSON / TOML
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("kv_connector_matches", "kv_connector_outputs", "kv_connector_window_loads",
                     "mm_identifiers", "lora_int_ids", "resumable_request_ids"):
            if isinstance(getattr(self, name), list):  # from JSON: lists all the way down
                object.__setattr__(self, name, _frozen(getattr(self, name)))
        self.validate()

    @property
    def kv_cache_groups(self) -> tuple:
        """The KV-cache groups vLLM builds for ``layer_types`` and
        ``sliding_window`` (``reference.kv.kv_cache_spec.kv_cache_groups_for``);
        empty for a single full-attention group: the default, and
        ``layer_types`` of full_attention layers only (not hybrid: vLLM builds
        that one group, the plain ``KVCacheManager``'s; regression, trial
        finding: it was refused as hybrid)."""
        from reference.kv.kv_cache_spec import kv_cache_groups_for
        if self.sliding_window is None and self.layer_types is None:
            return ()
        if self.layer_types is not None and all(t == "full_attention" for t in self.layer_types):
            return ()
        layer_types = self.layer_types or ("sliding_attention",)
        return kv_cache_groups_for(layer_types, self.block_size, self.sliding_window,
                                   max_model_len=self.max_model_len,
                                   num_speculative_tokens=self.num_speculative_tokens,
                                   swa_bounded_replay=self.swa_bounded_replay)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight (vLLM's ``VllmConfig.max_concurrent_batches``, the
        engine core's batch queue size): 1 = synchronous; 2 with
        ``async_scheduling``; ``pipeline_parallel_size`` otherwise
        (``derive_max_concurrent_batches``)."""
        return derive_max_concurrent_batches(self.pipeline_parallel_size, self.async_scheduling)

    @property
    def token_budget(self) -> int:
        """``max_num_scheduled_tokens`` if set, else ``max_num_batched_tokens``."""
        if self.max_num_scheduled_tokens is not None:
            return self.max_num_scheduled_tokens
        return self.max_num_batched_tokens

    @property
    def encoder_compute_budget(self) -> int:
        """Encoder embeds computable per step: ``max_num_encoder_input_tokens``
        if set, else ``max_num_batched_tokens`` (vLLM's SchedulerConfig)."""
        if self.max_num_encoder_input_tokens is not None:
            return self.max_num_encoder_input_tokens
        return self.max_num_batched_tokens

    @property
    def encoder_cache_capacity(self) -> int:
        """Encoder cache size in embeds: ``encoder_cache_size`` if set, else
        ``max_num_batched_tokens`` (vLLM's SchedulerConfig)."""
        if self.encoder_cache_size is not None:
            return self.encoder_cache_size
        return self.max_num_batched_tokens

    def validate(self) -> None:
        """Raise ConfigError on a configuration vLLM would refuse (or we cannot run)."""
        def positive(name: str) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        for name in ("num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs",
                     "max_num_batched_tokens"):
            positive(name)
        for name in ("max_num_scheduled_tokens", "max_num_encoder_input_tokens", "encoder_cache_size"):
            if getattr(self, name) is not None:
                positive(name)
        if self.sliding_window is not None:
            positive("sliding_window")
        if self.layer_types is not None:
            if not isinstance(self.layer_types, tuple) or not self.layer_types \
                    or not all(isinstance(t, str) for t in self.layer_types):
                raise ConfigError(f"layer_types must be a non-empty list of layer type names, "
                                  f"got {self.layer_types!r}")
            from reference.kv.kv_cache_spec import LAYER_TYPES, LEGACY_LAYER_TYPES
            for i, layer_type in enumerate(self.layer_types):
                if layer_type in LEGACY_LAYER_TYPES:
                    raise ConfigError(f"layer_types[{i}] {layer_type!r} is a legacy name: write "
                                      f"{LEGACY_LAYER_TYPES[layer_type]!r} (transformers' name for it)")
                if layer_type not in LAYER_TYPES:
                    raise ConfigError(f"layer_types[{i}] {layer_type!r} is not a layer type"
                                      + (did_you_mean(layer_type, LAYER_TYPES) or
                                         f" (one of {', '.join(LAYER_TYPES)})"))
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("layer_types has sliding_attention layers but sliding_window is not set")
            if "linear_attention" in self.layer_types and self.enable_prefix_caching:
                # vLLM 0.33.0 turns prefix caching with Mamba layers into
                # mamba_cache_mode "align" (MambaModelConfig), not modelled.
                raise ConfigError("layer_types has linear_attention (Mamba) layers with enable_prefix_caching: "
                                  "vLLM 0.33.0 then caches Mamba state in mamba_cache_mode 'align', which is not "
                                  "modelled; set enable_prefix_caching = false (mode 'none')")
        if self.swa_bounded_replay:
            if self.sliding_window is None:
                raise ConfigError("swa_bounded_replay needs sliding-window layers: set sliding_window "
                                  "(and layer_types)")
            if self.layer_types is not None and "sliding_attention" not in self.layer_types:
                raise ConfigError("swa_bounded_replay needs sliding_attention layers in layer_types")
            if self.enable_prefix_caching and self.layer_types is not None and len(self.kv_cache_groups) > 1 and all(
                    t == "sliding_attention" for t in self.layer_types):
                # vLLM's HybridKVCacheCoordinator asserts a prefix-cacheable group.
                raise ConfigError("swa_bounded_replay with only sliding_attention layers in several "
                                  "KV-cache groups: vLLM needs one group that keeps a prefix cache")
        if self.num_gpu_blocks > MAX_NUM_GPU_BLOCKS:
            # A harness limit, not vLLM's: one Python object per block.
            raise ConfigError(f"num_gpu_blocks {self.num_gpu_blocks} is above this harness's "
                              f"limit of {MAX_NUM_GPU_BLOCKS}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # Token counts and budgets reach the trace's int32 columns (token_budget, ...).
            if isinstance(value, int) and not isinstance(value, bool) and value > INT32_MAX:
                raise ConfigError(f"{f.name} {value} does not fit the trace's int32 columns "
                                  f"(at most {INT32_MAX})")
        if self.max_num_scheduled_tokens is not None and self.max_num_scheduled_tokens > self.max_num_batched_tokens:
            # docs/trace-format.md: the per-step budget may only be lowered.
            raise ConfigError(f"max_num_scheduled_tokens {self.max_num_scheduled_tokens} is above "
                              f"max_num_batched_tokens {self.max_num_batched_tokens} (it must be <= it)")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 0:
            raise ConfigError("num_speculative_tokens must be an integer >= 0")
        if not 0.0 <= self.draft_acceptance_rate <= 1.0:
            raise ConfigError(f"draft_acceptance_rate must be in [0, 1], got {self.draft_acceptance_rate}")
        try:
            parse_draft_acceptance_pattern(self.draft_acceptance_pattern)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not isinstance(self.data_parallel_size, int) or self.data_parallel_size < 1:
            raise ConfigError("data_parallel_size must be an integer >= 1")
        if not isinstance(self.prefill_schedule_interval, int) or self.prefill_schedule_interval < 1:
            raise ConfigError("prefill_schedule_interval must be an integer >= 1")
        if not isinstance(self.pipeline_parallel_size, int) or isinstance(self.pipeline_parallel_size, bool) \
                or self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be an integer >= 1, "
                              f"got {self.pipeline_parallel_size!r}")
        if not isinstance(self.async_scheduling, bool):
            # Checked before max_concurrent_batches is derived from it.
            raise ConfigError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")
        if self.defer_block_free and self.max_concurrent_batches < 2:
            raise ConfigError("defer_block_free needs more than one batch in flight (async_scheduling=true "
                              "or pipeline_parallel_size >= 2; vLLM's gate: a KV consumer and "
                              "max_concurrent_batches > 1)")
        if 0 < self.long_prefill_token_threshold < 1 + self.num_speculative_tokens \
                and not _ACCEPT_VLLM_CRASH.get():
            # vLLM 0.33.0 pads a new decode to 1 + K tokens, then caps it at the
            # threshold and fails `assert num_new_tokens == 1 + num_spec_tokens`
            # (scheduler.py, waiting loop): a config vLLM accepts but crashes on.
            raise VLLMCrashConfig(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) below "
                f"1 + num_speculative_tokens ({1 + self.num_speculative_tokens}) crashes vLLM 0.33.0's "
                f"spec-decode padding (an assertion in Scheduler.schedule); use 0 or >= "
                f"{1 + self.num_speculative_tokens}")
        if self.num_speculative_tokens and self.pipeline_parallel_size > 1:
            # Without async scheduling, drafts proposed for a batch whose
            # successor is already scheduled land on the wrong positions (found
            # by `harness fuzz`: the request then livelocks); with it, vLLM's
            # pipeline stages pass drafts between ranks, which the harness does
            # not model. Async scheduling alone (two batches in flight, -1 draft
            # placeholders: reference.async_spec) is modelled.
            raise ConfigError("speculative decoding with pipeline_parallel_size > 1 is not modelled "
                              "(use async_scheduling=true with pipeline_parallel_size 1)")
        if not isinstance(self.kv_load_steps, int) or isinstance(self.kv_load_steps, bool) \
                or self.kv_load_steps < 1:
            raise ConfigError(f"kv_load_steps must be an integer >= 1, got {self.kv_load_steps!r}")
        for name in ("kv_store_fraction", "kv_load_failure_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must be a number in [0, 1], got {value!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ConfigError(f"kv_load_failure_policy must be one of "
                              f"{', '.join(KV_LOAD_FAILURE_POLICIES)}, got {self.kv_load_failure_policy!r}")
        _validate_recorded_connector(self)
        if self.mm_identifiers is not None and not (
                isinstance(self.mm_identifiers, tuple)
                and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                        and isinstance(item[1], tuple) and item[1]
                        and all(isinstance(i, str) and i for i in item[1]) for item in self.mm_identifiers)
                and len({item[0] for item in self.mm_identifiers}) == len(self.mm_identifiers)):
            raise ConfigError(f"mm_identifiers: each item is [request_id, [identifier, ...]] (non-empty "
                              f"strings, one item per request), got {self.mm_identifiers!r:.200}")
        if self.max_loras is not None:
            positive("max_loras")
        if self.lora_int_ids is not None and not (
                isinstance(self.lora_int_ids, tuple)
                and all(isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                        and isinstance(item[1], int) and not isinstance(item[1], bool)
                        and 1 <= item[1] <= INT32_MAX for item in self.lora_int_ids)
                and len({item[0] for item in self.lora_int_ids}) == len(self.lora_int_ids)):
            raise ConfigError(f"lora_int_ids: each item is [request_id, lora_int_id >= 1] (one item per "
                              f"request), got {self.lora_int_ids!r:.200}")
        if (not isinstance(self.num_lookahead_tokens, int) or isinstance(self.num_lookahead_tokens, bool)
                or not 0 <= self.num_lookahead_tokens <= INT32_MAX):
            raise ConfigError(f"num_lookahead_tokens must be an integer >= 0, got {self.num_lookahead_tokens!r}")
        if (not isinstance(self.num_prefill_lookahead, int) or isinstance(self.num_prefill_lookahead, bool)
                or not 0 <= self.num_prefill_lookahead <= INT32_MAX):
            raise ConfigError(f"num_prefill_lookahead must be an integer >= 0, got {self.num_prefill_lookahead!r}")
        if self.resumable_request_ids is not None and not (
                isinstance(self.resumable_request_ids, tuple)
                and all(isinstance(i, str) and i for i in self.resumable_request_ids)
                and len(set(self.resumable_request_ids)) == len(self.resumable_request_ids)):
            raise ConfigError(f"resumable_request_ids: distinct request ids (non-empty strings), got "
                              f"{self.resumable_request_ids!r:.200}")
        if self.lora_int_ids and self.max_loras is None:
            raise ConfigError("lora_int_ids (LoRA requests) need max_loras (vLLM's LoRAConfig)")
        if self.kv_connector and self.max_concurrent_batches > 1 and not self.defer_block_free:
            # vLLM 0.33.0 Scheduler.__init__: a KV consumer with more than one
            # batch in flight always defers block frees.
            raise ConfigError("kv_connector with more than one batch in flight (async_scheduling or "
                              "pipeline_parallel_size > 1) needs defer_block_free=true (vLLM defers "
                              "block frees for a KV consumer with batches in flight)")
        for name in ("watermark", "step_fixed_s", "step_per_token_s", "draft_acceptance_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value!r}")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "scheduler_reserve_full_isl",
                     "async_scheduling", "defer_block_free", "kv_connector", "disable_chunked_mm_input"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.num_gpu_blocks < 2:
            raise ConfigError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be an integer >= 0")
        if self.long_prefill_token_threshold > self.max_model_len:
            # vLLM SchedulerConfig.verify_max_model_len
            raise ConfigError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be "
                f"greater than max_model_len ({self.max_model_len})")
        if not 0.0 <= self.watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.step_fixed_s < 0 or self.step_per_token_s < 0 or self.step_fixed_s + self.step_per_token_s <= 0:
            raise ConfigError("step costs must be >= 0 and not both 0")
        # vLLM (SchedulerConfig.verify_max_model_len): without chunked prefill a
        # whole prompt must fit one step's budget.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len \
                and not _ACCEPT_VLLM_CRASH.get():  # a trace's config: the Scheduler vLLM built
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill disabled")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})")
        if not _ACCEPT_VLLM_CRASH.get():
            self._check_enough_kv_cache_blocks()

    def _check_enough_kv_cache_blocks(self) -> None:
        """Raise ConfigError unless one request of ``max_model_len`` tokens fits
        the pool's ``num_gpu_blocks - 1`` usable blocks in every KV-cache group
        at once: the groups share the pool, so a request's need is the sum of
        each group's (full attention: every token's block; sliding window: its
        admission cap, window plus tokens in flight; Mamba: its state blocks;
        ``reference.kv.kv_cache_spec.max_memory_usage_blocks_from_groups``).

        vLLM 0.33.0's engine start-up check, in blocks
        (``vllm/v1/core/kv_cache_planning.py::get_kv_cache_configs``,
        ``_check_enough_kv_cache_memory`` over
        ``_max_memory_usage_bytes_from_groups``). Not the Scheduler's: a
        trace's config (``from_dict(accept_vllm_crash=True)``, what the engine
        ran) may hold a smaller pool, so ``validate`` skips it then.
        Regressions: recordings of vLLM's own scheduler tests, which build a
        Scheduler over a few blocks, were refused; a hybrid config was checked
        against one group's blocks only, so an undersized pool stalled the
        reference (LIVENESS / IDLE-ADMISSION false alarms) instead of being
        refused (tests/test_regression_hybrid_pool_check_one_group.py)."""
        groups = self.kv_cache_groups
        if not groups:
            needed = -(-self.max_model_len // self.block_size)
            if needed > self.num_gpu_blocks - 1:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} needs {needed} KV blocks of "
                    f"{self.block_size} tokens but the pool has only {self.num_gpu_blocks - 1} "
                    f"usable blocks: raise num_gpu_blocks or lower max_model_len")
            return
        from reference.kv.kv_cache_spec import FullAttentionSpec, MambaSpec, max_memory_usage_blocks_from_groups
        per_group = max_memory_usage_blocks_from_groups(
            groups, max_model_len=self.max_model_len,
            max_in_flight_tokens=self.max_concurrent_batches * self.max_num_batched_tokens)
        needed = sum(per_group)
        if needed > self.num_gpu_blocks - 1:
            kinds = {FullAttentionSpec: "full", MambaSpec: "Mamba"}
            parts = ", ".join(f"{kinds.get(type(g.kv_cache_spec), 'sliding-window')} {n}"
                              for g, n in zip(groups, per_group))
            raise ConfigError(
                f"max_model_len {self.max_model_len} needs {needed} KV blocks across its "
                f"{len(groups)} KV-cache groups sharing the pool ({parts}) but the pool has only "
                f"{self.num_gpu_blocks - 1} usable blocks (vLLM 0.33.0 refuses this at start-up): "
                f"raise num_gpu_blocks to {needed + 1} or lower max_model_len")

    # -- serialisation ------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field, except a key of ``OMITTED_AT_DEFAULT`` at its default
        (what trace metadata stores and the fingerprint hashes), with
        ``pipeline_parallel_size`` written as the derived
        ``max_concurrent_batches`` in its place (the key the checker and older
        harnesses read; the bytes older traces and goldens hold). It is also
        written, after that, only where the count does not give it back
        (``pipeline_parallel_size_for``: async scheduling with PP 2)."""
        data: dict[str, Any] = {}
        for name, value in dataclasses.asdict(self).items():
            if name == "pipeline_parallel_size":
                data["max_concurrent_batches"] = self.max_concurrent_batches
                if pipeline_parallel_size_for(self.max_concurrent_batches, self.async_scheduling) != value:
                    data[name] = value
            else:
                data[name] = value
        fields = type(self).__dataclass_fields__
        for name in OMITTED_AT_DEFAULT:
            if data[name] == fields[name].default:
                del data[name]
        return data

    def fingerprint(self) -> str:
        """sha256 hex of the canonical JSON of ``to_dict()``."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, accept_vllm_crash: bool = False) -> EngineConfig:
        """Build from a dict (e.g. trace metadata, a fuzz case). A stored
        ``max_concurrent_batches`` (``to_dict``'s, or an older harness's user
        key) maps to ``pipeline_parallel_size`` (``upgrade_config_keys``).
        Unknown keys, or a stored count the fields do not derive, raise
        ConfigError. ``accept_vllm_crash`` (a trace's config: what the engine
        ran) lets a ``VLLMCrashConfig`` through."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names - set(DERIVED_KEYS))
        if unknown:
            raise ConfigError(unknown_key_message(unknown[0], names) if len(unknown) == 1
                              else f"unknown config keys: {', '.join(unknown)}")
        token = _ACCEPT_VLLM_CRASH.set(accept_vllm_crash)
        try:
            return cls(**upgrade_config_keys(data))
        except TypeError as exc:
            raise ConfigError(str(exc)) from None
        finally:
            _ACCEPT_VLLM_CRASH.reset(token)

    def with_overrides(self, overrides: dict[str, str]) -> EngineConfig:
        """Apply ``key=value`` strings (from ``--set``), parsing each by the field's type."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        values: dict[str, Any] = {}
        for key, raw in overrides.items():
            if key == "max_concurrent_batches":
                raise ConfigError("max_concurrent_batches is not a config key: as in vLLM it is derived "
                                  "from pipeline_parallel_size and async_scheduling (async_scheduling=true "
                                  "gives 2, pipeline_parallel_size=N gives N)")
            if key not in fields:
                raise ConfigError(unknown_key_message(key, fields))
            values[key] = _parse_value(key, str(fields[key].type), raw)
        return dataclasses.replace(self, **values)


def unknown_key_message(key: str, known: Any) -> str:
    """One line for a config key ``key`` not among ``known`` (EngineConfig's
    fields): the close matches, not the whole list of ~30 keys."""
    hint = did_you_mean(key, sorted(known))
    return f"unknown config key {key!r}" + (hint or f" (no key is close; {len(known)} keys: "
                                                    f"EngineConfig in reference/config.py)")


def _parse_value(key: str, type_name: str, raw: str) -> Any:
    text = raw.strip()
    if type_name == "tuple[str, ...] | None" and text.lower() in ("", "none"):
        # Regression (trial finding): `--set layer_types=` and `=none` were taken silently
        # as "no layer types" (the key left out is the way to say that).
        raise ConfigError(f"bad value for {key}: {raw!r}: give one layer type per layer, "
                          f"comma-separated (e.g. sliding_attention,full_attention), or leave {key} out")
    try:
        if type_name == "bool":
            lowered = text.lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if type_name == "int":
            return int(text)
        if type_name == "int | None":
            return None if text.lower() in ("", "none") else int(text)
        if type_name == "float":
            return float(text)
        if type_name == "tuple[str, ...] | None":
            return tuple(t.strip() for t in text.split(","))
        return text
    except ValueError:
        words = {"int": "an integer", "int | None": "an integer or none", "float": "a number", "bool": "a boolean"}
        raise ConfigError(f"bad value for {key}: {raw!r} is not {words.get(type_name, type_name)}") from None
