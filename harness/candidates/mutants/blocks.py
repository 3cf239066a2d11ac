"""Mutants of KV blocks and the prefix cache.

Each swaps in a broken ``KVCacheManager`` or ``BlockPool`` (leaks on finish,
abort or preemption, a double free, the wrong end of the free queue, a
reallocated block keeping its hash, one block too many, a held block handed
out again); the invariant that catches it is in its docstring and in
``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

from reference.block_pool import BlockPool
from reference.kv_cache_manager import KVCacheManager
from reference.request import Request, RequestStatus
from reference.scheduler import Scheduler


def build_kv_manager(cls: type[KVCacheManager], config) -> KVCacheManager:
    """A KV-cache manager of the (broken) class ``cls`` built like the reference's."""
    return cls(num_gpu_blocks=config.num_gpu_blocks, block_size=config.block_size,
               max_model_len=config.max_model_len, enable_caching=config.enable_prefix_caching,
               watermark=config.watermark)


class _LeakyKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.is_finished():
            # Forget the table without returning the blocks (the leak).
            blocks = self.req_to_blocks.pop(request.request_id, [])
            self.num_cached_block.pop(request.request_id, None)
            return [b.block_id for b in blocks[::-1]]
        return super().free(request)


class LeakOnFinish(Scheduler):
    """Finished requests never return their blocks (BLOCK-CONSERVATION)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_LeakyKVCacheManager, config)


class _NoEvictBlockPool(BlockPool):
    def _maybe_evict_cached_block(self, block) -> None:
        pass  # the bug: a reallocated block keeps its old hash in the map


class HitEvictedBlock(Scheduler):
    """Reallocating a free cached block does not evict its hash, so a later
    prefix hit can land on a block that now holds other tokens
    (PREFIX-HIT-RULES)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _NoEvictBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class _AbortLeakKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.status == RequestStatus.FINISHED_ABORTED:
            self.req_to_blocks.pop(request.request_id, None)
            self.num_cached_block.pop(request.request_id, None)
            return []  # the blocks never return to the pool
        return super().free(request)


class LeakOnAbort(Scheduler):
    """An aborted request's blocks are forgotten, not freed (FREE-WHOLE-TABLE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_AbortLeakKVCacheManager, config)


class _DoubleFreeKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        blocks = list(self.req_to_blocks.get(request.request_id, ()))
        freed = super().free(request)
        # The bug: a block still shared with another request is released a
        # second time, so it enters the free queue while still referenced.
        shared = [b for b in blocks if b.ref_cnt > 0]
        self.block_pool.free_blocks(shared[:1])
        return freed


class _TolerantBlockPool(BlockPool):
    def free_blocks(self, ordered_blocks) -> None:
        # Ignore frees of blocks already at ref 0 instead of asserting, so the
        # double free shows up in the trace rather than as a crash.
        super().free_blocks([b for b in ordered_blocks if b.ref_cnt > 0])


class DoubleFreeShared(Scheduler):
    """Frees a prefix-shared block twice; it is then handed to a new owner
    while the other request still holds it (BLOCK-CONSERVATION)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_DoubleFreeKVCacheManager, config)
        self.kv_cache_manager.block_pool = _TolerantBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class _TailFreeBlockPool(BlockPool):
    def free_blocks(self, ordered_blocks) -> None:
        ordered = list(ordered_blocks)
        for block in ordered:
            block.ref_cnt -= 1
        # The bug: every block goes to the tail, unhashed ones included.
        self.free_block_queue.append_n([b for b in ordered if b.ref_cnt == 0])


class FreeUnhashedToTail(Scheduler):
    """Unhashed (partial) blocks are freed to the tail instead of the head
    (ALLOC-FROM-HEAD: the next allocation does not take the expected block)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _TailFreeBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


class _PreemptLeakKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        if request.status != RequestStatus.RUNNING:
            return super().free(request)
        # Preemption (the request is still RUNNING here): the first block is
        # dropped from the table but never returned to the pool.
        blocks = self.req_to_blocks.get(request.request_id, [])
        if blocks:
            blocks.pop(0)
            self.num_cached_block.pop(request.request_id, None)
        return super().free(request)


class PreemptKeepsBlock(Scheduler):
    """A preempted request does not give back its first block (PREEMPT-EFFECTS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_PreemptLeakKVCacheManager, config)


class _HeadFirstKVCacheManager(KVCacheManager):
    def free(self, request: Request) -> list[int]:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(blocks)  # the bug: table order, head block first
        return [b.block_id for b in blocks]


