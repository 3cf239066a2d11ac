"""Normalise a real vLLM v1 ``Scheduler``'s decisions into the harness's event shapes.

STANDALONE: standard library only, no import side effects (no environment
variables set, no vLLM import at module level), so it can be imported inside a
vLLM server process (``harness/candidates/vllm/recording_scheduler.py``) as well as by the
subprocess driver (``harness/candidates/vllm/driver.py``), which uses these for its
hooks, normalisation, finished-request info, snapshots and prefill-gate
recomputation.

Shapes (those of ``reference/output.py``, as the driver's protocol speaks them):
``normalise`` returns ``{events, num_scheduled_tokens, total_num_scheduled_tokens,
preempted_req_ids, finished_req_ids, token_budget, request_data_ids}`` where ``events`` is the
chronological list of ``{"type": "schedule", request_id, kind,
num_computed_tokens, num_scheduled_tokens, num_prefix_hit_tokens,
new_block_ids, spec_token_ids}``, ``{"type": "withdraw", request_id,
num_scheduled_tokens, block_ids}``, ``{"type": "preempt", request_id,
num_computed_tokens, freed_block_ids, fence}``, ``{"type": "skip",
request_id, reason}``, and with the KV connector ``{"type": "kv_load",
request_id, num_prefix_hit_tokens, num_external_tokens, block_ids,
reserved_blocks}`` (an async-load admission: ``allocate_slots`` called with
``delay_cache_blocks=True``) and ``{"type": "kv_promote", request_id, status,
num_computed_tokens, load_failed, freed_block_ids}`` (a finished load promoted
by ``_handle_blocked_waiting_request``), and with encoder inputs ``{"type":
"encoder_plan", request_id, num_computed_tokens, num_scheduled_tokens,
encoder_input_ids}`` (a ``_try_schedule_encoder_inputs`` call whose window
overlaps an item: the window after its cut, the inputs to encode), a
``schedule`` event's ``encoder_input_ids`` (vLLM ``scheduled_encoder_inputs``)
and a ``withdraw`` event's (the inputs its plan had chosen), and the output's
``free_encoder_mm_hashes``; these keys are left out when empty. ``snapshot`` adds ``request_states``
(``request_states``: what vLLM's ``Request`` objects hold). Inconsistent
outputs are recorded as they are (``normalise``); only malformed input
raises NormalisationError, naming the field.

Deferred block frees (vLLM's ``defer_block_free``, spec 5.10): a free that
``Scheduler._free_request_blocks`` defers goes through
``kv_cache_manager.pop_blocks_for_free`` instead of ``free``; the hooks record
its blocks (tail first) and its fence (``sched_step_seq`` at the time), and
``_drain_deferred_frees`` is wrapped to report what each update released.

One file over ~500 lines on purpose: it is loaded by path, alone, beside the
driver and inside vLLM's engine-core process; a second file would be a
second by-path load in both.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from array import array


#: The skip reason of a request whose connector answered None (a verbatim copy
#: of ``reference.kv_connector.KV_MATCH_PENDING``: this module imports nothing of ours).
KV_MATCH_PENDING = "KV connector cannot tell yet"
#: The skip reason of a waiting request whose encoder inputs cut its window to 0
#: tokens (a verbatim copy of ``reference/scheduler.py``'s ``Skip`` reason).
ENCODER_INPUT_UNAVAILABLE = "encoder input unavailable"
#: The skip reason of a waiting request whose LoRA adapter would exceed max_loras
#: (a verbatim copy of ``reference.scheduler.MAX_LORAS_REACHED``).
MAX_LORAS_REACHED = "max_loras adapters scheduled"
#: The skip reason of a waiting request whose window the drafter's prefill look-ahead cut
#: to 0 tokens (a verbatim copy of ``reference.scheduler.PREFILL_LOOKAHEAD_RESERVED``).
PREFILL_LOOKAHEAD_RESERVED = "prefill look-ahead reserved"
#: The skip reason of a parked streaming-input session (a verbatim copy of
#: ``reference.scheduler.STREAMING_INPUT_PENDING``).
STREAMING_INPUT_PENDING = "waiting for streaming input"


class NormalisationError(Exception):
    """Malformed input: a SchedulerOutput field that cannot be read (the
    message names it), or a decision the hooks could not observe. An
    inconsistent but readable output is recorded, never refused."""


def blocks_of(kv_blocks) -> list[int]:
    """Block ids of the single KV-cache group of a KVCacheBlocks (or None)."""
    if kv_blocks is None:
        return []
    ids = kv_blocks.get_block_ids()
    return list(ids[0]) if ids else []


def table_of(kv_cache_manager, request_id: str) -> list[int]:
    """The request's whole block table (single group). Feature probe:
    ``KVCacheManager.get_blocks`` from 0.10.1 on, ``get_block_ids`` (a tuple
    of per-group id lists) in 0.10.0. KeyError for an unknown request."""
    get_blocks = getattr(kv_cache_manager, "get_blocks", None)
    if get_blocks is not None:
        return blocks_of(get_blocks(request_id))
    ids = kv_cache_manager.get_block_ids(request_id)
    return list(ids[0]) if ids else []


def group_tables(kv_cache_manager, request_id: str) -> list[list[int]]:
    """The request's table of every KV-cache group (null blocks as 0): vLLM
    ``KVCacheManager.get_blocks(id).get_block_ids()``; ``[]`` per group for
    an unknown request."""
    get_blocks = getattr(kv_cache_manager, "get_blocks", None)
    ids = get_blocks(request_id).get_block_ids() if get_blocks is not None \
        else kv_cache_manager.get_block_ids(request_id)
    return [list(g) for g in ids]


def group_ids_of(kv_blocks, num_groups: int) -> list[list[int]]:
    """Every group's block ids of a KVCacheBlocks (None: an empty list per group)."""
    if kv_blocks is None:
        return [[] for _ in range(num_groups)]
    return [list(g) for g in kv_blocks.get_block_ids()]


def is_hybrid(kv_cache_config) -> bool:
    """Whether a KVCacheConfig is a hybrid model's, as the harness records it
    (trace schema 9): more than one KV-cache group, or a group whose spec is
    not full attention (a sliding window)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    return len(groups) > 1 or any(type(g.kv_cache_spec).__name__ != "FullAttentionSpec" for g in groups)


#: What a ``MambaSpec`` group's description adds (vLLM 0.33.0
#: ``kv_cache_interface.MambaSpec`` fields the converter needs to tell mode
#: "none", which the reference models, from "align" and its checkpoints).
MAMBA_SPEC_FIELDS = ("mamba_cache_mode", "num_speculative_blocks", "num_prefill_checkpoint_blocks")
#: What a ``SlidingWindowMLASpec`` group's description adds (vLLM 0.33.0
#: ``kv_cache_interface.SlidingWindowMLASpec``: DeepSeek-V4.1's bounded
#: replay, and the window's trailing extension, which the converter needs at 0).
SWA_MLA_SPEC_FIELDS = ("bounded_replay", "prefix_cacheable", "prefix_replay_tokens", "extra_retained_tokens")


def describe_groups(kv_cache_config) -> list[list]:
    """Each KV-cache group as ``[spec class name, sliding_window or None,
    block_size, number of layers]``, in group order (a recording's meta
    ``kv_cache_groups``: the converter maps them onto the harness's
    ``sliding_window`` and ``layer_types``). A ``MambaSpec`` group has a
    fifth entry, ``{field: value}`` of ``MAMBA_SPEC_FIELDS`` the spec has
    (block_size is then vLLM's ``mamba_block_size``: ``max_model_len`` in
    mode "none"); a ``SlidingWindowMLASpec`` group those of
    ``SWA_MLA_SPEC_FIELDS`` (bools as bools, counts as ints)."""
    out = []
    for g in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        entry = [type(spec).__name__, None if window is None else int(window),
                 int(getattr(spec, "block_size", 0) or 0), len(getattr(g, "layer_names", ()) or ())]
        if entry[0] == "MambaSpec":
            entry.append({name: (getattr(spec, name) if name == "mamba_cache_mode" else int(getattr(spec, name)))
                          for name in MAMBA_SPEC_FIELDS if hasattr(spec, name)})
        elif entry[0] == "SlidingWindowMLASpec":
            entry.append({name: (bool(value) if isinstance(value, bool) else int(value))
                          for name in SWA_MLA_SPEC_FIELDS
                          if (value := getattr(spec, name, None)) is not None})
        out.append(entry)
    return out


def freed_per_group(tables: list[list[int]]) -> list[list[int]]:
    """What freeing these tables gives back, per group: each table tail
    first, null blocks left out (vLLM ``SingleTypeKVCacheManager.free``; the
    pool passes over the null block)."""
    return [[b for b in reversed(table) if b] for table in tables]


def kwargs_for(callable_obj, wanted: dict) -> dict:
    """The subset of ``wanted`` that ``callable_obj`` accepts."""
    params = inspect.signature(callable_obj).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(wanted)
    return {k: v for k, v in wanted.items() if k in params}


def _unit(data: bytes) -> float:
    """A uniform number in [0, 1) from bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2**64


