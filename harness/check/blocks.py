"""Blocks and prefix cache: block tables, ownership, the free queue, prefix hits.

What the trace says each step allocates, shares, frees and hits is checked
against the model's shadow pool (``TraceModel.owners``, ``free_queue``,
``content``/``cached``, ``uncomputed``): vLLM 0.33.0 ``BlockPool``,
``KVCacheManager`` and ``FreeKVCacheBlockQueue`` (spec 5).
"""

from __future__ import annotations

from reference.words import plural

from harness.check.model import ReqShadow, TraceModel, cdiv
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("PREFIX-HIT-RULES", "A prefix hit is whole blocks, at most num_tokens - 1 tokens, 0 with caching off, and its blocks hold exactly the request's prefix.", "5.6, 8 #29",
              SAFETY, "A hit reuses whole blocks of KV computed for exactly this prefix, never the last token (its logits are needed), none with caching off: any other hit reads KV for different tokens."),
    Invariant("PREFIX-HIT-LONGEST", "A prefix hit is the longest prefix whose full blocks are cached.", "5.6",
              SEMANTICS, "Taking the longest cached prefix, with cached contents as this version registers and evicts them, is design: a shorter hit is still correct."),
    Invariant("HIT-UNCOMPUTED-BLOCK", "A prefix hit never lands on a block whose KV was never computed, such as one cached at allocation by a chunk that a PRIORITY give-back then withdrew.", "4.2, 5.7 step 10",
              SAFETY, "A hit on a block whose KV was never computed reads garbage KV in every version (a finding in vLLM 0.33.0)."),
    Invariant("BLOCKS-COVER", "After scheduling, a request's table (a hybrid model: each KV-cache group's, null slots counted; a full-attention group's holds no null block) has at least ceil((computed + scheduled) / block_size) blocks.", "5.7",
              SAFETY, "The table must cover computed + scheduled tokens or the step writes KV outside the request's blocks, in every version; more blocks than that corrupt nothing (a drafter's look-ahead slots, an anti-thrash reserve: BLOCKS-EXACT)."),
    Invariant("BLOCKS-EXACT", "After scheduling, a request's table (a hybrid model: each KV-cache group's) has no more blocks than it held before or ceil(min(computed + scheduled + num_lookahead_tokens, max_model_len) / block_size), whichever is more (an async KV load's admission: no look-ahead).", "5.7",
              SEMANTICS, "Allocating exactly the blocks the scheduled tokens and the drafter's look-ahead slots need (vLLM 0.33.0 KVCacheManager.allocate_slots with Scheduler.num_lookahead_tokens) is this version's design: a table holding more corrupts nothing, and a leak is BLOCK-CONSERVATION's."),
    Invariant("BLOCK-EXCLUSIVE", "A newly allocated block is held by nobody; a block in two tables is a full, prefix-shared block.", "5.3, 8 #26",
              SAFETY, "A block written by two requests corrupts both unless it is a full, prefix-shared (read-only) block; the null block is never allocated."),
    Invariant("ALLOC-FROM-HEAD", "New blocks are taken from the head of the free queue, whose order follows from the frees: unhashed (or caching off) blocks to the head, hashed ones to the tail, tail block first.", "5.2, 8 #27-28, 10.7",
              SEMANTICS, "Which free block is taken (the head of the free queue, and the order frees leave it in) is eviction-policy design: 0.33.0 frees unhashed blocks to the head, 0.20.2 appends every block to the tail."),
    Invariant("BLOCK-CONSERVATION", "free blocks + distinct held blocks = num_gpu_blocks - 1 (null block excluded).", "5.1, 8 #24",
              SAFETY, "Blocks are neither leaked nor invented: free + held = usable, in every version."),
    Invariant("FREE-ORDER", "A finished, aborted or preempted request's free returns its table tail block first.", "5.2, 5.8",
              SEMANTICS, "Freeing the tail block first (so the least useful prefix is evicted first) is the v1 design."),
    Invariant("FREE-WHOLE-TABLE", "A finished or aborted request frees exactly the blocks of its table, each once (a preempted one: PREEMPT-EFFECTS).", "5.2, 5.8",
              SAFETY, "A request that ends or is preempted gives back exactly the blocks it holds, each once: anything else leaks blocks or double-frees them."),
    Invariant("RESET-ONLY-WHEN-FREE", "A prefix-cache reset succeeds exactly when no block is held (by a request or a deferred free); a forced reset (reset_running_requests) always succeeds after its preemptions.", "vLLM BlockPool.reset_prefix_cache",
              SEMANTICS, "Refusing a prefix-cache reset while blocks are held is BlockPool.reset_prefix_cache's design."),
    Invariant("HIT-AFTER-RESET", "No prefix hit lands on a block whose content a successful prefix-cache reset forgot (until a fresh allocation recomputes it).", "vLLM BlockPool.reset_prefix_cache",
              SAFETY, "After a prefix-cache reset the cache promises nothing: a hit on content it forgot reads KV that may have been overwritten."),
]


