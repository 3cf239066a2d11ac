"""Unit tests for the KV-cache manager and block pool (spec sections 5 and 10.7).

Each test reproduces a fact of vLLM 0.33.0 with exact block ids, token counts
and free-queue orders. Where a test mirrors one of vLLM's own tests
(``tests/v1/core/test_prefix_caching.py``, summarised in spec 9.2) its name says so.

Conventions: block size 16; a pool of ``N`` blocks has the null block 0 and
usable blocks 1..N-1. Requests are admitted the way the scheduler's waiting loop
does it (``admit``): prefix lookup, then ``allocate_slots`` with the hit.
"""

from __future__ import annotations

import itertools

import pytest

from reference.block_pool import BlockPool
from reference.kv_cache_manager import KVCacheManager
from reference.kv_cache_utils import NONE_HASH, hash_block_tokens
from reference.request import Request, RequestStatus, SamplingParams

BS = 16


# -- helpers -------------------------------------------------------------------
def make_manager(num_gpu_blocks: int = 11, *, enable_caching: bool = True,
                 max_model_len: int | None = None, watermark: float = 0.0) -> KVCacheManager:
    if max_model_len is None:
        max_model_len = (num_gpu_blocks - 1) * BS
    return KVCacheManager(num_gpu_blocks=num_gpu_blocks, block_size=BS,
                          max_model_len=max_model_len, enable_caching=enable_caching,
                          watermark=watermark)


def make_request(request_id: str, token_ids: list[int], max_tokens: int = 16) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=max_tokens), block_size=BS)


def free_queue(manager: KVCacheManager) -> list[int]:
    return manager.block_pool.free_block_queue.block_ids()


def ref_counts(manager: KVCacheManager, block_ids: list[int]) -> list[int]:
    return [manager.block_pool.blocks[i].ref_cnt for i in block_ids]


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None, **kwargs):
    """Admit like the waiting loop: lookup, allocate with the hit, advance.

    Returns (new blocks or None, hit tokens). On success the request is
    RUNNING with ``num_computed_tokens = hit + num_new_tokens``, as after the
    scheduler's ``_update_after_schedule``.
    """
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    blocks = manager.allocate_slots(request, num_new_tokens, num_new_computed_tokens=num_hit,
                                    new_computed_blocks=hits, **kwargs)
    if blocks is not None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_new_tokens
    return blocks, num_hit


_FILL_BASES = itertools.count(1_000_000, 100_000)


def fill(manager: KVCacheManager, num_blocks: int, request_id: str = "filler") -> Request:
    """Hold ``num_blocks`` blocks with a request of never-seen tokens (no watermark)."""
    base = next(_FILL_BASES)
    request = make_request(request_id, range(base, base + num_blocks * BS))
    blocks, _ = admit(manager, request, has_scheduled_reqs=False)
    assert blocks is not None and len(blocks) == num_blocks
    return request


def manager_with_free(num_free: int, **kwargs) -> KVCacheManager:
    """An 11-block pool (10 usable) with exactly ``num_free`` free blocks."""
    manager = make_manager(11, **kwargs)
    if num_free < 10:
        fill(manager, 10 - num_free)
    assert manager.num_free_blocks == num_free
    return manager


# -- block 0, fresh pool, allocation order ---------------------------------------
def test_null_block_and_fresh_free_queue():
    pool = BlockPool(11, enable_caching=True)
    assert pool.null_block.block_id == 0
    assert pool.null_block.is_null
    assert pool.blocks[0] is pool.null_block
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.get_num_free_blocks() == 10
    assert pool.get_usage() == 0.0