def held_prefix_tokens(prompt_token_ids, block_size: int, fraction: float) -> int:
    """Tokens of the longest prefix of full prompt blocks the simulated KV
    store holds: a verbatim copy of ``reference.kv_connector.held_prefix_tokens``
    (this module cannot import the reference package; a test keeps the two
    equal). Block i is held iff a chained hash of the first (i + 1) blocks
    falls below ``fraction``."""
    held = 0
    parent = b"kv-store"
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", prompt_token_ids[start:start + block_size]).tobytes())
        parent = digest.digest()
        if _unit(parent) >= fraction:
            break
        held += block_size
    return held


def kv_hooks_installable(sched) -> bool:
    """Whether ``allocate_slots`` tells an async-load admission apart
    (``delay_cache_blocks``) and carries its reservation."""
    params = inspect.signature(sched.kv_cache_manager.allocate_slots).parameters
    return {"delay_cache_blocks", "reserved_blocks", "num_external_computed_tokens"} <= set(params)


def field_names(cls) -> set[str]:
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return set(inspect.signature(cls).parameters)


class DecisionHooks:
    """Wraps, on one scheduler instance, ``kv_cache_manager.allocate_slots``
    (each successful call inside ``schedule()`` is a scheduling decision),
    ``kv_cache_manager.free`` (the blocks a request releases, tail first) and
    ``_preempt_request`` (a preemption, with the blocks it freed; a release
    without it preempts inline, seen as the free of a RUNNING request inside
    ``schedule()``).

    ``seq`` collects the current schedule's decisions (``begin()`` resets it);
    ``freed`` maps request id -> blocks released by its last free (pop them);
    ``fences`` maps request id -> the fence of its last free when that free
    was deferred (``pop_blocks_for_free``; pop it with ``freed``);
    ``drained`` collects ``(fence, block ids tail first)`` of the deferred
    frees ``_drain_deferred_frees`` released (the caller resets it);
    ``free_order``, when set to a list, collects request ids in the order
    ``free`` sees them (None: not tracked). ``active = False`` makes every
    wrapper a plain pass-through.

    Skips: the waiting loop's local ``skip_request`` adds the request to
    ``sched.deferred_waiting``, the only such add inside ``schedule()``; that
    set is replaced by one that reports the add as a ``("skip", id, reason)``
    decision. A scheduler without that set but with a ``skipped_waiting``
    queue (0.29.0, 0.20.2) is probed through the loop's queue selection
    instead (``_hook_skipped_waiting``).

    KV connector: an ``allocate_slots`` call with ``delay_cache_blocks=True``
    is an async-load admission, recorded as ``("remote_load", ...)`` with its
    local hit, external tokens, whole block table and the ``reserved_blocks``
    vLLM passed (its ``skip_request`` is not a skip);
    ``_handle_blocked_waiting_request`` (``_try_promote_blocked_waiting_request``
    before 0.31.0) of a load reported done is a
    promotion, ``("promote", id, status, num_computed_tokens, load_failed,
    freed blocks)``; ``_update_from_kv_xfer_finished`` fills ``recving`` and
    ``kv_freed``.

    Hybrid models (``hybrid``: several KV-cache groups, or a sliding window;
    ``is_hybrid``): an ``alloc`` item carries a tenth element, each group's
    new block ids (a running request) or each group's whole table and hit
    length in blocks (an admission); ``freed_groups`` maps request id ->
    each group's blocks of its last free (tail first, null blocks left out);
    a ``preempt`` item carries them as its sixth element; and the blocks a
    sliding-window group frees as they leave the window
    (``coordinator.remove_skipped_blocks``, called by ``allocate_slots``
    before it allocates, whether or not the allocation then fits) are a
    ``("skipped_free", id, each group's freed ids, last block first)`` item
    right before that call's ``alloc`` (or the preemptions its failure causes).
    """

    def __init__(self, sched) -> None:
        self.sched = sched
        self.seq: list[tuple] = []
        self.freed: dict[str, list[int]] = {}
        self.fences: dict[str, int] = {}
        self.drained: list[tuple[int, list[int]]] = []
        self.free_order: list[str] | None = None
        # KV connector, per update (the caller resets them): transfers
        # reported done, in processing order, and the frees of requests that
        # had finished while loading: (request id, blocks tail first, fence).
        self.recving: list[str] = []
        self.kv_freed: list[tuple[str, list[int], int | None]] = []
        # The connector's answers in the current schedule() (``begin()`` resets
        # them): [request id, num_computed_tokens it was given, num_external_tokens
        # (None: cannot tell yet), load_kv_async] per get_num_new_matched_tokens call.
        self.matches: list[list] = []
        self.in_schedule = False
        self.active = True
        # The request whose window vLLM's _reserve_prefill_lookahead last cut to 0
        # tokens in this schedule() (a skip's reason; ``begin()`` resets it).
        self.lookahead_cut: str | None = None
        kv_cache_config = getattr(sched, "kv_cache_config", None) or getattr(
            sched.kv_cache_manager, "kv_cache_config", None)
        self.hybrid = is_hybrid(kv_cache_config)
        self.num_groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ()) or 1
        self.freed_groups: dict[str, list[list[int]]] = {}
        # Each group's blocks the windows freed inside the allocate_slots call
        # under way (hybrid models): taken by the allocate_slots hook.
        self.skipped: list[list[int]] | None = None
        # Called as outside(method, request id) when a preemption happens outside
        # schedule() (a unit test calling _preempt_request by hand; a reset that
        # preempts the running requests): the recording scheduler sets it.
        self.outside = None
        kvm = sched.kv_cache_manager
        orig_alloc = kvm.allocate_slots
        # allocate_slots(request, num_new_tokens, ...): where each argument the
        # hook reads sits positionally (after ``request``), so that a call is
        # read without inspect's bind (the hook runs inside vLLM's schedule()).
        alloc_pos = {name: i - 1 for i, name in
                     enumerate(inspect.signature(orig_alloc).parameters) if i}
        orig_free = kvm.free
        # Feature probe: releases before _preempt_request (before 0.12.0) preempt
        # inline in schedule(): running.pop(), kv_cache_manager.free(victim),
        # then status PREEMPTED and num_computed_tokens = 0. There, a free
        # inside schedule() of a RUNNING request is that preemption (nothing
        # else frees during schedule() in those releases).
        orig_preempt = getattr(sched, "_preempt_request", None)
        self.inline_preempt = orig_preempt is None
        hooks = self

        def arg(args, kwargs, name):
            """An argument of an allocate_slots call as passed (0 when left out)."""
            if name in kwargs:
                return kwargs[name]
            i = alloc_pos.get(name)
            return args[i] if i is not None and i < len(args) else 0

        status_names: dict = {}  # RequestStatus member -> name (Enum.name is a Python-level property)
        i_delay = alloc_pos.get("delay_cache_blocks")
        # (Where num_new_tokens and num_new_computed_tokens sit positionally: read
        # inline below, as ``arg`` reads them, for the calls every step makes.)
        i_new = alloc_pos.get("num_new_tokens")
        i_hit = alloc_pos.get("num_new_computed_tokens")

        @functools.wraps(orig_alloc)  # keeps the signature for whoever wraps us
        def allocate_slots(request, *args, **kwargs):
            computed_before = request.num_computed_tokens
            status = request.status
            status_before = status_names.get(status)
            if status_before is None:
                status_before = status_names[status] = status.name
            hooks.skipped = None
            result = orig_alloc(request, *args, **kwargs)
            skipped, hooks.skipped = hooks.skipped, None
            if not (hooks.in_schedule and hooks.active):
                return result
            if skipped is not None:
                hooks.seq.append(("skipped_free", request.request_id, skipped))
            if result is not None:
                n_args = len(args)
                n_new = (kwargs["num_new_tokens"] if "num_new_tokens" in kwargs
                         else args[i_new] if i_new is not None and i_new < n_args else 0)
                n_hit = (kwargs["num_new_computed_tokens"] if "num_new_computed_tokens" in kwargs
                         else args[i_hit] if i_hit is not None and i_hit < n_args else 0)
                if kwargs.get("delay_cache_blocks") or (
                        i_delay is not None and i_delay < n_args and args[i_delay]):
                    # An async KV load (load_kv_async): blocks for the local
                    # hit and the external tokens, nothing scheduled. The
                    # reservation is the one vLLM passed.
                    groups = None
                    if hooks.hybrid:  # each group's whole table and hit length, as an admission's
                        hits = getattr(arg(args, kwargs, "new_computed_blocks") or None, "blocks", None)
                        groups = {"table": group_tables(kvm, request.request_id),
                                  "hits": [len(g) for g in hits] if hits else [0] * hooks.num_groups}
                    hooks.seq.append(("remote_load", request.request_id, status_before,
                                      n_hit, arg(args, kwargs, "num_external_computed_tokens"),
                                      table_of(kvm, request.request_id),
                                      arg(args, kwargs, "reserved_blocks"), n_new, groups))
                    return result
                if status_before == "RUNNING":
                    # Drafts a running request gets verified (vLLM picks them right
                    # after this call; a withdrawal later drops them from its output).
                    spec = []
                    if request.spec_token_ids:
                        n_spec = (n_new + computed_before - request.num_tokens
                                  - getattr(request, "num_output_placeholders", 0))
                        if n_spec > 0:
                            spec = list(request.spec_token_ids[:n_spec])
                    # (normalise reads the whole table of admissions only.)
                    groups = ({"new": group_ids_of(result, hooks.num_groups)} if hooks.hybrid else None)
                    # (blocks_of, read inline: KVCacheBlocks.get_block_ids()[0].)
                    ids = result.get_block_ids()
                    hooks.seq.append(("alloc", request.request_id, status_before, computed_before,
                                      n_new, n_hit, list(ids[0]) if ids else [], spec, None, groups))
                else:
                    groups = None
                    if hooks.hybrid:
                        hits = getattr(arg(args, kwargs, "new_computed_blocks") or None, "blocks", None)
                        groups = {"table": group_tables(kvm, request.request_id),
                                  "hits": [len(g) for g in hits] if hits else [0] * hooks.num_groups}
                    hooks.seq.append(("alloc", request.request_id, status_before, computed_before,
                                      n_new, n_hit, blocks_of(result), [], table_of(kvm, request.request_id),
                                      groups))
            return result

        @functools.wraps(orig_free)  # keeps the signature for whoever wraps us
        def free(request, *args, **kwargs):
            if not hooks.active:
                return orig_free(request, *args, **kwargs)
            try:
                table = table_of(kvm, request.request_id)
            except KeyError:
                table = []
            groups = None
            if hooks.hybrid:
                groups = freed_per_group(group_tables(kvm, request.request_id))
                table = [b for ids in groups for b in ids][::-1]  # reversed below: every group in order
            computed_before = request.num_computed_tokens
            inline_victim = (hooks.inline_preempt and hooks.in_schedule
                             and request.status.name == "RUNNING")
            orig_free(request, *args, **kwargs)
            hooks.freed[request.request_id] = table[::-1]
            hooks.fences.pop(request.request_id, None)
            if groups is not None:
                hooks.freed_groups[request.request_id] = groups
            if hooks.free_order is not None:
                hooks.free_order.append(request.request_id)
            if inline_victim:
                hooks.freed.pop(request.request_id, None)
                hooks.seq.append(("preempt", request.request_id, computed_before, table[::-1], None,
                                  hooks.freed_groups.pop(request.request_id, None)))

        orig_pop = getattr(kvm, "pop_blocks_for_free", None)

        def pop_blocks_for_free(request, *args, **kwargs):
            # The deferred branch of _free_request_blocks: the blocks leave the
            # request now and reach the pool once the fence has passed.
            groups = (freed_per_group(group_tables(kvm, request.request_id))
                      if hooks.active and hooks.hybrid else None)
            blocks = orig_pop(request, *args, **kwargs)
            if hooks.active:
                hooks.freed[request.request_id] = [b.block_id for b in reversed(blocks)]
                if groups is not None:
                    hooks.freed_groups[request.request_id] = groups
                hooks.fences[request.request_id] = sched.sched_step_seq
                if hooks.free_order is not None:
                    hooks.free_order.append(request.request_id)
            return blocks

        orig_drain = getattr(sched, "_drain_deferred_frees", None)

        def _drain_deferred_frees(*args, **kwargs):
            pending = list(sched.deferred_frees)
            result = orig_drain(*args, **kwargs)
            if hooks.active:
                # Draining pops from the front only (and appends nothing).
                for fence, blocks in pending[:len(pending) - len(sched.deferred_frees)]:
                    hooks.drained.append((fence, [b.block_id for b in reversed(blocks)]))
            return result

        @functools.wraps(orig_preempt)  # keeps the signature for whoever wraps us
        def _preempt_request(request, *args, **kwargs):
            if not hooks.active:
                return orig_preempt(request, *args, **kwargs)
            if not hooks.in_schedule and hooks.outside is not None:
                hooks.outside("_preempt_request", request.request_id)
            computed_before = request.num_computed_tokens
            hooks.freed.pop(request.request_id, None)
            hooks.fences.pop(request.request_id, None)
            hooks.freed_groups.pop(request.request_id, None)
            orig_preempt(request, *args, **kwargs)
            freed = hooks.freed.pop(request.request_id, None)
            fence = hooks.fences.pop(request.request_id, None)
            groups = hooks.freed_groups.pop(request.request_id, None)
            if freed is None:
                # Our hooks missed the free (a vLLM whose free path they do not
                # wrap): the observation is broken, not the engine.
                raise NormalisationError(f"preemption of {request.request_id} freed no blocks "
                                         f"through kv_cache_manager.free or pop_blocks_for_free")
            hooks.seq.append(("preempt", request.request_id, computed_before, freed, fence, groups))

        connector = getattr(sched, "connector", None)
        orig_match = getattr(connector, "get_num_new_matched_tokens", None)
        #: Whether the connector's answers are observed (``matches``).
        self.kv_answers = orig_match is not None

        def get_num_new_matched_tokens(request, num_computed_tokens, *args, **kwargs):
            # KVConnectorBase_V1.get_num_new_matched_tokens: an input from outside
            # the scheduler, recorded as answered.
            result = orig_match(request, num_computed_tokens, *args, **kwargs)
            if hooks.in_schedule and hooks.active:
                external, load_kv_async = result
                hooks.matches.append([request.request_id, int(num_computed_tokens),
                                      None if external is None else int(external), bool(load_kv_async)])
            return result

        if orig_match is not None:
            connector.get_num_new_matched_tokens = get_num_new_matched_tokens

        # vLLM 0.33.0 (DeepSeek-V4.1's SWA bounded replay): whether a KV load
        # restored the bounded-replay groups, which the scheduler asks
        # through _load_restores_replay_window (the connector's
        # get_loaded_kv_cache_group_ids, which a test may swap after the
        # scheduler is built: the answer is taken where the scheduler reads it).
        # [request id, answer] per call, in call order (``window_loads``; the
        # recorder writes and empties it with each schedule record).
        self.window_loads: list[list] = []
        orig_window = getattr(sched, "_load_restores_replay_window", None)
        if orig_window is not None and getattr(sched, "prefix_replay_group_ids", ()):
            @functools.wraps(orig_window)
            def _load_restores_replay_window(request, *args, **kwargs):
                result = orig_window(request, *args, **kwargs)
                if hooks.active:
                    hooks.window_loads.append([request.request_id, bool(result)])
                return result

            sched._load_restores_replay_window = _load_restores_replay_window

        class _SkipRecordingSet(set):
            """``deferred_waiting``: an add inside schedule() is a waiting-loop skip."""

            def add(self, request) -> None:
                if hooks.in_schedule and hooks.active and not (
                        hooks.seq and hooks.seq[-1][0] == "remote_load"
                        and hooks.seq[-1][1] == request.request_id):
                    # (An async-load admission leaves through skip_request
                    # too: it is reported as its kv_load, not as a skip.)
                    last = hooks.matches[-1] if hooks.matches else None
                    reason = (KV_MATCH_PENDING if last is not None and last[0] == request.request_id
                              and last[2] is None else hooks.skip_reason(request))
                    hooks.seq.append(("skip", request.request_id, reason))
                super().add(request)

        # 0.31.0 on: _handle_blocked_waiting_request; 0.20.2 through 0.29.0 name it
        # _try_promote_blocked_waiting_request (same contract: request -> ready).
        # Regression: only the newer name was hooked, so 0.29.0's promotions went
        # unrecorded and its admissions after a load read as ADMISSION-ORDER
        # "admitted as new but its status was WAITING_FOR_REMOTE_KVS".
        blocked_name = next((n for n in ("_handle_blocked_waiting_request",
                                         "_try_promote_blocked_waiting_request") if hasattr(sched, n)), None)
        orig_blocked = getattr(sched, blocked_name, None) if blocked_name else None

        def _handle_blocked_waiting_request(request, *args, **kwargs):
            # A finished async load is promoted here (vLLM
            # _update_waiting_for_remote_kv, then WAITING or PREEMPTED).
            promoting = (request.status.name == "WAITING_FOR_REMOTE_KVS"
                         and request.request_id in sched.finished_recving_kv_req_ids)
            load_failed = request.request_id in sched.failed_recving_kv_req_ids
            if not (promoting and hooks.active):
                return orig_blocked(request, *args, **kwargs)
            hooks.freed.pop(request.request_id, None)
            hooks.freed_groups.pop(request.request_id, None)
            ready = orig_blocked(request, *args, **kwargs)
            freed = hooks.freed.pop(request.request_id, [])
            hooks.fences.pop(request.request_id, None)
            # (A hybrid model: each group's freed blocks, tail first; none freed: empty lists.)
            groups = (hooks.freed_groups.pop(request.request_id, None) or [[] for _ in range(hooks.num_groups)]
                      if hooks.hybrid else None)
            if hooks.in_schedule:
                hooks.seq.append(("promote", request.request_id, request.status.name,
                                  request.num_computed_tokens, load_failed, freed, groups))
            return ready

        orig_xfer = getattr(sched, "_update_from_kv_xfer_finished", None)

        def _update_from_kv_xfer_finished(kv_connector_output, *args, **kwargs):
            # Finished transfers: loads become promotable; a request that
            # finished while loading frees its blocks now (maybe deferred).
            if not hooks.active:
                return orig_xfer(kv_connector_output, *args, **kwargs)
            ids = list(kv_connector_output.finished_recving or ())
            pending = []
            for req_id in ids:
                request = sched.requests.get(req_id)
                if request is not None and request.is_finished():
                    hooks.freed.pop(req_id, None)
                    hooks.fences.pop(req_id, None)
                    hooks.freed_groups.pop(req_id, None)
                    pending.append(req_id)
            result = orig_xfer(kv_connector_output, *args, **kwargs)
            hooks.recving.extend(ids)
            for req_id in pending:
                item = (req_id, hooks.freed.pop(req_id, []), hooks.fences.pop(req_id, None))
                groups = hooks.freed_groups.pop(req_id, None)
                # (A hybrid model: each group's freed blocks, tail first, as a 4th item.)
                hooks.kv_freed.append(item + ((groups or [[] for _ in range(hooks.num_groups)],)
                                              if hooks.hybrid else ()))
            return result

        coordinator = getattr(kvm, "coordinator", None)
        orig_remove = getattr(coordinator, "remove_skipped_blocks", None)

        def remove_skipped_blocks(request_id, *args, **kwargs):
            # Each group's slots that held a block and hold the null block
            # after the call were freed, last first (vLLM _remove_blocks_in_range).
            before = [list(g) for g in coordinator.get_blocks(request_id)]
            result = orig_remove(request_id, *args, **kwargs)
            after = coordinator.get_blocks(request_id)
            freed = [[old[i].block_id for i in range(len(old) - 1, -1, -1)
                      if not old[i].is_null and i < len(new) and new[i].is_null]
                     for old, new in zip(before, after)]
            if any(freed):
                hooks.skipped = freed if hooks.skipped is None else [
                    a + b for a, b in zip(hooks.skipped, freed)]
            return result

        orig_encoder = getattr(sched, "_try_schedule_encoder_inputs", None)

        @functools.wraps(orig_encoder)  # keeps the signature for whoever wraps us
        def _try_schedule_encoder_inputs(request, num_computed_tokens, num_new_tokens, *args, **kwargs):
            # vLLM Scheduler._try_schedule_encoder_inputs: which encoder inputs the
            # window [num_computed_tokens, + num_new_tokens) encodes and where it
            # stops. An ("encoder_plan", id, num_computed_tokens, tokens after the
            # cut, input ids to encode) item when the window overlaps an input
            # (the reference's EncoderPlan; a window of 0 tokens decides nothing).
            result = orig_encoder(request, num_computed_tokens, num_new_tokens, *args, **kwargs)
            if hooks.in_schedule and hooks.active and num_new_tokens > 0:
                # The window the call looked at reaches a drafter's prefill look-ahead
                # further (vLLM 0.33.0's shift_computed_tokens, after the budget).
                shift = kwargs.get("shift_computed_tokens", args[1] if len(args) > 1 else 0)
                end = num_computed_tokens + num_new_tokens + int(shift or 0)
                # (A vLLM whose Request has no mm_features records no plan: its requests
                # with encoder inputs are marked unsupported at arrival.)
                if any(f.mm_position.offset < end
                       and num_computed_tokens < f.mm_position.offset + f.mm_position.length
                       for f in getattr(request, "mm_features", None) or ()):
                    hooks.seq.append(("encoder_plan", request.request_id, int(num_computed_tokens),
                                      int(result[1]), [int(i) for i in result[0]]))
            return result

        orig_reserve = getattr(sched, "_reserve_prefill_lookahead", None)

        @functools.wraps(orig_reserve)
        def _reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens, *args, **kwargs):
            # vLLM 0.33.0: a cut to 0 tokens makes the waiting loop skip the request.
            result = orig_reserve(request, num_computed_tokens, num_new_tokens, *args, **kwargs)
            if hooks.in_schedule and num_new_tokens > 0 and result == 0:
                hooks.lookahead_cut = request.request_id
            return result

        if orig_reserve is not None:
            sched._reserve_prefill_lookahead = _reserve_prefill_lookahead
        kvm.allocate_slots = allocate_slots
        kvm.free = free
        if orig_encoder is not None and hasattr(sched, "encoder_cache_manager"):
            sched._try_schedule_encoder_inputs = _try_schedule_encoder_inputs
        if self.hybrid and orig_remove is not None:
            coordinator.remove_skipped_blocks = remove_skipped_blocks
        if orig_blocked is not None:
            setattr(sched, blocked_name, _handle_blocked_waiting_request)
        if orig_xfer is not None:
            sched._update_from_kv_xfer_finished = _update_from_kv_xfer_finished
        if orig_pop is not None:
            kvm.pop_blocks_for_free = pop_blocks_for_free
        if orig_drain is not None:
            sched._drain_deferred_frees = _drain_deferred_frees
        if orig_preempt is not None:
            sched._preempt_request = _preempt_request
        if isinstance(getattr(sched, "deferred_waiting", None), set):
            sched.deferred_waiting = _SkipRecordingSet(sched.deferred_waiting)
        elif (getattr(sched, "skipped_waiting", None) is not None
              and hasattr(sched, "_select_waiting_queue_for_scheduling")):
            self._hook_skipped_waiting(sched)

    def _hook_skipped_waiting(self, sched) -> None:
        """Skips on a scheduler without ``deferred_waiting`` (vLLM 0.29.0,
        0.20.2 ``Scheduler.schedule``): the waiting loop pops a skipped
        request into a local per-step queue, re-queued onto
        ``skipped_waiting`` after the loop. Every iteration starts with
        ``_select_waiting_queue_for_scheduling`` and ends either in a break
        (its head stays queued: no next iteration) or after popping that head,
        so the head one iteration examined was skipped unless it was
        admitted (appended to ``running``, or an async load). The last
        iteration's head is settled by the ``skipped_waiting.prepend_requests``
        of the per-step queue (a skip: it is in that queue)."""
        hooks = self
        orig_select = sched._select_waiting_queue_for_scheduling
        queue = sched.skipped_waiting
        orig_prepend = queue.prepend_requests
        examined: list = []  # the head the current iteration examined

        def settle(skipped) -> None:
            request = examined.pop() if examined else None
            if request is None or not (hooks.in_schedule and hooks.active):
                return
            admitted = any(r is request for r in sched.running) or (
                hooks.seq and hooks.seq[-1][0] == "remote_load"
                and hooks.seq[-1][1] == request.request_id)
            if skipped(request) and not admitted:
                hooks.seq.append(("skip", request.request_id, hooks.skip_reason(request)))

        @functools.wraps(orig_select)
        def _select_waiting_queue_for_scheduling(*args, **kwargs):
            settle(lambda request: True)
            request_queue = orig_select(*args, **kwargs)
            if request_queue and hooks.in_schedule:
                examined.append(request_queue.peek_request())
            return request_queue

        @functools.wraps(orig_prepend)
        def prepend_requests(requests, *args, **kwargs):
            requests = list(requests)  # (a queue iterates in its own order)
            settle(lambda request: any(r is request for r in requests))
            return orig_prepend(requests, *args, **kwargs)

        sched._select_waiting_queue_for_scheduling = _select_waiting_queue_for_scheduling
        queue.prepend_requests = prepend_requests
        self._examined = examined

    def skip_reason(self, request) -> str:
        """Why the waiting loop skipped ``request`` now: the reference's
        ``"encoder input unavailable"`` when this step's last decision is an
        encoder plan of that request that cut its window to 0 tokens (vLLM
        ``_try_schedule_encoder_inputs``: the encoder budget or cache is
        full); ``"prefill look-ahead reserved"`` when vLLM 0.33.0's
        ``_reserve_prefill_lookahead`` cut its window to 0 (a drafter's
        look-ahead); else ``skip_reason``."""
        last = self.seq[-1] if self.seq else None
        if last is not None and last[0] == "encoder_plan" and last[1] == request.request_id and last[3] == 0:
            return ENCODER_INPUT_UNAVAILABLE
        if self.lookahead_cut == request.request_id:
            self.lookahead_cut = None
            return PREFILL_LOOKAHEAD_RESERVED
        return skip_reason(request, self.sched)

    def begin(self) -> None:
        self.seq = []
        self.matches = []
        self.lookahead_cut = None
        self.in_schedule = True

    def end(self) -> None:
        self.in_schedule = False
        if hasattr(self, "_examined"):
            self._examined.clear()  # a head the loop broke on stayed queued: no skip


