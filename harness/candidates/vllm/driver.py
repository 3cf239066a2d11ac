#!/usr/bin/env python3
"""Drive vLLM's real v1 ``Scheduler`` step by step, over newline-delimited JSON.

STANDALONE: this script runs under a vLLM virtual environment's Python
(``harness/candidates/vllm/env.py`` builds those) and imports only the standard library,
``vllm`` and ``torch`` -- never this project's packages. The harness side is
``harness/candidates/vllm/candidate.py``.

Protocol: one JSON object per line on stdin, one answer per line on stdout
(the original stdout file descriptor; everything vLLM prints goes to stderr).
Each request is ``{"op": NAME, ...}``; each answer is ``{"ok": true, ...}`` or
``{"ok": false, "error": "one line", "traceback": "...", "exc_type", "exc_message",
"where"}`` (the exception as the trace's ``crash`` row records it: ``events.crash_info``). Ops:

- ``hello``    -> ``{vllm_version, protocol, import_s}`` (no scheduler needed)
- ``init``     ``{config: EngineConfig dict, seed}``: build (or rebuild) the
  scheduler on a CPU platform, no tokenizer (see "Pipelining" below).
- ``add``      ``{request: {request_id, prompt_token_ids, max_tokens, min_tokens,
  ignore_eos, eos_token_id, stop_token_ids, priority, arrival_time}}``
- ``abort``    ``{request_ids}`` -> ``{finished: [FinishedRequest]}``
- ``schedule`` ``{throttle_prefills}`` -> ``{output: SchedulerOutput, snapshot}``
- ``update``   ``{sampled: {request_id: [token ids]}, kv?: {finished_recving,
  invalid_block_ids}}`` -> ``{new_token_ids, finished, num_draft_tokens,
  num_rejected_draft_tokens, drained, snapshot}`` (applies to the oldest
  ``schedule`` output not yet updated); with ``kv`` (KV connector on) also
  ``{finished_recving, invalid_block_ids, kv_freed: [[id, blocks, fence]]}``
- ``drafts``   ``{drafts: {request_id: [token ids]}}`` -> ``{stored, snapshot}``
  (``Scheduler.update_draft_token_ids``; speculative decoding with synchronous
  scheduling only: under async scheduling ``EngineCore.post_step`` hands no
  drafts to the scheduler, which schedules ``-1`` placeholders the worker
  fills, so the op is refused there)
- ``snapshot`` -> ``{snapshot: {waiting, running, num_free_blocks, request_states}}``
  (``request_states``: ``events.request_states`` for the latest
  ``schedule``'s preempted ids: ``[[id, status, num_computed_tokens,
  spec_token_ids], ...]``)
- ``stats``    -> op counts and seconds spent inside vLLM per op
- ``shutdown`` -> answers, then exits 0

Decisions come back in the shape of the harness's ``reference/output.py``:
``SchedulerOutput.events`` is the chronological list of
``{"type": "schedule", request_id, kind, num_computed_tokens,
num_scheduled_tokens, num_prefix_hit_tokens, new_block_ids}``,
``{"type": "withdraw", request_id, num_scheduled_tokens, block_ids}`` and
``{"type": "preempt", request_id, num_computed_tokens, freed_block_ids, fence}``
and ``{"type": "skip", request_id, reason}``, and with the KV connector
``{"type": "kv_load", ...}`` and ``{"type": "kv_promote", ...}``.
The order comes from wrapping, on the scheduler instance,
``kv_cache_manager.allocate_slots`` (each successful call is a scheduling
decision), ``_preempt_request``, ``kv_cache_manager.free`` and
``pop_blocks_for_free`` (the blocks a request releases, tail first) and the
``deferred_waiting`` set (a waiting-loop skip); the values are taken from the
real ``SchedulerOutput``, an inconsistent one recorded as it is, with the ids
its request data carries (``request_data_ids``; ``events.py``).

Pipelining (the harness's ``pipeline_parallel_size``, ``async_scheduling``,
``defer_block_free``), driven as vLLM's ``EngineCore.step_with_batch_queue``
drives its scheduler:

- ``pipeline_parallel_size`` goes to vLLM's ``ParallelConfig``; the batches in
  flight are vLLM's own ``VllmConfig.max_concurrent_batches`` (the engine
  core's batch queue size), read once the scheduler config is final. A
  ``max_concurrent_batches`` in the config (the harness's derived value, what
  ``EngineConfig.to_dict`` writes) must equal it, else ``init`` fails with
  one line. With the V1 model runner the stages change no decision of the
  scheduler (``Scheduler.use_pp`` only adds the sampled tokens to the
  ``CachedRequestData`` payload); ``AsyncScheduler``'s PP decode stagger is
  the V2 runner's only;
- up to ``max_concurrent_batches`` SchedulerOutputs are in flight; each
  ``update`` is applied to the oldest one (FIFO, as the batch queue does), with
  the ModelRunnerOutput built for that batch's requests;
- ``async_scheduling``: the scheduler is vLLM's ``AsyncScheduler``, built
  directly (the CPU platform's config check turns
  ``SchedulerConfig.async_scheduling`` off; it is set back on afterwards, so
  ``VllmConfig.max_concurrent_batches`` reads 2 as on a GPU). Built that way
  it also skips ``VllmConfig``'s refusal of explicitly enabled async
  scheduling with pipeline parallelism on the V1 runner; vLLM's scheduler
  itself runs it (``max_concurrent_batches`` is then ``pipeline_parallel_size``);
- ``defer_block_free``: vLLM 0.33.0 turns it on only in ``Scheduler.__init__``,
  when a KV connector is configured that is a KV consumer and
  ``VllmConfig.max_concurrent_batches > 1``. With the KV connector on and more
  than one batch in flight, that gate sets it itself (the harness's config
  requires ``defer_block_free=true`` then); without a connector the driver
  sets the one attribute the gate sets, ``scheduler.defer_block_free = True``
  (also requiring more than one batch in flight); ``defer_async_loads`` stays
  off (HiSparse only). Deferred frees come back with their fence; each update
  reports the frees it drained.
- ``data_parallel_size`` > 1: each rank is its own driver (the harness engine
  builds one candidate per rank); the scheduler gets a ParallelConfig with
  that ``data_parallel_size``, which is what turns vLLM's local prefill
  cadence off (the MoE DP regime: the engine core's throttle flag drives it).

KV connector (the harness's ``kv_connector``, ``reference/kv_connector.py``):
vLLM gets a scheduler-side stand-in, ``HarnessKVStoreConnector`` (a
``KVConnectorBase_V1``, role SCHEDULER), registered in this process with
``KVConnectorFactory.register_connector`` and configured through
``KVTransferConfig(kv_connector=..., kv_role="kv_consumer",
kv_load_failure_policy=...)``. Its ``get_num_new_matched_tokens(request,
num_computed_tokens)`` returns ``(max(held - num_computed_tokens, 0), ext >
0)`` with ``held = held_prefix_tokens(prompt, block_size,
kv_store_fraction)`` (``events.held_prefix_tokens``, a copy of the
reference's pure function); ``update_state_after_alloc`` does nothing,
``build_connector_meta`` returns empty metadata, ``request_finished`` returns
``(False, None)`` (a consumer never delays its frees). Everything else is
vLLM's own: the waiting loop's lookup, the async-load allocation and its
``reserved_blocks``, ``kv_holding_waiting``, promotion, the handling of
``invalid_block_ids`` and of ``finished_recving`` (fed from the harness's
simulated worker through ``ModelRunnerOutput.kv_connector_output`` on each
``update``). The hooks report an ``allocate_slots`` call with
``delay_cache_blocks=True`` as a ``kv_load`` (the reservation is the
``reserved_blocks`` vLLM passed), ``_handle_blocked_waiting_request`` of a
finished load as a ``kv_promote``, and ``_update_from_kv_xfer_finished`` as
the transfers processed and the frees of requests that finished while
loading. Versions whose scheduler lacks 0.33.0's connector plumbing
(``kv_holding_waiting``, ...) are refused at ``init`` with one line.

Hybrid models (the harness's ``sliding_window`` and ``layer_types``, named
as in a model config; ``reference/kv/``): one KV-cache spec per layer
(``FullAttentionSpec`` for ``full_attention``, ``SlidingWindowSpec`` with the
window for ``sliding_attention``, ``SlidingWindowMLASpec(bounded_replay=True)``
with ``swa_bounded_replay``; a window without layer types: one sliding
layer), all of the config's ``block_size``, grouped by vLLM's own
``get_kv_cache_groups`` into the ``KVCacheConfig`` of ``num_gpu_blocks``
blocks the scheduler gets, as a GPU engine would build it: the CPU
platform turns ``SchedulerConfig.disable_hybrid_kv_cache_manager`` on (no
hybrid KV-cache support), so it is set back off first. ``init`` answers the
groups (``kv_cache_groups``: ``[spec name, window or None, layer indices]``
each) for the harness to check against its own grouping. The hooks then
record every group's blocks and the window frees (``events.DecisionHooks``,
``normalise(num_groups=...)``). A KV connector with a hybrid config is
refused, as the harness refuses it.

One file over ~500 lines on purpose: it is started as a script by path
under vLLM's own virtual environment (``candidate.py``), where this
project's packages are not importable, so the protocol loop, the scheduler
wrappers and the KV-connector stand-in travel as one self-contained file;
only ``events.py`` (stdlib only) is loaded beside it by path
(``tests/test_vllm.py::test_driver_is_standalone``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections import deque
import importlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

# Run as a script, the driver has its own folder first on sys.path, where our
# events.py, spec.py, env.py, ... would shadow a scheduler_cls module of the
# same name that `vllm serve --scheduler-cls` finds (adversarial trial:
# `scheduler_cls=events:MyScheduler` loaded our events.py). Nothing here is
# imported from that folder, so it goes.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

# The driver runs as a script with the vLLM env's python (no access to our
# package), so its sibling module is loaded by file path, under a private name
# (a top-level "events" could shadow or be shadowed by another package).
_EVENTS_SPEC = importlib.util.spec_from_file_location(
    "sched_harness_vllm_events", Path(__file__).resolve().with_name("events.py"))
ev = importlib.util.module_from_spec(_EVENTS_SPEC)
sys.modules[_EVENTS_SPEC.name] = ev
_EVENTS_SPEC.loader.exec_module(ev)

PROTOCOL = 1
# The V2 model runner lists resumed requests in scheduled_new_reqs; both
# layouts are normalised. Set explicitly (the default depends on Triton).
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class DriverError(Exception):
    """A request the driver cannot honour (bad op, unsupported config, ...)."""


class SchedulerClassError(Exception):
    """The ``scheduler_cls`` of ``init`` cannot be used: its module does not
    import, it is not a subclass of vLLM's ``Scheduler`` (the hooks need its
    internals), or its ``__init__`` raised. The harness reports it in one line."""


def load_scheduler_class(name: str, base: type) -> type:
    """``module:Class`` (or vLLM's dotted ``module.Class``) imported from this
    process's ``sys.path`` (the caller's ``PYTHONPATH``), as vLLM's
    ``SchedulerConfig.get_scheduler_cls`` resolves ``scheduler_cls`` with
    ``resolve_obj_by_qualname``. Raises SchedulerClassError (one line) when the
    module does not import, lacks the attribute, or it is not a subclass of
    ``base`` (vLLM's ``vllm.v1.core.sched.scheduler.Scheduler``)."""
    import importlib

    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    try:
        obj = importlib.import_module(module_name)
    except BaseException as exc:  # an import can fail in any way, SystemExit included
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.startswith(exc.name):
            hint = " (is its folder on PYTHONPATH?)"  # the class is found where vllm serve would find it
        raise SchedulerClassError(f"scheduler_cls {name}: module {module_name!r} does not import: "
                                  f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}{hint}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SchedulerClassError(f"scheduler_cls {name}: module {module_name!r} has no "
                                      f"attribute {attr!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type) or not issubclass(obj, base):
        what = f"class {obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else \
            f"a {type(obj).__name__}"
        raise SchedulerClassError(f"scheduler_cls {name} is {what}, not a subclass of "
                                  f"vllm.v1.core.sched.scheduler.Scheduler")
    return obj


# The hooks and the normalisation are shared with the recording scheduler.
NormalisationError = ev.NormalisationError


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


#: EngineConfig fields the driver maps onto vLLM's configs.
MAPPED_KEYS = {
    "num_gpu_blocks", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "max_num_scheduled_tokens", "policy", "enable_prefix_caching", "enable_chunked_prefill",
    "long_prefill_token_threshold", "watermark", "scheduler_reserve_full_isl",
    "num_speculative_tokens", "prefill_schedule_interval",
    # Pipelining and data parallelism (see the module docstring);
    # max_concurrent_batches is derived (checked against vLLM's own).
    "async_scheduling", "pipeline_parallel_size", "max_concurrent_batches", "defer_block_free",
    "data_parallel_size",
    # A hybrid model's KV cache (see "Hybrid models" in the module docstring).
    "sliding_window", "layer_types", "swa_bounded_replay",
    # A drafter's look-ahead KV slots: set on the built Scheduler (_set_lookahead).
    "num_lookahead_tokens",
}
#: Formerly the pipelining fields refused at non-synchronous values; all are
#: mapped now (kept empty for callers that still add it to the known keys).
SYNC_ONLY: dict = {}
#: EngineConfig fields that only drive the harness (virtual clock, scripted proposer).
HARNESS_ONLY_KEYS = {"step_fixed_s", "step_per_token_s", "draft_acceptance_rate",
                     "draft_acceptance_pattern"}
#: The harness's simulated KV-consumer connector (``reference/kv_connector.py``):
#: driven in vLLM through a scheduler-side stand-in (``HarnessKVStoreConnector``,
#: see "KV connector" in the module docstring). ``kv_store_fraction`` and
#: ``kv_load_failure_policy`` reach vLLM; ``kv_load_steps`` and
#: ``kv_load_failure_rate`` only drive the harness's simulated worker, whose
#: output each ``update`` forwards.
KV_CONNECTOR_KEYS = {"kv_connector", "kv_store_fraction", "kv_load_steps",
                     "kv_load_failure_rate", "kv_load_failure_policy",
                     # A recorded connector (reference.kv_connector.RecordedKVConnector):
                     # the stand-in answers as recorded; the worker side is the harness's.
                     "kv_connector_matches", "kv_connector_outputs"}
#: The name the stand-in is registered under (KVConnectorFactory).
KV_CONNECTOR_NAME = "HarnessKVStoreConnector"

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


_CONNECTOR_CLASS = None


def _register_connector():
    """Define the KV-connector stand-in (a ``KVConnectorBase_V1`` subclass, so
    only once vLLM is imported) and register it with ``KVConnectorFactory``
    under ``KV_CONNECTOR_NAME`` (once per process; the factory imports it back
    from this module by name)."""
    global _CONNECTOR_CLASS
    if _CONNECTOR_CLASS is not None:
        return _CONNECTOR_CLASS
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                  KVConnectorMetadata,
                                                                  KVConnectorRole)

    class HarnessKVConnectorMetadata(KVConnectorMetadata):
        """Nothing to tell a worker: the harness's simulated worker starts
        its loads from the normalised ``kv_load`` events."""

    class HarnessKVStoreConnector(KVConnectorBase_V1):
        """Scheduler side of the harness's simulated KV-consumer connector
        (``reference.kv_connector.SimulatedKVConnector``): an external store
        holding, by content, the longest prefix of full prompt blocks whose
        chained hash falls below ``kv_store_fraction``; everything it holds
        past the local hit loads asynchronously. The worker side is the
        harness's: its ``KVConnectorOutput`` reaches ``update_from_output``
        through the driver's ``update``."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config, role, kv_cache_config)
            if role != KVConnectorRole.SCHEDULER:
                raise RuntimeError("the harness KV-store stand-in has no worker side")
            extra = self._kv_transfer_config.kv_connector_extra_config
            self.block_size = int(extra["block_size"])
            self.fraction = float(extra["kv_store_fraction"])
            self._held: dict[str, int] = {}
            # A recorded connector's answers (config kv_connector_matches): per request,
            # in call order; None: the simulated store answers.
            matches = extra.get("matches")
            self._answers = None if matches is None else {r: [tuple(a) for a in answers]
                                                          for r, answers in matches}
            self._calls: dict[str, int] = {}

        # Scheduler side.
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            if self._answers is not None:
                # As reference.kv_connector.RecordedKVConnector: the k-th call for a
                # request gets its k-th recorded answer (past them the last; none: 0).
                answers = self._answers.get(request.request_id) or [(0, False)]
                k = self._calls.get(request.request_id, 0)
                self._calls[request.request_id] = k + 1
                external, load_kv_async = answers[min(k, len(answers) - 1)]
                return external, bool(load_kv_async)
            held = self._held.get(request.request_id)
            if held is None:
                held = self._held[request.request_id] = ev.held_prefix_tokens(
                    list(request.prompt_token_ids), self.block_size, self.fraction)
            external = max(held - num_computed_tokens, 0)
            return external, external > 0

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            return None

        def build_connector_meta(self, scheduler_output):
            return HarnessKVConnectorMetadata()

        def request_finished(self, request, block_ids):
            self._held.pop(request.request_id, None)
            return False, None

        # Worker side: never built (role SCHEDULER only).
        def start_load_kv(self, forward_context, **kwargs):
            raise NotImplementedError

        def wait_for_layer_load(self, layer_name):
            raise NotImplementedError

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            raise NotImplementedError

        def wait_for_save(self):
            raise NotImplementedError

    HarnessKVStoreConnector.__name__ = HarnessKVStoreConnector.__qualname__ = KV_CONNECTOR_NAME
    module = sys.modules[__name__]
    setattr(module, KV_CONNECTOR_NAME, HarnessKVStoreConnector)
    if KV_CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(KV_CONNECTOR_NAME, __name__, KV_CONNECTOR_NAME)
    _CONNECTOR_CLASS = HarnessKVStoreConnector
    return HarnessKVStoreConnector


class Driver:
    """One vLLM Scheduler plus the hooks that normalise its decisions."""

    def __init__(self) -> None:
        t0 = time.perf_counter()
        import torch  # noqa: F401  (imported once per process)
        import vllm

        self.vllm = vllm
        self.version = vllm.__version__
        self.vt = _version_tuple(self.version)
        self._pin_cpu_platform()
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

        try:
            from vllm.config import SpeculativeConfig
        except ImportError:  # pragma: no cover - every supported version has it
            SpeculativeConfig = None
        try:
            from vllm.v1.outputs import DraftTokenIds
        except ImportError:
            DraftTokenIds = None
        self.SpeculativeConfig, self.DraftTokenIds = SpeculativeConfig, DraftTokenIds
        from vllm.sampling_params import SamplingParams
        from vllm.v1.core.kv_cache_utils import init_none_hash

        try:  # feature probe: the Request hashes its own blocks (0.10.1 on)
            from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        except ImportError:  # 0.10.0: the KV-cache manager hashes them
            get_request_block_hasher = None
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        try:
            from vllm.utils.hashing import sha256
        except ImportError:  # older layouts
            from vllm.utils import sha256  # type: ignore[no-redef]
        self.CacheConfig, self.ModelConfig = CacheConfig, ModelConfig
        self.SchedulerConfig, self.VllmConfig = SchedulerConfig, VllmConfig
        self.SamplingParams, self.Request, self.RequestStatus = SamplingParams, Request, RequestStatus
        self.Scheduler, self.ModelRunnerOutput = Scheduler, ModelRunnerOutput
        self.FullAttentionSpec, self.KVCacheConfig = FullAttentionSpec, KVCacheConfig
        self.KVCacheGroupSpec, self.StructuredOutputManager = KVCacheGroupSpec, StructuredOutputManager
        self.get_request_block_hasher, self.sha256 = get_request_block_hasher, sha256
        self.torch = torch
        init_none_hash(sha256)  # once per process
        self.import_s = time.perf_counter() - t0
        self.sched = None
        self.stats: dict[str, list[float]] = {}

    @staticmethod
    def _parallel_config(data_parallel_size: int = 1, pipeline_parallel_size: int = 1):
        from vllm.config import ParallelConfig

        wanted = {}
        if data_parallel_size != 1:
            wanted["data_parallel_size"] = data_parallel_size
        if pipeline_parallel_size != 1:
            wanted["pipeline_parallel_size"] = pipeline_parallel_size
        return ParallelConfig(**ev.kwargs_for(ParallelConfig, wanted))

    @staticmethod
    def _pin_cpu_platform() -> None:
        import vllm.platforms as platforms
        from vllm.platforms.cpu import CpuPlatform

        platform = CpuPlatform()
        import torch

        if hasattr(platform, "import_kernels") and \
                not hasattr(getattr(torch._C, "_cpu", None), "_is_avx512_supported"):
            # Feature probe: some releases (0.17.1) pick their CPU kernels with
            # torch._C._cpu._is_avx512_supported, which torch 2.13.0 lacks. The
            # scheduler needs no kernel (layered envs ship none), so the
            # platform loads none.
            platform.import_kernels = lambda: None
        platforms._current_platform = platform

    # -- init -----------------------------------------------------------------
    def init(self, config: dict, seed: int, scheduler_cls: str | None = None) -> dict:
        """Build the scheduler for ``config`` (an EngineConfig dict); with
        ``scheduler_cls`` (``module:Class``) that Scheduler subclass instead of
        vLLM's (SchedulerClassError if unusable). DriverError: a config this
        vLLM cannot express, one option per message."""
        self.sched = None
        custom_cls = (load_scheduler_class(scheduler_cls, self.Scheduler)
                      if scheduler_cls else None)
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
        scheduler_cls = self.Scheduler
        if self.async_scheduling:
            try:
                from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            except ImportError:
                raise DriverError(f"vLLM {self.version} has no AsyncScheduler") from None
            scheduler_cls = AsyncScheduler
            if custom_cls is not None and not issubclass(custom_cls, AsyncScheduler):
                # vLLM uses a custom class as given, async or not; a synchronous
                # Scheduler under async scheduling is not a run vLLM supports.
                # The line says how to cover these configs (new-user trial: a plain
                # subclass read "15 ok, 5 skipped, 0 failed" and no one said how).
                raise DriverError(f"async_scheduling needs an AsyncScheduler subclass; "
                                  f"scheduler_cls {scheduler_cls_name(custom_cls)} is not one (to cover "
                                  f"async scheduling, run again with scheduler_cls= your change on a subclass "
                                  f"of vllm.v1.core.sched.async_scheduler.AsyncScheduler)")
            # What a GPU platform leaves on (the scheduler itself only reads the
            # class; VllmConfig.max_concurrent_batches reads the flag).
            sc.async_scheduling = True
        elif custom_cls is not None:
            try:
                from vllm.v1.core.sched.async_scheduler import AsyncScheduler
            except ImportError:
                AsyncScheduler = None
            if AsyncScheduler is not None and issubclass(custom_cls, AsyncScheduler):
                # vLLM builds the class as given: an AsyncScheduler keeps output
                # placeholders for a step in flight, which only an async engine
                # (async_scheduling, two batches in flight) has; in a synchronous
                # config they would be misjudged (issue 23: SCHEDULED-SPAN x346).
                raise DriverError(f"scheduler_cls {scheduler_cls_name(custom_cls)} is an AsyncScheduler "
                                  f"subclass: it runs only with async_scheduling = true, and this "
                                  f"config is synchronous")
        if custom_cls is not None:
            # Built directly, like AsyncScheduler above (what vLLM's
            # SchedulerConfig.get_scheduler_cls returns for scheduler_cls).
            scheduler_cls = custom_cls
        # Batches in flight: vLLM's own derivation (EngineCore.batch_queue_size),
        # from pipeline_parallel_size and async_scheduling as now set (a vLLM
        # without the property: its V1 runner's rule, the same numbers).
        self.max_in_flight = int(getattr(vllm_config, "max_concurrent_batches",
                                         max(self.pp_size, 2 if self.async_scheduling else 1)))
        expected = config.get("max_concurrent_batches")
        if expected is not None and int(expected) != self.max_in_flight:
            raise DriverError(
                f"vLLM {self.version} derives max_concurrent_batches={self.max_in_flight} from "
                f"pipeline_parallel_size={self.pp_size}, async_scheduling={self.async_scheduling} "
                f"(use_v2_model_runner={bool(getattr(vllm_config, 'use_v2_model_runner', False))}); "
                f"the harness config says {expected}")
        if self.defer_block_free and self.max_in_flight < 2:
            # vLLM's own gate: max_concurrent_batches > 1 (and a KV consumer).
            raise DriverError("defer_block_free needs more than one batch in flight "
                              "(async_scheduling or pipeline_parallel_size > 1)")

        spec_kwargs = dict(block_size=block_size, num_kv_heads=1, head_size=1,
                           dtype=self.torch.float32)
        if "use_mla" in ev.field_names(self.FullAttentionSpec):
            spec_kwargs["use_mla"] = False
        spec = self.FullAttentionSpec(**spec_kwargs)
        kv_cache_groups = self._hybrid_kv_cache_groups(config, vllm_config, spec_kwargs)
        self.kv_cache_groups_answer = None
        if kv_cache_groups is None:
            kv_cache_groups = [self.KVCacheGroupSpec(["layer"], spec)]
        else:
            self.kv_cache_groups_answer = [
                [type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                 [int(name.rsplit(".", 1)[1]) for name in g.layer_names]] for g in kv_cache_groups]
        kv_cache_config = self.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=kv_cache_groups)
        # vLLM schedules on the least common multiple of the groups' block
        # sizes (a Mamba group's is max_model_len; resolve_kv_cache_block_sizes),
        # which its coordinator asserts; the same as block_size without Mamba.
        sched_block_size = math.lcm(block_size, *(g.kv_cache_spec.block_size for g in kv_cache_groups))
        sched_kwargs = dict(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                            structured_output_manager=self.StructuredOutputManager(vllm_config),
                            block_size=sched_block_size, log_stats=False, include_finished_set=False)
        try:
            sched = scheduler_cls(**ev.kwargs_for(scheduler_cls, sched_kwargs))
        except Exception as exc:
            if custom_cls is None:
                raise
            raise SchedulerClassError(
                f"scheduler_cls {scheduler_cls_name(custom_cls)}: __init__ raised "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}") from None
        self._set_lookahead(sched, int(config.get("num_lookahead_tokens", 0) or 0),
                            int(getattr(vllm_config, "num_lookahead_tokens", 0) or 0))
        connector = getattr(sched, "connector", None)
        if self.kv_connector:
            self._check_connector(sched)
        elif connector is not None:
            raise DriverError("vLLM configured a KV connector; the driver asked for none")
        vllm_deferred = bool(getattr(sched, "defer_block_free", False))
        if vllm_deferred and not self.defer_block_free:
            raise DriverError("vLLM turned defer_block_free on; the config has it off")
        if self.defer_block_free and not getattr(sched, "defer_block_free", False):
            # vLLM's gate (Scheduler.__init__): a KV-consumer connector and
            # VllmConfig.max_concurrent_batches > 1. Without a connector, set
            # the one attribute the gate sets.
            if not hasattr(sched, "defer_block_free") or not hasattr(sched, "deferred_frees"):
                raise DriverError(f"vLLM {self.version} has no deferred block frees")
            sched.defer_block_free = True
        if getattr(sched, "defer_async_loads", False):
            raise DriverError("vLLM turned defer_async_loads on (HiSparse only); not modelled")
        if self.dp_size > 1 and getattr(sched, "local_prefill_interval", 1) != 1:
            raise DriverError("vLLM kept the local prefill cadence with data parallelism")
        self.sched = sched
        if getattr(self.sched, "use_v2_model_runner", self.use_v2) != self.use_v2:
            self.use_v2 = bool(self.sched.use_v2_model_runner)
        self.block_hasher = (None if self.get_request_block_hasher is None
                             else self.get_request_block_hasher(block_size, self.sha256))
        self.max_num_scheduled_tokens = self.sched.max_num_scheduled_tokens
        self._schedule_sig = inspect.signature(self.sched.schedule).parameters
        self._request_params = set(inspect.signature(self.Request).parameters)
        self._request_mm_params = sorted(p for p in self._request_params
                                         if p.startswith(("multi_modal", "mm_")))
        self._install_hooks()
        # vLLM SchedulerOutputs in flight, oldest first (EngineCore.batch_queue).
        self.in_flight: deque = deque()
        self.num_unfinished_local = 0
        return {"vllm_version": self.version, "use_v2_model_runner": self.use_v2,
                "scheduler_class": type(sched).__name__,
                "scheduler_cls": scheduler_cls_name(custom_cls) if custom_cls else None,
                # Set when the CPU platform only took this block size (see init).
                "platform_block_size": self.platform_block_size,
                "kv_connector": type(connector).__name__ if connector is not None else None,
                "recompute_kv_load_failures": bool(getattr(sched, "recompute_kv_load_failures",
                                                           True)),
                "defer_block_free": bool(getattr(sched, "defer_block_free", False)),
                # True when vLLM's own gate (KV consumer, max_concurrent_batches
                # > 1) turned it on, False when the driver set it.
                "defer_block_free_by_vllm": vllm_deferred,
                "local_prefill_interval": getattr(sched, "local_prefill_interval", 1),
                "max_concurrent_batches": self.max_in_flight,
                "kv_cache_groups": self.kv_cache_groups_answer,
                "num_free_blocks": self.num_free_blocks()}

    def _set_lookahead(self, sched, lookahead: int, derived: int) -> None:
        """Give vLLM's ``Scheduler`` the config's ``num_lookahead_tokens`` (a
        drafter's look-ahead KV slots, tokens; vLLM derives it from a drafter
        with its own forward pass, which the driver does not build). A
        ``scheduler_cls`` that set its own keeps it. With drafts, the async
        load reservation ``__init__`` derived from it (``_spec_decode_step_blocks``,
        one step of ``1 + num_spec_tokens + num_lookahead_tokens`` slots per
        non-Mamba group) is resized too. DriverError: a vLLM without the knob."""
        if not lookahead:
            return
        if not hasattr(sched, "num_lookahead_tokens"):
            raise DriverError(f"vLLM {self.version}'s Scheduler has no num_lookahead_tokens")
        if sched.num_lookahead_tokens != derived:
            return  # the scheduler class chose its own
        sched.num_lookahead_tokens = lookahead
        if self.num_spec and hasattr(sched, "_spec_decode_step_blocks"):
            managers = sched.kv_cache_manager.coordinator.single_type_managers
            sched._spec_decode_step_blocks = sum(
                -(-(1 + self.num_spec + lookahead) // m.block_size) for m in managers
                if type(m.kv_cache_spec).__name__ != "MambaSpec")

    def _hybrid_kv_cache_groups(self, config: dict, vllm_config, spec_kwargs: dict):
        """vLLM's KV-cache groups for the config's ``layer_types`` and
        ``sliding_window`` (see "Hybrid models" in the module docstring), or
        None for a model of full-attention layers only (the one-group
        ``KVCacheConfig``). DriverError: a layer type the driver does not
        build, a KV connector, a vLLM without the grouping function."""
        window = config.get("sliding_window")
        layer_types = list(config.get("layer_types") or ())
        if not layer_types:
            layer_types = ["sliding_attention"] if window is not None else []
        if all(t == "full_attention" for t in layer_types):
            return None
        if self.kv_connector:
            raise DriverError("a KV connector with a hybrid KV cache (sliding_window/layer_types) is not driven")
        from vllm.v1.kv_cache_interface import SlidingWindowSpec
        try:
            from vllm.v1.kv_cache_interface import MambaSpec
        except ImportError:  # a release without Mamba groups: refused below
            MambaSpec = None
        bounded_replay = bool(config.get("swa_bounded_replay", False))
        if bounded_replay:
            # DeepSeek-V4.1's SWA bounded replay: its sliding-window layers'
            # SlidingWindowMLASpec(bounded_replay=True) (vLLM 0.33.0 on).
            try:
                from vllm.v1.kv_cache_interface import SlidingWindowMLASpec
            except ImportError:
                SlidingWindowMLASpec = None
            if SlidingWindowMLASpec is None or "bounded_replay" not in ev.field_names(SlidingWindowMLASpec):
                raise DriverError(f"vLLM {self.version} has no SlidingWindowMLASpec.bounded_replay: "
                                  f"swa_bounded_replay is not driven")

        specs = {}
        for i, layer_type in enumerate(layer_types):
            if layer_type == "full_attention":
                specs[f"layer.{i}"] = self.FullAttentionSpec(**spec_kwargs)
            elif layer_type == "sliding_attention" and window is not None and bounded_replay:
                # An MLA page holds one latent vector per token (no separate V):
                # twice the head size gives the full-attention layers' page, so
                # every group shares one pool.
                specs[f"layer.{i}"] = SlidingWindowMLASpec(**ev.kwargs_for(
                    SlidingWindowMLASpec, {**spec_kwargs, "head_size": 2 * spec_kwargs["head_size"],
                                           "sliding_window": int(window), "bounded_replay": True}))
            elif layer_type == "sliding_attention" and window is not None:
                specs[f"layer.{i}"] = SlidingWindowSpec(**ev.kwargs_for(
                    SlidingWindowSpec, {**spec_kwargs, "sliding_window": int(window)}))
            elif layer_type == "linear_attention" and MambaSpec is not None:
                # A Mamba layer as MambaBase.get_kv_cache_spec builds it: one
                # state block of max_model_len tokens (mode "none": prefix
                # caching off, which the config requires), its page padded to
                # the attention layers' so every group shares one pool.
                specs[f"layer.{i}"] = MambaSpec(**ev.kwargs_for(MambaSpec, dict(
                    block_size=int(config["max_model_len"]), shapes=((1,),), dtypes=(self.torch.float32,),
                    page_size_padded=self.FullAttentionSpec(**spec_kwargs).page_size_bytes,
                    mamba_cache_mode="none",
                    num_speculative_blocks=int(config.get("num_speculative_tokens") or 0))))
            else:
                raise DriverError(f"layer_types[{i}] {layer_type!r} (sliding_window {window}) is not "
                                  f"a layer the driver builds")
        get_kv_cache_groups = None
        for module in ("vllm.v1.core.kv_cache_planning", "vllm.v1.core.kv_cache_utils"):
            try:
                get_kv_cache_groups = getattr(importlib.import_module(module), "get_kv_cache_groups")
                break
            except (ImportError, AttributeError):
                continue
        if get_kv_cache_groups is None:
            raise DriverError(f"vLLM {self.version} has no get_kv_cache_groups: hybrid KV caches "
                              f"are not driven")
        sc = vllm_config.scheduler_config
        if getattr(sc, "disable_hybrid_kv_cache_manager", False):
            # The CPU platform's choice (no hybrid KV-cache support); a GPU keeps it on.
            sc.disable_hybrid_kv_cache_manager = False
        cc = vllm_config.cache_config
        unresolved = hasattr(cc, "kv_cache_layout") and cc.kv_cache_layout is None
        if unresolved:
            # The engine core resolves the layout from its workers' backends
            # (none here); it only matters to layers of different page sizes,
            # and every layer built here has the same page size.
            cc.kv_cache_layout = "NHD"
        try:
            return list(get_kv_cache_groups(vllm_config, specs))
        finally:
            if unresolved:
                cc.kv_cache_layout = None

    # -- KV connector stand-in ------------------------------------------------
    def _kv_transfer_config(self, config: dict):
        try:
            from vllm.config import KVTransferConfig
        except ImportError:
            raise DriverError(f"vLLM {self.version} has no KVTransferConfig") from None
        if "kv_load_failure_policy" not in ev.field_names(KVTransferConfig):
            raise DriverError(f"vLLM {self.version}'s KVTransferConfig has no "
                              f"kv_load_failure_policy")
        _register_connector()
        return KVTransferConfig(
            kv_connector=KV_CONNECTOR_NAME, kv_role="kv_consumer",
            kv_load_failure_policy=config.get("kv_load_failure_policy", "recompute"),
            kv_connector_extra_config={
                "block_size": config["block_size"],
                "kv_store_fraction": float(config.get("kv_store_fraction", 1.0)),
                "matches": config.get("kv_connector_matches")})

    def _check_connector(self, sched) -> None:
        connector = getattr(sched, "connector", None)
        if type(connector).__name__ != KV_CONNECTOR_NAME:
            raise DriverError(f"vLLM built connector {type(connector).__name__}, "
                              f"not the harness's stand-in")
        policy = self.config.get("kv_load_failure_policy", "recompute")
        if bool(sched.recompute_kv_load_failures) != (policy == "recompute"):
            raise DriverError(f"vLLM did not take kv_load_failure_policy={policy!r}")
        # A capability probe, not a version check. 0.20.2..0.29.0 have the rest of the plumbing
        # (allocate_slots' delay_cache_blocks/reserved_blocks from 0.25.0, the promotion under
        # its old name _try_promote_blocked_waiting_request, which events.py hooks too), but no
        # kv_holding_waiting: a held load waits in waiting/skipped_waiting, and the fail policy's
        # finished requests (update_from_output below) are ordered by that queue. Driving them
        # needs that order modelled and checked against those releases first.
        for name in ("kv_holding_waiting", "finished_recving_kv_req_ids",
                     "failed_recving_kv_req_ids", "_inflight_prefill_reserved_blocks",
                     "_handle_blocked_waiting_request", "_update_from_kv_xfer_finished"):
            if not hasattr(sched, name):
                raise DriverError(f"vLLM {self.version}'s Scheduler has no {name}: async KV "
                                  f"loads cannot be driven")
        if not ev.kv_hooks_installable(sched):
            raise DriverError(f"vLLM {self.version}'s allocate_slots takes no "
                              f"delay_cache_blocks/reserved_blocks")

    def _install_hooks(self) -> None:
        # Chronological decisions of each schedule() and the blocks each free
        # releases (tail first).
        self.hooks = ev.DecisionHooks(self.sched)
        # The latest schedule()'s preempted ids: snapshots report their states.
        self.last_preempted: list[str] = []

    # -- requests -------------------------------------------------------------
    def _require(self):
        if self.sched is None:
            raise DriverError("no scheduler: send 'init' first")
        return self.sched

    def add(self, req: dict) -> dict:
        sched = self._require()
        params = self.SamplingParams(
            max_tokens=req["max_tokens"], min_tokens=req.get("min_tokens", 0),
            ignore_eos=bool(req.get("ignore_eos", False)),
            stop_token_ids=list(req.get("stop_token_ids") or []))
        eos = req.get("eos_token_id")
        kwargs = dict(request_id=req["request_id"], prompt_token_ids=list(req["prompt_token_ids"]),
                      sampling_params=params, pooling_params=None,
                      arrival_time=float(req.get("arrival_time", 0.0)),
                      priority=int(req.get("priority", 0)), block_hasher=self.block_hasher)
        if hasattr(params, "update_from_generation_config"):
            # What vLLM's input processor does with the model's EOS token.
            params.update_from_generation_config({}, eos)
        if "eos_token_id" in self._request_params:  # 0.10-era Request
            kwargs["eos_token_id"] = eos
        for name in self._request_mm_params:
            # Feature probe: releases whose Request takes the multimodal
            # fields as arguments (0.10.0: multi_modal_inputs/_hashes/
            # _placeholders, 0.10.1: multi_modal_kwargs, ...) get "none", as
            # a text-only prompt has.
            kwargs.setdefault(name, None)
        request = self.Request(**{k: v for k, v in kwargs.items() if k in self._request_params})
        if req["request_id"] in sched.requests:
            raise DriverError(f"duplicate request id {req['request_id']!r}")
        sched.add_request(request)
        return {}

    def _finished_info(self, request) -> dict:
        groups = self.hooks.freed_groups.pop(request.request_id, None)
        if self.hooks.hybrid and groups is None:
            groups = [[] for _ in range(self.hooks.num_groups)]
        return ev.finished_info(request, self.hooks.freed.pop(request.request_id, []),
                                self.hooks.fences.pop(request.request_id, None),
                                groups if self.hooks.hybrid else None)

    def abort(self, request_ids: list[str]) -> dict:
        sched = self._require()
        # The Request objects, before vLLM drops them (what finish_requests
        # returns differs across versions: Requests, or (id, client) pairs).
        live = {i: sched.requests.get(i) for i in dict.fromkeys(request_ids)}
        live = {i: r for i, r in live.items() if r is not None and not r.is_finished()}
        sched.finish_requests(list(live), self.RequestStatus.FINISHED_ABORTED)
        # vLLM collects ids into a set: report in the order given, as the harness does.
        out = [self._finished_info(r) for r in live.values()
               if r.status == self.RequestStatus.FINISHED_ABORTED]
        return {"finished": out, "num_unfinished": sched.get_num_unfinished_requests()}

    def reset_prefix_cache(self, reset_running_requests: bool) -> dict:
        """vLLM's own ``Scheduler.reset_prefix_cache(reset_running_requests)``
        (``EngineCore.reset_prefix_cache``'s body; no connector to reset).
        Returns ``{succeeded, running_before, preemptions, snapshot}``: the
        forced preemptions as the hooks saw them (tail of running first),
        each ``{request_id, num_computed_tokens, freed_block_ids, fence}``.
        vLLM's RuntimeError (a forced reset that still fails) propagates."""
        sched = self._require()
        running_before = [r.request_id for r in sched.running]
        self.hooks.seq = []
        # Passed by name: a vLLM without the parameter fails loudly (TypeError).
        ok = sched.reset_prefix_cache(reset_running_requests=reset_running_requests)
        preemptions = [{"request_id": item[1], "num_computed_tokens": item[2],
                        "freed_block_ids": list(item[3]), "fence": item[4] if len(item) > 4 else None,
                        "group_block_ids": item[5] if len(item) > 5 else None}
                       for item in self.hooks.seq if item[0] == "preempt"]
        self.hooks.seq = []
        return {"succeeded": bool(ok), "running_before": running_before, "preemptions": preemptions,
                "snapshot": self.snapshot()}

    def num_free_blocks(self) -> int:
        return ev.num_free_blocks(self.sched)

    def snapshot(self) -> dict:
        return ev.snapshot(self._require(), self.last_preempted)

    # -- schedule -------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False) -> dict:
        sched = self._require()
        if len(self.in_flight) >= self.max_in_flight:
            raise DriverError(f"'schedule' with {len(self.in_flight)} batches in flight "
                              f"(max_concurrent_batches={self.max_in_flight}): update first")
        kwargs = {}
        if throttle_prefills:
            if "throttle_prefills" not in self._schedule_sig:
                raise DriverError(f"vLLM {self.version} schedule() has no throttle_prefills")
            kwargs["throttle_prefills"] = True
        defer = ev.prefill_gate(sched, throttle_prefills)
        self.hooks.begin()
        try:
            so = sched.schedule(**kwargs)
        finally:
            self.hooks.end()
        self.in_flight.append(so)
        output = ev.normalise(so, self.hooks.seq, use_v2=self.use_v2,
                              max_num_scheduled_tokens=self.max_num_scheduled_tokens,
                              requests=sched.requests,
                              num_groups=self.hooks.num_groups if self.hooks.hybrid else 0)
        self.last_preempted = list(output["preempted_req_ids"])
        output.update(throttle_prefills=bool(throttle_prefills), defer_prefills=defer,
                      prefill_capacity_bound=bool(getattr(sched, "prefill_capacity_bound", False)))
        return {"output": output, "snapshot": self.snapshot()}

    # -- update ---------------------------------------------------------------
    def _kv_connector_output(self, kv: dict | None):
        """vLLM's ``KVConnectorOutput`` for the harness's simulated worker
        output ``{finished_recving: [ids], invalid_block_ids: [ids]}``.

        ``finished_recving`` is a set in vLLM (the worker side aggregates
        sets, so the order ``_update_from_kv_xfer_finished`` frees in is
        hash-dependent); the harness processes transfers in load start order,
        so an insertion-ordered set view (dict keys) is passed: vLLM only
        iterates it."""
        if kv is None:
            return None
        if not self.kv_connector:
            raise DriverError("KV connector output sent with kv_connector off")
        from vllm.v1.outputs import KVConnectorOutput

        return KVConnectorOutput(**ev.kwargs_for(KVConnectorOutput, dict(
            finished_recving=dict.fromkeys(kv.get("finished_recving") or ()).keys(),
            invalid_block_ids=set(kv.get("invalid_block_ids") or ()))))

    def _model_runner_output(self, req_ids: list[str], sampled: dict[str, list[int]],
                             kv_connector_output=None):
        values = {
            "req_ids": req_ids,
            "req_id_to_index": {r: i for i, r in enumerate(req_ids)},
            "sampled_token_ids": [list(sampled.get(r, [])) for r in req_ids],
            "spec_token_ids": None, "logprobs": None, "prompt_logprobs_dict": {},
            "pooler_output": [], "kv_connector_output": kv_connector_output,
            "num_nans_in_logits": None,
        }
        cls = self.ModelRunnerOutput
        if dataclasses.is_dataclass(cls):
            kwargs = {}
            for f in dataclasses.fields(cls):
                if not f.init:
                    continue
                if f.name in values:
                    kwargs[f.name] = values[f.name]
                elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    kwargs[f.name] = None
            return cls(**kwargs)
        return cls(**ev.kwargs_for(cls, values))

    def update(self, sampled: dict[str, list[int]], kv: dict | None = None) -> dict:
        sched = self._require()
        if not self.in_flight:
            raise DriverError("'update' without a preceding 'schedule'")
        so = self.in_flight[0]  # the oldest batch, as EngineCore's batch queue pops it
        req_ids = list(so.num_scheduled_tokens)
        unknown = sorted(set(sampled) - set(req_ids))
        if unknown:
            raise DriverError(f"sampled tokens for unscheduled requests {unknown[:5]}")
        requests = {r: sched.requests.get(r) for r in req_ids}
        # Draft accounting as update_from_output does it (its SpecDecodingStats
        # exist only with log_stats): drafts verified for a live request that
        # produced tokens; accepted = tokens returned - the one sampled token.
        num_draft = num_rejected = 0
        spec_tokens = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        for r in req_ids:
            request, drafts, generated = requests[r], spec_tokens.get(r), sampled.get(r)
            if request is None or request.is_finished() or not drafts or not generated:
                continue
            if getattr(request, "num_stale_output_tokens", 0) > 0 and \
                    getattr(request, "drop_stale_output", False):
                continue
            num_draft += len(drafts)
            num_rejected += len(drafts) - max(len(generated) - 1, 0)
        kv_output = self._kv_connector_output(kv)
        # Requests a failed load may finish (fail policy): unscheduled ones
        # waiting in kv_holding_waiting, in queue order.
        known = dict(sched.requests) if kv_output is not None else requests
        holding = {r.request_id: i for i, r in
                   enumerate(getattr(sched, "kv_holding_waiting", ()))}
        self.in_flight.popleft()
        self.hooks.drained = []
        self.hooks.recving, self.hooks.kv_freed = [], []
        engine_outputs = sched.update_from_output(
            so, self._model_runner_output(req_ids, sampled, kv_output))
        drained, self.hooks.drained = self.hooks.drained, []
        recving, self.hooks.recving = self.hooks.recving, []
        kv_freed, self.hooks.kv_freed = self.hooks.kv_freed, []
        new_token_ids: dict[str, list[int]] = {}
        finished: list[dict] = []
        errors: list[dict] = []
        for client in sorted(engine_outputs):
            for out in engine_outputs[client].outputs:
                if out.new_token_ids:
                    new_token_ids[out.request_id] = list(out.new_token_ids)
                if out.finish_reason is not None:
                    request = known.get(out.request_id)
                    if request is None:
                        raise NormalisationError(f"{out.request_id} finished but was not scheduled")
                    info = self._finished_info(request)
                    if info["finish_reason"] != str(out.finish_reason):
                        raise NormalisationError(f"{out.request_id}: finish reason mismatch")
                    if info["status"] == "FINISHED_ERROR" and out.request_id in holding:
                        errors.append(info)
                    else:
                        finished.append(info)
        # KV-load failures under the fail policy finish after every other
        # output, through finish_requests(set): report them in queue order
        # (as the reference does), not in the set's hash order.
        finished += sorted(errors, key=lambda f: holding[f["request_id"]])
        answer = {"new_token_ids": new_token_ids, "finished": finished,
                  "num_draft_tokens": num_draft, "num_rejected_draft_tokens": num_rejected,
                  "drained": [[fence, blocks] for fence, blocks in drained],
                  "num_unfinished": sched.get_num_unfinished_requests(),
                  "snapshot": self.snapshot()}
        if kv_output is not None:
            answer.update(finished_recving=recving,
                          invalid_block_ids=sorted(kv_output.invalid_block_ids or ()),
                          kv_freed=[list(item) for item in kv_freed])
        return answer

    def drafts(self, drafts: dict[str, list[int]]) -> dict:
        sched = self._require()
        if not self.num_spec:
            raise DriverError("draft tokens sent with speculative decoding off")
        if self.async_scheduling:
            # vLLM 0.33.0 EngineCore.post_step: `not self.async_scheduling`.
            raise DriverError("draft tokens sent with async scheduling (EngineCore hands drafts to the "
                              "scheduler only when scheduling is synchronous)")
        ids = list(drafts)
        sched.update_draft_token_ids(self.DraftTokenIds(ids, [list(drafts[i]) for i in ids]))
        stored = {}
        for req_id in ids:
            request = sched.requests.get(req_id)
            if request is not None and not request.is_finished() and request.spec_token_ids:
                stored[req_id] = list(request.spec_token_ids)
        return {"stored": stored, "snapshot": self.snapshot()}


def scheduler_cls_name(cls: type) -> str:
    """``module.Class``: vLLM's qualname spelling of a scheduler class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _one_line(exc: BaseException) -> str:
    """``Type: message``; for a bare ``assert`` (no message), where it failed."""
    text = " ".join(str(exc).split())
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            f = frames[-1]
            where = "/".join(f.filename.split("/")[-3:])
            text = f"at {where}:{f.lineno} `{(f.line or '').strip()}`"
    return f"{type(exc).__name__}: {text}"[:500]


def _serve(inp, out) -> int:
    driver: Driver | None = None
    t_start = time.perf_counter()
    for line in inp:
        line = line.strip()
        if not line:
            continue
        op = "?"
        try:
            msg = json.loads(line)
            op = msg.get("op", "?")
            if driver is None:
                driver = Driver()
                print(f"vllm {driver.version} imported in {driver.import_s:.1f} s "
                      f"({time.perf_counter() - t_start:.1f} s since start)", file=sys.stderr)
            t0 = time.perf_counter()
            if op == "hello":
                resp = {"vllm_version": driver.version, "protocol": PROTOCOL,
                        "import_s": round(driver.import_s, 3), "pid": os.getpid()}
            elif op == "init":
                resp = driver.init(msg["config"], int(msg.get("seed", 0)),
                                   msg.get("scheduler_cls"))
            elif op == "add":
                resp = driver.add(msg["request"])
            elif op == "abort":
                resp = driver.abort(msg["request_ids"])
            elif op == "reset_prefix_cache":
                resp = driver.reset_prefix_cache(bool(msg.get("reset_running_requests", False)))
            elif op == "schedule":
                resp = driver.schedule(bool(msg.get("throttle_prefills", False)))
            elif op == "update":
                resp = driver.update(msg.get("sampled") or {}, msg.get("kv"))
            elif op == "drafts":
                resp = driver.drafts(msg.get("drafts") or {})
            elif op == "snapshot":
                resp = {"snapshot": driver.snapshot()}
            elif op == "stats":
                resp = {"stats": {k: {"count": len(v), "total_s": sum(v)}
                                  for k, v in driver.stats.items()},
                        "import_s": driver.import_s}
            elif op == "shutdown":
                resp = {}
            else:
                raise DriverError(f"unknown op {op!r}")
            driver.stats.setdefault(op, []).append(time.perf_counter() - t0)
            answer = {"ok": True, **resp}
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # reported to the harness, which raises (a SystemExit too)
            answer = {"ok": False, "op": op, "error": _one_line(exc),
                      "traceback": traceback.format_exc()[-4000:], **ev.crash_info(exc)}
            print(answer["traceback"], file=sys.stderr)
        out.write(json.dumps(answer, separators=(",", ":")) + "\n")
        out.flush()
        if op == "shutdown":
            return 0
    return 0


def main() -> int:
    # The protocol owns the original stdout; anything else printed goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return _serve(sys.stdin, proto)


if __name__ == "__main__":
    sys.exit(main())
