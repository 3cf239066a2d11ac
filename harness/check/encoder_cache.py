"""The trace checker's model of encoder inputs (multimodal items).

A shadow of vLLM 0.33.0's encoder cache (``EncoderCacheManager``) rebuilt
from the trace alone, and the decision ``Scheduler._try_schedule_encoder_inputs``
must take for a token window, written independently of the reference (only
the definitions are shared, see docs/trace-format.md): an item is an
``(offset, length)`` pair of prompt positions with ``length`` embeds; its
identifier is the first 16 hex digits of the sha256 of its prompt tokens
(int64 little-endian). Part of the checker's model (``harness.check.model``);
the encoder family (``harness.check.encoder``) drives it and checks against it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def item_identifier(token_ids: Sequence[int]) -> str:
    """An item's identifier: sha256 of its tokens (int64 LE), 16 hex digits."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:16]


@dataclass(frozen=True)
class Item:
    """One encoder input of a request: prompt positions [offset, offset + length)."""

    offset: int
    length: int
    identifier: str

    @property
    def end(self) -> int:
        return self.offset + self.length


def request_items(prompt: Sequence[int], positions: Sequence[Sequence[int]] | None,
                  identifiers: Sequence[str] | None = None) -> tuple[Item, ...]:
    """The request's items from its prompt and ``mm_positions`` column; their
    identifiers are ``identifiers`` when given (the trace config's
    ``mm_identifiers`` of a recording of vLLM: its
    ``MultiModalFeatureSpec.identifier``, one per item), else derived from the
    prompt tokens (``item_identifier``)."""
    if identifiers:
        return tuple(Item(o, n, str(h)) for (o, n), h in zip(positions or (), identifiers, strict=True))
    return tuple(Item(o, n, item_identifier(prompt[o:o + n])) for o, n in positions or ())


def items_in_window(items: Sequence[Item], start: int, end: int) -> list[int]:
    """Indices of the items overlapping the token window [start, end)."""
    return [i for i, item in enumerate(items) if item.offset < end and start < item.end]


def block_extra_keys(items: Sequence[Item], start: int, end: int) -> tuple | None:
    """Multimodal extra keys of the block [start, end) (vLLM
    ``_gen_mm_extra_hash_keys``): (identifier, offset - start) per item
    overlapping it; None without any."""
    keys = tuple((item.identifier, item.offset - start) for item in items
                 if item.offset < end and start < item.end)
    return keys or None


@dataclass
class Plan:
    """What the window decision should be (``ShadowEncoderCache.plan``):
    inputs to encode, the window length after the cut, the budget left,
    same-step duplicates, the cached inputs referenced, and the input the
    window stopped before (None: not cut)."""

    input_ids: list[int]
    num_tokens: int
    budget_left: int
    duplicates: list[int]
    hits: list[int]
    stopped_before: int | None


