"""Normalise a real vLLM v1 ``Scheduler``'s decisions into the harness's event shapes.

STANDALONE: standard library only, no import side effects (no environment
variables set, no vLLM import at module level), so it can be imported inside a
vLLM server process (``harness/candidates/vllm/recording_scheduler.py``) as well as by the
subprocess driver (``harness/candidates/vllm/driver.py``), which uses these for its
hooks, normalisation, finished-request info, snapshots and prefill-gate
recomputation.

Shapes (those of ``reference/output.py``, as the driver's protocol speaks them):
``normalise`` returns ``{events, num_scheduled_tokens, total_num_scheduled_tokens,
preempted_req_ids, finished_req_ids, token_budget}`` where ``events`` is the
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
by ``_handle_blocked_waiting_request``).

Deferred block frees (vLLM's ``defer_block_free``, spec 5.10): a free that
``Scheduler._free_request_blocks`` defers goes through
``kv_cache_manager.pop_blocks_for_free`` instead of ``free``; the hooks record
its blocks (tail first) and its fence (``sched_step_seq`` at the time), and
``_drain_deferred_frees`` is wrapped to report what each update released.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from array import array


class NormalisationError(Exception):
    """What the hooks saw disagrees with vLLM's own SchedulerOutput."""


def blocks_of(kv_blocks) -> list[int]:
    """Block ids of the single KV-cache group of a KVCacheBlocks (or None)."""
    if kv_blocks is None:
        return []
    ids = kv_blocks.get_block_ids()
    return list(ids[0]) if ids else []


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
    ``_preempt_request`` (a preemption, with the blocks it freed).

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
    ``_handle_blocked_waiting_request`` of a load reported done is a
    promotion, ``("promote", id, status, num_computed_tokens, load_failed,
    freed blocks)``; ``_update_from_kv_xfer_finished`` fills ``recving`` and
    ``kv_freed``.
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
        self.in_schedule = False
        self.active = True
        kvm = sched.kv_cache_manager
        orig_alloc = kvm.allocate_slots
        alloc_sig = inspect.signature(orig_alloc)
        orig_free = kvm.free
        orig_preempt = sched._preempt_request
        hooks = self

        @functools.wraps(orig_alloc)  # keeps the signature for whoever wraps us
        def allocate_slots(request, *args, **kwargs):
            computed_before = request.num_computed_tokens
            status_before = request.status.name
            result = orig_alloc(request, *args, **kwargs)
            if result is not None and hooks.in_schedule and hooks.active:
                bound = alloc_sig.bind(request, *args, **kwargs).arguments
                n_new = bound.get("num_new_tokens", 0)
                if bound.get("delay_cache_blocks", False):
                    # An async KV load (load_kv_async): blocks for the local
                    # hit and the external tokens, nothing scheduled. The
                    # reservation is the one vLLM passed.
                    hooks.seq.append(("remote_load", request.request_id, status_before,
                                      bound.get("num_new_computed_tokens", 0),
                                      bound.get("num_external_computed_tokens", 0),
                                      blocks_of(kvm.get_blocks(request.request_id)),
                                      bound.get("reserved_blocks", 0), n_new))
                    return result
                # Drafts a running request gets verified (vLLM picks them right
                # after this call; a withdrawal later drops them from its output).
                spec = []
                if status_before == "RUNNING" and request.spec_token_ids:
                    n_spec = (n_new + computed_before - request.num_tokens
                              - getattr(request, "num_output_placeholders", 0))
                    if n_spec > 0:
                        spec = list(request.spec_token_ids[:n_spec])
                hooks.seq.append(("alloc", request.request_id, status_before, computed_before,
                                  n_new, bound.get("num_new_computed_tokens", 0),
                                  blocks_of(result), spec))
            return result

        @functools.wraps(orig_free)  # keeps the signature for whoever wraps us
        def free(request, *args, **kwargs):
            if not hooks.active:
                return orig_free(request, *args, **kwargs)
            try:
                table = blocks_of(kvm.get_blocks(request.request_id))
            except KeyError:
                table = []
            orig_free(request, *args, **kwargs)
            hooks.freed[request.request_id] = table[::-1]
            hooks.fences.pop(request.request_id, None)
            if hooks.free_order is not None:
                hooks.free_order.append(request.request_id)

        orig_pop = getattr(kvm, "pop_blocks_for_free", None)

        def pop_blocks_for_free(request, *args, **kwargs):
            # The deferred branch of _free_request_blocks: the blocks leave the
            # request now and reach the pool once the fence has passed.
            blocks = orig_pop(request, *args, **kwargs)
            if hooks.active:
                hooks.freed[request.request_id] = [b.block_id for b in reversed(blocks)]
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
            computed_before = request.num_computed_tokens
            hooks.freed.pop(request.request_id, None)
            hooks.fences.pop(request.request_id, None)
            orig_preempt(request, *args, **kwargs)
            freed = hooks.freed.pop(request.request_id, None)
            fence = hooks.fences.pop(request.request_id, None)
            if freed is None:
                raise NormalisationError(f"preemption of {request.request_id} freed no blocks "
                                         f"through kv_cache_manager.free or pop_blocks_for_free")
            hooks.seq.append(("preempt", request.request_id, computed_before, freed, fence))

        class _SkipRecordingSet(set):
            """``deferred_waiting``: an add inside schedule() is a waiting-loop skip."""

            def add(self, request) -> None:
                if hooks.in_schedule and hooks.active and not (
                        hooks.seq and hooks.seq[-1][0] == "remote_load"
                        and hooks.seq[-1][1] == request.request_id):
                    # (An async-load admission leaves through skip_request
                    # too: it is reported as its kv_load, not as a skip.)
                    hooks.seq.append(("skip", request.request_id, skip_reason(request)))
                super().add(request)

        orig_blocked = getattr(sched, "_handle_blocked_waiting_request", None)

        def _handle_blocked_waiting_request(request, *args, **kwargs):
            # A finished async load is promoted here (vLLM
            # _update_waiting_for_remote_kv, then WAITING or PREEMPTED).
            promoting = (request.status.name == "WAITING_FOR_REMOTE_KVS"
                         and request.request_id in sched.finished_recving_kv_req_ids)
            load_failed = request.request_id in sched.failed_recving_kv_req_ids
            if not (promoting and hooks.active):
                return orig_blocked(request, *args, **kwargs)
            hooks.freed.pop(request.request_id, None)
            ready = orig_blocked(request, *args, **kwargs)
            freed = hooks.freed.pop(request.request_id, [])
            hooks.fences.pop(request.request_id, None)
            if hooks.in_schedule:
                hooks.seq.append(("promote", request.request_id, request.status.name,
                                  request.num_computed_tokens, load_failed, freed))
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
                    pending.append(req_id)
            result = orig_xfer(kv_connector_output, *args, **kwargs)
            hooks.recving.extend(ids)
            for req_id in pending:
                hooks.kv_freed.append((req_id, hooks.freed.pop(req_id, []),
                                       hooks.fences.pop(req_id, None)))
            return result

        kvm.allocate_slots = allocate_slots
        kvm.free = free
        if orig_blocked is not None:
            sched._handle_blocked_waiting_request = _handle_blocked_waiting_request
        if orig_xfer is not None:
            sched._update_from_kv_xfer_finished = _update_from_kv_xfer_finished
        if orig_pop is not None:
            kvm.pop_blocks_for_free = pop_blocks_for_free
        if orig_drain is not None:
            sched._drain_deferred_frees = _drain_deferred_frees
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
                hooks.seq.append(("skip", request.request_id, skip_reason(request)))

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

    def begin(self) -> None:
        self.seq = []
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
        return first + list(sched.waiting)
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


