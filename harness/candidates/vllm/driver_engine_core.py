"""The ``Driver``: vLLM's ``Scheduler`` built as ``EngineCore`` builds it, with the decision hooks.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM, torch inside
functions) only; importing it sets the driver's vLLM environment defaults
(``driver_platform.py``). ``Driver.__init__`` imports vLLM once per process
(and pins the CPU platform); ``Driver.init`` builds the scheduler as
``EngineCore.__init__`` does (``vllm/v1/engine/core.py``): the ``VllmConfig``
(``driver_vllm_config.py``), the scheduler class
(``driver_scheduler_cls.py``), the ``KVCacheConfig``
(``driver_kv_cache_config.py``), the batch queue's size, then checks what
vLLM's ``Scheduler.__init__`` set (KV connector: ``driver_kv_connector.py``;
``defer_block_free``; the local prefill cadence) and installs the hooks
(``events.DecisionHooks``). The ops on a built scheduler are its halves:
``driver_requests.py``, ``driver_step.py``, ``driver_model_runner_output.py``.

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
"""

from __future__ import annotations

import inspect
import time
from collections import deque

from . import events as ev
from .driver_errors import DriverError, SchedulerClassError
from .driver_kv_cache_config import KVCacheConfigBuilder
from .driver_kv_connector import KVConnectorSetup
from .driver_model_runner_output import ModelRunnerOutputStub
from .driver_platform import _version_tuple, pin_cpu_platform
from .driver_requests import RequestOps
from .driver_scheduler_cls import SchedulerClassChoice, load_scheduler_class, scheduler_cls_name
from .driver_step import StepLoop
from .driver_vllm_config import VllmConfigMapping


class Driver(VllmConfigMapping, SchedulerClassChoice, KVCacheConfigBuilder, KVConnectorSetup,
             RequestOps, StepLoop, ModelRunnerOutputStub):
    """One vLLM Scheduler plus the hooks that normalise its decisions."""

    def __init__(self) -> None:
        t0 = time.perf_counter()
        import torch  # noqa: F401  (imported once per process)
        import vllm

        self.vllm = vllm
        self.version = vllm.__version__
        self.vt = _version_tuple(self.version)
        pin_cpu_platform()
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

    # -- init -----------------------------------------------------------------
    def init(self, config: dict, seed: int, scheduler_cls: str | None = None) -> dict:
        """Build the scheduler for ``config`` (an EngineConfig dict); with
        ``scheduler_cls`` (``module:Class``) that Scheduler subclass instead of
        vLLM's (SchedulerClassError if unusable). DriverError: a config this
        vLLM cannot express, one option per message."""
        self.sched = None
        custom_cls = (load_scheduler_class(scheduler_cls, self.Scheduler)
                      if scheduler_cls else None)
        vllm_config = self._vllm_config(config, seed)
        block_size = config["block_size"]
        scheduler_cls = self._scheduler_class(custom_cls, vllm_config.scheduler_config)
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

        kv_cache_config, sched_block_size = self._kv_cache_config(config, vllm_config)
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

    def _install_hooks(self) -> None:
        # Chronological decisions of each schedule() and the blocks each free
        # releases (tail first).
        self.hooks = ev.DecisionHooks(self.sched)
        # The latest schedule()'s preempted ids: snapshots report their states.
        self.last_preempted: list[str] = []

    # -- the scheduler the ops need --------------------------------------------
    def _require(self):
        if self.sched is None:
            raise DriverError("no scheduler: send 'init' first")
        return self.sched