class ShadowEncoderCache:
    """The encoder cache as the trace implies it; sizes in embeds.

    ``cached``: identifier -> referencing request ids (empty: freeable);
    ``freeable``: unreferenced entries, oldest first (evicted first);
    ``refs``: request -> its referenced input ids (a set: released in set
    order, as vLLM's ``free`` does); ``evicted``: identifiers evicted since
    the last ``take_evicted``.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = capacity
        self.reclaimable = capacity  # free + embeds of freeable entries
        self.cached: dict[str, set[str]] = {}
        self.size: dict[str, int] = {}
        self.refs: dict[str, set[int]] = {}
        self.hash_refs: dict[str, dict[str, int]] = {}
        self.freeable: OrderedDict[str, int] = OrderedDict()
        self.evicted: list[str] = []

    def _ref(self, rid: str, items: Sequence[Item], i: int) -> None:
        ids = self.refs.setdefault(rid, set())
        if i in ids:
            return
        ids.add(i)
        counts = self.hash_refs.setdefault(rid, {})
        counts[items[i].identifier] = counts.get(items[i].identifier, 0) + 1

    def hit(self, rid: str, items: Sequence[Item], i: int) -> bool:
        """A cache hit references the entry (it stops being freeable)."""
        key = items[i].identifier
        if key not in self.cached:
            return False
        if not self.cached[key]:
            self.reclaimable -= self.freeable.pop(key)
        self.cached[key].add(rid)
        self._ref(rid, items, i)
        return True

    def fits(self, items: Sequence[Item], i: int, budget: int, pending: int) -> bool:
        """Within the budget left and the cache (with ``pending`` embeds already
        chosen), evicting freeable entries oldest first if needed."""
        need = items[i].length
        if need > budget:
            return False
        need += pending
        if need <= self.free:
            return True
        if need > self.reclaimable:
            return False
        while need > self.free:
            key, size = self.freeable.popitem(last=False)
            del self.cached[key]
            del self.size[key]
            self.evicted.append(key)
            self.free += size
        return True

    def allocate(self, rid: str, items: Sequence[Item], i: int) -> bool:
        """Reserve an encoded input's embeds; False if the cache cannot hold it."""
        key, size = items[i].identifier, items[i].length
        if self.cached.get(key):
            # Already cached and referenced: nothing more to reserve.
            self.cached[key].add(rid)
            self._ref(rid, items, i)
            return True
        if key in self.freeable:
            self.hit(rid, items, i)
            return True
        if size > self.free:
            return False
        self.cached.setdefault(key, set()).add(rid)
        self.size[key] = size
        self._ref(rid, items, i)
        self.free -= size
        self.reclaimable -= size
        return True

    def release(self, rid: str, items: Sequence[Item], i: int) -> None:
        """Drop one reference; an entry nobody references becomes freeable."""
        key = items[i].identifier
        ids = self.refs.get(rid)
        if ids is not None and i in ids:
            ids.remove(i)
            counts = self.hash_refs[rid]
            counts[key] -= 1
            if not counts[key]:
                del counts[key]
            if not ids:
                del self.refs[rid]
                del self.hash_refs[rid]
        if not self.cached.get(key) or key in self.hash_refs.get(rid, ()):
            return
        self.cached[key].discard(rid)
        if not self.cached[key]:
            self.freeable[key] = self.size[key]
            self.reclaimable += self.size[key]

    def release_all(self, rid: str, items: Sequence[Item]) -> None:
        for i in list(self.refs.get(rid, ())):
            self.release(rid, items, i)

    def release_passed(self, rid: str, items: Sequence[Item], confirmed: int) -> None:
        """Release the inputs whose range ends at or before ``confirmed``
        (num_computed_tokens - placeholders), in set order."""
        for i in list(self.refs.get(rid, ())):
            if items[i].end <= confirmed:
                self.release(rid, items, i)

    def is_cached(self, items: Sequence[Item], i: int) -> bool:
        return items[i].identifier in self.cached

    def take_evicted(self) -> list[str]:
        """Evicted since the last call, minus those cached again."""
        evicted = [key for key in self.evicted if key not in self.cached]
        self.evicted = []
        return evicted

    def plan(self, rid: str, items: Sequence[Item], computed: int, num_tokens: int, budget: int,
             no_chunked_items: bool, shift: int = 0) -> Plan:
        """The decision for window [computed, computed + num_tokens) with
        ``budget`` embeds left. Applies its side effects (hits referenced,
        evictions) like the scheduler does before allocation. ``shift``: a
        drafter's prefill look-ahead (tokens): the items looked at reach that
        far past the window and a no-chunking stop lands that much earlier
        (vLLM 0.33.0 ``shift_computed_tokens``)."""
        chosen: list[int] = []
        duplicates: list[int] = []
        hits: list[int] = []
        keys: set[str] = set()
        pending = 0
        stopped = None
        if num_tokens <= 0:
            return Plan(chosen, num_tokens, budget, duplicates, hits, stopped)
        for i in items_in_window(items, computed, computed + num_tokens + shift):
            item = items[i]
            if no_chunked_items and computed <= item.offset and computed + num_tokens < item.end:
                num_tokens, stopped = max(0, item.offset - (computed + shift)), i
                break
            if item.identifier in keys:
                duplicates.append(i)
                continue
            if self.hit(rid, items, i):
                hits.append(i)
                continue
            if not self.fits(items, i, budget, pending):
                num_tokens = min(num_tokens, item.offset - computed) if computed < item.offset else 0
                stopped = i
                break
            pending += item.length
            budget -= item.length
            keys.add(item.identifier)
            chosen.append(i)
        return Plan(chosen, num_tokens, budget, duplicates, hits, stopped)


@dataclass
class EncoderStep:
    """Per-step encoder state of the checker: the budget left (embeds), the
    pending plan (a request between its ``encoder_plan`` row and its
    ``schedule`` row or failure), the inputs committed per request, the
    requests whose plan cut their window to 0 (may be skipped), the cursor
    over the processed batch's requests and whether the update's frees ran."""

    budget_left: int = 0
    pending: dict | None = None
    committed: dict[str, list[int]] = field(default_factory=dict)
    zero: set[str] = field(default_factory=set)
    cursor: int = 0
    update_done: bool = True
