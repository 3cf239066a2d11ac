"""vLLM's ``KVCacheConfig`` for the config: one full-attention group, or a hybrid model's groups.

Part of the driver (``driver.py`` and its ``driver_*.py`` siblings): runs
under a vLLM environment's Python, standard library (and vLLM inside
functions) only. What ``EngineCore._initialize_kv_caches`` gets from its
workers on a GPU (``vllm/v1/engine/core.py``; the specs of
``vllm/v1/kv_cache_interface.py``, grouped by ``get_kv_cache_groups`` of
``vllm/v1/core/kv_cache_planning.py``, ``kv_cache_utils.py`` in older releases)
is built here from the config alone, of ``num_gpu_blocks`` blocks.

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
"""

from __future__ import annotations

import importlib
import math

from . import events as ev
from .driver_errors import DriverError


class KVCacheConfigBuilder:
    """``Driver``'s half that builds the ``KVCacheConfig`` (reads ``torch``,
    ``FullAttentionSpec``, ``KVCacheGroupSpec``, ``KVCacheConfig``,
    ``kv_connector``, ``version``; sets ``kv_cache_groups_answer``)."""

    def _kv_cache_config(self, config: dict, vllm_config):
        """``(KVCacheConfig, block size the scheduler runs on)`` for
        ``config``: one full-attention group, or the hybrid groups of
        ``_hybrid_kv_cache_groups`` (then also answered to ``init`` as
        ``kv_cache_groups_answer``). DriverError as
        ``_hybrid_kv_cache_groups``."""
        block_size, num_blocks = config["block_size"], config["num_gpu_blocks"]
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
        return kv_cache_config, sched_block_size

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
