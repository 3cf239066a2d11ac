"""KV-cache specs and groups: which layers share a block table.

Mirrors ``vllm/v1/kv_cache_interface.py`` (``FullAttentionSpec``,
``SlidingWindowSpec``, ``SlidingWindowMLASpec``'s ``bounded_replay``,
``MambaSpec``, ``KVCacheGroupSpec``) and the grouping of
``vllm/v1/core/kv_cache_planning.py::_get_kv_cache_groups_uniform_page_size``
of vLLM 0.33.0, for layers of one page size (attention groups have the
config's ``block_size``, taken as the size after vLLM unifies page sizes; a
Mamba group's block is one whole state: ``max_model_len`` tokens, vLLM's
``mamba_cache_mode`` "none").
"""

from __future__ import annotations

from dataclasses import dataclass

#: The layer types of a Hugging Face model config (``config.layer_types``)
#: that the reference models, mapped to the spec each builds.
#: ``linear_attention`` is a recurrent (Mamba, Mamba2, GDN, ...) layer:
#: transformers' name, which maps the legacy ``mamba`` to it
#: (``configuration_utils.remap_legacy_layer_types``; Qwen3-Next, OLMo-hybrid).
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")

#: Legacy layer-type names and the name transformers maps each to.
LEGACY_LAYER_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A full-attention layer: every token's KV is kept (``block_size`` tokens a block)."""

    block_size: int

    #: Every group of this spec is cached and looked up; none replays (vLLM
    #: ``KVCacheSpec.prefix_cacheable`` / ``prefix_replay_tokens`` defaults).
    prefix_cacheable = True
    prefix_replay_tokens = 0

    def max_memory_usage_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request of ``max_model_len`` tokens holds at most (vLLM
        ``FullAttentionSpec.max_memory_usage_bytes`` over its page size, no
        decode context parallelism): every token's block."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A sliding-window layer: a token attends to the ``sliding_window``
    tokens ending at itself, so older blocks are dropped (vLLM
    ``SlidingWindowSpec``; no ``extra_retained_tokens``, no MTP)."""

    block_size: int
    sliding_window: int
    #: DeepSeek-V4.1's "SWA bounded replay" (vLLM 0.33.0
    #: ``SlidingWindowMLASpec.bounded_replay``, set from
    #: ``cache_config.swa_bounded_replay``): the group keeps no prefix cache;
    #: after a prefix hit of the other groups the scheduler recomputes the
    #: hit's last ``sliding_window`` tokens to rebuild this group's window.
    #: False: a plain sliding window (an MLA one without it schedules the same).
    bounded_replay: bool = False

    @property
    def prefix_cacheable(self) -> bool:
        """Whether the group's blocks are cached and looked up (vLLM
        ``KVCacheSpec.prefix_cacheable``; ``SlidingWindowMLASpec``: not with
        bounded replay)."""
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens of a prefix hit recomputed to rebuild this group (vLLM
        ``SlidingWindowMLASpec.prefix_replay_tokens``): the window with
        bounded replay, else 0."""
        return self.sliding_window if self.bounded_replay else 0

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Per-request admission cap in blocks (vLLM
        ``SlidingWindowSpec.max_admission_blocks_per_request``): the window
        minus one plus the tokens in flight, capped at ``max_model_len``, in
        blocks, plus one for a window that starts mid-block."""
        num_tokens = min(self.sliding_window - 1 + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    def max_memory_usage_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request holds at most (vLLM
        ``SlidingWindowSpec.max_memory_usage_bytes`` over its page size): the
        admission cap, ``max_admission_blocks_per_request``."""
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)


