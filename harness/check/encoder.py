"""The trace checker's model of encoder inputs (multimodal items).

A shadow of vLLM 0.33.0's encoder cache (``EncoderCacheManager``) rebuilt
from the trace alone, and the decision ``Scheduler._try_schedule_encoder_inputs``
must take for a token window, written independently of the reference (only
the definitions are shared, see docs/trace-format.md): an item is an
``(offset, length)`` pair of prompt positions with ``length`` embeds; its
identifier is the first 16 hex digits of the sha256 of its prompt tokens
(int64 little-endian). ``harness.check.TraceChecker`` feeds it the events.
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


def request_items(prompt: Sequence[int], positions: Sequence[Sequence[int]] | None) -> tuple[Item, ...]:
    """The request's items from its prompt and ``mm_positions`` column."""
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
             no_chunked_items: bool) -> Plan:
        """The decision for window [computed, computed + num_tokens) with
        ``budget`` embeds left. Applies its side effects (hits referenced,
        evictions) like the scheduler does before allocation."""
        chosen: list[int] = []
        duplicates: list[int] = []
        hits: list[int] = []
        keys: set[str] = set()
        pending = 0
        stopped = None
        if num_tokens <= 0:
            return Plan(chosen, num_tokens, budget, duplicates, hits, stopped)
        for i in items_in_window(items, computed, computed + num_tokens):
            item = items[i]
            if no_chunked_items and computed <= item.offset and computed + num_tokens < item.end:
                num_tokens, stopped = max(0, item.offset - computed), i
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


