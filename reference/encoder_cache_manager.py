"""Encoder inputs (multimodal items): identifiers, the encoder cache and the
per-step choice of which items to encode.

Mirrors vLLM 0.33.0:

* ``vllm/v1/core/encoder_cache_manager.py::EncoderCacheManager``: a cache of
  encoder outputs keyed by the item's identifier (``mm_hash``), shared by every
  request carrying the same item; an entry no request references is
  *freeable* and is evicted, oldest first, only when an allocation needs the
  room (``can_allocate``); evicted identifiers are reported once in
  ``SchedulerOutput.free_encoder_mm_hashes``;
* ``vllm/multimodal/utils.py::get_mm_features_in_window``;
* ``Scheduler._try_schedule_encoder_inputs`` (``try_schedule_encoder_inputs``
  below): which items a step's token window needs, and where the window must
  stop when an item does not fit the encoder compute budget or the cache.

Units: an item's size is in *embeds*; here an item of ``length`` placeholder
tokens has exactly ``length`` embeds (no ``is_embed`` mask, no break tokens).
Items are ``(offset, length)`` pairs in prompt token positions, sorted by
offset and non-overlapping. Not modelled: encoder-decoder models, the EC
connector (external encoder cache), EAGLE's prefill shift, and the embed-count
mismatch check (an identifier here is a hash of the item's content, so equal
identifiers always mean equal sizes).
"""

from __future__ import annotations

import bisect
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