@dataclass(frozen=True)
class MambaSpec:
    """A recurrent (Mamba) layer in vLLM 0.33.0's ``mamba_cache_mode``
    "none" (vLLM ``MambaSpec``; its mode with prefix caching disabled,
    ``MambaModelConfig.verify_and_update_config``): one block holds the
    request's whole state, so ``block_size`` is ``max_model_len`` tokens
    (``mamba_block_size``), plus ``num_speculative_blocks`` blocks for
    speculative tokens (vLLM: ``num_speculative_tokens``)."""

    block_size: int
    num_speculative_blocks: int = 0
    mamba_cache_mode: str = "none"

    #: Every group of this spec is cached and looked up; none replays (vLLM
    #: ``KVCacheSpec.prefix_cacheable`` / ``prefix_replay_tokens`` defaults).
    prefix_cacheable = True
    prefix_replay_tokens = 0

    def max_memory_usage_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        """Blocks one request holds at most (vLLM ``MambaSpec.max_memory_usage_bytes``
        over its page size, mode "none"): the state block and the speculative
        blocks, whatever the request's length."""
        return 1 + self.num_speculative_blocks


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """One KV-cache group: the layer indices sharing one block table and their spec."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: KVCacheSpec


def kv_cache_groups_for(layer_types: tuple[str, ...], block_size: int,
                        sliding_window: int | None, *, max_model_len: int | None = None,
                        num_speculative_tokens: int = 0,
                        swa_bounded_replay: bool = False) -> tuple[KVCacheGroupSpec, ...]:
    """The KV-cache groups vLLM 0.33.0 builds for these layers.

    Layers of one spec form a bucket, buckets in order of their first layer;
    the group size is the smallest bucket (the largest when no bucket has
    1.5 times the smallest's layers), and a bucket of ``n`` layers splits into
    ``cdiv(n, group_size)`` groups, group ``i`` taking ``layers[i::count]``
    (``_get_kv_cache_groups_uniform_page_size``). One spec only: one group.
    A ``linear_attention`` layer is a ``MambaSpec`` of ``max_model_len``
    tokens a block with ``num_speculative_tokens`` speculative blocks (vLLM
    ``MambaBase.get_kv_cache_spec``). With ``swa_bounded_replay`` (vLLM's
    ``cache_config.swa_bounded_replay`` on DeepSeek-V4.1's MLA sliding-window
    layers, ``SlidingWindowMLASpec(bounded_replay=True)``) every
    ``sliding_attention`` layer's spec has ``bounded_replay``.

    Raises ValueError for an unknown layer type, ``sliding_attention``
    without a ``sliding_window``, or ``linear_attention`` without ``max_model_len``.
    """
    specs: list[KVCacheSpec] = []
    for i, layer_type in enumerate(layer_types):
        if layer_type == "full_attention":
            specs.append(FullAttentionSpec(block_size))
        elif layer_type == "sliding_attention":
            if sliding_window is None:
                raise ValueError(f"layer_types[{i}] is sliding_attention but sliding_window is not set")
            specs.append(SlidingWindowSpec(block_size, sliding_window, swa_bounded_replay))
        elif layer_type == "linear_attention":
            if max_model_len is None:
                raise ValueError(f"layer_types[{i}] is linear_attention but max_model_len is not given")
            specs.append(MambaSpec(max_model_len, num_speculative_tokens))
        else:
            raise ValueError(f"layer_types[{i}] {layer_type!r} is not one of {', '.join(LAYER_TYPES)}")
    buckets: dict[KVCacheSpec, list[int]] = {}
    for i, spec in enumerate(specs):
        buckets.setdefault(spec, []).append(i)
    if len(buckets) <= 1:
        return tuple(KVCacheGroupSpec(tuple(layers), spec) for spec, layers in buckets.items())
    sizes = [len(layers) for layers in buckets.values()]
    group_size = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
    groups: list[KVCacheGroupSpec] = []
    for spec, layers in buckets.items():
        count = cdiv(len(layers), group_size)
        groups.extend(KVCacheGroupSpec(tuple(layers[i::count]), spec) for i in range(count))
    return tuple(groups)


def max_memory_usage_blocks_from_groups(kv_cache_groups: tuple[KVCacheGroupSpec, ...], *, max_model_len: int,
                                        max_in_flight_tokens: int) -> tuple[int, ...]:
    """Each group's blocks for one request of ``max_model_len`` tokens, in
    group order; their sum is what the request takes from the one pool the
    groups share, since each group claims its own blocks from it.

    vLLM 0.33.0's start-up check (``vllm/v1/core/kv_cache_planning.py``:
    ``get_kv_cache_configs`` calls ``_check_enough_kv_cache_memory`` with
    ``_max_memory_usage_bytes_from_groups``) adds up, per group,
    ``cdiv(spec.max_memory_usage_bytes, spec.page_size_bytes)`` blocks and
    multiplies by the pool's bytes per block; the memory it compares with is
    ``num_blocks`` blocks less the null block. In blocks: a config is
    refused when the sum exceeds ``num_gpu_blocks - 1``. (The per-layer sum of
    the same file's ``check_enough_kv_cache_memory``, which no engine path of
    0.33.0 calls, would under-count a group padded to the group size.)
    ``max_in_flight_tokens``: vLLM's ``VllmConfig.max_in_flight_tokens``,
    batches in flight times ``max_num_batched_tokens``."""
    return tuple(g.kv_cache_spec.max_memory_usage_blocks(max_model_len, max_in_flight_tokens)
                 for g in kv_cache_groups)
