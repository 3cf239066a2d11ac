"""Mutants of encoder inputs: the encoder compute budget and the encoder cache.

Each breaks one rule of ``_try_schedule_encoder_inputs`` or of the
``EncoderCacheManager`` (the budget ignored, no cache lookup, eviction
order, give-back of encoder embeds); the invariant that catches it is in its
docstring and in ``harness.candidates.mutants.MUTANTS_AND_TARGETS``.
"""

from __future__ import annotations

from reference.encoder_cache_manager import EncoderCacheManager
from reference.scheduler import Scheduler


class IgnoreEncoderBudget(Scheduler):
    """Encodes every input a window needs, whatever the encoder compute budget
    left; the budget goes negative (ENCODER-BUDGET)."""

    def _try_schedule_encoder_inputs(self, request, num_computed_tokens, num_new_tokens,
                                     encoder_compute_budget):
        ids, n, _, duplicates = super()._try_schedule_encoder_inputs(
            request, num_computed_tokens, num_new_tokens, 1 << 30)
        return ids, n, encoder_compute_budget - sum(request.get_num_encoder_embeds(i) for i in ids), \
            duplicates


class _NoHitEncoderCache(EncoderCacheManager):
    def check_and_update_cache(self, request, input_id) -> bool:
        return False  # the bug: never a hit, so cached inputs are encoded again

    def allocate(self, request, input_id) -> None:
        if request.mm_hashes[input_id] in self.cached:
            # Keep the bookkeeping consistent: reference the existing entry.
            super().check_and_update_cache(request, input_id)
            return
        super().allocate(request, input_id)


class NoEncoderCacheCheck(Scheduler):
    """Never looks an encoder input up in the encoder cache: inputs cached by
    an earlier step or another request are encoded again (ENCODER-INPUTS)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.encoder_cache_manager = _NoHitEncoderCache(config.encoder_cache_capacity)


class _NewestFirstEncoderCache(EncoderCacheManager):
    def _pop_eviction_victim(self) -> tuple[str, int]:
        return self.freeable.popitem(last=True)  # the bug: newest first


class EvictNewestFirst(Scheduler):
    """Evicts the most recently freed encoder-cache entry first instead of
    the oldest (ENCODER-CACHE)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.encoder_cache_manager = _NewestFirstEncoderCache(config.encoder_cache_capacity)


class NoEncoderGiveBack(Scheduler):
    """PRIORITY give-back returns a withdrawn victim's tokens but not its
    encoder embeds: later windows are cut for want of budget
    (ENCODER-INPUTS)."""

    def _encoder_embeds_to_restore(self, victim, input_ids) -> int:
        return 0
