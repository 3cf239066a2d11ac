"""Our config keys mapped onto vLLM's ``VllmConfig``.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. Holds which ``EngineConfig`` keys the driver maps
(``MAPPED_KEYS``; ``HARNESS_ONLY_KEYS`` drive the harness alone), the stand-in
model (an OPT-style ``config.json`` without weights or tokenizer, enough for
``ModelConfig``) and ``VllmConfigMapping._vllm_config``: the ``ModelConfig``,
``SchedulerConfig``, ``CacheConfig``, ``SpeculativeConfig`` (n-gram),
``ParallelConfig`` and ``KVTransferConfig`` built from the config, joined into
a ``VllmConfig`` as ``EngineArgs.create_engine_config`` joins them
(``vllm/engine/arg_utils.py``, ``vllm/config/``), then every field vLLM's
post-init (or the CPU platform's ``check_and_update_config``) changed is
insisted on or refused (``DriverError``, one option per message).
"""

from __future__ import annotations

import json
import os
import tempfile

from . import events as ev
from .driver_errors import DriverError
from .driver_kv_connector import KV_CONNECTOR_KEYS

#: EngineConfig fields the driver maps onto vLLM's configs.
MAPPED_KEYS = {
    "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "max_num_scheduled_tokens", "policy", "enable_prefix_caching", "enable_chunked_prefill",
    "long_prefill_token_threshold", "watermark", "scheduler_reserve_full_isl",
    "num_speculative_tokens", "prefill_schedule_interval",
    # Pipelining and data parallelism (see driver_engine_core.py's docstring);
    # max_concurrent_batches is derived (checked against vLLM's own).
    "async_scheduling", "pipeline_parallel_size", "max_concurrent_batches", "defer_block_free",
    "data_parallel_size",
    # A hybrid model's KV cache (see driver_kv_cache_config.py's docstring).
    "sliding_window", "layer_types", "swa_bounded_replay",
    # A drafter's look-ahead KV slots: set on the built Scheduler
    # (driver_engine_core.Driver._set_lookahead).
    "num_lookahead_tokens",
}
#: Formerly the pipelining fields refused at non-synchronous values; all are
#: mapped now (kept empty for callers that still add it to the known keys).
SYNC_ONLY: dict = {}
#: EngineConfig fields that only drive the harness (virtual clock, scripted proposer).
HARNESS_ONLY_KEYS = {"step_fixed_s", "step_per_token_s", "draft_acceptance_rate",
                     "draft_acceptance_pattern"}

# OPT-125m's config, enough for ModelConfig to inspect the architecture.
_OPT_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2,
    "do_layer_norm_before": True, "dropout": 0.1, "eos_token_id": 2, "ffn_dim": 3072,
    "hidden_size": 768, "init_std": 0.02, "layerdrop": 0.0, "max_position_embeddings": 2048,
    "model_type": "opt", "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1,
    "prefix": "</s>", "torch_dtype": "float16", "transformers_version": "4.21.0.dev0",
    "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}