def snapshot(sched) -> dict:
    """``{waiting, running, num_free_blocks}``: queue orders (request ids;
    waiting in service order, ``waiting_in_service_order``) and free blocks."""
    waiting = [r.request_id for r in waiting_in_service_order(sched)]
    return {"waiting": waiting, "running": [r.request_id for r in sched.running],
            "num_free_blocks": num_free_blocks(sched)}


def finished_info(request, freed_block_ids: list[int], fence: int | None = None) -> dict:
    """A finished (or aborted) request as the harness's ``FinishedRequest``
    (``fence``: set when its free was deferred)."""
    reason = request.get_finished_reason()
    return {"request_id": request.request_id, "status": request.status.name,
            "finish_reason": None if reason is None else str(reason),
            "stop_reason": request.stop_reason,
            "num_output_tokens": request.num_output_tokens,
            "freed_block_ids": list(freed_block_ids), "fence": fence}


def skip_reason(request) -> str:
    """Why vLLM's waiting loop skipped ``request``, in the reference's words
    (``reference/scheduler.py``: ``Skip`` reasons)."""
    if request.status.name == "WAITING_FOR_REMOTE_KVS":
        return "waiting for remote KV"
    if getattr(request, "num_stale_output_tokens", 0) and not getattr(request, "drop_stale_output", False):
        return "stale output in flight"
    # Blocked statuses, LoRA limits, connector or encoder-cache waits: none
    # of them is modelled by the harness.
    return f"skipped by vLLM (status {request.status.name})"