class EncoderChecks:
    """ENCODER-BUDGET, ENCODER-INPUTS and ENCODER-CACHE, mixed into
    ``harness.check.TraceChecker`` (which provides ``reqs``, ``_violate``,
    ``_note``, the budgets and the step state ``st`` with ``st.enc``).

    Timing follows vLLM: an ``encoder_plan`` row is checked when it occurs
    (before the preemptions its request's allocation causes), against the
    window the request would get without encoder limits; the request's
    ``schedule`` row commits it (the budget becomes the plan's budget left,
    dropping any give-back in between, as vLLM does); a plan not followed by
    its ``schedule`` row failed allocation: a waiting request then releases
    its references, a running one keeps them. After a step, each processed
    request, in batch order, releases the inputs behind its confirmed
    progress (and all of them if it stops).
    """

    def _init_encoder(self, config: dict) -> None:
        mnbt = config["max_num_batched_tokens"]
        self.max_num_batched_tokens: int = mnbt
        self.chunked_prefill: bool = config.get("enable_chunked_prefill", True)
        self.enc_budget: int = config.get("max_num_encoder_input_tokens") or mnbt
        self.enc_cache_size: int = config.get("encoder_cache_size") or mnbt
        self.enc_no_chunk: bool = config.get("disable_chunked_mm_input", False)
        self.enc = ShadowEncoderCache(self.enc_cache_size)
        self.enc_active = False  # some request carried encoder inputs
        self.enc_known = True    # false after the shadow stopped matching the trace

    # -- arrivals ---------------------------------------------------------------
    def _enc_inadmissible(self, positions) -> str | None:
        """Why an item makes a request inadmissible (the input processor's
        encoder checks), or None."""
        step_tokens = min(self.token_budget, self.max_num_batched_tokens)
        if self.threshold > 0:
            step_tokens = min(step_tokens, self.threshold)
        for i, (_, length) in enumerate(positions or ()):
            if length > self.enc_cache_size:
                return f"encoder input {i} of {length} embeds > encoder cache size {self.enc_cache_size}"
            if length > self.enc_budget:
                return f"encoder input {i} of {length} embeds > encoder compute budget {self.enc_budget}"
            if self.enc_no_chunk and length > step_tokens:
                return (f"encoder input {i} of {length} tokens > {step_tokens} tokens per step with "
                        f"disable_chunked_mm_input")
        return None

    def _enc_stop(self, invariant: str, rid: str | None, message: str) -> None:
        """Report a contradiction of the shadow cache, after which it is no
        longer inferable: the shadow-dependent checks stop."""
        self._violate(invariant, rid, message + "; the encoder cache can no longer be inferred, so "
                                                "these checks stop here")
        self.enc_known = False

    # -- scheduling -------------------------------------------------------------
    def _enc_before(self, ev: dict, st) -> None:
        """Resolve what the previous rows left open before ``ev`` is handled."""
        kind, enc = ev["kind"], st.enc
        plan = enc.pending
        if plan is not None and kind not in ("withdraw", "preempt") \
                and not (kind == "schedule" and ev["request_id"] == plan["rid"]):
            enc.pending = None  # its allocation failed
            req = self.reqs.get(plan["rid"])
            if plan["waiting"] and req is not None:
                self.enc.release_all(req.request_id, req.items)
        if not enc.update_done and kind in ("finish", "kv_finished", "kv_free", "draft", "update_end"):
            self._enc_update_until(st, None)
            enc.update_done = True

    def _expected_window(self, req, computed: int, st) -> int:
        """The tokens the request would get before encoder limits (spec 10.3,
        10.6): its remaining tokens (padded for a new decode), the threshold,
        the budgets left and, for running requests, max_model_len."""
        running = req.status == "RUNNING"
        if running:
            n = req.num_tokens + len(req.spec_token_ids) + req.placeholders - computed
        else:
            n = req.num_tokens - computed
            if (self.num_spec > 0 and n == 1 and not st.prefill_scheduled
                    and (st.running_scheduled or computed > 0)
                    and computed + 2 + self.num_spec <= self.max_model_len):
                n = 1 + self.num_spec
        threshold = self.threshold if st.eligible > 1 else 0
        if 0 < threshold < n:
            n = threshold
        n = min(n, self.token_budget - st.total, self.max_num_batched_tokens - st.total)
        if running:
            n = min(n, self.max_model_len - computed - 1)
        return n

    def _on_encoder_plan(self, ev: dict, st) -> None:
        rid, computed, n = ev["request_id"], ev["num_computed_tokens"], ev["num_scheduled_tokens"]
        ids = list(ev.get("encoder_input_ids") or [])
        req = self.reqs.get(rid)
        enc = st.enc
        if req is None or not req.items:
            self._violate("ENCODER-INPUTS", rid, "an encoder plan for a request without encoder inputs")
            return
        waiting = req.status != "RUNNING"
        if self.enc_known:
            n_pre = self._expected_window(req, computed, st)
            plan = self.enc.plan(rid, req.items, computed, n_pre, enc.budget_left, self.enc_no_chunk)
            if (plan.input_ids, plan.num_tokens) != (ids, n):
                self._enc_stop("ENCODER-INPUTS", rid, self._plan_mismatch(req, computed, n, ids, n_pre, plan,
                                                                          enc.budget_left))
            duplicates = plan.duplicates
        else:
            duplicates = []
        self._note(req, f"encoder plan: window [{computed}, {computed + n}), encode inputs {ids}")
        if n == 0:
            enc.zero.add(rid)
            return
        enc.pending = {"rid": rid, "computed": computed, "n": n, "ids": ids, "duplicates": duplicates,
                       "budget": enc.budget_left, "waiting": waiting}

    def _plan_mismatch(self, req, computed: int, n: int, ids: list[int], n_pre: int, plan: Plan,
                       budget: int) -> str:
        head = (f"encoder plan window [{computed}, {computed + n}) encoding inputs {ids}, but with "
                f"{n_pre} tokens available, {budget} embeds of encoder budget left and the cache "
                f"({self.enc.free} free, {self.enc.reclaimable} reclaimable embeds)")
        cached = [i for i in ids if i in plan.hits]
        if cached:
            return f"{head} input(s) {cached} are cached: they must be hits, not encoded again"
        if n < plan.num_tokens:
            nxt = [i for i in items_in_window(req.items, computed + n, computed + plan.num_tokens)]
            return (f"{head} the window must reach {computed + plan.num_tokens} encoding {plan.input_ids}: "
                    f"it was cut before input(s) {nxt} that fit")
        if n > plan.num_tokens:
            what = (f"input {plan.stopped_before} {req.items[plan.stopped_before].offset, req.items[plan.stopped_before].length}"
                    if plan.stopped_before is not None else "an input")
            return (f"{head} the window must stop at {computed + plan.num_tokens}, before {what}, which "
                    f"fits neither the budget left nor the cache")
        return f"{head} the inputs to encode are {plan.input_ids}"

    def _enc_on_schedule(self, ev: dict, st, req, computed: int, n: int) -> None:
        """Commit the request's plan; check the window's coverage and the budget."""
        rid, enc = req.request_id, st.enc
        ids = list(ev.get("encoder_input_ids") or [])
        overlapping = items_in_window(req.items, computed, computed + n)
        plan = enc.pending if enc.pending is not None and enc.pending["rid"] == rid else None
        duplicates: list[int] = []
        if plan is not None:
            enc.pending = None
            duplicates = plan["duplicates"]
            if (plan["computed"], plan["n"], plan["ids"]) != (computed, n, ids):
                self._violate("ENCODER-INPUTS", rid,
                              f"scheduled window [{computed}, {computed + n}) encoding {ids}, but its "
                              f"encoder plan was [{plan['computed']}, {plan['computed'] + plan['n']}) "
                              f"encoding {plan['ids']}")
            if ids:
                # vLLM commits the budget computed before the allocation loop.
                enc.budget_left = plan["budget"] - sum(req.items[i].length for i in ids)
        else:
            if overlapping:
                self._violate("ENCODER-INPUTS", rid,
                              f"window [{computed}, {computed + n}) overlaps encoder input(s) {overlapping} "
                              f"without an encoder plan")
            enc.budget_left -= sum(req.items[i].length for i in ids if i < len(req.items))
        stray = [i for i in ids if i not in overlapping]
        if stray:
            self._violate("ENCODER-INPUTS", rid,
                          f"encodes input(s) {stray} outside its window [{computed}, {computed + n})")
            ids = [i for i in ids if i in overlapping]
        if ids:
            enc.committed[rid] = ids
        total = sum(sum(self.reqs[r].items[i].length for i in i_s)
                    for r, i_s in enc.committed.items() if r in self.reqs)
        if total > self.enc_budget:
            self._violate("ENCODER-BUDGET", rid,
                          f"this step encodes {total} embeds (requests {sorted(enc.committed)}) > "
                          f"max_num_encoder_input_tokens {self.enc_budget}")
        if not self.enc_known:
            return
        for i in ids:
            if not self.enc.allocate(rid, req.items, i):
                self._enc_stop("ENCODER-CACHE", rid,
                               f"encodes input {i} ({req.items[i].length} embeds) but the cache has only "
                               f"{self.enc.free} free embeds after this step's evictions "
                               f"(size {self.enc_cache_size})")
                return
        for i in duplicates:
            self.enc.hit(rid, req.items, i)
        missing = [i for i in overlapping if not self.enc.is_cached(req.items, i)]
        if missing:
            self._enc_stop("ENCODER-INPUTS", rid,
                           f"window [{computed}, {computed + n}) runs over encoder input(s) "
                           f"{[(i, req.items[i].offset, req.items[i].length) for i in missing]} that are "
                           f"neither cached nor encoded this step")

    def _enc_on_withdraw(self, ev: dict, st, rid: str) -> None:
        """PRIORITY give-back: the victim's inputs return to the budget."""
        given = list(ev.get("encoder_input_ids") or [])
        committed = st.enc.committed.pop(rid, [])
        if given != committed:
            self._violate("ENCODER-BUDGET", rid,
                          f"withdrawn giving back encoder inputs {given}, but it had scheduled {committed}")
        req = self.reqs.get(rid)
        if req is not None:
            st.enc.budget_left += sum(req.items[i].length for i in committed)

    def _enc_on_preempt(self, st, req) -> None:
        pending = st.enc.pending
        if pending is not None and pending["rid"] == req.request_id:
            st.enc.pending = None  # it preempted itself: the plan fails
        if self.enc_known:
            self.enc.release_all(req.request_id, req.items)

    def _enc_on_finish(self, req) -> None:
        if self.enc_known:
            self.enc.release_all(req.request_id, req.items)

    def _enc_on_schedule_end(self, ev: dict, st) -> None:
        if not self.enc_known:
            return
        expected = self.enc.take_evicted()
        reported = list(ev.get("free_encoder_mm_hashes") or [])
        if reported != expected:
            self._enc_stop("ENCODER-CACHE", None,
                           f"free_encoder_mm_hashes {reported}, but evicting unreferenced entries oldest "
                           f"first gives {expected}")

    # -- update -----------------------------------------------------------------
    def _enc_update_until(self, st, rid: str | None) -> None:
        """Release passed inputs of the processed batch's requests, in batch
        order, up to (not including) ``rid`` (None: all the rest)."""
        scheduled = st.batch.scheduled if st.batch is not None else []
        while st.enc.cursor < len(scheduled):
            current = scheduled[st.enc.cursor]
            st.enc.cursor += 1
            if current == rid:
                return
            req = self.reqs.get(current)
            if req is not None:
                self._enc_free_passed(req)

    def _enc_free_passed(self, req) -> None:
        if self.enc_known and req.items:
            self.enc.release_passed(req.request_id, req.items, req.num_computed_tokens - req.placeholders)
