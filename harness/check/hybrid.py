"""Hybrid models: block tables per KV-cache group over one shared pool.

A config with ``sliding_window`` / ``layer_types`` (docs/explanation/hybrid-kv.md)
records each row's blocks per group (``group_block_ids``, trace schema 9).
The pool-wide rules (BLOCK-CONSERVATION, BLOCK-EXCLUSIVE, ALLOC-FROM-HEAD,
FREE-ORDER, FREE-WHOLE-TABLE, PREEMPT-EFFECTS) keep their ids and are fed
here group by group in the order vLLM 0.33.0's coordinator takes and frees
blocks (``vllm/v1/core/kv_cache_coordinator.py``); BLOCKS-COVER and the
prefix-hit rules are judged per group; the two sliding-window rules and
the two Mamba rules below are this module's own (vLLM ``SlidingWindowManager``,
``MambaManager``, ``KVCacheManager.remove_skipped_blocks``).

Shadow state: ``ReqShadow.groups`` (each group's table, the null block as 0)
and ``ReqShadow.group_registered`` (each group's leading blocks whose content
is recorded); ``TraceModel.group_windows`` (None: full attention, else the
window in tokens). A block's cached content is its chained hash with the
group id appended (vLLM caches per group). A Mamba group (``linear_attention``
layers, vLLM's ``mamba_cache_mode`` "none") has window None, no hits (prefix
caching is off), blocks of ``max_model_len`` tokens and is listed in
``TraceModel.mamba_groups`` (group -> its state blocks per request).
Units: tokens unless named blocks.
"""

from __future__ import annotations

from typing import Any

from harness.check import blocks
from harness.check.model import ReqShadow, TraceModel, cdiv
from harness.check.result import SAFETY, SEMANTICS, Invariant

INVARIANTS = [
    Invariant("SLIDING-WINDOW-HELD", "A sliding-window group keeps a block at every table index the window of the request's oldest unprocessed token reads (tokens from processed - sliding_window + 1 on, processed = num_computed_tokens minus the tokens of steps in flight; with bounded replay never before the replay's start, whose tokens' window KV the replay writes and reads); a skipped_free row frees only blocks of its own table wholly before that window.", "vLLM SlidingWindowManager.remove_skipped_blocks",
              SAFETY, "A block the window still reads (by this step or a step still in flight) that is freed or nulled can be reallocated and overwritten under the attention that reads it, in every version."),
    Invariant("SLIDING-WINDOW-FREE", "When a running request is allocated slots, its sliding-window groups have just freed every block wholly before the window of its processed tokens, last block first, in a skipped_free row before its schedule row (table slots then hold the null block); an admission's hit holds the null block there.", "vLLM KVCacheManager.allocate_slots, remove_skipped_blocks",
              SEMANTICS, "Freeing the blocks that left the window at each allocation (not later, not at the request's end) is 0.33.0's design: keeping them longer is still correct, only wasteful."),
    Invariant("MAMBA-STATE-HELD", "A Mamba group's table holds a real block (not the null block) at the slot of the request's state (slot cdiv(num_computed_tokens + num_scheduled_tokens, block_size) - 1) whenever the request is scheduled, and a skipped_free never frees a Mamba group's state block.", "vLLM MambaManager (mamba_cache_mode none)",
              SAFETY, "The recurrent state of the request lives in that block: freed or nulled, it can be handed to another request and overwritten, or the step reads no state, in every version."),
    Invariant("MAMBA-STATE-BLOCKS", "With mamba_cache_mode none (Mamba blocks of max_model_len tokens) a Mamba group's table is exactly 1 + num_speculative_tokens real blocks from the request's first allocation until its free: none added, none freed on the way.", "vLLM MambaManager.get_num_blocks_to_allocate, allocate_new_blocks (mode none)",
              SEMANTICS, "One state block per request (plus one per speculative token) is 0.33.0's design without prefix caching; an engine holding more (align mode's per-block states, attention-sized blocks) is correct, only wasteful."),
]