def num_free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def waiting_in_service_order(sched) -> list:
    """The waiting requests in the order the next waiting loop examines them.

    vLLM 0.33.0: ``kv_holding_waiting`` then ``waiting`` (a skipped request
    is back at the head of its queue). A scheduler with a ``skipped_waiting``
    queue (0.29.0, 0.20.2) serves it through
    ``Scheduler._select_waiting_queue_for_scheduling``: under FCFS
    ``skipped_waiting`` first, then ``waiting``; under PRIORITY whichever
    head is smaller (``Request.__lt__``: priority, arrival time, id), i.e.
    the two sorted queues merged.
    """
    first = list(getattr(sched, "kv_holding_waiting", ()))
    skipped = getattr(sched, "skipped_waiting", None)
    if skipped is None:
        first.extend(sched.waiting)
        return first
    skipped, waiting = list(skipped), list(sched.waiting)
    if getattr(sched.policy, "name", "FCFS") == "FCFS":
        return first + skipped + waiting
    merged, i, j = [], 0, 0
    while i < len(waiting) and j < len(skipped):
        if waiting[i] < skipped[j]:
            merged.append(waiting[i])
            i += 1
        else:
            merged.append(skipped[j])
            j += 1
    return first + merged + waiting[i:] + skipped[j:]