def test_allocation_pops_from_head_and_null_block_is_never_freed():
    pool = BlockPool(11, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [1, 2, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10]
    assert pool.get_usage() == pytest.approx(0.3)
    # The null block is skipped by free_blocks (its ref count is not maintained).
    pool.free_blocks([pool.null_block])
    assert 0 not in pool.free_block_queue.block_ids()
    assert pool.get_num_free_blocks() == 7
    with pytest.raises(ValueError):
        pool.get_new_blocks(8)


def test_block_pool_rejects_pool_without_usable_block():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


# -- vLLM test_prefill ---------------------------------------------------------------
def test_prefill_free_order_matches_vllm_test_prefill():
    """vLLM ``test_prefill``: two requests share three full prompt blocks.

    req0 = 48 common tokens + 7 unique (55 tokens) -> blocks [1, 2, 3, 4] with a
    partial 4th block; req1 = the same 48 + 5 unique (53 tokens) hits 1, 2, 3
    (48 tokens) and gets its private partial block 5. Freeing req0 then req1
    (each tail first): unhashed partial blocks go to the head, hashed ones to
    the tail -> [5, 4, 6, 7, 8, 9, 10, 3, 2, 1].
    """
    manager = make_manager(11)
    common = list(range(48))

    req0 = make_request("0", common + list(range(100, 107)))
    assert req0.num_tokens == 55
    hits, num_hit = manager.get_computed_blocks(req0)
    assert (hits, num_hit) == ([], 0)
    blocks = manager.allocate_slots(req0, 55)
    assert ids(blocks) == [1, 2, 3, 4]
    req0.num_computed_tokens = 55
    # Blocks 1-3 are full and registered under the chained hashes; block 4 is partial.
    assert len(req0.block_hashes) == 3
    parent = None
    for i in range(3):
        expected = hash_block_tokens(parent, common[i * BS:(i + 1) * BS])
        assert req0.block_hashes[i] == expected
        assert manager.block_pool.blocks[i + 1].block_hash == expected
        parent = expected
    assert manager.block_pool.blocks[4].block_hash is None
    assert free_queue(manager) == [5, 6, 7, 8, 9, 10]

    req1 = make_request("1", common + list(range(200, 205)))
    hits, num_hit = manager.get_computed_blocks(req1)
    assert ids(hits) == [1, 2, 3]
    assert num_hit == 48
    blocks = manager.allocate_slots(req1, 5, num_new_computed_tokens=48, new_computed_blocks=hits)
    assert ids(blocks) == [5]
    assert manager.get_block_ids("1") == [1, 2, 3, 5]
    assert ref_counts(manager, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]
    assert free_queue(manager) == [6, 7, 8, 9, 10]

    assert manager.free(req0) == [4, 3, 2, 1]
    assert ref_counts(manager, [1, 2, 3, 4]) == [1, 1, 1, 0]
    assert free_queue(manager) == [4, 6, 7, 8, 9, 10]

    assert manager.free(req1) == [5, 3, 2, 1]
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert ref_counts(manager, list(range(1, 11))) == [0] * 10
    assert manager.num_free_blocks == 10


def test_prefill_hit_on_free_blocks_and_large_allocation_eviction_order():
    """Continuation of vLLM ``test_prefill``.

    req2 (48 common + 6) hits the now-free blocks 1, 2, 3 (touch pulls them out
    of the queue) and takes its new block from the head (5). After freeing it,
    a 159-token request of fresh tokens takes all ten blocks in queue order
    [5, 4, 6, 7, 8, 9, 10, 3, 2, 1], evicting the common prefix from the cache.
    """
    manager = make_manager(11)
    common = list(range(48))
    req0 = make_request("0", common + list(range(100, 107)))
    admit(manager, req0)
    req1 = make_request("1", common + list(range(200, 205)))
    admit(manager, req1)
    manager.free(req0)
    manager.free(req1)
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    req2 = make_request("2", common + list(range(300, 306)))
    blocks, num_hit = admit(manager, req2)
    assert num_hit == 48
    assert ids(blocks) == [5]
    assert manager.get_block_ids("2") == [1, 2, 3, 5]
    assert ref_counts(manager, [1, 2, 3, 5]) == [1, 1, 1, 1]
    assert free_queue(manager) == [4, 6, 7, 8, 9, 10]
    assert manager.free(req2) == [5, 3, 2, 1]
    assert free_queue(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    req3 = make_request("3", range(1000, 1000 + 16 * 10 - 1))
    blocks, num_hit = admit(manager, req3)
    assert num_hit == 0
    assert ids(blocks) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert free_queue(manager) == []
    # The common prefix was evicted: a request with it no longer hits.
    probe = make_request("probe", common + [1])
    assert manager.get_computed_blocks(probe) == ([], 0)


# -- vLLM test_evict -----------------------------------------------------------------
def test_evict_free_order_matches_vllm_test_evict():
    """vLLM ``test_evict`` (0.33.0 free order).

    Pool of 11 blocks. req0 has 5 full blocks + 7 tokens (87 tokens) -> blocks
    1..6 with block 6 partial; req1 (48 fresh tokens) takes 7, 8, 9, leaving
    only block 10 free. Freeing req0 walks its table tail first: 6 has no hash
    and is prepended (reused first), 5, 4, 3, 2, 1 are hashed and appended ->
    [6, 10, 5, 4, 3, 2, 1]. Freeing req1 appends 9, 8, 7. A request that shares
    req0's first two blocks then touches 1 and 2 and gets its new block from
    the head: 6.
    """
    manager = make_manager(11)
    req0 = make_request("0", range(5 * BS + 7))
    blocks, _ = admit(manager, req0)
    assert ids(blocks) == [1, 2, 3, 4, 5, 6]
    req1 = make_request("1", range(1000, 1000 + 3 * BS))
    blocks, _ = admit(manager, req1)
    assert ids(blocks) == [7, 8, 9]
    assert free_queue(manager) == [10]

    assert manager.free(req0) == [6, 5, 4, 3, 2, 1]
    assert free_queue(manager) == [6, 10, 5, 4, 3, 2, 1]
    assert manager.free(req1) == [9, 8, 7]
    assert free_queue(manager) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    req2 = make_request("2", range(2 * BS + 3))
    hits, num_hit = manager.get_computed_blocks(req2)
    assert ids(hits) == [1, 2]
    assert num_hit == 32
    blocks = manager.allocate_slots(req2, 3, num_new_computed_tokens=32, new_computed_blocks=hits)
    assert ids(blocks) == [6]
    assert manager.get_block_ids("2") == [1, 2, 6]
    assert free_queue(manager) == [10, 5, 4, 3, 9, 8, 7]
    assert manager.num_free_blocks == 7


# -- hit rules -----------------------------------------------------------------------
def test_block_aligned_fully_cached_prompt_recomputes_last_block():
    """Max hit = num_tokens - 1, in whole blocks: an identical 32-token prompt
    hits 16 tokens (block 1) and recomputes its whole last block."""
    manager = make_manager(11)
    req_a = make_request("a", range(32))
    blocks, _ = admit(manager, req_a)
    assert ids(blocks) == [1, 2]

    req_b = make_request("b", range(32))
    hits, num_hit = manager.get_computed_blocks(req_b)
    assert ids(hits) == [1]
    assert num_hit == 16
    blocks = manager.allocate_slots(req_b, 16, num_new_computed_tokens=16, new_computed_blocks=hits)
    assert ids(blocks) == [3]
    assert manager.get_block_ids("b") == [1, 3]
    assert ref_counts(manager, [1, 2, 3]) == [2, 1, 1]
    # Block 3 holds the same tokens as block 2: no de-duplication, two blocks
    # under one hash; a lookup returns the first registered (block 2).
    assert manager.block_pool.blocks[3].block_hash == manager.block_pool.blocks[2].block_hash
    assert manager.block_pool.get_cached_block(req_b.block_hashes[1]).block_id == 2


def test_hit_is_whole_blocks_and_capped_at_num_tokens_minus_one():
    manager = make_manager(11)
    admit(manager, make_request("a", range(40)))  # blocks 1, 2 full, 3 partial (8 tokens)
    # 33 tokens: max hit (33-1)//16 = 2 blocks = 32 tokens.
    hits, num_hit = manager.get_computed_blocks(make_request("b", range(33)))
    assert (ids(hits), num_hit) == ([1, 2], 32)
    # 40 identical tokens: the 8-token partial block is never a hit -> 32, not 39.
    hits, num_hit = manager.get_computed_blocks(make_request("c", range(40)))
    assert (ids(hits), num_hit) == ([1, 2], 32)
    # 31 tokens: max hit 30 tokens -> one whole block.
    hits, num_hit = manager.get_computed_blocks(make_request("d", range(31)))
    assert (ids(hits), num_hit) == ([1], 16)
    # 16 tokens: max hit 15 -> nothing.
    assert manager.get_computed_blocks(make_request("e", range(16))) == ([], 0)
    # A different first token misses everything (hashes are chained).
    assert manager.get_computed_blocks(make_request("f", [7] + list(range(1, 40)))) == ([], 0)


def test_hit_stops_at_first_missing_block():
    """Block 2's hash evicted, block 3's still cached: the hit stops at block 1."""
    manager = make_manager(11)
    req_a = make_request("a", range(64))
    admit(manager, req_a)  # blocks 1..4, all hashed
    manager.free(req_a)
    assert free_queue(manager) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    manager.block_pool._maybe_evict_cached_block(manager.block_pool.blocks[2])
    hits, num_hit = manager.get_computed_blocks(make_request("b", range(64)))
    assert (ids(hits), num_hit) == ([1], 16)


def test_basic_prefix_caching_disabled_frees_to_head():
    """vLLM ``test_basic_prefix_caching_disabled`` + spec 10.7: no hits, no
    hashes, and every freed block is prepended to the head in the order passed
    (the reversed table), so the freed tail block is allocated next."""
    manager = make_manager(11, enable_caching=False)
    req_a = make_request("a", range(40))
    blocks, _ = admit(manager, req_a)
    assert ids(blocks) == [1, 2, 3]
    assert [manager.block_pool.blocks[i].block_hash for i in (1, 2, 3)] == [None, None, None]
    assert manager.block_pool.cached_block_hash_to_block == {}
    assert manager.get_computed_blocks(make_request("b", range(40))) == ([], 0)

    assert manager.free(req_a) == [3, 2, 1]
    assert free_queue(manager) == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]

    req_c = make_request("c", range(40))
    blocks, num_hit = admit(manager, req_c)
    assert num_hit == 0
    assert ids(blocks) == [3, 2, 1]
    # Exhaustion returns None.
    fill(manager, 7, "rest")
    assert admit(manager, make_request("d", range(5)))[0] is None


def test_caching_enabled_unhashed_blocks_to_head_hashed_to_tail_in_reverse_order():
    manager = make_manager(11)
    req_a = make_request("a", range(40))  # blocks 1, 2 hashed; 3 partial
    admit(manager, req_a)
    req_b = make_request("b", range(1000, 1048))  # blocks 4, 5, 6 all hashed
    admit(manager, req_b)
    assert manager.free(req_a) == [3, 2, 1]
    assert free_queue(manager) == [3, 7, 8, 9, 10, 2, 1]
    assert manager.free(req_b) == [6, 5, 4]
    assert free_queue(manager) == [3, 7, 8, 9, 10, 2, 1, 6, 5, 4]


# -- eviction on reuse -----------------------------------------------------------------
def test_hash_block_correct_reuse():
    """vLLM ``test_hash_block_correct_reuse``: reallocating a free cached block
    drops its hash from the map, so a later lookup misses it.

    Pool of 5 (usable 1-4). req_a (33 tokens) gets [1, 2, 3]; freed -> [3, 4, 2, 1]
    (3 is partial). A 48-token request pops 3, 4, 2, evicting block 2's hash.
    req_a's prompt then only hits block 1 (16 tokens).
    """
    manager = make_manager(5)
    req_a = make_request("a", range(33))
    admit(manager, req_a)
    hash0, hash1 = req_a.block_hashes
    manager.free(req_a)
    assert free_queue(manager) == [3, 4, 2, 1]

    blocks, _ = admit(manager, make_request("b", range(1000, 1048)))
    assert ids(blocks) == [3, 4, 2]
    assert hash1 not in manager.block_pool.cached_block_hash_to_block
    assert manager.block_pool.get_cached_block(hash1) is None
    assert manager.block_pool.get_cached_block(hash0).block_id == 1
    # Block 2 now carries req b's second-block hash, not req a's.
    assert manager.block_pool.blocks[2].block_hash != hash1

    hits, num_hit = manager.get_computed_blocks(make_request("a2", range(33)))
    assert (ids(hits), num_hit) == ([1], 16)


def test_computed_blocks_not_evicted():
    """vLLM ``test_computed_blocks_not_evicted``: a hit block sitting in the
    free queue is touched out of it before new blocks are popped, so the
    allocation evicts another free block, not the hit."""
    manager = make_manager(3)  # usable blocks 1, 2
    req_a = make_request("a", range(16))
    admit(manager, req_a)  # [1]
    req_b = make_request("b", range(100, 116))
    admit(manager, req_b)  # [2]
    manager.free(req_a)
    manager.free(req_b)
    assert free_queue(manager) == [1, 2]
    req_c = make_request("c", list(range(16)) + list(range(200, 216)))
    blocks, num_hit = admit(manager, req_c)
    assert num_hit == 16
    assert ids(blocks) == [2]
    assert manager.get_block_ids("c") == [1, 2]


# -- failed allocation changes nothing ---------------------------------------------------
def test_prefill_not_enough_free_blocks_with_computed_blocks():
    """vLLM ``test_prefill_not_enough_free_blocks_with_computed_blocks``: a
    failed allocate_slots (hits held by a running request) leaves free count,
    ref counts, queue order and tables untouched; it succeeds once enough
    blocks are free."""
    manager = make_manager(11)
    common = list(range(48))
    req0 = make_request("0", common + [7])
    admit(manager, req0)  # [1, 2, 3, 4]
    filler = fill(manager, 5)  # [5..9]
    assert free_queue(manager) == [10]

    # 48 common + 30 = 78 tokens: 5 blocks, 3 hits held by req0 -> 2 new needed.
    req2 = make_request("2", common + list(range(500, 530)))
    hits, num_hit = manager.get_computed_blocks(req2)
    assert (ids(hits), num_hit) == ([1, 2, 3], 48)
    assert manager.allocate_slots(req2, 30, num_new_computed_tokens=48, new_computed_blocks=hits) is None
    assert manager.num_free_blocks == 1
    assert free_queue(manager) == [10]
    assert ref_counts(manager, [1, 2, 3, 4]) == [1, 1, 1, 1]
    assert manager.get_block_ids("2") == []
    assert "2" not in manager.num_cached_block

    manager.free(filler)  # hashed 9..5 to the tail
    assert free_queue(manager) == [10, 9, 8, 7, 6, 5]
    blocks = manager.allocate_slots(req2, 30, num_new_computed_tokens=48, new_computed_blocks=hits)
    assert ids(blocks) == [10, 9]
    assert manager.get_block_ids("2") == [1, 2, 3, 10, 9]
    assert ref_counts(manager, [1, 2, 3]) == [2, 2, 2]


def test_failed_allocation_with_free_hit_blocks_changes_nothing():
    """Hit blocks with ref 0 count as needed blocks (touching removes them
    from the free queue). Needed = 2 new + 3 evictable hits = 5: with 3 free
    (the hits themselves) it fails and nothing moves; with exactly 5 free it
    succeeds."""
    manager = make_manager(11)
    common = list(range(48))
    req0 = make_request("0", common + [7])
    admit(manager, req0)  # [1, 2, 3, 4]
    manager.free(req0)
    assert free_queue(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    fill(manager, 1, "filler_0")  # pops 4
    filler_a = fill(manager, 2, "filler_a")  # pops 5, 6
    fill(manager, 4, "filler_b")  # pops 7..10
    assert free_queue(manager) == [3, 2, 1]

    req2 = make_request("2", common + list(range(500, 530)))
    hits, num_hit = manager.get_computed_blocks(req2)
    assert (ids(hits), num_hit) == ([1, 2, 3], 48)
    assert manager.allocate_slots(req2, 30, num_new_computed_tokens=48, new_computed_blocks=hits) is None
    assert free_queue(manager) == [3, 2, 1]
    assert ref_counts(manager, [1, 2, 3]) == [0, 0, 0]
    assert manager.get_block_ids("2") == []
    # The hits are still cached.
    assert manager.get_computed_blocks(req2)[1] == 48

    # Free exactly two more blocks (5 needed = 2 new + 3 evictable hits).
    manager.free(filler_a)
    assert free_queue(manager) == [3, 2, 1, 6, 5]
    blocks = manager.allocate_slots(req2, 30, num_new_computed_tokens=48, new_computed_blocks=hits)
    assert ids(blocks) == [6, 5]
    assert manager.num_free_blocks == 0
    assert manager.get_block_ids("2") == [1, 2, 3, 6, 5]
    assert ref_counts(manager, [1, 2, 3]) == [1, 1, 1]


def test_allocate_slots_rejects_zero_tokens_without_hit():
    manager = make_manager(11)
    with pytest.raises(ValueError):
        manager.allocate_slots(make_request("a", range(10)), 0)


# -- watermark and full-sequence gate -----------------------------------------------------
def test_watermark_blocks_is_int_of_fraction_times_num_gpu_blocks():
    # vLLM: int(watermark * kv_cache_config.num_blocks); num_blocks includes the null block.
    assert make_manager(11, watermark=0.2).watermark_blocks == 2
    assert make_manager(11, watermark=0.09).watermark_blocks == 0
    assert make_manager(101, watermark=0.05).watermark_blocks == 5


@pytest.mark.parametrize("num_free, expected_ok", [(3, False), (4, True)])
def test_watermark_applies_to_waiting_admission_when_others_scheduled(num_free, expected_ok):
    """A 32-token WAITING request needs 2 blocks + watermark 2: flips at 4 free."""
    manager = manager_with_free(num_free, watermark=0.2)
    req = make_request("w", range(32))
    blocks, _ = admit(manager, req, has_scheduled_reqs=True)
    assert (blocks is not None) == expected_ok
    assert manager.num_free_blocks == (num_free - 2 if expected_ok else num_free)


@pytest.mark.parametrize("num_free, expected_ok", [(3, False), (4, True)])
def test_watermark_applies_to_preempted_admission(num_free, expected_ok):
    manager = manager_with_free(num_free, watermark=0.2)
    req = make_request("p", range(32))
    req.status = RequestStatus.PREEMPTED
    blocks, _ = admit(manager, req, has_scheduled_reqs=True)
    assert (blocks is not None) == expected_ok


@pytest.mark.parametrize("num_free, expected_ok", [(1, False), (2, True)])
def test_watermark_not_applied_without_scheduled_requests(num_free, expected_ok):
    manager = manager_with_free(num_free, watermark=0.2)
    blocks, _ = admit(manager, make_request("w", range(32)), has_scheduled_reqs=False)
    assert (blocks is not None) == expected_ok


def test_watermark_not_applied_to_running_request():
    """A RUNNING request growing into a new block needs only that block."""
    manager = make_manager(11, watermark=0.2)
    req = make_request("r", range(32))
    admit(manager, req, has_scheduled_reqs=False)  # [1, 2]
    req.append_output_token_ids(5)  # 33 tokens, computed 32
    fill(manager, 7)
    assert manager.num_free_blocks == 1
    blocks = manager.allocate_slots(req, 1, has_scheduled_reqs=True)
    assert ids(blocks) == [10]
    assert manager.num_free_blocks == 0


@pytest.mark.parametrize("num_free, expected_ok", [(6, False), (7, True)])
def test_full_sequence_gate_bounds_admission_by_whole_prompt(num_free, expected_ok):
    """scheduler_reserve_full_isl: a 100-token prompt admitted with a 16-token
    chunk needs cdiv(100, 16) = 7 free blocks, although the chunk takes 1."""
    manager = manager_with_free(num_free)
    req = make_request("g", range(100))
    blocks = manager.allocate_slots(req, 16, full_sequence_must_fit=True)
    if expected_ok:
        assert len(blocks) == 1
        assert manager.num_free_blocks == num_free - 1
    else:
        assert blocks is None
        assert manager.num_free_blocks == num_free
        assert manager.get_block_ids("g") == []


@pytest.mark.parametrize("num_free, expected_ok", [(0, False), (1, True)])
def test_without_full_sequence_gate_only_the_chunk_must_fit(num_free, expected_ok):
    manager = manager_with_free(num_free)
    blocks = manager.allocate_slots(make_request("g", range(100)), 16, full_sequence_must_fit=False)
    assert (blocks is not None) == expected_ok


@pytest.mark.parametrize("num_free, expected_ok", [(8, False), (9, True)])
def test_full_sequence_gate_adds_watermark(num_free, expected_ok):
    """7 blocks for the whole prompt + watermark 2 -> flips at 9 free."""
    manager = manager_with_free(num_free, watermark=0.2)
    blocks = manager.allocate_slots(make_request("g", range(100)), 16,
                                    full_sequence_must_fit=True, has_scheduled_reqs=True)
    assert (blocks is not None) == expected_ok


@pytest.mark.parametrize("num_free, expected_ok", [(6, False), (7, True)])
def test_full_sequence_gate_counts_generated_tokens_of_resumed_request(num_free, expected_ok):
    """A preempted request with 90 prompt + 10 generated tokens is gated on 100
    tokens (7 blocks), not on its prompt (6 blocks)."""
    manager = manager_with_free(num_free)
    req = make_request("r", range(90))
    for t in range(10):
        req.append_output_token_ids(5000 + t)
    req.status = RequestStatus.PREEMPTED
    blocks = manager.allocate_slots(req, 16, full_sequence_must_fit=True)
    assert (blocks is not None) == expected_ok


def test_full_sequence_gate_clamps_to_max_model_len():
    """The gate uses min(num_tokens, max_model_len): 200 tokens with
    max_model_len 96 need 6 blocks."""
    manager = make_manager(11, max_model_len=96)
    fill(manager, 4)
    assert manager.num_free_blocks == 6
    blocks = manager.allocate_slots(make_request("g", range(200)), 16, full_sequence_must_fit=True)
    assert len(blocks) == 1


# -- hashing -----------------------------------------------------------------------------
def test_hash_chaining():
    a = make_request("a", range(48))
    b = make_request("b", list(range(32)) + list(range(500, 516)))
    c = make_request("c", [999] + list(range(1, 48)))
    assert len(a.block_hashes) == len(b.block_hashes) == len(c.block_hashes) == 3
    # Equal prefixes -> equal hashes, until the first differing block.
    assert a.block_hashes[:2] == b.block_hashes[:2]
    assert a.block_hashes[2] != b.block_hashes[2]
    # A different first block changes every later hash, even for equal tokens.
    assert all(x != y for x, y in zip(a.block_hashes, c.block_hashes))
    # hash_i = H(hash_{i-1} or NONE_HASH, tokens_i).
    assert a.block_hashes[0] == hash_block_tokens(None, range(16))
    assert a.block_hashes[0] == hash_block_tokens(NONE_HASH, range(16))
    assert a.block_hashes[1] == hash_block_tokens(a.block_hashes[0], range(16, 32))
    assert c.block_hashes[1] == hash_block_tokens(c.block_hashes[0], range(16, 32))
    assert c.block_hashes[1] != a.block_hashes[1]


def test_partial_blocks_are_not_hashed_and_appended_tokens_complete_blocks():
    req = make_request("a", range(31))
    assert len(req.block_hashes) == 1
    req.append_output_token_ids(31)
    assert len(req.block_hashes) == 2
    assert req.block_hashes == make_request("b", range(32)).block_hashes
    req.append_output_token_ids(32)
    assert len(req.block_hashes) == 2


def test_decode_caches_completed_block_only():
    """vLLM ``test_decode``: decode tokens fill the partial block; a new block
    is allocated when it is full; a block gets a hash only once full."""
    manager = make_manager(11)
    req = make_request("a", range(30))
    blocks, _ = admit(manager, req)
    assert ids(blocks) == [1, 2]
    assert manager.block_pool.blocks[2].block_hash is None
    for token in (30, 31):
        req.append_output_token_ids(token)
        blocks = manager.allocate_slots(req, 1)
        assert blocks == []
        req.num_computed_tokens += 1
    # 32 tokens now: block 2 is full and registered (computed 31 + 1 <= 32).
    assert manager.block_pool.blocks[2].block_hash == req.block_hashes[1]
    req.append_output_token_ids(32)  # 33rd token needs a 3rd block
    blocks = manager.allocate_slots(req, 1)
    assert ids(blocks) == [3]
    assert manager.block_pool.blocks[3].block_hash is None
    assert manager.num_cached_block["a"] == 2
