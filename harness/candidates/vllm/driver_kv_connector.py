"""The KV connector: the harness's simulated KV-consumer store as a vLLM ``KVConnectorBase_V1``.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. Mirrors vLLM's scheduler-side connector API
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``, registered through
``kv_connector/factory.py``'s ``KVConnectorFactory``) and its configuration
(``KVTransferConfig``, ``vllm/config/kv_transfer.py``). The worker side is the
harness's; its output reaches vLLM through ``driver_model_runner_output.py``.

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
"""

from __future__ import annotations

import sys

from . import events as ev
from .driver_errors import DriverError

#: The harness's simulated KV-consumer connector (``reference/kv_connector.py``):
#: driven in vLLM through a scheduler-side stand-in (``HarnessKVStoreConnector``,
#: see this module's docstring). ``kv_store_fraction`` and
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


class KVConnectorSetup:
    """``Driver``'s half that configures the stand-in and checks vLLM built
    it (reads ``version``, ``config``)."""

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
