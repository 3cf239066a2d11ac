"""The KV-cache manager of a hybrid model: the scheduler's face of the coordinator.

Mirrors ``vllm/v1/core/kv_cache_manager.py::KVCacheManager`` of vLLM 0.33.0
over ``reference.kv.kv_cache_coordinator`` (several KV-cache groups, sliding
windows). It answers the scheduler with the same methods as the
single-group ``reference.kv_cache_manager.KVCacheManager``; block lists that
vLLM keeps per group (``KVCacheBlocks``) are tuples of per-group lists here.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import BlockPool
from reference.kv.kv_cache_coordinator import GroupBlocks, get_kv_cache_coordinator
from reference.kv.kv_cache_spec import KVCacheGroupSpec
from reference.kv_cache_utils import KVCacheBlock
from reference.request import Request, RequestStatus


class HybridKVCacheManager:
    """Block tables per KV-cache group over one shared pool.

    ``max_in_flight_tokens`` (tokens scheduled and not yet settled: batches in
    flight x ``max_num_batched_tokens``, vLLM ``VllmConfig.max_in_flight_tokens``)
    sizes a sliding window's admission cap.
    """

    def __init__(self, kv_cache_groups: Sequence[KVCacheGroupSpec], *, num_gpu_blocks: int,
                 max_model_len: int, max_in_flight_tokens: int, enable_caching: bool,
                 watermark: float = 0.0) -> None:
        self.kv_cache_groups = tuple(kv_cache_groups)
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.coordinator = get_kv_cache_coordinator(
            self.kv_cache_groups, num_gpu_blocks=num_gpu_blocks, max_model_len=max_model_len,
            max_in_flight_tokens=max_in_flight_tokens, enable_caching=enable_caching)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.num_kv_cache_groups = len(self.kv_cache_groups)
        # Blocks the windows left, freed by allocate_slots and not yet taken
        # by the scheduler (``take_skipped_frees``): (request id, each group's
        # freed ids in free order).
        self.skipped_frees: list[tuple[str, list[list[int]]]] = []

    @property
    def block_pool(self) -> BlockPool:
        return self.coordinator.block_pool

    @block_pool.setter
    def block_pool(self, block_pool: BlockPool) -> None:
        self.coordinator.set_block_pool(block_pool)

    def _empty(self) -> GroupBlocks:
        return tuple([] for _ in range(self.num_kv_cache_groups))

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The prefix hit of every group and its length in tokens, at most
        ``num_tokens - 1`` (vLLM ``KVCacheManager.get_computed_blocks``)."""
        if not self.enable_caching:
            return self._empty(), 0
        return self.coordinator.find_longest_cache_hit(request.block_hashes, request.num_tokens - 1)

    def allocate_slots(self, request: Request, num_new_tokens: int, *,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: GroupBlocks | None = None,
                       num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> GroupBlocks | None:
        """Slots for ``num_new_tokens`` more tokens in every group (vLLM
        ``KVCacheManager.allocate_slots``): the full-sequence gate (with the
        sliding window's admission cap); blocks that left each window, given
        the processed tokens (``num_computed_tokens - num_in_flight_tokens``),
        freed even when the allocation then fails; the hit adopted; new
        blocks per group; full blocks cached. Returns each group's new blocks,
        or None when they do not fit. Raises ValueError when there is nothing
        to allocate or adopt."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        hits = new_computed_blocks if new_computed_blocks is not None else self._empty()
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark = self.watermark_blocks
        request_id = request.request_id
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            needed = self.coordinator.get_num_blocks_to_allocate(request_id, full, hits, total_computed,
                                                                 apply_admission_cap=True)
            if needed + watermark > self.block_pool.get_num_free_blocks():
                return None
        num_tokens_need_slot = min(total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        skipped = self.coordinator.remove_skipped_blocks(
            request_id, max(0, total_computed - request.num_in_flight_tokens))
        if any(skipped):
            self.skipped_frees.append((request_id, [[b.block_id for b in blocks] for blocks in skipped]))
        needed = self.coordinator.get_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, hits, num_local_computed + num_external_computed_tokens)
        if needed + watermark > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None
        if any(hits) or num_external_computed_tokens > 0:  # vLLM: not its empty KVCacheBlocks
            self.coordinator.allocate_new_computed_blocks(request_id, hits, num_local_computed,
                                                          num_external_computed_tokens)
        new_blocks = self.coordinator.allocate_new_blocks(request_id, num_tokens_need_slot)
        if not delay_cache_blocks:
            self.coordinator.cache_blocks(request, min(total_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def get_num_blocks_to_hold(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` still needs for ``num_tokens`` tokens in all
        groups, with the admission cap (vLLM scheduler
        ``_request_remaining_blocks``)."""
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, self._empty(), request.num_computed_tokens, apply_admission_cap=True)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every group's full blocks within the first ``num_tokens``."""
        self.coordinator.cache_blocks(request, num_tokens)

    def take_skipped_frees(self) -> list[tuple[str, list[list[int]]]]:
        """The window frees since the last call (``skipped_frees``), emptied."""
        frees, self.skipped_frees = self.skipped_frees, []
        return frees

    def free(self, request: Request) -> list[int]:
        """Free every group's table (group order, each tail first); returns
        the ids in that order, null blocks left out."""
        return [b for ids in self.free_per_group(request) for b in ids]

    def free_per_group(self, request: Request) -> list[list[int]]:
        """Free every group's table (group order, each tail first); returns
        each group's freed ids in that order, null blocks left out."""
        freed: list[list[int]] = []
        for manager in self.coordinator.single_type_managers:
            freed.append([b.block_id for b in manager.free(request.request_id) if not b.is_null])
        return freed

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Every group's table, group after group, not yet freed."""
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def reset_prefix_cache(self) -> bool:
        """The shared pool's reset (vLLM ``reset_prefix_cache``)."""
        return self.block_pool.reset_prefix_cache()

    def get_block_ids_per_group(self, request_id: str) -> tuple[list[int], ...]:
        """Each group's table as block ids (null blocks as 0), vLLM ``get_block_ids``."""
        return tuple([b.block_id for b in blocks] for blocks in self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> list[int]:
        """Every group's table, group after group, null blocks left out."""
        return [b for ids in self.get_block_ids_per_group(request_id) for b in ids if b]

    def admission_block_ids(self, request_id: str, hit_blocks: GroupBlocks) -> tuple[list[int], list[list[int]]]:
        """An admitted request's blocks as the trace records them: the ids in
        the order they left the free queue (every group's hit blocks, then
        every group's new blocks, group order, null blocks left out) and each
        group's whole table (null blocks as 0)."""
        tables = [list(ids) for ids in self.get_block_ids_per_group(request_id)]
        hits = [table[:len(hit_blocks[g])] for g, table in enumerate(tables)]
        news = [table[len(hit_blocks[g]):] for g, table in enumerate(tables)]
        return [b for part in (*hits, *news) for b in part if b], tables

    def new_block_ids(self, new_blocks: GroupBlocks) -> list[int]:
        """Every group's new ids, group after group (the order allocated)."""
        return [b.block_id for blocks in new_blocks for b in blocks]

    def new_group_block_ids(self, new_blocks: GroupBlocks) -> list[list[int]]:
        """Each group's new ids."""
        return [[b.block_id for b in blocks] for blocks in new_blocks]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