def snapshot(sched, preempted_req_ids=()) -> dict:
    """``{waiting, running, num_free_blocks, request_states}``: queue orders
    (request ids; waiting in service order, ``waiting_in_service_order``),
    free blocks, and ``request_states(sched, preempted_req_ids)``."""
    waiting = [r.request_id for r in waiting_in_service_order(sched)]
    return {"waiting": waiting, "running": [r.request_id for r in sched.running],
            "num_free_blocks": num_free_blocks(sched),
            "request_states": request_states(sched, preempted_req_ids)}


def request_states(sched, preempted_req_ids=()) -> list[list]:
    """``[[request_id, status name, num_computed_tokens, spec_token_ids], ...]``
    by request id (the harness's ``RequestState``, read off vLLM's
    ``Request``): every unfinished request that is not RUNNING and holds
    draft tokens, and every request of ``preempted_req_ids`` still known
    (the latest ``schedule()``'s victims), each once."""
    # Without speculative decoding no request holds drafts: skip the scan of every
    # request (twice a step in the recording scheduler; most of its per-step cost
    # with many requests waiting).
    drafting = getattr(sched, "num_spec_tokens", 1) != 0
    if not drafting and not preempted_req_ids:
        return []
    shown = {r.request_id: r for r in sched.requests.values()
             if r.status.name != "RUNNING" and not r.is_finished() and getattr(r, "spec_token_ids", None)
             } if drafting else {}
    for req_id in preempted_req_ids:
        request = sched.requests.get(req_id)
        if request is not None:
            shown[req_id] = request
    return [[i, shown[i].status.name, int(shown[i].num_computed_tokens),
             [int(t) for t in getattr(shown[i], "spec_token_ids", None) or ()]] for i in sorted(shown)]


