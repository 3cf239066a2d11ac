"""The coordinator over KV-cache groups: one shared block pool, one manager per group.

Mirrors ``vllm/v1/core/kv_cache_coordinator.py`` of vLLM 0.33.0
(``KVCacheCoordinator``, ``UnitaryKVCacheCoordinator``,
``HybridKVCacheCoordinator``, ``get_kv_cache_coordinator``) for groups of one
block size (``scheduler_block_size == hash_block_size == block_size``), no
EAGLE, no sparse retention, no cross-attention; groups that are not
prefix-cacheable (bounded-replay windows) are left out of lookups. Units: tokens unless named blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from reference.block_pool import BlockPool
from reference.kv.kv_cache_spec import FullAttentionSpec, KVCacheGroupSpec, KVCacheSpec
from reference.kv.single_type_kv_cache_manager import (
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
)
from reference.kv_cache_utils import KVCacheBlock
from reference.request import Request

#: Blocks per group, in group order (vLLM ``KVCacheBlocks.blocks``).
GroupBlocks = tuple[list[KVCacheBlock], ...]


class KVCacheCoordinator:
    """``num_gpu_blocks`` blocks (block 0 the null block) shared by every
    group's manager (vLLM ``KVCacheCoordinator``).

    Raises ValueError for no groups, or groups of different block sizes with
    prefix caching (without it, as vLLM's ``KVCacheCoordinatorNoPrefixCache``,
    a Mamba group's blocks are ``max_model_len`` tokens).
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], *, num_gpu_blocks: int,
                 max_model_len: int, max_in_flight_tokens: int, enable_caching: bool) -> None:
        if not kv_cache_groups:
            raise ValueError("a KV-cache coordinator needs at least one KV-cache group")
        if enable_caching and len({g.kv_cache_spec.block_size for g in kv_cache_groups}) != 1:
            raise ValueError("KV-cache groups of different block sizes are not modelled with prefix caching")
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(g.kv_cache_spec, self.block_pool, enable_caching, i,
                                          max_in_flight_tokens, max_model_len)
            for i, g in enumerate(self.kv_cache_groups))

    def set_block_pool(self, block_pool: BlockPool) -> None:
        """Point every manager at ``block_pool`` (a mutant's broken pool)."""
        self.block_pool = block_pool
        for manager in self.single_type_managers:
            manager.block_pool = block_pool

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int, new_computed_blocks: GroupBlocks,
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """Blocks all groups together take from the free queue (vLLM
        ``KVCacheCoordinator.get_num_blocks_to_allocate``): the sum of each
        manager's ``get_num_blocks_to_allocate``."""
        return sum(m.get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks[i],
                                                total_computed_tokens, apply_admission_cap)
                   for i, m in enumerate(self.single_type_managers))

    def allocate_new_computed_blocks(self, request_id: str, new_computed_blocks: GroupBlocks,
                                     num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Adopt the prefix hit in every group, then blocks for connector
        tokens in every group, so one group's allocation cannot evict another
        group's untouched hit (vLLM ``allocate_new_computed_blocks``). A
        running request (already tracked) has nothing to adopt."""
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            assert all(len(blocks) == 0 for blocks in new_computed_blocks)
            return
        for i, manager in enumerate(self.single_type_managers):
            manager.add_local_computed_blocks(request_id, new_computed_blocks[i],
                                              num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for manager in self.single_type_managers:
                manager.allocate_external_computed_blocks(request_id, num_local_computed_tokens,
                                                          num_external_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> GroupBlocks:
        """Each group's new blocks for ``num_tokens`` slots, group by group
        (vLLM ``allocate_new_blocks``)."""
        return tuple(m.allocate_new_blocks(request_id, num_tokens) for m in self.single_type_managers)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register each group's full blocks (vLLM ``cache_blocks``; with
        one block size the scheduler-block rounding changes nothing)."""
        if not self.enable_caching:
            return
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> list[KVCacheBlock]:
        """Free every group's table, group by group, each tail first (vLLM
        ``free``); returns the blocks in that order."""
        freed: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            freed.extend(manager.free(request_id))
        return freed

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's table in allocation order, group after group, not
        yet freed (vLLM ``pop_blocks_for_free``); the caller frees them reversed."""
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> GroupBlocks:
        """Each group frees the blocks its window left (vLLM ``remove_skipped_blocks``);
        returns each group's freed blocks in free order."""
        return tuple(manager.remove_skipped_blocks(request_id, processed_computed_tokens)
                     for manager in self.single_type_managers)

    def get_blocks(self, request_id: str) -> GroupBlocks:
        """Each group's table (vLLM ``get_blocks``)."""
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """The hit blocks of each group and the hit length in tokens."""
        raise NotImplementedError

    def _no_hit(self) -> tuple[GroupBlocks, int]:
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group (vLLM ``UnitaryKVCacheCoordinator``): e.g. every
    layer a sliding-window layer."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """The group's own longest hit (vLLM ``UnitaryKVCacheCoordinator.find_longest_cache_hit``)."""
        if not self.enable_caching:
            return self._no_hit()
        manager = self.single_type_managers[0]
        return type(manager).find_longest_cache_hit(block_hashes, max_cache_hit_length, [0],
                                                    self.block_pool, manager.kv_cache_spec)


class SpecGroup(NamedTuple):
    """Groups of one spec, looked up together (vLLM ``SpecGroup``, without ``use_eagle``)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Groups of several attention types (vLLM ``HybridKVCacheCoordinator``).

    ``attention_groups``: groups of one spec and manager class, in group order,
    then stably sorted full attention first (``verify_and_split_kv_cache_groups``);
    a group that is not prefix-cacheable (a bounded-replay window) takes no
    part in lookups and its hit stays empty.

    Raises ValueError when, with prefix caching, no group is prefix-cacheable
    (vLLM asserts one).
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], **kwargs) -> None:
        super().__init__(kv_cache_groups, **kwargs)
        self.attention_groups: list[SpecGroup] = []
        for i, group in enumerate(self.kv_cache_groups):
            if not group.kv_cache_spec.prefix_cacheable:
                continue
            manager_cls = type(self.single_type_managers[i])
            for spec_group in self.attention_groups:
                if spec_group.spec == group.kv_cache_spec and spec_group.manager_cls is manager_cls:
                    spec_group.group_ids.append(i)
                    break
            else:
                self.attention_groups.append(SpecGroup(group.kv_cache_spec, [i], manager_cls))
        if self.enable_caching and not self.attention_groups:
            raise ValueError("a hybrid KV cache needs a prefix-cacheable group (every group here is a "
                             "bounded-replay window)")
        self.attention_groups.sort(key=lambda g: not isinstance(g.spec, FullAttentionSpec))

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_cache_hit_length: int) -> tuple[GroupBlocks, int]:
        """The longest length every group hits, by fixed point (vLLM
        ``HybridKVCacheCoordinator.find_longest_cache_hit``): each spec group
        in turn accepts the candidate length or lowers it, looking up within
        it; full attention, downward closed, is looked up once and then only
        trimmed. Repeat while the length fell (once only for full attention
        plus one other spec). Full-attention hits are then cut to the final
        length. Returns (hit blocks of each group, hit length in tokens)."""
        if not self.enable_caching:
            return self._no_hit()
        num_groups = len(self.kv_cache_groups)
        hit_length = max_cache_hit_length
        hit_blocks_by_group: list[list[KVCacheBlock] | None] = [None] * num_groups
        hit_length_by_group = [0] * num_groups
        is_simple_hybrid = (len(self.attention_groups) == 2
                            and isinstance(self.attention_groups[0].spec, FullAttentionSpec))
        while True:
            curr_hit_length = hit_length
            for spec, group_ids, manager_cls in self.attention_groups:
                first = group_ids[0]
                if isinstance(spec, FullAttentionSpec) and hit_blocks_by_group[first] is not None:
                    curr_hit_length = min(curr_hit_length, hit_length_by_group[first])
                    continue
                hit_blocks, curr_hit_length = manager_cls.find_longest_cache_hit(
                    block_hashes, curr_hit_length, group_ids, self.block_pool, spec)
                for group_id, blocks in zip(group_ids, hit_blocks):
                    hit_blocks_by_group[group_id] = blocks
                    hit_length_by_group[group_id] = curr_hit_length
            if curr_hit_length >= hit_length:
                break
            hit_length = curr_hit_length
            if is_simple_hybrid:
                break
        for spec, group_ids, _ in self.attention_groups:
            if not isinstance(spec, FullAttentionSpec):
                continue
            num_blocks = -(-hit_length // spec.block_size)
            for group_id in group_ids:
                blocks = hit_blocks_by_group[group_id]
                if blocks is not None:
                    del blocks[num_blocks:]
        return tuple(b if b is not None else [] for b in hit_blocks_by_group), hit_length


def get_kv_cache_coordinator(kv_cache_groups: Sequence[KVCacheGroupSpec], **kwargs) -> KVCacheCoordinator:
    """Unitary for one group, hybrid for more (vLLM ``get_kv_cache_coordinator``;
    caching off: every lookup misses, as ``KVCacheCoordinatorNoPrefixCache``)."""
    if len(kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_groups, **kwargs)
    return HybridKVCacheCoordinator(kv_cache_groups, **kwargs)