def check_conservation(m: TraceModel, where: str, num_free: int | None) -> None:
    """BLOCK-CONSERVATION at ``where`` (a row carrying ``num_free_blocks``):
    free + distinct held = num_gpu_blocks - 1, and free = the shadow queue's length.
    The witness names what changed the free count since the last such row
    (``conservation_witness``)."""
    if num_free is None:
        return
    usable = m.num_gpu_blocks - 1
    if num_free + m.held() != usable or num_free != len(m.free_queue):
        m.violate("BLOCK-CONSERVATION", None,
                  f"at {where}: {num_free} free + {m.held()} held != {usable} usable blocks "
                  f"(the trace implies {len(m.free_queue)} free)" + conservation_witness(m, num_free))
        gap = num_free - len(m.free_queue)
        if m.free_gap is None or m.free_gap[0] != gap:
            m.free_gap = (gap, f"{where} at step {m.step}")
    else:
        m.free_gap = None
    m.free_seen = (where, m.step, num_free)
    m.free_changes = {}


def conservation_witness(m: TraceModel, num_free: int) -> str:
    """What a human checks a BLOCK-CONSERVATION violation against: the engine's
    free count at the last row that carried one, the trace's events since that
    changed the inferred free queue (each request's take or free: blocks named,
    change of the free count) and the change they imply against the one
    observed; "" before the first such row."""
    if m.free_seen is None:
        return ""
    where, step, before = m.free_seen
    implied = sum(change for _, change in m.free_changes.values())
    observed = num_free - before
    parts = []
    for (what, rid), (named, change) in list(m.free_changes.items())[:8]:
        if what == "take":
            parts.append(f"{rid} took {plural(-change, 'free block')} ({change:+d})")
        else:
            parts.append(f"{what} {rid} freed {plural(named, 'block')}, {change} back to the free queue ({change:+d})")
    more = len(m.free_changes) - len(parts)
    events = "; ".join(parts) + (f"; {more} more" if more > 0 else "") if parts else "no event changed it"
    gap = observed - implied
    verdict = (f"{plural(-gap, 'block')} fewer came back than the trace frees" if gap < 0
               else f"{plural(gap, 'block')} more than the trace frees" if gap > 0
               else f"as the trace implies; the gap of {num_free - len(m.free_queue):+d} dates from "
                    f"{m.free_gap[1] if m.free_gap else 'an earlier step'}")
    return (f"; since {where} at step {step} ({before} free) the engine's count changed by {observed:+d}, "
            f"the trace's events by {implied:+d} ({events}): {verdict}")


def check_acquire(m: TraceModel, req: ReqShadow, block: int, as_hit: bool) -> None:
    """Before ``req`` takes ``block``: BLOCK-EXCLUSIVE (a fresh block is held by
    nobody, never twice in a table, never the null block) and ALLOC-FROM-HEAD
    (a fresh block is the head of the inferred free queue; after the first
    miss the order is unknown and the check stops)."""
    holders = m.owners.get(block) or ()
    if req.request_id in holders:
        m.violate("BLOCK-EXCLUSIVE", req.request_id, f"block {block} appears twice in its table")
    if holders and not as_hit:
        m.violate("BLOCK-EXCLUSIVE", req.request_id,
                  f"newly allocated block {block} is still held by {sorted(holders)}")
    if block == 0:
        m.violate("BLOCK-EXCLUSIVE", req.request_id, "the null block 0 was allocated")
    if not as_hit and m.free_queue_known:
        head = next(iter(m.free_queue), None)
        if block != head:
            preview = list(m.free_queue)[:8]
            order = ("" if m.free_unhashed_to_head else
                     " (as this profile's release frees: every freed block to the tail)")
            m.violate("ALLOC-FROM-HEAD", req.request_id,
                      f"allocated block {block} but the free queue starts {preview}{order}; "
                      f"the queue order can no longer be inferred, so this check stops here")
            m.free_queue_known = False