def finished_info(request, freed_block_ids: list[int], fence: int | None = None,
                  group_block_ids: list[list[int]] | None = None) -> dict:
    """A finished (or aborted) request as the harness's ``FinishedRequest``
    (``fence``: set when its free was deferred; ``group_block_ids``: a hybrid
    model's freed ids per group, ``DecisionHooks.freed_groups``)."""
    reason = request.get_finished_reason()
    info = {"request_id": request.request_id, "status": request.status.name,
            "finish_reason": None if reason is None else str(reason),
            "stop_reason": request.stop_reason,
            "num_output_tokens": request.num_output_tokens,
            "freed_block_ids": list(freed_block_ids), "fence": fence}
    if group_block_ids is not None:
        info["group_block_ids"] = group_block_ids
    return info


def skip_reason(request, sched=None) -> str:
    """Why vLLM's waiting loop skipped ``request``, in the reference's words
    (``reference/scheduler.py``: ``Skip`` reasons). ``sched``: the scheduler,
    for the LoRA limit (vLLM 0.33.0 skips a request whose adapter would make
    more than ``lora_config.max_loras`` adapters scheduled: those of every
    running request, including the ones admitted before it in this step)."""
    if request.status.name == "WAITING_FOR_REMOTE_KVS":
        return "waiting for remote KV"
    if request.status.name == "WAITING_FOR_STREAMING_REQ":
        return STREAMING_INPUT_PENDING
    if getattr(request, "num_stale_output_tokens", 0) and not getattr(request, "drop_stale_output", False):
        return "stale output in flight"
    lora_config = getattr(sched, "lora_config", None)
    lora = getattr(request, "lora_request", None)
    if lora_config is not None and lora is not None:
        loras = {r.lora_request.lora_int_id for r in sched.running
                 if getattr(r, "lora_request", None) and r.lora_request.lora_int_id > 0}
        if len(loras) == lora_config.max_loras and lora.lora_int_id not in loras:
            return MAX_LORAS_REACHED
    # Blocked statuses, LoRA limits, connector or encoder-cache waits: none
    # of them is modelled by the harness.
    return f"skipped by vLLM (status {request.status.name})"