def _model_dir(max_position_embeddings: int) -> str:
    """A folder holding only an OPT-style config.json (no weights, no tokenizer).

    Shared and reused: its content depends only on ``max_position_embeddings``
    (written atomically), so killed drivers leave nothing new behind.
    """
    path = os.path.join(tempfile.gettempdir(),
                        f"sched-harness-vllm-model-{os.getuid()}-{max_position_embeddings}")
    os.makedirs(path, exist_ok=True)
    target = os.path.join(path, "config.json")
    data = json.dumps(dict(_OPT_CONFIG, max_position_embeddings=max_position_embeddings),
                      sort_keys=True)
    try:
        with open(target) as fh:
            if fh.read() == data:
                return path
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(dir=path, prefix=".config.", suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        fh.write(data)
    os.replace(tmp, target)
    return path



class VllmConfigMapping:
    """``Driver``'s half that builds vLLM's ``VllmConfig`` from an
    ``EngineConfig`` dict (reads ``version``, ``ModelConfig``,
    ``SchedulerConfig``, ``CacheConfig``, ``VllmConfig``, ``SpeculativeConfig``,
    ``DraftTokenIds``; sets ``kv_connector``, ``pp_size``, ``async_scheduling``,
    ``defer_block_free``, ``dp_size``, ``config``, ``use_v2``, ``num_spec``,
    ``platform_block_size``)."""

    @staticmethod
    def _parallel_config(data_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        from vllm.config import ParallelConfig

        wanted = {}
        if data_parallel_size != 1:
            wanted["data_parallel_size"] = data_parallel_size
        if pipeline_parallel_size != 1:
            wanted["pipeline_parallel_size"] = pipeline_parallel_size
        return ParallelConfig(**ev.kwargs_for(ParallelConfig, wanted))


    def _vllm_config(self, config: dict, seed: int):
        """The ``VllmConfig`` for ``config`` (an EngineConfig dict), its fields
        as the config says after vLLM's post-init; ``seed`` goes to
        ``ModelConfig``. DriverError: a config this vLLM cannot express, one
        option per message."""
        unknown = sorted(set(config) - MAPPED_KEYS - HARNESS_ONLY_KEYS - KV_CONNECTOR_KEYS)
        if unknown:
            # A new EngineConfig field must be mapped here, never ignored.
            raise DriverError(f"config key(s) {unknown} have no vLLM mapping in the driver")
        self.kv_connector = bool(config.get("kv_connector", False))
        self.pp_size = int(config.get("pipeline_parallel_size", 1))
        self.async_scheduling = bool(config.get("async_scheduling", False))
        self.defer_block_free = bool(config.get("defer_block_free", False))
        self.dp_size = int(config.get("data_parallel_size", 1))
        if self.pp_size < 1 or self.dp_size < 1:
            raise DriverError("pipeline_parallel_size and data_parallel_size must be >= 1")
        self.config = config
        self.use_v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "1"
        block_size = config["block_size"]
        max_model_len = config["max_model_len"]
        model_dir = _model_dir(max(2048, max_model_len))
        model_config = self.ModelConfig(**ev.kwargs_for(self.ModelConfig, dict(
            model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
            dtype="float16", seed=seed, max_model_len=max_model_len)))

        sched_fields = ev.field_names(self.SchedulerConfig)
        wanted = dict(
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=config["max_num_batched_tokens"],
            max_model_len=max_model_len,
            enable_chunked_prefill=config["enable_chunked_prefill"],
            policy=config["policy"],
            long_prefill_token_threshold=config["long_prefill_token_threshold"],
            is_encoder_decoder=False,
            # The CPU platform turns it off anyway; set back below.
            async_scheduling=False,
        )
        # Fields an older vLLM lacks: fine only at that version's behaviour.
        optional = {
            "max_num_scheduled_tokens": (config.get("max_num_scheduled_tokens"), None),
            "watermark": (config.get("watermark", 0.0), 0.0),
            "scheduler_reserve_full_isl": (config.get("scheduler_reserve_full_isl", True), False),
            "prefill_schedule_interval": (config.get("prefill_schedule_interval", 1), 1),
        }
        for name, (value, old_behaviour) in optional.items():
            if name in sched_fields:
                wanted[name] = value
            elif value != old_behaviour and not (
                    name == "max_num_scheduled_tokens" and value == config["max_num_batched_tokens"]):
                raise DriverError(f"vLLM {self.version} has no SchedulerConfig.{name}; "
                                  f"it only behaves as {name}={old_behaviour!r}, got {value!r}")
        missing = [k for k in ("max_num_seqs", "max_num_batched_tokens", "policy",
                               "long_prefill_token_threshold", "enable_chunked_prefill")
                   if k not in sched_fields]
        if missing:
            raise DriverError(f"vLLM {self.version} SchedulerConfig lacks {missing}")
        scheduler_config = self.SchedulerConfig(**ev.kwargs_for(self.SchedulerConfig, wanted))
        cache_config = self.CacheConfig(**ev.kwargs_for(self.CacheConfig, dict(
            block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
            enable_prefix_caching=config["enable_prefix_caching"], swap_space=0)))
        self.num_spec = int(config.get("num_speculative_tokens", 0) or 0)
        speculative_config = None
        if self.num_spec:
            # An n-gram proposer: no draft model, so no lookahead KV slots and
            # no extra input-budget slots (what the harness's proposer is).
            if self.SpeculativeConfig is None or self.DraftTokenIds is None:
                raise DriverError(f"vLLM {self.version} has no speculative decoding API")
            speculative_config = self.SpeculativeConfig(**ev.kwargs_for(self.SpeculativeConfig, dict(
                method="ngram", num_speculative_tokens=self.num_spec,
                prompt_lookup_max=self.num_spec, prompt_lookup_min=1,
                target_model_config=model_config,
                target_parallel_config=self._parallel_config())))
        parallel_config = self._parallel_config(self.dp_size, self.pp_size)
        for name, value in (("data_parallel_size", self.dp_size),
                            ("pipeline_parallel_size", self.pp_size)):
            if getattr(parallel_config, name, 1) != value:
                raise DriverError(f"vLLM {self.version}'s ParallelConfig did not take {name}={value}")
        kv_transfer_config = self._kv_transfer_config(config) if self.kv_connector else None
        vllm_parts = dict(model_config=model_config, cache_config=cache_config,
                          scheduler_config=scheduler_config, speculative_config=speculative_config,
                          parallel_config=parallel_config, kv_transfer_config=kv_transfer_config)
        self.platform_block_size = None
        try:
            vllm_config = self.VllmConfig(**ev.kwargs_for(self.VllmConfig, vllm_parts))
        except RuntimeError as exc:
            # Feature probe: before 0.11 the CPU platform's check_and_update_config
            # refuses any block size but 16 without IPEX (its attention
            # kernels' constraint, vllm/platforms/cpu.py). The scheduler and
            # the KV-cache manager take the block size from the KVCacheConfig
            # built below, so the config is built at 16 and ours restored
            # after post-init (as for any field post-init adjusts).
            if "--block-size" not in str(exc) or block_size == 16:
                raise DriverError(f"vLLM {self.version} refuses the config: "
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
            self.platform_block_size = 16
            cache_config.block_size = 16
            vllm_config = self.VllmConfig(**ev.kwargs_for(self.VllmConfig, vllm_parts))
        if self.kv_connector and getattr(vllm_config, "kv_transfer_config", None) is None:
            raise DriverError(f"vLLM {self.version}'s VllmConfig takes no kv_transfer_config")
        if self.num_spec:
            lookahead = getattr(vllm_config, "num_lookahead_tokens", 0)
            slots = getattr(vllm_config.speculative_config, "max_num_new_slots_for_drafting", 0)
            if lookahead or slots:
                raise DriverError(f"vLLM {self.version}'s n-gram proposer reserves {lookahead} "
                                  f"lookahead and {slots} draft slots; the harness models none")
        num_blocks = config["num_gpu_blocks"]
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        # VllmConfig/platform post-init may adjust fields: insist on ours.
        sc, cc = vllm_config.scheduler_config, vllm_config.cache_config
        if cc.block_size != block_size:
            cc.block_size = block_size
        for name, value in wanted.items():
            if name in ("is_encoder_decoder", "max_model_len"):
                continue
            actual = getattr(sc, name, value)
            if name == "max_num_scheduled_tokens":
                # None means max_num_batched_tokens (vLLM fills it in with drafts on).
                actual = actual or sc.max_num_batched_tokens
                value = value or config["max_num_batched_tokens"]
            if actual != value:
                raise DriverError(f"vLLM {self.version} changed SchedulerConfig.{name} from "
                                  f"{value!r} to {getattr(sc, name)!r}")
        if vllm_config.model_config.max_model_len != max_model_len:
            raise DriverError(f"vLLM set max_model_len {vllm_config.model_config.max_model_len}, "
                              f"expected {max_model_len}")
        if bool(cc.enable_prefix_caching) != config["enable_prefix_caching"]:
            raise DriverError("vLLM changed enable_prefix_caching")
        for name, value in (("data_parallel_size", self.dp_size),
                            ("pipeline_parallel_size", self.pp_size)):
            if getattr(vllm_config.parallel_config, name, 1) != value:
                raise DriverError(f"vLLM changed {name} to "
                                  f"{getattr(vllm_config.parallel_config, name)}")
        if getattr(sc, "async_scheduling", False):
            raise DriverError("async scheduling could not be turned off")
        return vllm_config