def _groups_of(config: dict[str, Any]) -> tuple | None:
    if config.get("sliding_window") is None and config.get("layer_types") is None:
        return None
    if config.get("layer_types") is not None and all(t == "full_attention" for t in config["layer_types"]):
        return None
    from reference.kv.kv_cache_spec import kv_cache_groups_for

    layer_types = tuple(config.get("layer_types") or ("sliding_attention",))
    return kv_cache_groups_for(layer_types, config["block_size"], config.get("sliding_window"),
                               max_model_len=config["max_model_len"],
                               num_speculative_tokens=config.get("num_speculative_tokens", 0),
                               swa_bounded_replay=bool(config.get("swa_bounded_replay", False)))


def group_windows_of(config: dict[str, Any]) -> list[int | None] | None:
    """Each KV-cache group's window (None: full attention or Mamba) of a trace
    config, in group order (``reference.kv.kv_cache_spec.kv_cache_groups_for``);
    None for a one-group model without a window, as ``EngineConfig.kv_cache_groups``
    (full_attention layers only are that plain model too)."""
    from reference.kv.kv_cache_spec import SlidingWindowSpec

    groups = _groups_of(config)
    if groups is None:
        return None
    return [g.kv_cache_spec.sliding_window if isinstance(g.kv_cache_spec, SlidingWindowSpec) else None
            for g in groups]


def mamba_groups_of(config: dict[str, Any]) -> dict[int, int]:
    """The Mamba groups of a trace config: group index -> state blocks a
    request holds (1 + ``num_speculative_tokens``; vLLM ``MambaSpec``,
    mode "none"). Empty without ``linear_attention`` layers."""
    from reference.kv.kv_cache_spec import MambaSpec

    return {g: 1 + group.kv_cache_spec.num_speculative_blocks
            for g, group in enumerate(_groups_of(config) or ())
            if isinstance(group.kv_cache_spec, MambaSpec)}


def replay_groups_of(config: dict[str, Any]) -> tuple[frozenset[int], int]:
    """The bounded-replay groups of a trace config (``swa_bounded_replay``:
    vLLM 0.33.0 ``SlidingWindowMLASpec(bounded_replay=True)``, not
    ``prefix_cacheable``) and their replay window in tokens (vLLM
    ``Scheduler.prefix_replay_tokens``); ``(frozenset(), 0)`` without them."""
    groups = [g for g, group in enumerate(_groups_of(config) or ()) if group.kv_cache_spec.prefix_replay_tokens]
    if not groups:
        return frozenset(), 0
    return frozenset(groups), _groups_of(config)[groups[0]].kv_cache_spec.prefix_replay_tokens


def group_block_size(m: TraceModel, g: int) -> int:
    """Tokens a block of group ``g`` holds: ``max_model_len`` for Mamba, else ``block_size``."""
    return m.max_model_len if g in m.mamba_groups else m.bs


def content_key(chain_hash: bytes, group: int) -> bytes:
    """The cached content of a group's block: the chained hash with the group id (vLLM's key)."""
    return chain_hash + group.to_bytes(2, "big")


def skipped_blocks(m: TraceModel, window: int | None, processed: int) -> int:
    """Leading table indices wholly before the window of the token after
    ``processed`` tokens (vLLM ``get_num_skipped_tokens // block_size``)."""
    if window is None:
        return 0
    return max(0, processed - window + 1) // m.bs