def prefill_gate(sched, throttle_prefills: bool) -> bool:
    """``defer_prefills`` for the ``schedule()`` about to run.

    vLLM keeps it local to ``schedule()``: recomputed from the state it reads
    (spec 7.1, 10.4); versions without the gate report False. Call before
    ``schedule()``.
    """
    # Deferred iff not capacity-bound, some running request decodes, and either
    # the DP throttle is on or the local prefill interval has not elapsed. The
    # scan of the running queue is skipped where neither can apply.
    interval = getattr(sched, "local_prefill_interval", 1)
    if getattr(sched, "prefill_capacity_bound", False) or (not throttle_prefills and interval <= 1):
        return False
    if not any(not getattr(r, "is_prefill_chunk", False) for r in sched.running):
        return False
    return bool(throttle_prefills) or (sched.num_executed_steps + 1) - sched.last_prefill_step < interval


def _ids(value, field: str) -> list[str]:
    """A SchedulerOutput list of request ids; NormalisationError naming ``field``
    when it is not one."""
    try:
        ids = list(value)
    except TypeError:
        raise NormalisationError(f"SchedulerOutput.{field}: not a list of request ids "
                                 f"({type(value).__name__})") from None
    if set(map(type, ids)) <= {str}:  # the common case, checked at C speed
        return ids
    bad = [i for i in ids if not isinstance(i, str)]
    if bad:
        raise NormalisationError(f"SchedulerOutput.{field}: request id {bad[0]!r} is not a string")
    return ids


def _count(value, field: str, *where) -> int:
    """``value`` if it is an integer (not a bool); NormalisationError naming
    ``field`` (``field.format(*where)`` when ``where`` is given: formatted only
    on failure, this runs per request per step) otherwise."""
    if type(value) is int:
        return value
    if not isinstance(value, int) or isinstance(value, bool):
        name = field.format(*where) if where else field
        raise NormalisationError(f"SchedulerOutput.{name}: {value!r} is not an integer")
    return value


def _group_blocks(value, field: str, *where) -> list[int]:
    """Block ids of the single KV-cache group of a ``([ids], ...)`` field (or None);
    ``field`` and ``where`` as for ``_count``."""
    if value is None:
        return []
    try:
        blocks = list(value[0]) if len(value) else []
    except (TypeError, IndexError, KeyError):
        name = field.format(*where) if where else field
        raise NormalisationError(f"SchedulerOutput.{name}: not a tuple of block-id lists "
                                 f"({type(value).__name__})") from None
    if not set(map(type, blocks)) <= {int}:
        for b in blocks:
            _count(b, field, *where)
    return blocks


def _all_groups(value, field: str, *where) -> list[list[int]] | None:
    """Every group's block ids of a ``([ids], ...)`` field (None stays None);
    ``field`` and ``where`` as for ``_count``."""
    if value is None:
        return None
    try:
        groups = [list(g) for g in value]
    except TypeError:
        name = field.format(*where) if where else field
        raise NormalisationError(f"SchedulerOutput.{name}: not a tuple of block-id lists "
                                 f"({type(value).__name__})") from None
    for ids in groups:
        if not set(map(type, ids)) <= {int}:
            for b in ids:
                _count(b, field, *where)
    return groups


def request_data(so) -> tuple[list[str], dict[str, tuple[str, int, list[int], list[list[int]] | None]]]:
    """The request data of a SchedulerOutput: the ids it carries, in order
    (``scheduled_new_reqs``, then ``scheduled_cached_reqs.req_ids``), and per
    id (source "admitted" or "running", num_computed_tokens, new block ids of
    group 0, every group's new block ids or None).
    Raises NormalisationError, naming the field, on malformed data (a
    missing field, a wrong type, cached lists of unequal lengths)."""
    ids: list[str] = []
    truth: dict[str, tuple[str, int, list[int]]] = {}
    try:
        new_reqs = list(so.scheduled_new_reqs)
        cached = so.scheduled_cached_reqs
        cached_ids = _ids(cached.req_ids, "scheduled_cached_reqs.req_ids")
        cached_blocks = list(cached.new_block_ids)
        cached_computed = list(cached.num_computed_tokens)
    except AttributeError as exc:
        raise NormalisationError(f"SchedulerOutput lacks a request-data field ({exc})") from None
    for i, nr in enumerate(new_reqs):
        req_id = _ids([getattr(nr, "req_id", None)], f"scheduled_new_reqs[{i}].req_id")[0]
        ids.append(req_id)
        truth.setdefault(req_id, ("admitted",
                                  _count(nr.num_computed_tokens, "scheduled_new_reqs[{}].num_computed_tokens", i),
                                  _group_blocks(nr.block_ids, "scheduled_new_reqs[{}].block_ids", i),
                                  _all_groups(nr.block_ids, "scheduled_new_reqs[{}].block_ids", i)))
    for name, values in (("new_block_ids", cached_blocks), ("num_computed_tokens", cached_computed)):
        if len(values) != len(cached_ids):
            raise NormalisationError(f"SchedulerOutput.scheduled_cached_reqs.{name}: {len(values)} entries "
                                     f"for {len(cached_ids)} req_ids")
    resumed_ids = set(getattr(cached, "resumed_req_ids", ()) or ())
    resumed_flags = getattr(cached, "resumed_from_preemption", None)  # 0.10-era
    ids += cached_ids
    for i, req_id in enumerate(cached_ids):
        resumed = req_id in resumed_ids or bool(resumed_flags and resumed_flags[i])
        computed, value = cached_computed[i], cached_blocks[i]
        if type(computed) is not int:
            computed = _count(computed, "scheduled_cached_reqs.num_computed_tokens[{}]", i)
        if value is None:  # no new blocks (vLLM's get_block_ids(allow_none=True))
            blocks, groups = [], None
        elif type(value) is tuple and len(value) == 1 and type(value[0]) is list and (
                not value[0] or set(map(type, value[0])) <= _INT):
            # One group of ints: what _group_blocks and _all_groups make of it.
            blocks, groups = value[0][:], [value[0][:]]
        else:
            blocks = _group_blocks(value, "scheduled_cached_reqs.new_block_ids[{}]", i)
            groups = _all_groups(value, "scheduled_cached_reqs.new_block_ids[{}]", i)
        if req_id not in truth:  # (the first entry of an id counts; every one is checked)
            truth[req_id] = ("admitted" if resumed else "running", computed, blocks, groups)
    return ids, truth


