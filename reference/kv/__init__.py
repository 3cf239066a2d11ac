"""The KV-cache manager of hybrid models: KV-cache groups, one manager per
attention type, and the coordinator over them (vLLM 0.33.0's
``vllm/v1/kv_cache_interface.py``, ``vllm/v1/core/single_type_kv_cache_manager.py``
and ``vllm/v1/core/kv_cache_coordinator.py``).

The single full-attention group stays in ``reference.kv_cache_manager``
(bytes of every existing trace unchanged); a config naming a sliding window
(``sliding_window``, ``layer_types``) runs ``HybridKVCacheManager`` instead.
"""