def replay_null_slots(m: TraceModel, end: int, start: int) -> int:
    """The leading slots a bounded-replay group may hold the null block at
    after an admission whose local and external hit ends at ``end`` tokens
    and whose computed tokens start at ``start`` (0 without bounded replay).

    Without a replay (the load restored the window) the window of token
    ``end`` reads from ``end - sliding_window + 1``. A replay starts at
    ``start = end - prefix_replay_tokens`` (vLLM 0.33.0
    ``Request.replay_start``): the worker writes the replayed tokens' window
    KV and reads it from there on (``sparse_swa.py``'s window indices start
    at ``max(p - sliding_window + 1, replay_start)``), so the slot holding
    token ``start`` is read too. vLLM 0.33.0 nulls the slots wholly before
    the window of token ``end`` (``add_local_computed_blocks``), one slot too
    many when ``end - sliding_window + 1`` is a multiple of the block size
    (a block-aligned hit and ``sliding_window - 1`` a multiple of it):
    SLIDING-WINDOW-HELD then reports the replay's first slot
    (docs/explanation/findings.md). An admission that does not start where
    the replay should (COMPUTED-CONTINUITY) is held to the window of ``end``."""
    if not m.replay_groups:
        return 0
    nulls = skipped_blocks(m, m.prefix_replay_tokens, end)
    if end > m.prefix_replay_tokens and start == end - m.prefix_replay_tokens:
        nulls = min(nulls, start // m.bs)
    return nulls


def _ensure(m: TraceModel, req: ReqShadow) -> list[list[int]]:
    if req.groups is None:
        req.groups = [[] for _ in m.group_windows]
        req.group_registered = [0] * len(m.group_windows)
    return req.groups


def _group_lists(m: TraceModel, ev: dict, where: str, req: ReqShadow) -> list[list[int]]:
    """The row's ``group_block_ids``, one list per group (none when misshapen:
    ``blocks.check_group_lists``)."""
    groups = ev.get("group_block_ids")
    if not blocks.check_group_lists(m, req, groups, where):
        return [[] for _ in m.group_windows]
    return [list(g or ()) for g in groups]


def table_lengths(m: TraceModel, req: ReqShadow) -> tuple[int, ...]:
    """Each group's table length (null slots included)."""
    return tuple(len(t) for t in _ensure(m, req))


def _take(m: TraceModel, req: ReqShadow, block: int, as_hit: bool) -> None:
    """BLOCK-EXCLUSIVE and ALLOC-FROM-HEAD for ``block``, then ``req`` takes
    it (the null block, a violation already, is never taken)."""
    blocks.check_acquire(m, req, block, as_hit)
    if block:
        m.take_block(req, block, as_hit)


def acquire_running(m: TraceModel, req: ReqShadow, ev: dict) -> None:
    """A running request's new blocks, group after group, from the free queue's head."""
    tables = _ensure(m, req)
    for g, new in enumerate(_group_lists(m, ev, "schedule", req)):
        for block in new:
            _take(m, req, block, False)
            tables[g].append(block)


def admit(m: TraceModel, req: ReqShadow, ev: dict, hit: int, external: int = 0) -> None:
    """An admission's tables: prefix-hit checks per group, every group's hit
    blocks taken (touched) before any group's new blocks (vLLM
    ``allocate_new_computed_blocks`` then ``allocate_new_blocks``).
    ``external``: the connector's tokens computed at admission (tokens).

    A bounded-replay group (``TraceModel.replay_groups``) has no hit: the
    slots wholly before the window of the token after the local and external
    hit hold the null block, every later slot a new block (vLLM
    ``add_local_computed_blocks`` with no hit blocks, then
    ``allocate_new_blocks``)."""
    rid = req.request_id
    tables = _group_lists(m, ev, "admission", req)
    n_hit = hit // m.bs
    check_prefix_hit(m, req, hit, [[] if g in m.replay_groups else t for g, t in enumerate(tables)])
    req.groups = [[] for _ in tables]
    req.group_registered = [0] * len(tables)
    req.replay_nulls = replay_null_slots(m, hit + external, ev.get("num_computed_tokens") or 0)
    req.replay_end = hit + external if m.replay_groups else 0
    news: list[list[int]] = []
    for g, table in enumerate(tables):
        window = m.group_windows[g]
        if g in m.replay_groups:
            skipped = skipped_blocks(m, window, hit + external)
            for i, block in enumerate(table):
                if block == 0 and i >= skipped:
                    m.violate("SLIDING-WINDOW-HELD", rid,
                              f"group {g} (bounded replay): slot {i} is the null block, but the window of "
                              f"token {hit + external} reads it")
                elif block != 0 and i < skipped:
                    m.violate("SLIDING-WINDOW-FREE", rid,
                              f"group {g} (bounded replay): slot {i} holds block {block}, wholly before the "
                              f"window of token {hit + external}: 0.33.0 adopts the null block there")
            news.append(table)  # no hit: every real block is new (one kept before the window too)
            continue
        # (The window of the token after the local hit and the connector's
        # tokens: vLLM's add_local_computed_blocks nulls the slots before it,
        # hit or loaded, and allocate_external_computed_blocks fills the rest.)
        skipped = skipped_blocks(m, window, hit + external)
        for i, block in enumerate(table[:n_hit]):
            if block == 0 and i >= skipped and window is not None:
                m.violate("SLIDING-WINDOW-HELD", rid,
                          f"group {g}: hit slot {i} is the null block, but the window of token "
                          f"{hit + external} reads it")
            elif block != 0 and i < skipped:
                m.violate("SLIDING-WINDOW-FREE", rid,
                          f"group {g}: hit slot {i} holds block {block}, wholly before the window of token "
                          f"{hit + external}: 0.33.0 adopts the null block there")
            if block:
                _take(m, req, block, True)
            req.groups[g].append(block)
        new = table[n_hit:]
        for i, block in enumerate(new[:max(skipped - n_hit, 0)], n_hit):  # loaded slots before the window
            if block != 0:
                m.violate("SLIDING-WINDOW-FREE", rid,
                          f"group {g}: loaded slot {i} holds block {block}, wholly before the window of token "
                          f"{hit + external}: 0.33.0 leaves the null block there")
                _take(m, req, block, False)
            req.groups[g].append(block)
        news.append(new[max(skipped - n_hit, 0):])
    for g, new in enumerate(news):
        for block in new:
            if block or g not in m.replay_groups:
                _take(m, req, block, False)
            req.groups[g].append(block)


def check_load_cover(m: TraceModel, req: ReqShadow, loaded: int) -> None:
    """BLOCKS-COVER after an async KV load of ``loaded`` tokens (hit +
    external): each group's table has ``cdiv(loaded, block_size)`` slots,
    null slots before a window included (vLLM ``add_local_computed_blocks``,
    ``allocate_external_computed_blocks``, then ``allocate_new_blocks`` for
    the same slots: nothing more)."""
    for g, table in enumerate(_ensure(m, req)):
        need = cdiv(loaded, group_block_size(m, g))
        blocks.check_group_load_cover(m, req, g, len(table), need, loaded)


def admit_loaded(m: TraceModel, req: ReqShadow, ev: dict) -> None:
    """The admission of a request whose async load was promoted (no lookup):
    each group's table in the row starts with the table the load left
    (BLOCKS-COVER otherwise), and the slots after it are new blocks, taken
    group after group (vLLM ``allocate_new_blocks``)."""
    held = _ensure(m, req)
    for g, table in enumerate(_group_lists(m, ev, "admission", req)):
        blocks.check_group_loaded_table_kept(m, req, g, table, held[g])
        for block in table[len(held[g]):]:
            _take(m, req, block, False)
            held[g].append(block)


def free_loaded(m: TraceModel, req: ReqShadow, ev: dict, rid: str) -> None:
    """A promotion after a load of which nothing was valid: every group's
    table is freed, one pool call per group, each tail first (vLLM
    ``KVCacheManager.free``), as ``group_block_ids`` must say."""
    parts = free_parts(m, req, deferred=False)
    check_free_groups(m, req, ev, "kv_promote")
    blocks.check_free_order(m, req, list(ev["block_ids"] or []), [b for part in parts for b in part])
    for part in parts:
        m.return_blocks(part, rid, "failed KV load")
    clear(req)


def group_caps_of(config: dict[str, Any]) -> list[int | None]:
    """Each group's admission cap in blocks (vLLM
    ``max_admission_blocks_per_request``: a sliding window's; None: no cap),
    group order; ``[]`` for a one-group model."""
    groups = _groups_of(config) or ()
    in_flight = config.get("max_concurrent_batches", 1) * config["max_num_batched_tokens"]
    return [g.kv_cache_spec.max_admission_blocks_per_request(in_flight, config["max_model_len"])
            if hasattr(g.kv_cache_spec, "sliding_window") else None for g in groups]


def remaining_blocks(m: TraceModel, req: ReqShadow, num_tokens: int) -> int:
    """Blocks a running request still needs for ``num_tokens`` tokens in all
    groups, a window's capped at its admission cap (vLLM
    ``_request_remaining_blocks`` over the coordinator's
    ``get_num_blocks_to_allocate`` with the cap)."""
    total = 0
    for g, table in enumerate(_ensure(m, req)):
        need = cdiv(num_tokens, group_block_size(m, g))
        if m.group_caps[g] is not None:
            need = min(need, m.group_caps[g])
        total += max(need - len(table), 0)
    return total


def check_prefix_hit(m: TraceModel, req: ReqShadow, hit: int, tables: list[list[int]]) -> None:
    """The prefix-hit rules per group (``blocks.check_group_prefix_hit``).
    With bounded replay a lookup's hit of at most ``prefix_replay_tokens``
    may be dropped (vLLM 0.33.0 ``Scheduler.schedule``: it would be
    recomputed whole): a hit of 0 then stands for it."""
    def longest(m: TraceModel, req: ReqShadow) -> int:
        found = longest_hit(m, req)
        return 0 if hit == 0 and found <= m.prefix_replay_tokens else found

    blocks.check_group_prefix_hit(m, req, hit, tables, content_key, longest)


def _cached(m: TraceModel, req: ReqShadow, i: int, groups: list[int]) -> bool:
    return all(m.cached.get(content_key(req.chain[i], g)) for g in groups)


def longest_hit(m: TraceModel, req: ReqShadow) -> int:
    """The hit vLLM 0.33.0 finds (``HybridKVCacheCoordinator.find_longest_cache_hit``):
    the longest length every group accepts, full attention a leading run of
    cached blocks, a window its last ``cdiv(sliding_window - 1, block_size)``
    blocks cached (searched right to left), iterated to a fixed point;
    bounded-replay groups take no part."""
    max_blocks = (req.num_tokens - 1) // m.bs
    m.extend_chain(req, max_blocks)
    spec_groups: dict[int | None, list[int]] = {}
    for g, window in enumerate(m.group_windows):
        if g not in m.replay_groups:  # (not prefix-cacheable: no part in the lookup)
            spec_groups.setdefault(window, []).append(g)
    order = sorted(spec_groups.items(), key=lambda kv: kv[0] is not None)  # full attention first
    length = max_blocks
    while True:
        cur = length
        for window, groups in order:
            if window is None:
                n = 0
                while n < cur and _cached(m, req, n, groups):
                    n += 1
                cur = n
                continue
            need = cdiv(window - 1, m.bs)
            run, found = 0, False
            for i in range(cur - 1, -1, -1):
                if not _cached(m, req, i, groups):
                    run = 0
                    continue
                run += 1
                if run >= need:
                    cur, found = i + run, True
                    break
            if not found:
                cur = run
        if cur >= length:
            return length * m.bs
        length = cur


def check_cover(m: TraceModel, req: ReqShadow, before: tuple[int, ...], end: int, processed: int) -> None:
    """After a schedule row: BLOCKS-COVER per group (ceil(end / block_size)
    slots; a full-attention table holds no null block) and
    SLIDING-WINDOW-HELD (no null slot the window of ``processed`` reads)."""
    rid = req.request_id
    # (Bounded replay: the hit's blocks are held while its last window is recomputed.)
    cover_end = max(end, req.replay_end)
    for g, table in enumerate(_ensure(m, req)):
        if g in m.mamba_groups:
            check_mamba_state(m, req, g, table, end)
            continue
        blocks.check_group_cover(m, req, g, table, before[g], cover_end)
        window = m.group_windows[g]
        if window is None:
            continue
        skipped = skipped_blocks(m, window, processed)
        if g in m.replay_groups:  # the window before the replay's start is not held (worker: replay_start)
            skipped = max(skipped, req.replay_nulls)
        nulls = [i for i, b in enumerate(table) if b == 0 and i >= skipped]
        if nulls:
            replay = (f" (bounded replay: the tokens recomputed before {req.replay_end} write and read window KV "
                      f"from the replay's start on, in slot {req.replay_nulls})"
                      if g in m.replay_groups and processed < req.replay_end and nulls[0] == req.replay_nulls
                      else "")
            m.violate("SLIDING-WINDOW-HELD", rid,
                      f"group {g}: slot {nulls[0]} is the null block, but the window of token {processed} reads "
                      f"it{replay}")


def check_mamba_state(m: TraceModel, req: ReqShadow, g: int, table: list[int], end: int) -> None:
    """After a schedule row, Mamba group ``g``'s table: MAMBA-STATE-HELD (a
    real block at the state's slot ``cdiv(end, block_size) - 1``) and
    MAMBA-STATE-BLOCKS (exactly ``m.mamba_groups[g]`` slots, all real)."""
    rid = req.request_id
    slot = max(cdiv(end, group_block_size(m, g)) - 1, 0)
    if slot >= len(table) or table[slot] == 0:
        m.violate("MAMBA-STATE-HELD", rid,
                  f"group {g} (Mamba): the state slot {slot} of token {end} holds "
                  + ("no block" if slot >= len(table) else "the null block") + f" (table {table})")
        return
    want = m.mamba_groups[g]
    if len(table) != want or 0 in table:
        m.violate("MAMBA-STATE-BLOCKS", rid,
                  f"group {g} (Mamba): table {table} after {end} tokens; 0.33.0 (mamba_cache_mode none) "
                  f"holds exactly {want} state block(s)")


def check_window_freed(m: TraceModel, req: ReqShadow, processed: int) -> None:
    """SLIDING-WINDOW-FREE at a running request's schedule row: no block
    wholly before the window of its processed tokens is still held."""
    for g, table in enumerate(_ensure(m, req)):
        skipped = skipped_blocks(m, m.group_windows[g], processed)
        kept = [b for b in table[:skipped] if b]
        if kept:
            m.violate("SLIDING-WINDOW-FREE", req.request_id,
                      f"group {g}: allocated with blocks {kept} still held, wholly before the window of "
                      f"token {processed} (0.33.0 frees them at the allocation)")


def on_skipped_free(m: TraceModel, req: ReqShadow, ev: dict) -> None:
    """A ``skipped_free`` row: each group's freed blocks, last first, are
    the table's blocks wholly before the window of the processed tokens
    (SLIDING-WINDOW-HELD: none the window reads, all of its own table;
    SLIDING-WINDOW-FREE: every one, last first; a Mamba group frees none:
    MAMBA-STATE-HELD); they leave the table (null slots) and return to the
    free queue, one pool call per group (caching off: each group's to the head)."""
    rid = req.request_id
    processed = req.num_computed_tokens - req.in_flight
    tables = _ensure(m, req)
    freed_all: list[int] = []
    parts: list[list[int]] = []
    for g, freed in enumerate(_group_lists(m, ev, "skipped_free", req)):
        part: list[int] = []
        parts.append(part)
        window = m.group_windows[g]
        skipped = skipped_blocks(m, window, processed)
        table = tables[g]
        expected = [b for b in table[:skipped] if b][::-1]
        if freed and g in m.mamba_groups:
            m.violate("MAMBA-STATE-HELD", rid,
                      f"group {g} (Mamba): freed {freed} as skipped, but the request's state lives there")
            for block in freed:
                if block in table:
                    table[table.index(block)] = 0
                if block in req.blocks:
                    req.blocks.remove(block)
                freed_all.append(block)
                part.append(block)
            continue
        for block in freed:
            index = table.index(block) if block and block in table else None
            if index is None or index >= skipped:
                m.violate("SLIDING-WINDOW-HELD", rid,
                          f"group {g}: freed block {block} as out of the window of token {processed}, but "
                          + ("it is not in the group's table" if index is None
                             else f"the window reads slot {index}"))
                if index is None:
                    continue  # followed as freed nonetheless: the trace says it left the table
            table[index] = 0
            if block in req.blocks:
                req.blocks.remove(block)
            part.append(block)
            freed_all.append(block)
        if freed != expected and all(b in expected for b in freed):
            m.violate("SLIDING-WINDOW-FREE", rid,
                      f"group {g}: freed {freed}; the blocks wholly before the window of token {processed}, "
                      f"last first, are {expected}")
    # One BlockPool.free_blocks call per group (vLLM's coordinator has each
    # manager free its own): with caching off each group's blocks go to the
    # free queue's head in turn, the last group's first. Regression: one
    # call for all groups predicted the first group's blocks at the head
    # (ALLOC-FROM-HEAD on the reference, two sliding-window groups).
    for part in parts:
        m.return_blocks(part, rid, "skipped_free")
    m.note(req, f"skipped_free {freed_all}")


def free_parts(m: TraceModel, req: ReqShadow, deferred: bool) -> list[list[int]]:
    """The table's blocks as a free returns them to the pool, one list per
    ``BlockPool.free_blocks`` call (vLLM ``KVCacheCoordinator.free``: one
    call per group, each tail first, null slots left out; a deferred free:
    one call, every group's blocks in allocation order, reversed, as the
    drain frees them)."""
    tables = _ensure(m, req)
    if deferred:
        return [[b for table in tables for b in table if b][::-1]]
    return [[b for b in table[::-1] if b] for table in tables]


def check_free_groups(m: TraceModel, req: ReqShadow, ev: dict, kind: str) -> None:
    """A free's ``group_block_ids`` against each group's table, tail first
    (``blocks.check_group_free_order``)."""
    if ev.get("group_block_ids") is None:
        if ev.get("block_ids"):
            # Regression: a preempt row whose groups were nulled passed as conformant.
            blocks.check_group_lists(m, req, None, kind)
        return
    expected = [[b for b in table[::-1] if b] for table in _ensure(m, req)]
    blocks.check_group_free_order(m, req, kind, [list(g or ()) for g in ev["group_block_ids"]], expected)


def clear(req: ReqShadow) -> None:
    """The request holds no table any more."""
    if req.groups is not None:
        req.groups = [[] for _ in req.groups]
        req.group_registered = [0] * len(req.groups)


def register_full_blocks(m: TraceModel, req: ReqShadow, upto_tokens: int) -> None:
    """Record each group's full blocks within ``upto_tokens`` (null slots
    passed over), keyed per group (vLLM ``cache_blocks`` per manager)."""
    if not m.caching:
        return
    tables = _ensure(m, req)
    for g, table in enumerate(tables):
        n_full = min(upto_tokens, req.num_tokens, len(table) * m.bs) // m.bs
        m.extend_chain(req, n_full)
        window = m.group_windows[g]
        # A window of 1 token: no block can end a hit, so vLLM 0.33.0 caches none of
        # its blocks (SlidingWindowManager.reachable_block_mask); they are freed unhashed.
        # A bounded-replay group caches nothing (vLLM: not prefix_cacheable).
        skip = (window is not None and cdiv(window - 1, m.bs) == 0) or g in m.replay_groups
        for i in range(n_full if skip else req.group_registered[g], n_full):
            block = table[i]
            if block and block not in m.content:
                key = content_key(req.chain[i], g)
                m.content[block] = key
                m.cached.setdefault(key, set()).add(block)
        req.group_registered[g] = max(req.group_registered[g], n_full)
    req.registered = min(req.group_registered)


def unregister_withdrawn(m: TraceModel, req: ReqShadow, registered_before: Any) -> None:
    """A withdrawn chunk's eagerly cached blocks hold no computed KV
    (``TraceModel.unregister_withdrawn``, per group)."""
    before = list(registered_before) if isinstance(registered_before, (list, tuple)) \
        else [registered_before] * len(m.group_windows)
    for g, table in enumerate(_ensure(m, req)):
        for i in range(before[g], req.group_registered[g]):
            block = table[i]
            key = content_key(req.chain[i], g)
            if block and m.content.get(block) == key:
                del m.content[block]
                m.cached[key].discard(block)
                if not m.cached[key]:
                    del m.cached[key]
                m.uncomputed[block] = req.request_id
        req.group_registered[g] = min(req.group_registered[g], before[g])
    req.registered = min(req.group_registered)


def blocks_needed(m: TraceModel, held: Any, end: int) -> int:
    """Blocks a request holding ``held`` (a table length, or each group's)
    still needs for ``end`` tokens (the progress layer's bound)."""
    n = cdiv(end, m.bs)
    if isinstance(held, tuple):
        return sum(max(n - h, 0) for h in held)
    return n - held