def check_free_whole_table(m: TraceModel, req: ReqShadow, freed: list[int], expected: list[int]) -> bool:
    """FREE-WHOLE-TABLE: a finished or aborted request frees exactly the blocks
    of its table (``expected``), each once. True when it does."""
    if sorted(freed) != sorted(expected):
        m.violate("FREE-WHOLE-TABLE", req.request_id, f"freed {freed}, but its table is {req.blocks}")
        return False
    return True


def check_free_order(m: TraceModel, req: ReqShadow, freed: list[int], expected: list[int]) -> None:
    """FREE-ORDER: a free that returns the whole table returns it tail block first."""
    if freed != expected:
        m.violate("FREE-ORDER", req.request_id, f"freed {freed}, expected its table tail first {expected}")


def check_prefix_hit(m: TraceModel, req: ReqShadow, hit: int, block_ids: list[int]) -> None:
    """A lookup's hit (admission or async load): PREFIX-HIT-RULES (whole blocks,
    at most num_tokens - 1, the longest cached prefix, blocks holding this
    request's prefix) and HIT-UNCOMPUTED-BLOCK (none of them never computed)."""
    rid = req.request_id
    if hit % m.bs or hit > req.num_tokens - 1 or (hit and not m.caching):
        m.violate("PREFIX-HIT-RULES", rid,
                  f"hit of {hit} tokens (block_size {m.bs}, {req.num_tokens} tokens, "
                  f"caching {'on' if m.caching else 'off'})")
    n_hit = hit // m.bs
    if not m.caching:
        return
    longest = m.longest_cached_prefix(req)
    if check_hit_blocks_computed(m, rid, block_ids[:n_hit]) and hit != longest:
        m.violate("PREFIX-HIT-LONGEST", rid, f"hit of {hit} tokens but {longest} tokens of its prefix are cached")
    for i, block in enumerate(block_ids[:n_hit]):
        if i < len(req.chain) and block not in m.uncomputed and block not in m.reset_forgotten \
                and m.content.get(block) != req.chain[i] and m.written.get(block) != req.chain[i]:
            m.violate("PREFIX-HIT-RULES", rid, f"hit block {block} (#{i}) does not hold this request's prefix block")
            break


def check_hit_blocks_computed(m: TraceModel, rid: str, hit_blocks: list[int]) -> bool:
    """HIT-AFTER-RESET and HIT-UNCOMPUTED-BLOCK for a hit's blocks; True
    when neither fires (so PREFIX-HIT-LONGEST may be judged)."""
    forgotten = [b for b in hit_blocks if b in m.reset_forgotten]
    uncomputed = [b for b in hit_blocks if b in m.uncomputed]
    if forgotten:
        block = forgotten[0]
        m.violate("HIT-AFTER-RESET", rid,
                  f"prefix hit on block {block}, whose cached content the prefix-cache reset at step "
                  f"{m.reset_forgotten[block]} forgot: hits after a reset must be recomputed content")
    elif uncomputed:
        block = uncomputed[0]
        m.violate("HIT-UNCOMPUTED-BLOCK", rid,
                  f"prefix hit on block {block}, whose KV was never computed: a chunk of "
                  f"{m.uncomputed[block]} cached it at allocation and was then withdrawn "
                  f"by a give-back (a victim scheduled earlier this step, policy {m.policy})")
    return not forgotten and not uncomputed


def check_no_lookup_with_loaded_kv(m: TraceModel, rid: str, hit: int) -> None:
    """PREFIX-HIT-RULES: a request admitted with loaded KV does no lookup."""
    if hit:
        m.violate("PREFIX-HIT-RULES", rid, f"a request holding loaded KV looked up a prefix hit of {hit} tokens")


def check_loaded_table_kept(m: TraceModel, req: ReqShadow, block_ids: list[int]) -> None:
    """BLOCKS-COVER: a request admitted with loaded KV keeps its table and grows it."""
    if block_ids[:len(req.blocks)] != req.blocks:
        m.violate("BLOCKS-COVER", req.request_id, f"admitted with table {block_ids}, but it held {req.blocks}")


