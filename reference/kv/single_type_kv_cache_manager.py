"""One KV-cache group's block tables: the per-attention-type managers.

Mirrors ``vllm/v1/core/single_type_kv_cache_manager.py`` of vLLM 0.33.0
(``SingleTypeKVCacheManager``, ``FullAttentionManager``,
``SlidingWindowManager``, ``MambaManager`` in ``mamba_cache_mode`` "none")
for groups of one page size, without EAGLE, decode
context parallelism, partial-block hits (copy-on-write) or sparse retention
(``prefix_cache_retention_interval`` unset: every full block is cached).
Units: tokens unless named blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.block_pool import BlockPool
from reference.kv.kv_cache_spec import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec, cdiv
from reference.kv_cache_utils import KVCacheBlock
from reference.request import Request


def trim_null_head(blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
    """``blocks`` without its leading null blocks (vLLM ``kv_cache_utils.trim_null_head``)."""
    n = 0
    while n < len(blocks) and blocks[n].is_null:
        n += 1
    return blocks[n:] if n else blocks


class SingleTypeKVCacheManager:
    """The block tables of one KV-cache group (vLLM ``SingleTypeKVCacheManager``).

    ``req_to_blocks[id]``: the request's table, one block per ``block_size``
    tokens, skipped blocks replaced by the pool's null block;
    ``num_cached_block[id]``: its leading blocks already in the prefix cache
    (running requests only). All groups draw from one shared ``block_pool``.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                 kv_cache_group_id: int, max_admission_blocks_per_request: int | None = None) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    @property
    def _null_block(self) -> KVCacheBlock:
        return self.block_pool.null_block

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """Blocks this group must take from the free queue for ``num_tokens``
        slots (vLLM ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``).

        ``apply_admission_cap`` (the full-sequence admission gate only) caps
        the requirement at ``max_admission_blocks_per_request`` (sliding
        window). A running request needs its missing blocks; a new one the
        blocks past the larger of its skipped and computed blocks, plus every
        free hit block that leaves the free queue when touched (hit blocks in
        the skipped prefix excepted).
        """
        num_required_blocks = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required_blocks = min(num_required_blocks, self.max_admission_blocks_per_request)
        num_req_blocks = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            assert len(new_computed_blocks) == 0
            return max(num_required_blocks - num_req_blocks, 0)
        num_skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_local_computed_blocks = len(new_computed_blocks) + num_req_blocks
        num_new_blocks = max(num_required_blocks - max(num_skipped_blocks, num_local_computed_blocks), 0)
        num_skipped_new_computed_blocks = max(0, num_skipped_blocks - num_req_blocks)
        num_evictable_blocks = sum(1 for b in new_computed_blocks[num_skipped_new_computed_blocks:]
                                   if b.ref_cnt == 0 and not b.is_null)
        return num_new_blocks + num_evictable_blocks

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        """Adopt a new request's prefix hit (vLLM
        ``SingleTypeKVCacheManager.add_local_computed_blocks``): hit blocks in
        the skipped prefix are replaced by null blocks, the rest touched; all
        count as cached."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, "prefix hits are only adopted by a request without blocks"
        num_skipped_blocks = self.get_num_skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens) // self.block_size
        if num_skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[num_skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int) -> None:
        """Blocks for connector-loaded tokens inside the window (vLLM
        ``SingleTypeKVCacheManager.allocate_external_computed_blocks``)."""
        num_total = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(num_total - num_skipped_tokens, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = max(0, cdiv(num_total, self.block_size) - len(req_blocks))
        req_blocks.extend(self.block_pool.get_new_blocks(num_new_blocks))

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Pop blocks from the free-queue head until the table covers
        ``num_tokens`` slots; returns them (vLLM ``allocate_new_blocks``)."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new_blocks = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new_blocks <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the full blocks within the first ``num_tokens`` tokens
        under (hash, group id) (vLLM ``SingleTypeKVCacheManager.cache_blocks``
        with dense retention: null blocks are passed over). A group that is
        not prefix-cacheable (a bounded-replay window) caches nothing: its
        blocks stay unhashed, and freed go to the free queue's head."""
        if not self.kv_cache_spec.prefix_cacheable:
            return
        num_cached_blocks = self.num_cached_block.get(request.request_id, 0)
        num_full_blocks = min(num_tokens, len(request.block_hashes) * self.block_size) // self.block_size
        if num_cached_blocks >= num_full_blocks:
            return
        self.block_pool.cache_full_blocks(self.req_to_blocks[request.request_id], request.block_hashes,
                                          num_cached_blocks, num_full_blocks,
                                          kv_cache_group_id=self.kv_cache_group_id)
        self.num_cached_block[request.request_id] = num_full_blocks

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Drop the request's bookkeeping; return its table in allocation order
        without the leading null blocks, not yet freed (vLLM
        ``pop_blocks_for_free``)."""
        self.num_cached_block.pop(request_id, None)
        return trim_null_head(self.req_to_blocks.pop(request_id, []))

    def free(self, request_id: str) -> list[KVCacheBlock]:
        """Free the table tail first (vLLM ``free``); returns the blocks in
        that order (null blocks in the table's middle included, which the pool
        passes over)."""
        ordered = self.pop_blocks_for_free(request_id)[::-1]
        self.block_pool.free_blocks(ordered)
        return ordered

    def _remove_blocks_in_range(self, request_id: str, first_block: int, last_block: int) -> list[KVCacheBlock]:
        """Free the table's blocks in [first_block, last_block), last first,
        replacing each by the null block; stops at the first null block met
        (the range below it was removed before) (vLLM ``_remove_blocks_in_range``).
        Returns the freed blocks in free order."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first_block >= last_block:
            return []
        freed: list[KVCacheBlock] = []
        for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
            if blocks[i] is self._null_block:
                break
            freed.append(blocks[i])
            blocks[i] = self._null_block
        if freed:
            self.block_pool.free_blocks(freed)
        return freed

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int) -> list[KVCacheBlock]:
        """Free the blocks no later token attends, given the tokens whose
        steps have completed (vLLM ``remove_skipped_blocks``; in-flight steps
        still read the blocks above ``processed_computed_tokens``). Returns
        the freed blocks in free order (last first)."""
        num_skipped_tokens = self.get_num_skipped_tokens(processed_computed_tokens)
        if num_skipped_tokens <= 0 or request_id not in self.req_to_blocks:
            return []
        blocks = self.req_to_blocks[request_id]
        return self._remove_blocks_in_range(request_id, 0, min(num_skipped_tokens // self.block_size, len(blocks)))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token does not attend: none by default."""
        return 0

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError


def _cached_blocks(block_pool: BlockPool, block_hash: bytes,
                   kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
    """The cached block of each group for this hash, or None if any group
    misses (vLLM ``BlockPool.get_cached_block`` over several group ids)."""
    found = []
    for group_id in kv_cache_group_ids:
        block = block_pool.get_cached_block(block_hash, group_id)
        if block is None:
            return None
        found.append(block)
    return found


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every block stays until the request is freed."""

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Leading blocks cached in every group, left to right, stopping at
        the first miss; at most ``max_length`` tokens (vLLM
        ``FullAttentionManager.find_longest_cache_hit``). Returns (the hit
        blocks of each group, hit length in tokens)."""
        assert isinstance(kv_cache_spec, FullAttentionSpec)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[: max_length // kv_cache_spec.block_size]:
            cached = _cached_blocks(block_pool, block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for blocks, block in zip(computed, cached):
                blocks.append(block)
        return computed, len(computed[0]) * kv_cache_spec.block_size


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: blocks wholly before the window are freed and their
    table slots hold the null block."""

    def __init__(self, kv_cache_spec: SlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """As any group's, except that a window of 1 token caches nothing
        (vLLM 0.33.0 ``SlidingWindowManager.reachable_block_mask``, with the
        coordinator's hit alignment of one block: a hit needs its last
        ``cdiv(sliding_window - 1, block_size)`` blocks cached, 0 for a window
        of 1, so no block can end a hit and the mask keeps none; a larger
        window keeps every block). Such blocks stay unhashed: freed, they go to
        the free queue's head. Regression (found by ``harness fuzz --hybrid``
        against vLLM 0.33.0): they were cached, and freed to the tail."""
        if cdiv(self.sliding_window - 1, self.block_size) == 0:
            return
        super().cache_blocks(request, num_tokens)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix whose last ``cdiv(sliding_window - 1,
        block_size)`` blocks are all cached, searched right to left from
        ``max_length`` (vLLM ``SlidingWindowManager.find_longest_cache_hit``).
        Blocks before the window come back as null blocks; with no run that
        long, the leading run of cached blocks from block 0 (if any) is the hit.
        Returns (the blocks of each group, hit length in tokens)."""
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        need = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        computed = tuple([block_pool.null_block] * max_num_blocks for _ in kv_cache_group_ids)
        num_contiguous_blocks = 0
        match_found = False
        for i in range(max_num_blocks - 1, -1, -1):
            cached = _cached_blocks(block_pool, block_hashes[i], kv_cache_group_ids)
            if cached is None:
                num_contiguous_blocks = 0
                continue
            for blocks, block in zip(computed, cached):
                blocks[i] = block
            num_contiguous_blocks += 1
            if num_contiguous_blocks >= need:
                for blocks in computed:
                    del blocks[i + num_contiguous_blocks:]
                match_found = True
                break
        if not match_found:
            for blocks in computed:
                del blocks[num_contiguous_blocks:]
        return computed, len(computed[0]) * block_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: ``num_computed_tokens
        - sliding_window + 1`` (at least 0) (vLLM
        ``SlidingWindowManager.get_num_skipped_tokens``). E.g. window 4, 7
        computed: tokens 0-3 are skipped."""
        return max(0, num_computed_tokens - self.sliding_window + 1)


class MambaManager(SingleTypeKVCacheManager):
    """Recurrent (Mamba) layers in ``mamba_cache_mode`` "none" (vLLM
    ``MambaManager``): the block is ``max_model_len`` tokens, so a request's
    table is one state block (plus ``num_speculative_blocks``), taken at its
    first allocation and kept until it is freed; no prefix caching (vLLM
    asserts "align" mode for it)."""

    def __init__(self, kv_cache_spec: MambaSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if kv_cache_spec.mamba_cache_mode != "none" or self.enable_caching:
            raise ValueError("Mamba prefix caching requires mamba_cache_mode 'align', which is not modelled")
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock],
                                   total_computed_tokens: int, apply_admission_cap: bool = False) -> int:
        """The base count for ``num_tokens`` plus ``num_speculative_blocks``
        blocks' worth of tokens (vLLM ``MambaManager.get_num_blocks_to_allocate``,
        mode "none"): 1 + ``num_speculative_blocks`` for a request without
        blocks, 0 after."""
        num_tokens += self.block_size * self.num_speculative_blocks
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks,
                                                  total_computed_tokens, apply_admission_cap)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """The state block and the speculative blocks, once (vLLM
        ``MambaManager.allocate_new_blocks``, mode "none")."""
        return super().allocate_new_blocks(request_id, num_tokens + self.block_size * self.num_speculative_blocks)

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Only the last computed token's state is needed: ``num_computed_tokens
        - 1`` (vLLM ``MambaManager.get_num_skipped_tokens``); with blocks of
        ``max_model_len`` tokens no block is ever wholly skipped."""
        return num_computed_tokens - 1

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: Sequence[bytes], max_length: int,
                               kv_cache_group_ids: list[int], block_pool: BlockPool,
                               kv_cache_spec: KVCacheSpec) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Never called: a Mamba group runs without prefix caching here (vLLM's
        lookup is "align" mode's). Raises NotImplementedError."""
        raise NotImplementedError("Mamba prefix hits are mamba_cache_mode 'align', not modelled")


def get_manager_for_kv_cache_spec(kv_cache_spec: KVCacheSpec, block_pool: BlockPool, enable_caching: bool,
                                  kv_cache_group_id: int, max_in_flight_tokens: int,
                                  max_model_len: int) -> SingleTypeKVCacheManager:
    """The manager of a spec (vLLM ``get_manager_for_kv_cache_spec``); a
    sliding window gets its admission cap, Mamba none."""
    if isinstance(kv_cache_spec, MambaSpec):
        return MambaManager(kv_cache_spec, block_pool=block_pool, enable_caching=enable_caching,
                            kv_cache_group_id=kv_cache_group_id)
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(
            kv_cache_spec, block_pool=block_pool, enable_caching=enable_caching,
            kv_cache_group_id=kv_cache_group_id,
            max_admission_blocks_per_request=kv_cache_spec.max_admission_blocks_per_request(
                max_in_flight_tokens, max_model_len))
    return FullAttentionManager(kv_cache_spec, block_pool=block_pool, enable_caching=enable_caching,
                                kv_cache_group_id=kv_cache_group_id)
