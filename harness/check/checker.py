"""Check a trace's invariants from the trace alone, in one streaming pass.

``TraceChecker`` is the model (``harness.check.model.TraceModel``) plus one
handler per row kind. Each handler is the fixed, documented sequence for its
row: the families' checks (functions of ``harness.check.<family>``, each
reading the model before the update it guards) interleaved with the model's
updates, in the order vLLM 0.33.0 takes the corresponding decisions. That
order is part of the output (violations are reported in it), so a new check
goes where its data is first known. Every violation is a witness a human can
check (in the spirit of Jepsen's Elle): step, request, rule, the
contradicting values, and the request's recent events.

Over ~500 lines on purpose: each handler is the one place the order of its
row's checks and updates is visible, and one class keeps all of them side
by side; the checks themselves are in the family modules.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from reference.scheduler import PREFILL_LOOKAHEAD_RESERVED
from reference.words import plural

from harness.check import (
    blocks,
    budget,
    data_parallel,
    encoder,
    fences,
    hybrid,
    kv_connector,
    lifecycle,
    preemption,
    progress,
    queues,
    spec_decode,
)
from harness.check.encoder_cache import request_items
from harness.check.invariants import root_cause_first
from harness.check.model import Batch, ReqShadow, StepState, TraceModel, cdiv, compact_tokens, wide_tokens
from harness.check.profiles import Profile, reference_profile
from harness.check.profiles import resolve as resolve_profile
from harness.check.result import MAX_PER_INVARIANT, CheckResult, Violation
from harness.trace import Trace, TraceError
from harness.trace.schema import OBSERVED_SINCE

__all__ = ["MAX_PER_INVARIANT", "CheckResult", "TraceChecker", "Violation", "check_steps", "check_trace"]


def _as_list(value: Any) -> list[str]:
    """A row's queue as a list: the row's own list (no copy), or ``list(value)``
    (which raises TypeError for a null, as the copy it replaces did)."""
    return value if type(value) is list else list(value)


class TraceChecker(TraceModel):
    """Feed steps in order with ``check_step``; call ``finish`` at the end."""

    # -- shared sequences ----------------------------------------------------------
    def _acquire(self, req: ReqShadow, block: int, as_hit: bool) -> None:
        blocks.check_acquire(self, req, block, as_hit)
        self.take_block(req, block, as_hit)

    def _release_all(self, req: ReqShadow, freed: list[int], kind: str, fence: int | None = None,
                     ev: dict | None = None) -> None:
        """Drop the request's references in table order, tail first (a preempt,
        finish or abort row's ``block_ids``, checked against it; a hybrid
        model's group after group, ``harness.check.hybrid.free_order``); blocks
        reaching ref 0 enter the free queue, or for a deferred free stay held
        by the fence entry until it is drained."""
        parts = None
        if self.group_windows is not None:
            parts = hybrid.free_parts(self, req, deferred=fence is not None)
            expected = [b for part in parts for b in part]
            if ev is not None:
                hybrid.check_free_groups(self, req, ev, kind)
            hybrid.clear(req)
        else:
            expected = req.blocks[::-1]
        whole = (preemption.check_preempt_frees(self, req, freed, expected) if kind == "preempt"
                 else blocks.check_free_whole_table(self, req, freed, expected))
        if whole:
            blocks.check_free_order(self, req, freed, expected)
        fences.check_free_fence(self, req, kind, expected, fence)
        if fence is not None:
            self.defer_blocks(req, expected, fence)
        else:
            for part in parts or [expected]:  # a hybrid model: one free per KV-cache group
                self.return_blocks(part, req.request_id, kind)
        req.blocks = []
        req.registered = 0

    def _finish(self, ev: dict, kind: str) -> ReqShadow | None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if not queues.check_known(self, rid, req, f"{kind} of an unknown or finished request"):
            return None
        freed = list(ev["block_ids"] or [])
        if req.status == "WAITING_FOR_REMOTE_KVS" and not req.kv_done:
            # Its load may still write the blocks: they stay until it reports.
            if freed:
                kv_connector.check_finish_frees_nothing(self, rid, kind, freed)
                self._release_all(req, freed, kind, ev.get("fence"), ev)
            else:
                self.kv_abandoned[rid] = req
        else:
            self._release_all(req, freed, kind, ev.get("fence"), ev)
        self.kv_queue.discard(rid)
        self.inflight.pop(rid, None)
        if req.items:
            encoder.on_finish(self, req)
        # A finished request leaves whichever queue it was in.
        self.prev_running = [r for r in self.prev_running if r != rid]
        if queues.in_waiting(self, rid, self.prev_waiting):  # the backlog is long, a finish rarely in it
            self.prev_waiting = [r for r in self.prev_waiting if r != rid]
        req.status = ev["status"]
        self.finished_since_schedule.add(rid)
        self.note(req, f"{kind}: {ev['status']} ({ev['finish_reason']})")
        del self.reqs[rid]
        return req

    # -- events ---------------------------------------------------------------
    def check_step(self, step: int, events: list[dict[str, Any]]) -> None:
        """Check one step's rows (in trace order) and update the model."""
        self.step = step
        self.step_rows = events
        self.result.steps += 1
        self.result.events += len(events)
        st = StepState()
        for ev in events:
            if self.enc_active:
                encoder.before_event(self, ev, st)
            handler = getattr(self, "_on_" + ev["kind"], None)
            if handler is None:
                queues.check_unknown_kind(self, ev)
                continue
            handler(ev, st)
        self._resolve_reset(st)  # a reset in a step without schedule()
        if self.observed and not self.crashed:
            preemption.check_state_rows_present(self, st)

    def _identifiers(self, rid: str, positions: Any) -> list[str] | None:
        """The recorded identifiers of ``rid``'s encoder inputs (config
        ``mm_identifiers``), one per ``mm_positions`` item; TraceError when the
        counts differ (adversarial trial: a bare ValueError from zip)."""
        ids = self.mm_identifiers.get(rid)
        if ids and len(ids) != len(positions or ()):
            raise TraceError(f"bad config in metadata: mm_identifiers: request {rid} has {len(ids)} "
                             f"identifier(s) for {len(positions or ())} mm_positions item(s)")
        return ids

    def _on_arrival(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        # array('i'): 4 bytes a token, not a list's pointer and int object (the
        # memory of check grows with the backlog of waiting prompts, issue 24).
        prompt = compact_tokens(ev["prompt_token_ids"] or ())
        self.result.requests += 1
        positions = ev.get("mm_positions")
        if positions:
            self.enc_active = True
        queues.check_arrival(self, rid, prompt, positions)
        if self.unseen_config_ids:
            self._seen_config_id(rid)
        req = ReqShadow(rid, ev["priority"], ev["arrival_time_s"], len(prompt), ev["max_tokens"],
                        ev["min_tokens"], None if ev["ignore_eos"] else ev["eos_token_id"],
                        tuple(ev["stop_token_ids"] or ()), prompt,
                        items=request_items(prompt, positions, self._identifiers(rid, positions)))
        self.note(req, f"arrived, {len(prompt)} prompt tokens, max_tokens {req.max_tokens}")
        self.reqs[rid] = req
        st.arrived.append(rid)

    def _seen_config_id(self, rid: str) -> None:
        for ids in self.unseen_config_ids.values():
            ids.discard(rid)

    def _on_reject(self, ev: dict, st: StepState) -> None:
        if self.unseen_config_ids:
            self._seen_config_id(ev["request_id"])
        self.result.requests += 1
        self.result.rejected += 1
        queues.check_reject(self, ev)

    def _on_abort(self, ev: dict, st: StepState) -> None:
        req = self.reqs.get(ev["request_id"])
        if req is not None:
            lifecycle.check_output_count(self, ev, req)
            lifecycle.check_finish_within_max_tokens(self, ev, req)
        if self._finish(ev, "abort") is not None:
            self.result.aborted += 1
            st.aborted.add(ev["request_id"])

    def _on_reset_prefix_cache(self, ev: dict, st: StepState) -> None:
        """A scenario action before this step's schedule(): the row states
        the result and the running queue before; a forced reset's
        ``preempt`` rows follow (tail of running first), and the result is
        judged once they are applied (vLLM preempts, then resets)."""
        running = list(ev["running"] or [])
        queues.check_reset_running(self, running, [r for r in self.prev_running if r not in st.aborted])
        forced = ev.get("message") == "reset_running_requests"
        st.reset = (ev["status"] == "succeeded", forced)
        st.reset_victims = running[::-1] if forced else []
        if not st.reset_victims:
            self._resolve_reset(st)

    def _resolve_reset(self, st: StepState) -> None:
        if st.reset is None:
            return
        succeeded, forced = st.reset
        st.reset = None
        if forced:
            preemption.check_reset_done(self, st.reset_victims)
            st.reset_victims = []
        blocks.check_reset(self, succeeded, forced)
        if succeeded:
            self.forget_cache()

    def _on_reset_preempt(self, ev: dict, st: StepState) -> None:
        """A forced reset's victim: preempted outside schedule(), so the
        step's running-loop rules (victim choice, no admission after a
        preemption) do not apply; it moves from running to the head of waiting."""
        rid = ev["request_id"]
        self.result.preemptions += 1
        req = self.reqs.get(rid)
        expected = st.reset_victims.pop(0)
        if not preemption.check_reset_victim(self, rid, expected, req):
            return
        if rid != expected and rid in st.reset_victims:
            st.reset_victims.remove(rid)
            st.reset_victims.insert(0, expected)
        self._preempt_effects(req, ev, st)
        self.prev_running = [r for r in self.prev_running if r != rid]
        self.prev_waiting = [rid] + [r for r in self.prev_waiting if r != rid]
        st.reset_preempted.append(rid)
        if not st.reset_victims:
            self._resolve_reset(st)

    def _preempt_effects(self, req: ReqShadow, ev: dict, st: StepState) -> None:
        """What any preemption does to the request: its table given back,
        progress reset, drafts and placeholders dropped, in-flight output stale."""
        queues.check_computed(self, req, ev["num_computed_tokens"], "preempt")
        self._release_all(req, list(ev["block_ids"] or []), "preempt", ev.get("fence"), ev)
        if req.items:
            encoder.on_preempt(self, st, req)
        req.status = "PREEMPTED"
        req.num_preemptions += 1
        self.inflight.pop(req.request_id, None)
        req.num_computed_tokens = 0
        # Drafts never survive a preemption: the shadow drops them; what the
        # engine holds is checked at its request_state row (schema 6).
        req.spec_token_ids = []
        req.stale = req.in_flight  # output still in flight is stale
        req.placeholders = 0
        self.note(req, f"preempted with {ev['num_computed_tokens']} computed tokens")

    def _on_schedule_begin(self, ev: dict, st: StepState) -> None:
        self._resolve_reset(st)  # a forced reset whose victims did not all come
        # The row's waiting queue is used as it is: nothing in the checker edits a
        # waiting list in place, so no copy of the backlog (issue 24). Running
        # (at most max_num_seqs ids) is copied: st.sim_running is edited.
        running, waiting = list(ev["running"]), _as_list(ev["waiting"])
        st.running_before, st.waiting_before = running, waiting
        st.sim_running = list(running)
        st.enc.budget_left = self.enc_budget
        change = queues.follow_waiting(self, waiting)
        queues.check_queues_at_start(self, st, running, waiting, change)
        blocks.check_conservation(self, "schedule_begin", ev["num_free_blocks"])
        st.eligible = len(running) + len(waiting)
        st.defer = budget.expected_defer(self, ev, running)
        progress.snapshot(self, st, running, ev["num_free_blocks"])

    def _on_preempt(self, ev: dict, st: StepState) -> None:
        if st.reset is not None and st.reset_victims:
            self._on_reset_preempt(ev, st)
            return
        rid = ev["request_id"]
        self.result.preemptions += 1
        preemption.check_no_admission_before(self, st, rid)
        req = self.reqs.get(rid)
        kv_connector.check_not_loading(self, req, "preempted")
        if not preemption.check_victim(self, st, rid, req):
            return
        if preemption.check_scheduled_victim_withdrawn(self, st, rid):
            st.scheduled.remove(rid)
            st.kept_victims.append(rid)
        progress.on_preempt(self, st, rid, ev.get("fence"))
        self._preempt_effects(req, ev, st)
        if rid in st.sim_running:
            index = st.sim_running.index(rid)
            st.sim_running.remove(rid)
            if index < st.last_running_index:
                st.last_running_index -= 1
        st.preempted.append(rid)

    def _on_skipped_free(self, ev: dict, st: StepState) -> None:
        """A hybrid model's window free (``harness.check.hybrid.on_skipped_free``)."""
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if not queues.check_known(self, rid, req, "skipped_free of an unknown or finished request"):
            return
        if self.group_windows is None:
            queues.check_unknown_kind(self, ev)
            return
        hybrid.on_skipped_free(self, req, ev)

    def _on_withdraw(self, ev: dict, st: StepState) -> None:
        """PRIORITY give-back: undo this step's scheduling of a victim."""
        rid, n = ev["request_id"], ev["num_scheduled_tokens"]
        req = self.reqs.get(rid)
        if not preemption.check_withdraw(self, st, rid, n, req):
            return
        st.scheduled.remove(rid)
        st.running_scheduled.discard(rid)
        st.total -= st.scheduled_tokens.pop(rid, 0)
        st.withdrawn.append(rid)
        if self.enc_active:
            encoder.on_withdraw(self, ev, st, rid)
        req.num_computed_tokens -= n
        req.in_flight -= n
        req.placeholders -= st.placeholders_added.pop(rid, 0)
        self.unregister_withdrawn(req, st.registered_before.pop(rid, req.registered))
        self.note(req, f"withdrawn: {plural(n, 'token')} given back")

    def _on_schedule(self, ev: dict, st: StepState) -> None:
        rid, kind = ev["request_id"], ev["schedule_kind"]
        n, computed = ev["num_scheduled_tokens"], ev["num_computed_tokens"]
        hit = ev["num_prefix_hit_tokens"] or 0
        req = self.reqs.get(rid)
        if not queues.check_known(self, rid, req, "scheduled an unknown or finished request"):
            return
        queues.check_scheduled_once(self, st, rid)
        kv_connector.check_not_loading(self, req, "scheduled")
        st.scheduled.append(rid)
        st.total += n
        st.scheduled_tokens[rid] = n
        if not budget.check_entry(self, st, rid, n):
            return
        drafts = list(ev["spec_token_ids"] or [])
        st.drafts[rid] = drafts
        blocks_before = len(req.blocks)
        groups_before = hybrid.table_lengths(self, req) if self.group_windows is not None else ()
        processed = computed - req.in_flight  # tokens whose steps are processed (the window's base)
        if kind == "running":
            progress.on_running_scheduled(self, st, rid, len(ev["block_ids"] or []))
            fences.check_not_past_max_tokens(self, req, computed)
            spec_decode.check_running_drafts(self, req, computed, n, drafts)
            if req.prefill_chunk:
                st.prefill_scheduled = True
                budget.check_chunk_not_deferred(self, st, req, computed)
            queues.check_running_order(self, st, req)
            queues.check_computed(self, req, computed, "running")
            budget.check_span_model_len(self, rid, computed, n)
            if self.group_windows is not None:
                hybrid.check_window_freed(self, req, processed)
                hybrid.acquire_running(self, req, ev)
            else:
                for block in ev["block_ids"] or []:
                    self._acquire(req, block, as_hit=False)
        else:
            spec_decode.check_admission_drafts(self, req, computed, n, drafts)
            self._on_admission(ev, st, req, kind, hit, computed, n)
        budget.check_span_tokens(self, req, computed, n, drafts)
        if self.group_windows is not None:
            hybrid.check_cover(self, req, groups_before, computed + n, processed)
        else:
            blocks.check_blocks_cover(self, req, blocks_before, computed + n)
        req.num_computed_tokens = computed + n
        req.in_flight += n
        req.prefill_chunk = computed + n < req.num_tokens + req.placeholders
        if self.async_scheduling and not req.prefill_chunk:
            st.placeholders_added[rid] = 1 + len(drafts)
            req.placeholders += 1 + len(drafts)
            spec_decode.set_async_draft_placeholders(self, req)
        st.ends[rid] = computed + n
        st.registered_before[rid] = (req.registered if req.groups is None
                                     else tuple(req.group_registered))  # type: ignore[assignment]
        self.register_full_blocks(req, computed + n)
        self.note(req, f"scheduled {kind}: computed {computed} + {n}"
                       + (f", prefix hit {hit}" if kind != "running" else "")
                       + f", new blocks {list(ev['block_ids'] or [])}")
        if kind == "running":
            st.running_scheduled.add(rid)
        if req.items or ev.get("encoder_input_ids"):
            encoder.on_schedule(self, ev, st, req, computed, n)

    def _on_admission(self, ev: dict, st: StepState, req: ReqShadow, kind: str, hit: int,
                      computed: int, n: int) -> None:
        rid = req.request_id
        preemption.check_no_admit_after_preempt(self, st, rid, f"admitted ({kind})")
        queues.check_admission_status(self, req, kind)
        fences.check_no_stale_at_admission(self, req, kind)
        queues.check_next_in_waiting(self, st, rid, "admission")
        budget.check_room_to_admit(self, st, rid, "admission")
        st.admitted.append(rid)
        st.sim_running.append(rid)
        self.deferred_waiting.discard(rid)
        self.kv_queue.discard(rid)
        if computed + n < req.num_tokens:
            self.inflight[rid] = None
        if computed < req.num_tokens - 1:
            st.prefill_admitted = True
            budget.check_admission_not_deferred(self, st, req, computed)
        block_ids = list(ev["block_ids"] or [])
        if req.num_computed_tokens > 0:
            # A finished async load: no lookup; it keeps its table and grows it.
            blocks.check_no_lookup_with_loaded_kv(self, rid, hit)
            queues.check_computed(self, req, computed, "loaded")
            if self.group_windows is not None:
                hybrid.check_window_freed(self, req, computed - req.in_flight)
                hybrid.admit_loaded(self, req, ev)
            else:
                blocks.check_loaded_table_kept(self, req, block_ids)
                for block in block_ids[len(req.blocks):]:
                    self._acquire(req, block, as_hit=False)
            req.status = "RUNNING"
            return
        if preemption.check_still_holding(self, req):
            self._release_all(req, req.blocks[::-1], "finish")
        external = queues.admission_computed(self, req, computed, hit)
        if external:
            self.note(req, f"{plural(external, 'external token')} computed at admission (a synchronous KV load)")
        if self.group_windows is not None:
            hybrid.admit(self, req, ev, hit, external)
            req.status = "RUNNING"
            self.result.prefix_hit_tokens += hit
            return
        n_hit = hit // self.bs
        blocks.check_prefix_hit(self, req, hit, block_ids)
        for i, block in enumerate(block_ids):
            self._acquire(req, block, as_hit=i < n_hit)
        req.status = "RUNNING"
        self.result.prefix_hit_tokens += hit

    def _on_schedule_end(self, ev: dict, st: StepState) -> None:
        budget.check_totals(self, ev, st)
        budget.check_loras(self, st)
        if self.defer and st.total > 0:
            self.sched_seq += 1
            for rid in st.scheduled:
                self.reqs[rid].last_sched_seq = self.sched_seq
        self.batches.append(Batch(self.step, list(st.scheduled), dict(st.scheduled_tokens),
                                  dict(st.drafts), dict(st.ends), st.total))
        queues.check_batches_in_flight(self)
        running = list(ev["running"])
        queues.check_running_after(self, st, running)
        budget.check_running_size(self, running)
        waiting = _as_list(ev["waiting"])
        taken = queues.head_taken(st.waiting_before, st.admitted, st.skipped,
                                  queues.counts_of(self, st.waiting_before))
        change = queues.follow_waiting(self, waiting)
        if not (self.policy == "fcfs" and not st.skipped and not self.kv_queue
                and not (self.profile.victims_behind_skipped and self.deferred_waiting)
                and queues.waiting_at_end_follows(self, st, waiting, change, taken)):
            # (Else the row's change shows waiting is the victims, reversed, + the rest
            # of the waiting queue: PREEMPT-WAITING-HEAD and STATE-CONTINUITY hold
            # with no list walked, issue 24; the kv-holding queue stays empty.)
            self._waiting_after(st, waiting)
        self._end_of_schedule(ev, st, running, waiting)

    def _waiting_after(self, st: StepState, waiting: list[str]) -> None:
        """PREEMPT-WAITING-HEAD and STATE-CONTINUITY of waiting after schedule(),
        from the whole lists: what the queue at step start less the admissions
        and skips, and the victims leave, kv-holding queue first; updates
        ``kv_queue``."""
        # Two queues, examined kv-holding first (spec 10.2): a skipped request
        # returns to the head of the queue it now belongs to, in the order met.
        rest = queues.remaining(st.waiting_before, st.admitted, st.skipped)
        skipped_kv = [r for r in st.skipped if self.holds_kv(r)]
        # (Each list below walks the backlog only when a KV queue exists.)
        kv_after = skipped_kv + ([r for r in rest if r in self.kv_queue] if self.kv_queue else [])
        wait_after = ([r for r in st.skipped if r not in skipped_kv]
                      + ([r for r in rest if r not in self.kv_queue] if self.kv_queue else rest))
        self.kv_queue = set(kv_after)
        num_kv = len(kv_after)
        if self.policy == "fcfs":
            # Victims go to the head of waiting in their old running order
            # (profile knob: behind the requests skipped earlier, which a
            # release with a skipped_waiting queue serves first).
            held = ([r for r in wait_after if r in self.deferred_waiting]
                    if self.profile.victims_behind_skipped and self.deferred_waiting else [])
            if held:
                wait_after = [r for r in wait_after if r not in held]
            if preemption.check_fcfs_victims_at_head(self, st, waiting, num_kv + len(held)):
                queues.check_waiting_after_fcfs(self, waiting,
                                                kv_after + held + st.preempted[::-1] + wait_after
                                                if kv_after or held or st.preempted else wait_after)
        else:
            preemption.check_priority_waiting_order(self, waiting, num_kv)
            queues.check_waiting_after_priority(self, st, waiting, kv_after, wait_after)

    def _end_of_schedule(self, ev: dict, st: StepState, running: list[str], waiting: list[str]) -> None:
        """``schedule_end``'s checks after the queues, in order."""
        for rid in st.scheduled:
            req = self.reqs.get(rid)
            if req is not None and not req.prefill_chunk:
                self.inflight.pop(rid, None)
        preemption.check_withdrawn_preempted(self, st)
        lifecycle.check_request_data(self, ev, st.scheduled + st.kept_victims)
        lifecycle.check_reported_ids(self, ev, st)
        preemption.check_reset_victims_reported(self, ev, st)
        self.finished_since_schedule = set()
        if self.enc_active:
            encoder.on_schedule_end(self, ev, st)
        blocks.check_conservation(self, "schedule_end", ev["num_free_blocks"])
        lifecycle.check_idle_admission(self, ev, st)
        lifecycle.check_progress(self, st)
        progress.check_step(self, ev, st, running, waiting)
        progress.note_running(self, running)
        self.result.deferred_prefill_steps += bool(ev["defer_prefills"])
        budget.check_defer_flag(self, ev, st)
        if not st.preempted and not st.defer:
            # Fewer skipped ids than waiting ones: some waiting id is not skipped,
            # whatever the intersection (no hash of every backlog id).
            self.capacity_bound = len(waiting) > (len(self.deferred_waiting.intersection(waiting))
                                                  if len(self.deferred_waiting) >= len(waiting) else 0)
        budget.check_capacity_flag(self, ev, waiting)
        if st.total > 0:
            self.num_executed += 1
        if self.interval > 1 and (st.prefill_scheduled or st.prefill_admitted):
            self.last_prefill_step = self.num_executed
        self.prev_running, self.prev_waiting = running, waiting
        st.sim_running = running

    def _on_request_state(self, ev: dict, st: StepState) -> None:
        """What a request holds after schedule() (rows after ``schedule_end``)
        or after the draft update (rows after the ``draft`` rows): observed,
        never assumed. The shadow keeps what a correct engine holds."""
        rid = ev["request_id"]
        if not queues.check_known(self, rid, self.reqs.get(rid), "state of an unknown or finished request"):
            return
        preemption.check_state_row(self, st, ev, "schedule()" if st.batch is None else "the draft update")
        if st.batch is None:
            st.state_rows.add(rid)

    def _on_skip(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        queues.check_next_in_waiting(self, st, rid, "skip")
        if req is not None and req.status == "WAITING_FOR_REMOTE_KVS":
            kv_connector.check_skip_loading(self, req)
        elif rid not in st.enc.zero and not kv_connector.match_pending(self, ev) \
                and not (self.prefill_lookahead and ev.get("message") == PREFILL_LOOKAHEAD_RESERVED
                         and req is not None and req.num_computed_tokens < req.num_tokens):
            # (an encoder plan may cut the window to 0 tokens; a connector may not tell yet;
            # so may a drafter's prefill look-ahead, a prefill's window that would end in it)
            fences.check_skip_reason(self, ev, req)
        st.skipped.append(rid)
        self.deferred_waiting.add(rid)
        if req is not None:
            self.note(req, f"skipped: {ev['message']}")

    def _on_encoder_plan(self, ev: dict, st: StepState) -> None:
        encoder.on_encoder_plan(self, ev, st)

    # -- KV connector (spec 7.2) ------------------------------------------------
    def _on_kv_load(self, ev: dict, st: StepState) -> None:
        """An async KV-load admission: local hit + blocks for the external
        tokens, WAITING_FOR_REMOTE_KVS, nothing scheduled; it left the
        reservation of in-flight prefills free."""
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        self.result.remote_kv_loads += 1
        if not queues.check_known(self, rid, req, "KV load for an unknown or finished request"):
            return
        hit, ext = ev["num_prefix_hit_tokens"] or 0, ev["num_external_tokens"] or 0
        kv_connector.check_load_start(self, rid)
        preemption.check_no_admit_after_preempt(self, st, rid, "started a KV load")
        queues.check_next_in_waiting(self, st, rid, "kv_load")
        budget.check_room_to_admit(self, st, rid, "kv_load")
        kv_connector.check_load_request(self, req)
        # A request that still holds blocks keeps them (its table only
        # grows), so the shadow pool stays in step after the witness.
        block_ids = list(ev["block_ids"] or [])
        held = len(req.blocks) if block_ids[:len(req.blocks)] == req.blocks else 0
        kv_connector.check_load_size(self, req, hit, ext)
        n_hit = hit // self.bs
        reserved = kv_connector.expected_reservation(self, ev, rid)
        if self.group_windows is not None:
            # Each group's table, as an admission with the connector's tokens
            # (hybrid.admit: the hit per group, window slots null, the rest new).
            hybrid.admit(self, req, ev, hit, ext)
            hybrid.check_load_cover(self, req, hit + ext)
        else:
            blocks.check_prefix_hit(self, req, hit, block_ids)
            for i, block in enumerate(block_ids[held:], held):
                self._acquire(req, block, as_hit=i < n_hit)
            blocks.check_load_cover(self, req, hit + ext)
        kv_connector.check_reservation_left_free(self, rid, reserved)
        # Hit blocks keep their content; loaded blocks are cached only at promotion.
        req.registered = n_hit
        req.status = "WAITING_FOR_REMOTE_KVS"
        req.num_computed_tokens = hit + ext
        req.kv_done = req.kv_failed = False
        self.inflight[rid] = None
        self.result.prefix_hit_tokens += hit
        st.skipped.append(rid)
        self.deferred_waiting.add(rid)
        self.note(req, f"KV load: hit {hit} + {ext} external tokens into {block_ids}")

    def _on_kv_promote(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if not queues.check_known(self, rid, req, "promoted an unknown or finished request"):
            return
        queues.check_next_in_waiting(self, st, rid, "kv_promote")
        kv_connector.check_promotable(self, req)
        computed = req.num_computed_tokens
        freed = list(ev["block_ids"] or [])
        if req.kv_failed and computed == 0:
            # Nothing valid arrived: every block goes back (no fence: vLLM
            # frees through the KV manager directly).
            if self.group_windows is not None:
                hybrid.free_loaded(self, req, ev, rid)
            else:
                blocks.check_free_order(self, req, freed, req.blocks[::-1])
                self.return_blocks(req.blocks[::-1], rid, "failed KV load")
            req.blocks, req.registered = [], 0
        else:
            kv_connector.check_valid_load_keeps_blocks(self, rid, freed)
            self.register_full_blocks(req, computed)
        # Bounded replay (vLLM 0.33.0 _update_waiting_for_remote_kv, _mark_prefix_replay):
        # a load that did not restore the window groups, or failed, is replayed over its
        # last window, which covers the last token.
        replayed = (min(self.prefix_replay_tokens, computed) if self.prefix_replay_tokens
                    and (req.kv_failed or rid not in self.window_loaded) else 0)
        if replayed:
            computed -= replayed
        elif computed == req.num_tokens:
            computed = req.num_tokens - 1  # the last token is recomputed to sample the next
        status = "PREEMPTED" if req.num_preemptions else "WAITING"
        kv_connector.check_promotion(self, ev, req, status, computed)
        req.status, req.num_computed_tokens = status, computed
        req.kv_done = req.kv_failed = False
        self.note(req, f"promoted ({ev['message']}): {computed} computed tokens")

    def _on_kv_invalid(self, ev: dict, st: StepState) -> None:
        """Failed loads: each loading request's computed count drops to the
        blocks before its first invalid block."""
        invalid = set(ev["block_ids"] or [])
        hit_blocks: set[int] = set()
        for rid, req in self.reqs.items():
            if req.status != "WAITING_FOR_REMOTE_KVS":
                continue
            for index, block in enumerate(req.blocks[:cdiv(req.num_computed_tokens, self.bs)]):
                if block in invalid:
                    hit_blocks.add(block)
                    req.num_computed_tokens = index * self.bs
                    req.kv_failed = True
                    st.kv_failed.append(rid)
                    self.result.failed_kv_loads += 1
                    self.note(req, f"KV load failed at block {block}: {req.num_computed_tokens} valid tokens")
                    break
        # A load whose request finished while loading may fail too; its
        # request is gone from the queues, so nothing changes (vLLM scans
        # only the waiting requests).
        for req in self.kv_abandoned.values():
            hit_blocks.update(b for b in req.blocks if b in invalid)
        kv_connector.check_invalid_blocks(self, invalid, hit_blocks)

    def _on_kv_finished(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        if rid in self.kv_abandoned:
            st.kv_free_due.add(rid)
            return
        req = self.reqs.get(rid)
        if kv_connector.check_transfer_done(self, rid, req):
            req.kv_done = True

    def _on_kv_free(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.kv_abandoned.pop(rid, None)
        kv_connector.check_abandoned_free(self, st, rid, req)
        if req is None:
            return
        st.kv_free_due.discard(rid)
        self._release_all(req, list(ev["block_ids"] or []), "finish", ev.get("fence"), ev)

    # -- update --------------------------------------------------------------------
    def _on_update_begin(self, ev: dict, st: StepState) -> None:
        """The oldest batch in flight is processed: its tokens leave flight."""
        if not queues.check_update_begin(self, ev):
            st.batch = Batch(-1, [], {}, {}, {}, 0)
            return
        batch = st.batch = self.batches.popleft()
        st.enc.cursor, st.enc.update_done = 0, not self.enc_active
        for rid in batch.scheduled:
            req = self.reqs.get(rid)
            if req is None:
                continue
            req.in_flight -= batch.tokens[rid]
            if req.stale > 0:
                st.stale.add(rid)
                req.stale -= batch.tokens[rid]
        if self.defer and batch.total > 0:
            self.processed_seq += 1
            st.expected_drains = 0
            for fence, _, _ in self.deferred:
                if fence > self.processed_seq:
                    break
                st.expected_drains += 1

    def _on_free_drain(self, ev: dict, st: StepState) -> None:
        blocks_, fence = list(ev["block_ids"] or []), ev["fence"]
        if not fences.check_drain_due(self, st, blocks_, fence):
            return
        head_fence, head_blocks, holder = self.deferred.popleft()
        st.drains += 1
        self.result.deferred_frees += 1
        fences.check_drain_is_oldest(self, fence, blocks_, head_fence, head_blocks)
        self.return_blocks(head_blocks, holder, "drain")

    def _on_output(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        tokens = list(ev["token_ids"] or [])
        if not lifecycle.check_output_in_batch(self, st, rid):
            return
        if not lifecycle.check_output_order(self, st, rid):
            return
        if self.enc_active:
            encoder.update_until(self, st, rid)
        if req is None:
            return  # finished (e.g. stopped by an earlier batch) while in flight: ignored
        st.outputs.add(rid)
        drafts = st.batch.drafts.get(rid, [])
        end = st.batch.ends.get(rid)
        if end is not None:  # None: its entry was not positive (BUDGET-TOKENS said so at schedule)
            lifecycle.check_output_complete(self, req, end, drafts, tokens)
        stale = rid in st.stale
        accepted = len(tokens) - 1
        spec_decode.check_acceptance(self, rid, tokens, drafts)
        if not stale:
            # Rejected drafts roll back (placeholders with them).
            rejected = max(len(drafts) - accepted, 0)
            if req.num_computed_tokens > 0:
                req.num_computed_tokens -= rejected
            if req.placeholders > 0:
                req.placeholders -= rejected
        self.result.draft_tokens += len(drafts)
        self.result.rejected_draft_tokens += max(len(drafts) - accepted, 0)
        if req.items:
            encoder.free_passed(self, req)  # after the rollback, before the new tokens
        had_placeholders = req.placeholders > 0
        stop = None
        token_ids = wide_tokens(req)
        for i, token in enumerate(tokens):
            token_ids.append(token)
            stop = lifecycle.stop_reason(self, req, token)
            if stop:
                if not stale:
                    req.num_computed_tokens -= len(tokens) - 1 - i
                break
        if not stale and req.placeholders > 0:
            req.placeholders -= len(tokens)
            fences.check_placeholders_left(self, req)
        st.expected_stop[rid] = stop
        if stop and req.items:
            encoder.on_finish(self, req)  # freed when it stops, before later requests' frees
        # Caching at update (blocks completed by accepted tokens): 0.33.0
        # whenever tokens were in flight or drafts verified; older releases
        # only in the AsyncScheduler (the profile says which).
        at_update = (had_placeholders or self.num_spec > 0 if self.profile.cache_at_update_with_spec
                     else self.async_scheduling)
        if not stale and req.status == "RUNNING" and at_update:
            self.register_full_blocks(req, req.num_computed_tokens - req.in_flight)
        if not stale and req.status == "RUNNING":
            # KV an engine may register now (its own moment: safety judges the
            # content, not the timing): the known tokens whose KV is computed
            # or in flight (a batch in flight runs before any later hit's), but
            # with drafts only what the outputs confirmed (an in-flight step's
            # draft positions may be rejected).
            self.note_written(req, req.num_computed_tokens - (req.in_flight if self.num_spec else 0))
        self.note(req, f"sampled {tokens}" + (f" (drafts {drafts})" if drafts else "")
                       + (" [stale, delivered]" if stale else "")
                       + (f" -> must stop ({stop})" if stop else ""))

    def _on_draft(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        drafts = list(ev["spec_token_ids"] or [])
        if spec_decode.check_stored_drafts(self, rid, req, drafts):
            req.spec_token_ids = drafts

    def _on_finish(self, ev: dict, st: StepState) -> None:
        rid = ev["request_id"]
        req = self.reqs.get(rid)
        if ev["status"] == "FINISHED_ERROR":
            kv_connector.check_finished_error(self, st, rid)
        elif req is not None:
            lifecycle.check_finish_reason(self, ev, req, st.expected_stop.get(rid))
        if req is not None:
            lifecycle.check_output_count(self, ev, req)
            lifecycle.check_finish_within_max_tokens(self, ev, req)
        if self._finish(ev, "finish") is not None:
            self.result.finished += 1
            st.finished.add(rid)

    def _on_update_end(self, ev: dict, st: StepState) -> None:
        lifecycle.check_stopped_finished(self, st)
        lifecycle.check_outputs_present(self, st)
        kv_connector.check_failed_loads_finished(self, st)
        kv_connector.check_abandoned_freed(self, st)
        fences.check_all_due_drained(self, st)
        self.prev_running = [r for r in self.prev_running if r not in st.finished]
        blocks.check_conservation(self, "update_end", ev["num_free_blocks"])

    def _on_crash(self, ev: dict, st: StepState) -> None:
        """The candidate raised: the step (and the run) ends here."""
        index = next(i for i, row in enumerate(self.step_rows) if row is ev)
        lifecycle.check_crash(self, ev, self.step_rows[:index])

    def finish(self) -> CheckResult:
        """Close the pass: liveness over the whole trace (after a crash only
        the crash is reported: the requests it cut off are not LIVENESS or
        end-of-trace KV findings of their own)."""
        lifecycle.check_liveness(self)
        if not self.crashed:
            kv_connector.check_end_of_trace(self)
        return self.result


def check_trace(trace: Trace, semantics: str = "auto", *, observe: Observer | None = None) -> CheckResult:
    """Check ``trace`` under the profile ``semantics`` names (``auto``: from
    its metadata; ``safety``; a profile name, ``harness.check.profiles``).
    The result says which profile ran and why, and (``notes``) what its
    schema version cannot show. ``observe``: see ``check_steps``. Raises
    ProfileError for an unknown name, TraceError for an unreadable trace."""
    profile, reason = resolve_profile(semantics, trace.meta)
    salvaged = trace.summary.get("salvaged")
    protocol = trace.summary.get("protocol")
    skip = unjudged_rules(trace.meta)
    # The reader's queue changes (issue 24): the rules follow the backlog by them.
    changes: dict[int, Any] | None = {} if isinstance(trace, Trace) else None
    steps = trace.iter_steps(queue_changes=changes) if changes is not None else trace.iter_steps()
    try:
        result = check_steps(trace.meta["config"], steps, profile,
                             schema_version=trace.meta.get("schema_version"),
                             truncated=salvaged is not None or protocol is not None,
                             observe=observe, skip=skip, queue_changes=changes)
    except TraceError as exc:  # the model's refusals name no file: this one is
        path = getattr(trace, "path", None)  # (any iterable of steps with meta and summary is checked)
        if path is None or str(exc).startswith(f"{path}:"):
            raise
        raise TraceError(f"{path}: {exc}") from None
    result.profile_reason = reason
    if salvaged is not None:
        result.notes.append(f"{salvaged}: LIVENESS and the end-of-trace checks not run")
    if protocol is not None:
        result.notes.append(f"{protocol}: the steps before it are checked; LIVENESS and the "
                            f"end-of-trace checks not run")
    for feature, rules in _by_feature(skip).items():
        result.notes.append(f"{', '.join(rules)}: not judged ({feature}: the model cannot follow it)")
    return result


def unjudged_rules(meta: dict[str, Any]) -> dict[str, str]:
    """``{rule id: the feature's description}`` for the rules a trace's recorded
    features keep the model from judging (empty for every trace but a vLLM
    recording with one of ``UNMODELLED_RULES``'s features)."""
    from harness.check.invariants import UNMODELLED_RULES  # the catalogue imports the families

    from harness.check.invariants import RECORDED_CONNECTOR_UNJUDGED

    recording = meta.get("vllm_recording")
    features = recording.get("unmodelled") if isinstance(recording, dict) else None
    if not isinstance(features, dict):
        return {}
    # A connector whose answers the trace recorded is followed by the model
    # (harness.check.kv_connector): only what it cannot count yet is skipped.
    recorded = connector_followed(meta)
    out: dict[str, str] = {}
    for feature, description in sorted(features.items()):
        rules = UNMODELLED_RULES.get(feature, ())
        if feature == "kv_connector" and recorded:
            rules = tuple(r for r in rules if r in RECORDED_CONNECTOR_UNJUDGED)
        for rule in rules:
            out.setdefault(rule, description)
    return out


def connector_followed(meta: dict[str, Any]) -> bool:
    """True when the trace's config carries a recorded KV connector's answers
    (``kv_connector_matches``): the model follows that connector, so the
    ``kv_connector`` feature keeps only ``RECORDED_CONNECTOR_UNJUDGED`` unjudged."""
    config = meta.get("config")
    return isinstance(config, dict) and config.get("kv_connector_matches") is not None


def _by_feature(skip: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for rule, feature in skip.items():
        out.setdefault(feature, []).append(rule)
    return out


def unobserved_notes(schema_version: int | None) -> list[str]:
    """One line per check a trace of ``schema_version`` cannot feed (None:
    the current schema, e.g. rows made in memory), such as
    "SCHEDULED-HAS-DATA: not checkable on schema 5 (no request_data_ids: ...)".
    Empty from schema 6 on."""
    if schema_version is None or schema_version >= OBSERVED_SINCE:
        return []
    # Each family names the checks of its own that need schema 6 (NEEDS_OBSERVED).
    return [f"{inv}: {part + ' ' if part else ''}not checkable on schema {schema_version} ({why})"
            for family in (preemption, lifecycle)
            for inv, (part, why) in family.NEEDS_OBSERVED.items()]


#: Called after each step is checked with (step, its rows, the per-rank
#: checkers, rank 0 first): what the shadow state holds then (the report's
#: series read block ownership and cached content from it; harness.view).
Observer = Callable[[int, list[dict[str, Any]], list[TraceChecker]], None]


def check_steps(config: dict[str, Any], steps: Iterable[tuple[int, list[dict[str, Any]]]],
                profile: Profile | None = None, *, schema_version: int | None = None,
                  truncated: bool = False, observe: Observer | None = None,
                skip: dict[str, str] | None = None, queue_changes: dict[int, Any] | None = None) -> CheckResult:
    """Run every invariant ``profile`` checks (default: the reference's,
    every rule of the vLLM version it mirrors) over ``steps`` (as yielded by
    ``Trace.iter_steps``; ``schema_version``: the trace's, for the notes on
    what it cannot show).

    With data parallelism each rank's rows go to its own checker (its own
    scheduler and KV pool), and the coordinator's routing is checked across
    ranks (``harness.check.data_parallel``); the results are merged.
    ``schema_version``: the trace's (its metadata); below 6 the result's
    ``notes`` name the checks its rows cannot feed (``unobserved_notes``),
    which are then not violations but not checked either. ``truncated``:
    the rows end where the run was cut off (a salvaged trace,
    ``harness.trace.salvage``): as after a crash, the requests still live
    at the end are not LIVENESS findings. ``observe`` (optional) sees the
    shadow state after every step; it must not change it. ``queue_changes``:
    the dict the reader fills with each rebuilt waiting list's change
    (``Trace.iter_steps(queue_changes=...)``), which lets the queue rules
    follow the backlog by its changes; the verdicts are the same without it.
    """
    profile = profile if profile is not None else reference_profile()
    # A trace known to record what each step leaves behind (rows made in
    # memory, schema_version None, are the recorder's own: nothing to doubt).
    observed = schema_version is not None and schema_version >= OBSERVED_SINCE
    with _rare_full_collections():
        result = _check_steps(config, steps, profile, observed, truncated, observe, frozenset(skip or ()),
                              queue_changes)
    # Several ids for one request in one step: the root cause first (harness.check.invariants).
    result.violations = root_cause_first(result.violations)
    result.profile = profile.name
    result.notes += unobserved_notes(schema_version)
    return result


@contextmanager
def _rare_full_collections() -> Iterator[None]:
    """The cyclic GC's full (generation 2) collections made rarer while a
    trace is checked (issue 24): each one walks every live object, and the
    live requests of a long backlog are most of them, so at the default
    threshold their cost per row grew with the backlog (the whole Azure code
    trace: 1.07x the CPU per row of its first 500 requests with the collector
    off, about 1.4x with it on). Young collections still run as usual, so
    short-lived cycles are freed as before; the threshold is restored after."""
    threshold = gc.get_threshold()
    if len(threshold) >= 3:
        gc.set_threshold(threshold[0], threshold[1], max(threshold[2], _FULL_COLLECTION_EVERY))
    try:
        yield
    finally:
        gc.set_threshold(*threshold)


#: Generation-1 collections between full collections while checking (CPython's default: 10).
_FULL_COLLECTION_EVERY = 1000


def _check_steps(config: dict[str, Any], steps: Iterable[tuple[int, list[dict[str, Any]]]],
                 profile: Profile, observed: bool, truncated: bool = False,
                 observe: Observer | None = None, skip: frozenset[str] = frozenset(),
                 queue_changes: dict[int, Any] | None = None) -> CheckResult:
    dp = config.get("data_parallel_size", 1)
    if dp == 1:
        checker = TraceChecker(config, profile, observed=observed)
        checker.queue_changes = queue_changes
        checker.checked = checker.checked - skip  # rules the model cannot judge here
        for step, events in steps:
            checker.check_step(step, events)
            if observe is not None:
                observe(step, events, [checker])
        # A run cut off (salvaged) ended like a crashed one: no end-of-run findings.
        checker.crashed = checker.crashed or truncated
        result = checker.finish()
        result.notes += unknown_config_ids_notes([checker], truncated)
        return result
    checkers = [TraceChecker(config, profile, observed=observed) for _ in range(dp)]
    for checker in checkers:
        checker.checked = checker.checked - skip
        checker.queue_changes = queue_changes  # (each rank's rows: its own chain of changes)
    for checker in checkers:
        checker.interval = 1  # the cadence is the coordinator's throttle flag
        checker.dp_interval = config.get("prefill_schedule_interval", 1)
    routing = TraceChecker(config, profile, observed=observed)  # coordinator violations only
    num_steps = 0
    for step, events in steps:
        num_steps += 1
        routing.step = step
        data_parallel.check_routing(routing, checkers, events)
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for ev in events:
            by_rank.setdefault(ev.get("rank") or 0, []).append(ev)
        for rank, rank_events in sorted(by_rank.items()):
            if data_parallel.check_rank(routing, rank, dp):
                checkers[rank].check_step(step, rank_events)
        if observe is not None:
            observe(step, events, checkers)
    # A crash on one rank ends every rank's run: none reports LIVENESS for it.
    crashed = truncated or any(c.crashed for c in checkers)
    for checker in checkers:
        checker.crashed = crashed
    results = [c.finish() for c in checkers] + [routing.result]
    merged = CheckResult(steps=num_steps)
    for r in results:
        for name in ("requests", "finished", "rejected", "aborted", "preemptions", "prefix_hit_tokens",
                     "draft_tokens", "rejected_draft_tokens", "deferred_frees",
                     "deferred_prefill_steps", "remote_kv_loads", "failed_kv_loads", "events",
                     "num_violations"):
            setattr(merged, name, getattr(merged, name) + getattr(r, name))
        merged.violations += r.violations
        for inv, count in r.by_invariant.items():
            merged.by_invariant[inv] = merged.by_invariant.get(inv, 0) + count
    merged.notes += unknown_config_ids_notes(checkers, truncated)
    return merged


def unknown_config_ids_notes(checkers: list[TraceChecker], truncated: bool) -> list[str]:
    """One warning line per config key (``mm_identifiers``, ``lora_int_ids``)
    naming request ids that no arrival or reject row of the whole trace has
    (every rank's ``checkers`` together), with the count and the smallest id:
    such an entry is ignored, likely a typo or a config meant for another
    trace. None for a ``truncated`` trace (cut at a step: the requests after
    the cut are legitimately absent). Notes, never violations."""
    if truncated:
        return []
    notes = []
    for key in ("mm_identifiers", "lora_int_ids"):
        sets = [c.unseen_config_ids.get(key) for c in checkers]
        if not sets or any(s is None for s in sets):
            continue
        unknown = set.intersection(*sets)
        if unknown:
            notes.append(f"warning: config {key} names {plural(len(unknown), 'request id')} no row of the "
                         f"trace has, e.g. {min(unknown)!r} (ignored)")
    return notes