def lookahead_end(m: TraceModel, end: int) -> int:
    """The last token slot vLLM allocates for a step ending at ``end`` tokens:
    ``end`` plus the drafter's look-ahead slots, capped at max_model_len (vLLM
    0.33.0 ``KVCacheManager.allocate_slots``' ``num_tokens_need_slot``)."""
    return min(end + m.num_lookahead, m.max_model_len) if m.num_lookahead else end


def check_table_size(m: TraceModel, rid: str, have: int, blocks_before: int, end: int,
                     lookahead: bool = True, group: int | None = None, unit: str = "block") -> None:
    """BLOCKS-COVER and BLOCKS-EXACT for a table of ``have`` blocks after a
    step ending at ``end`` (computed + scheduled) tokens, ``blocks_before`` held
    before it (tables never shrink; rejected drafts can leave blocks past the
    need). BLOCKS-COVER (safety): at least ceil(end / block_size). BLOCKS-EXACT
    (semantics): at most the blocks before or those of ``end`` plus the look-ahead
    (``lookahead`` False: an async load's admission, vLLM allocates none)."""
    where = f"group {group}: " if group is not None else ""
    cover = cdiv(end, m.bs)
    if have < cover:
        m.violate("BLOCKS-COVER", rid, f"{where}table has {plural(have, unit)} for {plural(end, 'token')}, "
                                       f"needs {cover}")
        return
    slots = lookahead_end(m, end) if lookahead else end
    exact = max(blocks_before, cdiv(slots, m.bs))
    if have > exact:
        ahead = (f" + {m.num_lookahead} look-ahead slot(s) = {min(end + m.num_lookahead, m.max_model_len)}"
                 if lookahead and m.num_lookahead else "")
        m.violate("BLOCKS-EXACT", rid, f"{where}table has {plural(have, unit)} for {plural(end, 'token')}{ahead}, "
                                       f"this version allocates {exact} (it held {blocks_before})")


def check_blocks_cover(m: TraceModel, req: ReqShadow, blocks_before: int, end: int) -> None:
    """BLOCKS-COVER and BLOCKS-EXACT after a schedule row, ``end`` =
    computed + scheduled tokens (``check_table_size``)."""
    check_table_size(m, req.request_id, len(req.blocks), blocks_before, end)


def check_load_cover(m: TraceModel, req: ReqShadow, loaded: int) -> None:
    """BLOCKS-COVER (too few) and BLOCKS-EXACT (too many) after an async KV
    load's admission of ``loaded`` tokens (hit + external; vLLM allocates no
    look-ahead slots for it)."""
    have, need = len(req.blocks), cdiv(loaded, m.bs)
    if have < need:
        m.violate("BLOCKS-COVER", req.request_id, f"table has {plural(have, 'block')} for {plural(loaded, 'loaded token')}")
    elif have > need:
        m.violate("BLOCKS-EXACT", req.request_id, f"table has {plural(have, 'block')} for "
                                                  f"{plural(loaded, 'loaded token')}, this version allocates {need}")


def check_reset(m: TraceModel, succeeded: bool, forced: bool) -> None:
    """RESET-ONLY-WHEN-FREE, once a reset's preemptions are applied: vLLM's
    ``BlockPool.reset_prefix_cache`` succeeds iff every block but the null
    block is free; a forced reset that still fails raises in vLLM."""
    held = m.held()
    if succeeded and held:
        m.violate("RESET-ONLY-WHEN-FREE", None,
                  f"prefix-cache reset succeeded while {held} blocks are held "
                  f"(e.g. {sorted(m.owners)[:8]}): their cached content would be forgotten under live KV")
    elif not succeeded and not held:
        m.violate("RESET-ONLY-WHEN-FREE", None, "prefix-cache reset refused although no block is held")
    elif not succeeded and forced:
        m.violate("RESET-ONLY-WHEN-FREE", None,
                  f"forced prefix-cache reset refused: {held} blocks still held after preempting every running request")


# -- a hybrid model's groups (harness.check.hybrid follows the tables) ------------------
def check_group_lists(m: TraceModel, req: ReqShadow, groups: list | None, where: str) -> bool:
    """BLOCKS-COVER: a hybrid model's row carries one block list per KV-cache
    group (otherwise the tables cannot be followed). True when it does."""
    if groups is None or len(groups) != len(m.group_windows):
        m.violate("BLOCKS-COVER", req.request_id,
                  f"{where} row without one block list per KV-cache group ({len(m.group_windows)} groups): "
                  f"{groups}")
        return False
    return True


