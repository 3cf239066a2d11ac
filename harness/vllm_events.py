"""Normalise a real vLLM v1 ``Scheduler``'s decisions into the harness's event shapes.

STANDALONE: standard library only, no import side effects (no environment
variables set, no vLLM import at module level), so it can be imported inside a
vLLM server process (``harness/vllm_recording_scheduler.py``) as well as by the
subprocess driver. The functions here mirror ``harness/vllm_driver.py``'s
``Driver._install_hooks``, ``_normalise``, ``_finished_info``, ``snapshot``
and its prefill-gate recomputation in ``schedule``; the driver still carries
its own copies (see the report of the change that added this module: the
driver should call these instead).

Shapes (those of ``reference/output.py``, as the driver's protocol speaks them):
``normalise`` returns ``{events, num_scheduled_tokens, total_num_scheduled_tokens,
preempted_req_ids, finished_req_ids, token_budget}`` where ``events`` is the
chronological list of ``{"type": "schedule", request_id, kind,
num_computed_tokens, num_scheduled_tokens, num_prefix_hit_tokens,
new_block_ids, spec_token_ids}``, ``{"type": "withdraw", request_id,
num_scheduled_tokens, block_ids}`` and ``{"type": "preempt", request_id,
num_computed_tokens, freed_block_ids}``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect


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
    ``free_order``, when set to a list, collects request ids in the order
    ``free`` sees them (None: not tracked). ``active = False`` makes every
    wrapper a plain pass-through.
    """

    def __init__(self, sched) -> None:
        self.sched = sched
        self.seq: list[tuple] = []
        self.freed: dict[str, list[int]] = {}
        self.free_order: list[str] | None = None
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
            if hooks.free_order is not None:
                hooks.free_order.append(request.request_id)

        @functools.wraps(orig_preempt)  # keeps the signature for whoever wraps us
        def _preempt_request(request, *args, **kwargs):
            if not hooks.active:
                return orig_preempt(request, *args, **kwargs)
            computed_before = request.num_computed_tokens
            hooks.freed.pop(request.request_id, None)
            orig_preempt(request, *args, **kwargs)
            freed = hooks.freed.pop(request.request_id, None)
            if freed is None:
                raise NormalisationError(f"preemption of {request.request_id} freed no blocks "
                                         f"through kv_cache_manager.free (deferred free?)")
            hooks.seq.append(("preempt", request.request_id, computed_before, freed))

        kvm.allocate_slots = allocate_slots
        kvm.free = free
        sched._preempt_request = _preempt_request

    def begin(self) -> None:
        self.seq = []
        self.in_schedule = True

    def end(self) -> None:
        self.in_schedule = False


def num_free_blocks(sched) -> int:
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def snapshot(sched) -> dict:
    """``{waiting, running, num_free_blocks}``: queue orders (request ids) and free blocks."""
    waiting = [r.request_id for r in getattr(sched, "kv_holding_waiting", ())]
    waiting += [r.request_id for r in sched.waiting]
    return {"waiting": waiting, "running": [r.request_id for r in sched.running],
            "num_free_blocks": num_free_blocks(sched)}


def finished_info(request, freed_block_ids: list[int]) -> dict:
    """A finished (or aborted) request as the harness's ``FinishedRequest``."""
    reason = request.get_finished_reason()
    return {"request_id": request.request_id, "status": request.status.name,
            "finish_reason": None if reason is None else str(reason),
            "stop_reason": request.stop_reason,
            "num_output_tokens": request.num_output_tokens,
            "freed_block_ids": list(freed_block_ids)}


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
        else:
            _, req_id, computed_before, freed = item
            withdrawn = live.pop(req_id, None)
            if withdrawn is not None:
                if withdrawn["new_block_ids"] is None:
                    raise NormalisationError(f"admitted {req_id} preempted in the same step")
                events.append({"type": "withdraw", "request_id": req_id,
                               "num_scheduled_tokens": withdrawn["num_scheduled_tokens"],
                               "block_ids": list(withdrawn["new_block_ids"])})
            events.append({"type": "preempt", "request_id": req_id,
                           "num_computed_tokens": computed_before, "freed_block_ids": freed})

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