def mm_identifier(token_ids: Sequence[int]) -> str:
    """An item's identifier (vLLM ``mm_hash``): the first 16 hex digits of the
    sha256 of its placeholder tokens (int64 little-endian), so identical items
    of different requests share one cache entry."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:16]


def mm_items_in_window(positions: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """``(lo, hi)``: items ``lo..hi-1`` overlap the token window ``[start, end)``
    (vLLM ``get_mm_features_in_window``; ``positions`` sorted, non-overlapping)."""
    lo = bisect.bisect_left(positions, start + 1, key=lambda p: p[0] + p[1])
    hi = bisect.bisect_left(positions, end, key=lambda p: p[0])
    return lo, hi


class EncoderRequest(Protocol):
    """What the encoder cache needs of a request."""

    request_id: str
    mm_positions: tuple[tuple[int, int], ...]
    mm_hashes: tuple[str, ...]

    def get_num_encoder_embeds(self, input_id: int) -> int: ...


class EncoderCacheManager:
    """The encoder cache's bookkeeping (vLLM ``EncoderCacheManager``).

    ``cache_size``, ``num_free_slots`` and ``num_freeable_slots`` are in
    embeds; ``num_freeable_slots`` counts free slots plus those of
    unreferenced entries. ``cached``: identifier -> ids of the requests
    referencing it (an empty set: cached but freeable); ``freeable``:
    unreferenced entries, oldest first; ``freed``: identifiers evicted since
    the last ``get_freed_mm_hashes``.
    """

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_free_slots = cache_size
        self.num_freeable_slots = cache_size
        self.cached: dict[str, set[str]] = {}
        self.num_embeds_by_hash: dict[str, int] = {}
        # request id -> its cached input ids; request id -> identifier -> how
        # many of its input ids carry it (a request may repeat an item).
        self.request_cached_ids: dict[str, set[int]] = {}
        self.request_hash_refs: dict[str, dict[str, int]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.freed: list[str] = []

    def check_and_update_cache(self, request: EncoderRequest, input_id: int) -> bool:
        """True if the item's output is cached; then ``request`` references it
        (an unreferenced entry stops being freeable)."""
        mm_hash = request.mm_hashes[input_id]
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        self._add_cached_input_id(request.request_id, input_id, mm_hash)
        return True

    def can_allocate(self, request: EncoderRequest, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Whether the item fits the compute budget left (embeds) and the cache
        together with ``num_embeds_to_schedule`` embeds already chosen in the
        same call; evicts freeable entries, oldest first, until it fits (the
        eviction stands even if the caller then schedules nothing)."""
        num_embeds = request.get_num_encoder_embeds(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        while num_embeds > self.num_free_slots:
            mm_hash, num_free_embeds = self._pop_eviction_victim()
            del self.cached[mm_hash]
            del self.num_embeds_by_hash[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_free_embeds
        return True

    def _pop_eviction_victim(self) -> tuple[str, int]:
        """The freeable entry to evict: the oldest (mm_hash, embeds)."""
        return self.freeable.popitem(last=False)

    def allocate(self, request: EncoderRequest, input_id: int) -> None:
        """Reserve the item's embeds for ``request`` (after ``can_allocate``)."""
        mm_hash = request.mm_hashes[input_id]
        self.cached.setdefault(mm_hash, set())
        num_embeds = request.get_num_encoder_embeds(input_id)
        assert self.num_embeds_by_hash.setdefault(mm_hash, num_embeds) == num_embeds
        assert self.num_free_slots >= num_embeds and self.num_freeable_slots >= num_embeds
        self.cached[mm_hash].add(request.request_id)
        self._add_cached_input_id(request.request_id, input_id, mm_hash)
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    def _add_cached_input_id(self, request_id: str, input_id: int, mm_hash: str) -> None:
        cached_ids = self.request_cached_ids.setdefault(request_id, set())
        if input_id in cached_ids:
            return
        cached_ids.add(input_id)
        refs = self.request_hash_refs.setdefault(request_id, {})
        refs[mm_hash] = refs.get(mm_hash, 0) + 1

    def get_cached_input_ids(self, request: EncoderRequest) -> set[int]:
        return self.request_cached_ids.get(request.request_id, set())

    def free_encoder_input(self, request: EncoderRequest, input_id: int) -> None:
        """Drop ``request``'s reference to one item; an entry nobody references
        any more becomes freeable (appended: evicted after older ones). A
        request repeating an item keeps its reference until its last
        occurrence is freed."""
        req_id = request.request_id
        mm_hash = request.mm_hashes[input_id]
        cached_ids = self.request_cached_ids.get(req_id)
        if cached_ids is not None and input_id in cached_ids:
            cached_ids.remove(input_id)
            refs = self.request_hash_refs[req_id]
            refs[mm_hash] -= 1
            if not refs[mm_hash]:
                del refs[mm_hash]
            if not cached_ids:
                del self.request_cached_ids[req_id]
                del self.request_hash_refs[req_id]
        if not self.cached.get(mm_hash):
            return
        if mm_hash in self.request_hash_refs.get(req_id, ()):
            return
        self.cached[mm_hash].discard(req_id)
        if not self.cached[mm_hash]:
            num_embeds = self.num_embeds_by_hash[mm_hash]
            self.freeable[mm_hash] = num_embeds
            self.num_freeable_slots += num_embeds

    def free(self, request: EncoderRequest) -> None:
        """Drop every reference of ``request`` (finish, abort, preemption), in
        the iteration order of its cached-id set, as vLLM does."""
        for input_id in list(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """Evicted identifiers since the last call (eviction order), minus any
        allocated again in the meantime; clears the list."""
        freed = [h for h in self.freed if h not in self.cached]
        self.freed = []
        return freed


def try_schedule_encoder_inputs(
    manager: EncoderCacheManager, request: EncoderRequest, num_computed_tokens: int,
    num_new_tokens: int, encoder_compute_budget: int, disable_chunked_mm_input: bool = False,
    shift_computed_tokens: int = 0,
) -> tuple[list[int], int, int, list[int]]:
    """Which items the window ``[num_computed_tokens, +num_new_tokens)`` needs
    encoded this step (vLLM ``Scheduler._try_schedule_encoder_inputs``).

    For each item overlapping the window, in order: with
    ``disable_chunked_mm_input``, a window starting at or before the item that
    cannot cover it all stops before it; an item already chosen in this call
    (same identifier) is a duplicate; a cached one is referenced (a hit);
    otherwise it is chosen if ``can_allocate`` (budget left and cache room,
    possibly after evictions), else the window stops before it (0 tokens if
    the window starts inside it, e.g. after a prefix hit) and later items are
    not looked at. Returns ``(input ids to encode, num_new_tokens,
    encoder_compute_budget left, duplicate input ids)``; tokens and embeds.
    Nothing is allocated here: the caller allocates when the request is
    scheduled.

    ``shift_computed_tokens`` (a drafter's prefill look-ahead, tokens): the
    items looked at reach that far past the window (the drafter reads the
    next prompt tokens' embeddings), and a ``disable_chunked_mm_input`` stop
    lands that much earlier; a stop for lack of budget or cache does not
    (vLLM 0.33.0: the read-ahead into an item not encoded falls back to token
    embeddings).
    """
    if num_new_tokens == 0 or not request.mm_positions:
        return [], num_new_tokens, encoder_compute_budget, []
    to_schedule: list[int] = []
    duplicates: list[int] = []
    hashes_to_schedule: set[str] = set()
    num_embeds_to_schedule = 0
    lo, hi = mm_items_in_window(request.mm_positions, num_computed_tokens,
                                num_computed_tokens + num_new_tokens + shift_computed_tokens)
    for i in range(lo, hi):
        start, length = request.mm_positions[i]
        if (disable_chunked_mm_input and num_computed_tokens <= start
                and num_computed_tokens + num_new_tokens < start + length):
            num_new_tokens = max(0, start - (num_computed_tokens + shift_computed_tokens))
            break
        mm_hash = request.mm_hashes[i]
        if mm_hash in hashes_to_schedule:
            duplicates.append(i)
            continue
        if manager.check_and_update_cache(request, i):
            continue
        if not manager.can_allocate(request, i, encoder_compute_budget, num_embeds_to_schedule):
            if num_computed_tokens < start:
                num_new_tokens = min(num_new_tokens, start - num_computed_tokens)
            else:
                num_new_tokens = 0
            break
        num_embeds = request.get_num_encoder_embeds(i)
        num_embeds_to_schedule += num_embeds
        encoder_compute_budget -= num_embeds
        hashes_to_schedule.add(mm_hash)
        to_schedule.append(i)
    return to_schedule, num_new_tokens, encoder_compute_budget, duplicates