_INT = frozenset((int,))


def flat_block_ids(groups: list[list[int]], hits: list[int] | None = None) -> list[int]:
    """A hybrid model's blocks as one list, in the order they left the free
    queue (the harness's ``new_block_ids``): every group's first ``hits[g]``
    ids (the prefix hit, adopted first), then every group's others, group
    order, null blocks (0) left out."""
    hits = hits or [0] * len(groups)
    return ([b for g, ids in enumerate(groups) for b in ids[:hits[g]] if b]
            + [b for g, ids in enumerate(groups) for b in ids[hits[g]:] if b])


def normalise(so, seq: list[tuple], *, use_v2: bool, max_num_scheduled_tokens: int,
              requests=None, num_groups: int = 0) -> dict:
    """The decisions of one ``schedule()`` call: ``seq`` (from ``DecisionHooks``)
    in order, valued from the real SchedulerOutput, recorded as they are.

    The ``schedule`` events (less the ``withdraw`` ones) are the keys of
    ``so.num_scheduled_tokens``, with its counts and drafts; the ids the
    request data carries are ``request_data_ids``, kept apart, so an
    inconsistent output shows in the trace (the checker judges it): a
    victim still in ``num_scheduled_tokens`` keeps its ``schedule`` event
    (no ``withdraw``), a key that was never allocated gets one at the end
    (valued from its request data, else from ``requests[id]``, vLLM's
    ``Scheduler.requests``, after ``_update_after_schedule``), an allocation
    that left the output without a preemption becomes a ``withdraw``, a
    request allocated twice has two events. Where the hooks and the output
    disagree on a value, the output's (what the worker is told) is recorded.
    Raises NormalisationError, naming the field, only on malformed input
    (``request_data``; a count that is not an integer; a key that nothing
    describes).

    ``num_groups`` (a hybrid model's KV-cache groups, ``DecisionHooks.hybrid``;
    0 otherwise): every ``schedule``, ``withdraw`` and ``preempt`` event also
    carries ``group_block_ids`` (an admission: each group's whole table, null
    blocks as 0; a running request: each group's new blocks; a preemption:
    each group's freed blocks), ``new_block_ids`` becomes every group's
    blocks in allocation order (``flat_block_ids``), and the window frees
    are ``{"type": "skipped_free", request_id, freed_block_ids,
    group_block_ids}``."""
    data_ids, truth = request_data(so)
    try:
        scheduled = dict(so.num_scheduled_tokens)
        if not set(map(type, scheduled.values())) <= {int}:
            scheduled = {k: _count(v, f"num_scheduled_tokens[{k!r}]") for k, v in scheduled.items()}
        spec_tokens = dict(getattr(so, "scheduled_spec_decode_tokens", None) or {})
        encoder_inputs = dict(getattr(so, "scheduled_encoder_inputs", None) or {})
    except (TypeError, ValueError):
        raise NormalisationError("SchedulerOutput.num_scheduled_tokens: not a mapping of request ids "
                                 "to token counts") from None

    events: list[dict] = []
    live: dict[str, dict] = {}        # allocated in this step and not (yet) taken out
    withdrawn: dict[str, dict] = {}   # victim id -> its withdraw event (kept only if it left the output)
    tables: dict[str, list[int]] = {}
    no_groups = [[] for _ in range(num_groups)]
    plans: dict[str, list[int]] = {}  # request id -> input ids of its latest encoder plan
    for item in seq:
        kind = item[0]
        if kind == "encoder_plan":
            _, req_id, computed, n_tokens, input_ids = item
            plans[req_id] = input_ids
            events.append({"type": "encoder_plan", "request_id": req_id, "num_computed_tokens": computed,
                           "num_scheduled_tokens": n_tokens, "encoder_input_ids": input_ids})
            continue
        if kind == "alloc":
            # (Indexed, not unpacked with *rest: this runs per scheduled request.)
            req_id, status, computed_before, n_new, n_hit, new_blocks, spec = item[1:8]
            groups = item[9] if num_groups and len(item) > 9 else None
            if status == "RUNNING":
                kind, hit = "running", 0
                if groups is not None:
                    new_blocks = flat_block_ids(groups["new"])
            else:  # an admission: PREEMPTED resumes, any other waiting status is new
                kind, hit = ("resumed" if status == "PREEMPTED" else "new"), n_hit
                computed_before += n_hit
                tables[req_id] = (flat_block_ids(groups["table"], groups["hits"]) if groups is not None
                                  else list(item[8]) if len(item) > 8 else list(new_blocks))
                new_blocks = None  # the whole table, from the SchedulerOutput
            event = {"type": "schedule", "request_id": req_id, "kind": kind,
                     "num_computed_tokens": computed_before, "num_scheduled_tokens": n_new,
                     "num_prefix_hit_tokens": hit, "new_block_ids": new_blocks,
                     "spec_token_ids": spec}
            if groups is not None:
                event["group_block_ids"] = groups.get("new") or groups["table"]
                event["_hits"] = groups.get("hits")
            enc = plans.pop(req_id, None) if plans else None
            if enc:  # its plan's inputs (a withdrawn request's row keeps them; vLLM's output drops it)
                event["encoder_input_ids"] = list(enc)
            live[req_id] = event
            events.append(event)
        elif kind == "skipped_free":
            _, req_id, freed = item
            events.append({"type": "skipped_free", "request_id": req_id,
                           "freed_block_ids": [b for ids in freed for b in ids], "group_block_ids": freed})
        elif kind == "remote_load":
            _, req_id, status, n_hit, n_external, block_ids, reserved, n_new, *rest = item
            groups = rest[0] if rest and num_groups else None
            event = {"type": "kv_load", "request_id": req_id,
                     "num_prefix_hit_tokens": n_hit, "num_external_tokens": n_external,
                     "block_ids": block_ids, "reserved_blocks": reserved}
            if groups is not None:  # each group's whole table; block_ids: hits first, as an admission's
                event["group_block_ids"] = groups["table"]
                event["block_ids"] = flat_block_ids(groups["table"], groups["hits"])
            events.append(event)
        elif kind == "promote":
            _, req_id, status, computed, load_failed, freed, *rest = item
            event = {"type": "kv_promote", "request_id": req_id, "status": status,
                     "num_computed_tokens": computed, "load_failed": bool(load_failed),
                     "freed_block_ids": list(freed)}
            if num_groups:
                event["group_block_ids"] = rest[0] if rest and rest[0] is not None else no_groups
                event["freed_block_ids"] = [b for ids in event["group_block_ids"] for b in ids]
            events.append(event)
        elif kind == "skip":
            _, req_id, reason = item
            events.append({"type": "skip", "request_id": req_id, "reason": reason})
        else:
            _, req_id, computed_before, freed, *rest = item
            fence = rest[0] if rest else None
            victim = live.pop(req_id, None)
            if victim is not None:
                # A give-back, if the output dropped it (decided below).
                blocks = victim["new_block_ids"]
                withdraw = {"type": "withdraw", "request_id": req_id,
                            "num_scheduled_tokens": victim["num_scheduled_tokens"],
                            "block_ids": list(tables.get(req_id, []) if blocks is None else blocks),
                            "_victim": victim}
                if victim.get("encoder_input_ids"):  # the inputs it had scheduled go back to the budget
                    withdraw["encoder_input_ids"] = list(victim["encoder_input_ids"])
                if num_groups:
                    withdraw["group_block_ids"] = victim.get("group_block_ids") or no_groups
                withdrawn[req_id] = withdraw
                events.append(withdraw)
            preempt = {"type": "preempt", "request_id": req_id,
                       "num_computed_tokens": computed_before, "freed_block_ids": freed,
                       "fence": fence}
            if num_groups:
                preempt["group_block_ids"] = (rest[1] if len(rest) > 1 and rest[1] is not None
                                              else no_groups)
            events.append(preempt)

    for req_id, withdraw in withdrawn.items():
        victim = withdraw.pop("_victim")
        if req_id in scheduled and req_id not in live:
            events.remove(withdraw)  # still in num_scheduled_tokens: not given back
            live[req_id] = victim
    for req_id, event in list(live.items()):
        if req_id not in scheduled:
            # Allocated, then out of the output without a preemption.
            blocks = event["new_block_ids"]
            withdraw = {"type": "withdraw", "request_id": req_id,
                        "num_scheduled_tokens": event["num_scheduled_tokens"],
                        "block_ids": list(tables.get(req_id, []) if blocks is None else blocks)}
            if event.get("encoder_input_ids"):
                withdraw["encoder_input_ids"] = list(event["encoder_input_ids"])
            if num_groups:
                withdraw["group_block_ids"] = event.get("group_block_ids") or no_groups
            events.append(withdraw)
            del live[req_id]
            if blocks is None:
                event["new_block_ids"] = list(tables.get(req_id, []))
    for req_id, n in scheduled.items():
        if req_id in live:
            continue
        # A key of num_scheduled_tokens that was never allocated.
        source, computed, blocks, _ = truth.get(req_id, (None, None, None, None))
        if source is None:
            request = (requests or {}).get(req_id)
            if request is None:
                raise NormalisationError(f"SchedulerOutput.num_scheduled_tokens[{req_id!r}]: "
                                         f"scheduled, but neither allocated, nor in the request data, "
                                         f"nor a known request")
            source, computed, blocks = "running", int(request.num_computed_tokens) - n, []
        event = {"type": "schedule", "request_id": req_id,
                 "kind": "running" if source == "running" else "new", "num_computed_tokens": computed,
                 "num_scheduled_tokens": n, "num_prefix_hit_tokens": 0, "new_block_ids": blocks,
                 "spec_token_ids": []}
        live[req_id] = event
        events.append(event)
    no_truth = (None, None, None, None)
    for req_id, event in live.items():
        source, computed, blocks, groups = truth.get(req_id, no_truth)
        hits = event.pop("_hits", None) if num_groups else None  # (set only with groups)
        if source is not None:
            event["num_computed_tokens"] = computed
            event["new_block_ids"] = blocks
            if num_groups:
                event["group_block_ids"] = groups or no_groups
                event["new_block_ids"] = flat_block_ids(event["group_block_ids"], hits)
        elif event["new_block_ids"] is None:
            event["new_block_ids"] = list(tables.get(req_id, []))
        if num_groups and "group_block_ids" not in event:
            event["group_block_ids"] = no_groups
        event["num_scheduled_tokens"] = scheduled[req_id]
        spec = spec_tokens.get(req_id) if spec_tokens else None
        event["spec_token_ids"] = [int(t) for t in spec] if spec else []
        enc = encoder_inputs.get(req_id) if encoder_inputs else None
        if enc:  # what the worker is told to encode (vLLM scheduled_encoder_inputs)
            event["encoder_input_ids"] = [int(i) for i in enc]
        elif "encoder_input_ids" in event:
            del event["encoder_input_ids"]
    if num_groups:  # ("_hits" is set only on events with groups)
        for event in events:
            event.pop("_hits", None)
    preempted = (sorted(_ids(so.preempted_req_ids, "preempted_req_ids")) if hasattr(so, "preempted_req_ids")
                 else sorted(e["request_id"] for e in events if e["type"] == "preempt"))
    total = _count(so.total_num_scheduled_tokens, "total_num_scheduled_tokens")
    out = {"events": events, "num_scheduled_tokens": list(map(list, scheduled.items())),
           "total_num_scheduled_tokens": total, "preempted_req_ids": preempted,
           "finished_req_ids": sorted(_ids(so.finished_req_ids, "finished_req_ids")),
           "token_budget": max_num_scheduled_tokens - total, "request_data_ids": data_ids}
    freed = getattr(so, "free_encoder_mm_hashes", None)
    if freed:  # encoder-cache entries evicted this step, in eviction order
        out["free_encoder_mm_hashes"] = [str(h) for h in freed]
    return out