def check_group_loaded_table_kept(m: TraceModel, req: ReqShadow, g: int, table: list[int], held: list[int]) -> None:
    """BLOCKS-COVER: a hybrid admission with loaded KV keeps group ``g``'s table and grows it."""
    if table[:len(held)] != held:
        m.violate("BLOCKS-COVER", req.request_id, f"group {g}: admitted with table {table}, but it held {held}")


def check_group_load_cover(m: TraceModel, req: ReqShadow, g: int, have: int, need: int, loaded: int) -> None:
    """A hybrid async KV load's group ``g``: ``need`` slots for ``loaded``
    tokens; fewer is BLOCKS-COVER (safety), more BLOCKS-EXACT (semantics)."""
    if have != need:
        m.violate("BLOCKS-COVER" if have < need else "BLOCKS-EXACT", req.request_id,
                  f"group {g}: table has {have} slot(s) for {loaded} loaded tokens, needs {need}")


def check_group_cover(m: TraceModel, req: ReqShadow, g: int, table: list[int], before: int, end: int) -> None:
    """BLOCKS-COVER (at least the slots of ``end`` tokens) and BLOCKS-EXACT (at
    most ``before`` or those of ``end`` plus the look-ahead) for group ``g``;
    a full-attention table holds no null block."""
    check_table_size(m, req.request_id, len(table), before, end, group=g, unit="slot")
    if m.group_windows[g] is None and 0 in table:
        m.violate("BLOCKS-COVER", req.request_id,
                  f"group {g} (full attention): slot {table.index(0)} is the null block, but a full-attention "
                  f"table holds every block")


def check_group_free_order(m: TraceModel, req: ReqShadow, kind: str, got: list[list[int]],
                           expected: list[list[int]]) -> None:
    """FREE-ORDER per group: a free's ``group_block_ids`` are each group's table
    tail first (null slots left out); a different set is FREE-WHOLE-TABLE's."""
    if got != expected and sorted(b for g in got for b in g) == sorted(b for g in expected for b in g):
        m.violate("FREE-ORDER", req.request_id, f"{kind} freed {got} per group, expected {expected}")


def check_group_prefix_hit(m: TraceModel, req: ReqShadow, hit: int, tables: list[list[int]],
                           key_of, longest_of) -> None:
    """A hybrid admission's hit: PREFIX-HIT-RULES (whole blocks, at most
    num_tokens - 1, none with caching off, no null block in a
    full-attention hit, every non-null hit block holding this request's
    prefix block of its group: ``key_of(chain_hash, group)``),
    HIT-UNCOMPUTED-BLOCK, HIT-AFTER-RESET, and PREFIX-HIT-LONGEST against
    ``longest_of(m, req)`` (vLLM's fixed point across groups)."""
    rid = req.request_id
    if hit % m.bs or hit > req.num_tokens - 1 or (hit and not m.caching):
        m.violate("PREFIX-HIT-RULES", rid, f"hit of {hit} tokens (block_size {m.bs}, {req.num_tokens} tokens, "
                                           f"caching {'on' if m.caching else 'off'})")
    n_hit = hit // m.bs
    for g, table in enumerate(tables):
        if m.group_windows[g] is None and 0 in table[:n_hit]:
            m.violate("PREFIX-HIT-RULES", rid, f"group {g} (full attention): hit slot {table.index(0)} is the null block")
    if not m.caching:
        return
    m.extend_chain(req, min(n_hit, req.num_tokens // m.bs))
    hit_blocks = [b for table in tables for b in table[:n_hit] if b]
    computed = check_hit_blocks_computed(m, rid, hit_blocks)
    for g, table in enumerate(tables):
        for i, block in enumerate(table[:n_hit]):
            if block and i < len(req.chain) and block not in m.uncomputed and block not in m.reset_forgotten \
                    and m.content.get(block) != key_of(req.chain[i], g):
                m.violate("PREFIX-HIT-RULES", rid,
                          f"group {g}: hit block {block} (#{i}) does not hold this request's prefix block")
                return
    longest = longest_of(m, req)
    if computed and hit != longest:
        m.violate("PREFIX-HIT-LONGEST", rid, f"hit of {hit} tokens, but every KV-cache group hits {longest}")