def prefill_gate(sched, throttle_prefills: bool) -> bool:
    """``defer_prefills`` for the ``schedule()`` about to run.

    vLLM keeps it local to ``schedule()``: recomputed from the state it reads
    (spec 7.1, 10.4); versions without the gate report False. Call before
    ``schedule()``.
    """
    bound = bool(getattr(sched, "prefill_capacity_bound", False))
    has_decode = any(not getattr(r, "is_prefill_chunk", False) for r in sched.running)
    defer = bool(throttle_prefills) and not bound and has_decode
    interval = getattr(sched, "local_prefill_interval", 1)
    if (not defer and interval > 1 and not bound and has_decode
            and (sched.num_executed_steps + 1) - sched.last_prefill_step < interval):
        defer = True
    return defer


def normalise(so, seq: list[tuple], *, use_v2: bool, max_num_scheduled_tokens: int) -> dict:
    """The decisions of one ``schedule()`` call: ``seq`` (from ``DecisionHooks``)
    in order, cross-checked against (and valued from) the real SchedulerOutput."""
    truth: dict[str, tuple[str, int, list[int]]] = {}
    for nr in so.scheduled_new_reqs:
        truth[nr.req_id] = ("admitted", nr.num_computed_tokens, list(nr.block_ids[0]))
    cached = so.scheduled_cached_reqs
    resumed_ids = set(getattr(cached, "resumed_req_ids", ()) or ())
    resumed_flags = getattr(cached, "resumed_from_preemption", None)  # 0.10-era
    for i, req_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        blocks = list(blocks[0]) if blocks else []
        resumed = req_id in resumed_ids or bool(resumed_flags and resumed_flags[i])
        truth[req_id] = ("admitted" if resumed else "running", cached.num_computed_tokens[i], blocks)

    events: list[dict] = []
    live: dict[str, dict] = {}
    for item in seq:
        if item[0] == "alloc":
            _, req_id, status, computed_before, n_new, n_hit, new_blocks, spec = item
            if status == "RUNNING":
                kind, hit = "running", 0
            elif status == "WAITING":
                kind, hit = "new", n_hit
            elif status == "PREEMPTED":
                kind, hit = "resumed", n_hit
            else:
                raise NormalisationError(f"{req_id} allocated in status {status}")
            if kind != "running":
                computed_before += n_hit
                new_blocks = None  # the whole table, from the SchedulerOutput
            event = {"type": "schedule", "request_id": req_id, "kind": kind,
                     "num_computed_tokens": computed_before, "num_scheduled_tokens": n_new,
                     "num_prefix_hit_tokens": hit, "new_block_ids": new_blocks,
                     "spec_token_ids": spec}
            if req_id in live:
                raise NormalisationError(f"{req_id} allocated twice in one step")
            live[req_id] = event
            events.append(event)
        elif item[0] == "remote_load":
            _, req_id, status, n_hit, n_external, block_ids, reserved, n_new = item
            if status not in ("WAITING", "PREEMPTED") or n_new != 0 or n_external <= 0:
                raise NormalisationError(f"{req_id}: async load in status {status} with "
                                         f"{n_new} new and {n_external} external tokens")
            if req_id in live:
                raise NormalisationError(f"{req_id} loads after it was scheduled in this step")
            events.append({"type": "kv_load", "request_id": req_id,
                           "num_prefix_hit_tokens": n_hit, "num_external_tokens": n_external,
                           "block_ids": block_ids, "reserved_blocks": reserved})
        elif item[0] == "promote":
            _, req_id, status, computed, load_failed, freed = item
            events.append({"type": "kv_promote", "request_id": req_id, "status": status,
                           "num_computed_tokens": computed, "load_failed": bool(load_failed),
                           "freed_block_ids": list(freed)})
        elif item[0] == "skip":
            _, req_id, reason = item
            if req_id in live:
                raise NormalisationError(f"{req_id} skipped after it was scheduled in this step")
            events.append({"type": "skip", "request_id": req_id, "reason": reason})
        else:
            _, req_id, computed_before, freed, *rest = item
            fence = rest[0] if rest else None
            withdrawn = live.pop(req_id, None)
            if withdrawn is not None:
                if withdrawn["new_block_ids"] is None:
                    raise NormalisationError(f"admitted {req_id} preempted in the same step")
                events.append({"type": "withdraw", "request_id": req_id,
                               "num_scheduled_tokens": withdrawn["num_scheduled_tokens"],
                               "block_ids": list(withdrawn["new_block_ids"])})
            events.append({"type": "preempt", "request_id": req_id,
                           "num_computed_tokens": computed_before, "freed_block_ids": freed,
                           "fence": fence})

    scheduled = dict(so.num_scheduled_tokens)
    spec_tokens = dict(getattr(so, "scheduled_spec_decode_tokens", None) or {})
    if list(live) != list(scheduled):
        raise NormalisationError(f"hooked scheduling order {list(live)} differs from "
                                 f"SchedulerOutput.num_scheduled_tokens {list(scheduled)}")
    for req_id, event in live.items():
        source, computed, blocks = truth.get(req_id, (None, None, None))
        if source is None:
            raise NormalisationError(f"{req_id} scheduled but absent from new/cached reqs")
        if (source == "running") != (event["kind"] == "running"):
            raise NormalisationError(f"{req_id}: hook says {event['kind']}, SchedulerOutput "
                                     f"says {source}")
        if event["kind"] == "resumed" and not use_v2 and req_id not in resumed_ids \
                and not resumed_flags:
            raise NormalisationError(f"{req_id} resumed but not in resumed_req_ids")
        if computed != event["num_computed_tokens"]:
            raise NormalisationError(f"{req_id}: num_computed_tokens {event['num_computed_tokens']} "
                                     f"(hook) vs {computed} (SchedulerOutput)")
        if event["new_block_ids"] is not None and event["new_block_ids"] != blocks:
            raise NormalisationError(f"{req_id}: new blocks {event['new_block_ids']} (hook) vs "
                                     f"{blocks} (SchedulerOutput)")
        drafts = list(spec_tokens.get(req_id, ()))
        if event["kind"] == "running" and drafts != event["spec_token_ids"]:
            raise NormalisationError(f"{req_id}: drafts {event['spec_token_ids']} (hook) vs "
                                     f"{drafts} (SchedulerOutput)")
        event["num_computed_tokens"] = computed
        event["new_block_ids"] = blocks
        event["num_scheduled_tokens"] = scheduled[req_id]
        event["spec_token_ids"] = drafts
    preempted = sorted(so.preempted_req_ids) if hasattr(so, "preempted_req_ids") else \
        sorted(e["request_id"] for e in events if e["type"] == "preempt")
    total = so.total_num_scheduled_tokens
    return {"events": events, "num_scheduled_tokens": [[k, v] for k, v in scheduled.items()],
            "total_num_scheduled_tokens": total, "preempted_req_ids": preempted,
            "finished_req_ids": sorted(so.finished_req_ids),
            "token_budget": max_num_scheduled_tokens - total}


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
