"""The block pool: all KV blocks, the free queue and the prefix-cache map.

Mirrors ``vllm/v1/core/block_pool.py::BlockPool`` of vLLM 0.33.0 (spec 5.1-5.5,
10.7) for one full-attention KV-cache group.
"""

from __future__ import annotations

from collections.abc import Iterable

from reference.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def make_block_hash_with_group_id(block_hash: bytes, kv_cache_group_id: int) -> bytes:
    """The prefix-cache key of a hybrid model's block: the block hash with the
    group id appended (4 bytes, big-endian), as vLLM 0.33.0's
    ``kv_cache_utils.make_block_hash_with_group_id``: the same tokens cached
    in two groups are two entries."""
    return block_hash + kv_cache_group_id.to_bytes(4, "big")


class BlockPool:
    """``num_gpu_blocks`` blocks with ids 0..N-1; block 0 is the null block.

    Invariants (checked by ``harness check`` from the trace):
    * free queue length + blocks with ref_cnt > 0 == num_gpu_blocks - 1;
    * a block is in the free queue iff ref_cnt == 0 (the null block never is);
    * ``cached_block_hash_to_block`` maps a hash to the blocks carrying it, in
      insertion order (no de-duplication, so block tables stay append-only).

    Raises ValueError if ``num_gpu_blocks < 2``.
    """

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks must be >= 2, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # The null block pads sliding-window / Mamba tables; never freed or cached.
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_id: int | None = None) -> KVCacheBlock | None:
        """First block registered under ``block_hash``, or None. With a
        ``kv_cache_group_id`` (hybrid models), the block of that group
        (vLLM ``BlockPool.get_cached_block`` over one group id)."""
        if kv_cache_group_id is not None:
            block_hash = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[bytes],
                          num_cached_blocks: int, num_full_blocks: int,
                          kv_cache_group_id: int | None = None) -> None:
        """Register blocks [num_cached_blocks, num_full_blocks) under their hashes.

        With a ``kv_cache_group_id`` (hybrid models) the key is the hash with
        the group id appended, as vLLM's ``make_block_hash_with_group_id``, and
        null blocks (a sliding window's skipped prefix) are passed over.
        """
        cached = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block.is_null:  # a prefix hit, already registered
                continue
            block_hash = block.block_hash = (
                block_hashes[i] if kv_cache_group_id is None
                else make_block_hash_with_group_id(block_hashes[i], kv_cache_group_id))
            bucket = cached.get(block_hash)
            if bucket is None:
                cached[block_hash] = {block.block_id: block}
            else:
                bucket[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free-queue head, evicting their old hashes.

        Raises ValueError if fewer blocks are free (callers check first).
        """
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:  # (else nothing to evict)
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        bucket = self.cached_block_hash_to_block.get(block.block_hash)
        if bucket is not None:
            bucket.pop(block.block_id, None)
            if not bucket:
                del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, only when no block is held.

        Mirrors vLLM 0.33.0 ``BlockPool.reset_prefix_cache``: with any block
        other than the null block out of the free queue (held by a request or
        by a deferred free) it refuses and returns False, changing nothing;
        otherwise it empties ``cached_block_hash_to_block``, clears each
        block's hash and returns True. The free queue keeps its order: blocks
        that were cached stay where their free put them (tail, LRU), they
        just hold nothing reusable any more, so the next allocations still
        pop the head first.
        """
        if self.get_num_free_blocks() != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks; free ones leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction-priority order.

        Blocks reaching ref 0 without a hash (or with caching off) go to the
        head, reused first; hashed ones go to the tail, keeping LRU order
        (spec 5.2, 10.7).
        """
        to_head: list[KVCacheBlock] = []
        to_tail: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of block {block.block_id}"
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    to_head.append(block)
                else:
                    to_tail.append(block)
        self.free_block_queue.prepend_n(to_head)
        self.free_block_queue.append_n(to_tail)