class FreeHeadFirst(Scheduler):
    """A request's table is freed head block first, so the free queue evicts
    its most shared prefix block before its tail (FREE-ORDER; a semantics
    rule: every block still comes back)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_HeadFirstKVCacheManager, config)


class _OverAllocKVCacheManager(KVCacheManager):
    def allocate_slots(self, request, num_new_tokens, **kwargs):
        if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            kwargs["num_lookahead_tokens"] = self.block_size  # one block too many
        return super().allocate_slots(request, num_new_tokens, **kwargs)


class OverAllocate(Scheduler):
    """Admissions get one block more than their tokens need (BLOCKS-EXACT: a semantics rule, more blocks corrupt nothing)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager = build_kv_manager(_OverAllocKVCacheManager, config)


class _ReuseHeldBlockPool(BlockPool):
    def get_new_blocks(self, num_blocks: int):
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        if blocks and blocks[-1].ref_cnt == 1:
            # The bug: the last block stays at the head, to be handed out again.
            self.free_block_queue.prepend_n([blocks[-1]])
        return blocks


class ReuseHeldBlock(Scheduler):
    """Hands a block still held by one request to another (BLOCK-EXCLUSIVE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool = _ReuseHeldBlockPool(
            config.num_gpu_blocks, config.enable_prefix_caching)


# -- prefix-cache reset (a scenario's reset_prefix_cache action) ----------------------
class _ResetWhileHeldPool(BlockPool):
    def reset_prefix_cache(self) -> bool:
        # The broken rule: no check that every block is free. Hashes of
        # blocks still holding live KV are forgotten too.
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        return True


class ResetWhileHeld(Scheduler):
    """``reset_prefix_cache`` succeeds while requests hold blocks
    (RESET-ONLY-WHEN-FREE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool.__class__ = _ResetWhileHeldPool


class _ResetKeepsHashesPool(BlockPool):
    def reset_prefix_cache(self) -> bool:
        # Refuses and succeeds like vLLM, but forgets nothing.
        return self.get_num_free_blocks() == self.num_gpu_blocks - 1


class ResetKeepsCache(Scheduler):
    """A successful ``reset_prefix_cache`` keeps every cached hash, so later
    requests hit blocks cached before the reset (HIT-AFTER-RESET)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.kv_cache_manager.block_pool.__class__ = _ResetKeepsHashesPool


# -- a hybrid model's sliding window (harness.check.hybrid) ------------------------------
class KeepSkippedBlocks(Scheduler):
    """A sliding-window group never frees the blocks that left its window:
    they stay in the table until the request ends (SLIDING-WINDOW-FREE;
    correct, only wasteful). A one-group config runs as the reference."""

    def __init__(self, config) -> None:
        super().__init__(config)
        if self.hybrid:
            coordinator = self.kv_cache_manager.coordinator
            coordinator.remove_skipped_blocks = lambda request_id, processed: tuple(
                [] for _ in coordinator.single_type_managers)


class FreeWindowAhead(Scheduler):
    """Frees a sliding window's blocks on the tokens after the step
    (computed + scheduled) instead of the processed ones, so blocks that
    this step's first tokens still read return to the pool
    (SLIDING-WINDOW-HELD). A one-group config runs as the reference."""

    def __init__(self, config) -> None:
        super().__init__(config)
        if not self.hybrid:
            return
        manager = self.kv_cache_manager
        allocate = manager.allocate_slots

        def allocate_slots(request: Request, num_new_tokens: int, **kwargs):
            ahead = request.num_computed_tokens + kwargs.get("num_new_computed_tokens", 0) + num_new_tokens
            skipped = manager.coordinator.remove_skipped_blocks(request.request_id, ahead)
            if any(skipped):
                manager.skipped_frees.append((request.request_id, [[b.block_id for b in g] for g in skipped]))
            return allocate(request, num_new_tokens, **kwargs)

        manager.allocate_slots = allocate_slots


# -- a hybrid model's Mamba groups (harness.check.hybrid) ---------------------------------
def _mamba_managers(scheduler: Scheduler) -> list:
    from reference.kv.single_type_kv_cache_manager import MambaManager

    if not scheduler.hybrid:
        return []
    return [m for m in scheduler.kv_cache_manager.coordinator.single_type_managers if isinstance(m, MambaManager)]


class MambaFreeState(Scheduler):
    """A Mamba group counts a whole block more as skipped
    (``get_num_skipped_tokens`` of ``n`` processed tokens: ``n + block_size - 1``),
    so every allocation after the first frees the request's state block and
    nulls its slot while the request runs (MAMBA-STATE-HELD). A config
    without Mamba layers runs as the reference."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for manager in _mamba_managers(self):
            manager.get_num_skipped_tokens = (lambda n, bs=manager.block_size: n + bs - 1 if n > 0 else 0)


class MambaExtraStateBlock(Scheduler):
    """A Mamba group holds one state block more per request than 0.33.0's
    ``mamba_cache_mode`` "none" (as "align" keeps the previous step's state
    beside the current one): two blocks from the first allocation to the free
    (MAMBA-STATE-BLOCKS; correct, only wasteful). A config without Mamba
    layers runs as the reference."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for manager in _mamba_managers(self):
            manager.num_speculative_blocks += 1