def crash_info(exc: BaseException) -> dict:
    """What the trace's ``crash`` row needs of an exception vLLM raised:
    ``{"exc_type", "exc_message", "where"}``. ``exc_message`` is
    ``"<Type>: <text>"`` (text on one line, at most 300 characters; for a bare
    ``assert``, the failing source line in backquotes); ``where`` is the
    innermost traceback frame in vLLM's package (else the innermost outside
    the standard library) as ``"vllm/v1/core/sched/scheduler.py:1579"``: its
    module name as a path, the same on every machine. The same rules as the
    harness's ``reference.candidate.describe_exception``, which this module
    cannot import."""
    import sysconfig
    import traceback

    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    stdlib = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})

    def module(entry) -> str:
        name = entry.tb_frame.f_globals.get("__name__")
        return name if isinstance(name, str) else ""

    def outside_stdlib(entry) -> bool:
        filename = entry.tb_frame.f_code.co_filename
        return not filename.startswith(stdlib) or "-packages" in filename

    chosen = (next((e for e in reversed(frames) if module(e).split(".")[0] == "vllm"), None)
              or next((e for e in reversed(frames) if outside_stdlib(e)), None)
              or (frames[-1] if frames else None))
    where = ""
    if chosen is not None:
        base = chosen.tb_frame.f_code.co_filename.replace("\\", "/").rsplit("/", 1)[-1]
        name = module(chosen)
        if name and name != "__main__":
            parts = name.split(".")
            path = "/".join((parts if base == "__init__.py" else parts[:-1]) + [base])
        else:
            path = base
        where = f"{path}:{chosen.tb_lineno}"
    kind = type(exc).__name__
    text = " ".join(str(exc).split())[:300]
    if not text and frames:
        line = (traceback.extract_tb(frames[-1], limit=1)[0].line or "").strip()
        text = f"`{line}`" if line else ""
    return {"exc_type": kind, "exc_message": f"{kind}: {text}" if text else kind, "where": where}
