"""The KV-cache manager: block tables per request, prefix lookup, allocation.

Mirrors ``vllm/v1/core/kv_cache_manager.py::KVCacheManager`` together with the
full-attention ``single_type_kv_cache_manager.py::FullAttentionManager`` of
vLLM 0.33.0 (spec 5.6-5.8, 10.7) for one full-attention KV-cache group.
"""

from __future__ import annotations

from reference.block_pool import BlockPool
from reference.kv_cache_utils import KVCacheBlock
from reference.request import Request, RequestStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: The statuses of an admission (``allocate_slots``' watermark applies to them).
_ADMISSION_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheManager:
    """Owns the block pool and every request's block table.

    ``req_to_blocks[id]`` is the request's table in allocation order (prefix
    hits first). ``num_cached_block[id]`` counts its leading blocks already
    registered in the prefix cache.
    """

    def __init__(self, *, num_gpu_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool, watermark: float = 0.0) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # vLLM: int(watermark * kv_cache_config.num_blocks); num_blocks counts the null block.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}

    # -- lookup -------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest prefix-cache hit: (hit blocks, hit length in tokens).

        The hit is whole blocks, stops at the first missing hash (hashes are
        chained) and is at most ``num_tokens - 1`` tokens: the last token is
        always recomputed to produce logits. Hit blocks are not touched here;
        ``allocate_slots`` takes their references. Caching off: ([], 0).
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    # -- allocation ---------------------------------------------------------
    def _num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                new_computed_blocks: list[KVCacheBlock]) -> int:
        num_required = cdiv(num_tokens, self.block_size)
        table = self.req_to_blocks.get(request_id, ())
        num_new = max(num_required - len(new_computed_blocks) - len(table), 0)
        # Touching a free hit block removes it from the free queue: count it.
        num_evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        return num_new + num_evictable

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False,
                       full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0,
                       has_scheduled_reqs: bool = True) -> list[KVCacheBlock] | None:
        """Give ``request`` slots for ``num_new_tokens`` more tokens (+ lookahead).

        Returns the newly allocated blocks (possibly empty) or None when they do
        not fit; None changes nothing (no references taken, no queue moved).
        Steps (spec 5.7): watermark only for WAITING/PREEMPTED admissions while
        something runs; the full-sequence gate for admissions; add prefix hits
        (touch); pop new blocks from the free-queue head; eagerly register
        full blocks up to min(computed + new, num_tokens) in the prefix cache.

        KV connector (spec 7.2): ``num_external_computed_tokens`` get blocks
        like new tokens (the connector loads them); ``delay_cache_blocks``
        (an async load) registers nothing until the load is done;
        ``reserved_blocks`` must stay free after the allocation (in-flight
        prefills' reservation; the full-sequence gate ignores it).

        Raises ValueError if ``num_new_tokens``, the hit and the external
        tokens are all 0.

        Pass all but the first two by keyword: vLLM's have another order
        (its ``num_encoder_tokens`` after ``delay_cache_blocks``). They are
        not keyword-only (``*``) because a function with keyword-only
        parameters misses CPython 3.11's fast call path, and this one is
        called per running request per step.
        """
        hits = new_computed_blocks or ()
        if num_new_tokens == 0 and num_new_computed_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be > 0 when there are no computed tokens to adopt")
        max_model_len = self.max_model_len
        # (min() spelled as comparisons here and below: a decode's every step comes through.)
        total_computed = request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens
        if total_computed > max_model_len:
            total_computed = max_model_len
        watermark = 0
        if has_scheduled_reqs and request.status in _ADMISSION_STATUSES:
            watermark = self.watermark_blocks
        request_id = request.request_id
        if full_sequence_must_fit:
            full = min(request.num_tokens, max_model_len)
            if (self._num_blocks_to_allocate(request_id, full, hits) + watermark
                    > self.block_pool.get_num_free_blocks()):
                return None
        num_tokens_need_slot = total_computed + num_new_tokens + num_lookahead_tokens
        if num_tokens_need_slot > max_model_len:
            num_tokens_need_slot = max_model_len
        table = self.req_to_blocks.get(request_id)
        num_required = -(-num_tokens_need_slot // self.block_size)
        if hits:
            needed = self._num_blocks_to_allocate(request_id, num_tokens_need_slot, hits)
        else:  # _num_blocks_to_allocate with no hit, inlined (a decode's every step)
            needed = num_required - (len(table) if table is not None else 0)
            if needed < 0:
                needed = 0
        # (Nothing to allocate and nothing to keep free always fits: the free
        # count is read only when it can refuse.)
        if (needed or watermark or reserved_blocks) \
                and needed + watermark > self.block_pool.get_num_free_blocks() - reserved_blocks:
            return None

        if table is None:
            table = self.req_to_blocks[request_id] = []
        if hits:
            assert not table, "prefix hits are only adopted by a request without blocks"
            self.block_pool.touch(hits)
            table.extend(hits)
            self.num_cached_block[request_id] = len(hits)
        num_new_blocks = num_required - len(table)
        if num_new_blocks > 0:
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            table.extend(new_blocks)
        else:
            new_blocks = []
        if not delay_cache_blocks and self.enable_caching:
            num_tokens = total_computed + num_new_tokens
            if num_tokens > len(request.all_token_ids):  # min(.., num_tokens)
                num_tokens = len(request.all_token_ids)
            # cache_blocks does nothing unless a block filled past those cached.
            if num_tokens // self.block_size > self.num_cached_block.get(request_id, 0):
                self.cache_blocks(request, num_tokens)
        return new_blocks

    def get_num_blocks_to_hold(self, request: Request, num_tokens: int) -> int:
        """Blocks ``request`` still needs for ``num_tokens`` tokens beyond its
        table (vLLM ``get_num_blocks_to_allocate`` with no new hits)."""
        return self._num_blocks_to_allocate(request.request_id, num_tokens, [])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks within its first ``num_tokens``."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        block_size = self.block_size
        block_hashes = request.block_hashes
        num_full = min(num_tokens, len(block_hashes) * block_size) // block_size
        if num_full <= num_cached:
            return
        table = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(table, block_hashes, num_cached, num_full)
        self.num_cached_block[request_id] = num_full

    # -- free ---------------------------------------------------------------
    def free(self, request: Request) -> list[int]:
        """Free the request's table tail-first; returns the freed ids in that order."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        ordered = blocks[::-1]
        self.block_pool.free_blocks(ordered)
        return [b.block_id for b in ordered]

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Drop the request's bookkeeping and return its table in allocation
        order without freeing (the caller defers the free behind a fence)."""
        self.num_cached_block.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def reset_prefix_cache(self) -> bool:
        """vLLM ``KVCacheManager.reset_prefix_cache`` (one group, no stats):
        the pool's reset; False, changing nothing, while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def new_block_ids(self, new_blocks: list[KVCacheBlock]) -> list[int]:
        """The ids of ``allocate_slots``' new blocks, in allocation order."""
        return [b.block_id for b in new_blocks]

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()
