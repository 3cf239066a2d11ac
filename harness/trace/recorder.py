"""Turn engine steps into trace rows, and record whole runs.

The row order inside a step is the order things happened (docs/trace-format.md):
inputs (``arrival``, ``reject``, ``abort``); if a batch was scheduled,
``schedule_begin`` (state before), decisions (``encoder_plan``, ``schedule``,
``withdraw``, ``preempt``, ``skip``, ``kv_load``, ``kv_promote`` as taken) and
``schedule_end`` (state after); if the oldest batch in flight was processed,
``update_begin`` (which batch), ``free_drain`` (deferred frees released),
``kv_invalid`` (failed KV loads), ``output`` (model output), ``finish``,
``kv_finished`` (+ ``kv_free``), ``draft``, ``update_end``. ``request_state``
rows (schema 6) follow ``schedule_end`` (what the step's victims, and any
request not running that holds drafts, hold after schedule()) and precede
``update_end`` (any request not running that holds drafts after the draft
update). A step whose candidate raised (``StepRecord.crash``) keeps the rows
of what happened before, as far as ``Crash.stage`` says they are known, and
ends on a ``crash`` row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import reference
from reference.config import EngineConfig
from reference.candidate import CandidateCrash, CandidateFactory
from reference.engine import Crash, Engine, EngineStalled, EngineSummary, StepRecord
from reference.output import (EncoderPlan, FinishedRequest, Preemption, PrefixCacheReset, Promotion,
                              RemoteLoad, RequestState, ScheduledRequest, Skip, SkippedFree, Withdrawal)
from reference.runners.base import RunnerFactory
from reference.scheduler import Scheduler
from reference.workload import RequestSpec, Workload
from workloads import load_workload, with_eos_stops

from harness.trace import TraceWriter
from harness.trace.rows import spec_from_row  # noqa: F401  (re-exported: callers import it from here)

Row = dict[str, Any]


def _request_fields(spec: RequestSpec) -> Row:
    return {
        "request_id": spec.request_id,
        "arrival_time_s": spec.arrival_time,
        "abort_time_s": spec.abort_time,
        "priority": spec.priority,
        "prompt_token_ids": list(spec.prompt_token_ids),
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.min_tokens,
        "ignore_eos": spec.ignore_eos,
        "eos_token_id": spec.eos_token_id,
        "stop_token_ids": list(spec.stop_token_ids),
        "scripted_output_len": spec.scripted_output_len,
        "mm_positions": [list(p) for p in spec.mm_positions] or None,
        "arrival_step": spec.arrival_step,
        "after": spec.after,
        "abort_step": spec.abort_step,
        "output_token_ids": None if spec.output_token_ids is None else list(spec.output_token_ids),
        "draft_acceptance_pattern": spec.draft_acceptance_pattern,
    }


def _groups(row: Row, group_block_ids: list[list[int]] | None) -> Row:
    """``row`` with a hybrid model's per-group block ids (schema 9); a
    one-group engine's rows never get the key, so its traces keep schema 8."""
    if group_block_ids is not None:
        row["group_block_ids"] = group_block_ids
    return row


def _finish_row(kind: str, fin: FinishedRequest) -> Row:
    return _groups({
        "kind": kind,
        "request_id": fin.request_id,
        "status": fin.status.name,
        "finish_reason": fin.finish_reason,
        "stop_reason": None if fin.stop_reason is None else str(fin.stop_reason),
        "num_output_tokens": fin.num_output_tokens,
        "block_ids": fin.freed_block_ids,
        "fence": fin.fence,
    }, fin.group_block_ids)


def step_rows(rec: StepRecord) -> list[Row]:
    """All rows of one step (every DP rank's, in rank order), with ``step``,
    ``event_index`` and ``rank`` filled in."""
    step = rec.step
    if not rec.peers:  # one rank (the usual case): one pass over its rows
        rows = _rank_rows(rec)
        rank = rec.rank
        for index, row in enumerate(rows):
            row["rank"] = rank
            row["step"] = step
            row["event_index"] = index
        return rows
    rows = []
    for record in [rec, *rec.peers]:
        for row in _rank_rows(record):
            row["rank"] = record.rank
            rows.append(row)
    for index, row in enumerate(rows):
        row["step"] = step
        row["event_index"] = index
    return rows


def _rank_rows(rec: StepRecord) -> list[Row]:
    rows: list[Row] = []
    rows += [{"kind": "arrival", **_request_fields(s)} for s in rec.arrivals]
    rows += [{"kind": "reject", "message": r.reason, **_request_fields(r.spec)} for r in rec.rejections]
    rows += [_finish_row("abort", f) for f in rec.aborts]
    rows += _action_rows(rec)
    out, crash = rec.output, rec.crash
    began = out is not None or (crash is not None and crash.stage == "schedule")
    if began:
        rows.append({"kind": "schedule_begin", "clock_s": rec.clock, "waiting": rec.waiting_before,
                     "running": rec.running_before, "num_free_blocks": rec.num_free_blocks_before,
                     "throttle_prefills": out.throttle_prefills if out is not None else rec.throttle_prefills})
    if out is not None:
        for event in out.events:
            rows.append(_decision_row(event))
    elif began:  # schedule() raised: the decisions it had taken, where known
        rows += [_decision_row(event) for event in crash.decisions]
    if out is not None and (crash is None or crash.stage != "schedule_end"):
        rows.append({"kind": "schedule_end", "waiting": rec.waiting_after, "running": rec.running_after,
                     "num_free_blocks": rec.num_free_blocks_after_schedule,
                     "token_budget": out.token_budget,
                     "total_num_scheduled_tokens": out.total_num_scheduled_tokens,
                     "preempted_req_ids": sorted(out.preempted_req_ids),
                     "finished_req_ids": sorted(out.finished_req_ids),
                     "defer_prefills": out.defer_prefills,
                     "prefill_capacity_bound": out.prefill_capacity_bound,
                     "free_encoder_mm_hashes": out.free_encoder_mm_hashes or None,
                     "request_data_ids": out.data_ids})
        rows += [_state_row(s) for s in rec.states_after_schedule]
    if rec.update is not None or (crash is not None and crash.stage == "update"):
        rows.append({"kind": "update_begin", "batch_step": rec.update_batch_step,
                     **({} if began else {"clock_s": rec.clock})})
    if rec.update is None:
        # update_from_output raised: the model output it was given is known.
        if crash is not None and crash.stage == "update":
            rows += [{"kind": "output", "request_id": req_id, "token_ids": tokens}
                     for req_id, tokens in rec.sampled.items() if tokens]
    else:
        rows += [{"kind": "free_drain", "fence": fence, "block_ids": blocks}
                 for fence, blocks in rec.update.drained]
        if rec.update.invalid_block_ids:
            rows.append({"kind": "kv_invalid", "block_ids": rec.update.invalid_block_ids})
        rows += [{"kind": "output", "request_id": req_id, "token_ids": tokens}
                 for req_id, tokens in rec.sampled.items() if tokens]
        rows += [_finish_row("finish", f) for f in rec.update.finished]
        kv_freed = {f.request_id: f for f in rec.update.kv_freed}
        for req_id in rec.update.finished_recving:
            rows.append({"kind": "kv_finished", "request_id": req_id})
            if req_id in kv_freed:
                rows.append(_groups({"kind": "kv_free", "request_id": req_id,
                                     "block_ids": kv_freed[req_id].freed_block_ids,
                                     "fence": kv_freed[req_id].fence}, kv_freed[req_id].group_block_ids))
        rows += [{"kind": "draft", "request_id": req_id, "spec_token_ids": drafts}
                 for req_id, drafts in rec.drafts.items()]
        if crash is None:
            rows += [_state_row(s) for s in rec.states_after_drafts]
            rows.append({"kind": "update_end", "num_free_blocks": rec.num_free_blocks_after_update})
    if crash is not None:
        rows.append(crash_row(crash))
    return rows


def crash_row(crash: Crash) -> Row:
    """The ``crash`` row: ``status`` the candidate method that raised,
    ``message`` ``"<ExceptionType>: <text>"``, ``stop_reason`` where (the
    innermost frame of candidate code, ``"path:line"``; docs/trace-format.md)."""
    return {"kind": "crash", "status": crash.call, "message": crash.message,
            "stop_reason": crash.where or None}


def _state_row(state: RequestState) -> Row:
    """A ``request_state`` row: what the request holds at that point of the
    step (after ``schedule_end``: after schedule(); before ``update_end``:
    after the draft update). ``spec_token_ids`` is [] when it holds none."""
    return {"kind": "request_state", "request_id": state.request_id, "status": state.status.name,
            "num_computed_tokens": state.num_computed_tokens,
            "spec_token_ids": list(state.spec_token_ids)}


def _action_rows(rec: StepRecord) -> list[Row]:
    """A step's workload actions, in order (schema 5): an abort action's
    ``abort`` rows; a reset's ``reset_prefix_cache`` row (``status``
    ``succeeded`` or ``refused``; ``running``: the running queue before;
    ``message``: ``reset_running_requests`` when it preempted them first)
    followed by its ``preempt`` rows, in the order taken."""
    rows: list[Row] = []
    for item in rec.actions:
        if isinstance(item, FinishedRequest):
            rows.append(_finish_row("abort", item))
            continue
        assert isinstance(item, PrefixCacheReset)
        rows.append({"kind": "reset_prefix_cache", "status": "succeeded" if item.succeeded else "refused",
                     "running": item.running_before,
                     "message": "reset_running_requests" if item.reset_running_requests else None})
        rows += [_decision_row(p) for p in item.preemptions]
    return rows


def _decision_row(event: ScheduledRequest | Withdrawal | Preemption | Skip) -> Row:
    if event.__class__ is ScheduledRequest:  # most rows: no isinstance chain before them
        return _schedule_row(event)
    if isinstance(event, Withdrawal):
        return _groups({"kind": "withdraw", "request_id": event.request_id,
                        "num_scheduled_tokens": event.num_scheduled_tokens, "block_ids": event.block_ids,
                        "encoder_input_ids": event.encoder_input_ids or None}, event.group_block_ids)
    if isinstance(event, SkippedFree):
        return {"kind": "skipped_free", "request_id": event.request_id, "block_ids": event.freed_block_ids,
                "group_block_ids": event.group_block_ids}
    if isinstance(event, EncoderPlan):
        return {"kind": "encoder_plan", "request_id": event.request_id,
                "num_computed_tokens": event.num_computed_tokens,
                "num_scheduled_tokens": event.num_scheduled_tokens,
                "encoder_input_ids": event.encoder_input_ids}
    if isinstance(event, Preemption):
        return _groups({"kind": "preempt", "request_id": event.request_id, "status": "RUNNING",
                        "num_computed_tokens": event.num_computed_tokens,
                        "block_ids": event.freed_block_ids, "fence": event.fence},
                       event.group_block_ids)
    if isinstance(event, Skip):
        return {"kind": "skip", "request_id": event.request_id, "message": event.reason}
    if isinstance(event, RemoteLoad):
        return _groups({"kind": "kv_load", "request_id": event.request_id,
                        "num_computed_tokens": event.num_prefix_hit_tokens,
                        "num_prefix_hit_tokens": event.num_prefix_hit_tokens,
                        "num_external_tokens": event.num_external_tokens,
                        "block_ids": event.block_ids, "reserved_blocks": event.reserved_blocks},
                       event.group_block_ids)
    if isinstance(event, Promotion):
        return _groups({"kind": "kv_promote", "request_id": event.request_id, "status": event.status.name,
                        "num_computed_tokens": event.num_computed_tokens,
                        "message": "load failed" if event.load_failed else "loaded",
                        "block_ids": event.freed_block_ids}, event.group_block_ids)
    return _schedule_row(event)


def _schedule_row(event: ScheduledRequest) -> Row:
    """A `schedule` row: the request scheduled, its tokens and new blocks."""
    return _groups({"kind": "schedule", "request_id": event.request_id, "schedule_kind": event.kind,
                    "num_computed_tokens": event.num_computed_tokens,
                    "num_scheduled_tokens": event.num_scheduled_tokens,
                    "num_prefix_hit_tokens": event.num_prefix_hit_tokens,
                    "block_ids": event.new_block_ids, "spec_token_ids": event.spec_token_ids or None,
                    "encoder_input_ids": event.encoder_input_ids or None},
                   event.group_block_ids)


def trace_metadata(workload: Workload, config: EngineConfig, seed: int, engine: str,
                   model: dict[str, Any] | None = None) -> dict[str, Any]:
    """The self-describing metadata every trace carries. ``model``: the
    real model runner's description (key ``model``, e.g. the torch runner's;
    absent for the scripted model). ``num_requests``: the workload's request
    count (traces recorded before it read without it)."""
    meta = {
        "engine": engine,
        # vllm@X.Y.Z traces carry the vLLM version; everything else ours.
        "engine_version": engine.split("@", 1)[1] if engine.startswith("vllm@") else reference.__version__,
        "vllm_semantics": reference.VLLM_VERSION,
        "config": config.to_dict(),
        "config_fingerprint": config.fingerprint(),
        "workload": {"source": workload.source, "sha256": workload.sha256,
                     "params": workload.params},
        "seed": seed,
        # The workload's size, so a trace missing requests (a salvaged recording cut at a
        # quiet point, its marker removed) reads as incomplete: Trace.incomplete.
        "num_requests": len(workload.requests),
    }
    if model is not None:
        meta["model"] = model
    return meta


def record_inputs(workload: str | Path, overrides: dict[str, str], *, limit: int | None = None,
                  time_scale: float = 1.0, seed: int = 0, priority_levels: int = 1,
                  stop_on_eos: bool = False) -> tuple[EngineConfig, Workload]:
    """The config and workload ``harness record`` runs: ``EngineConfig()``
    with ``overrides`` (``--set`` values, vLLM's names, parsed by
    ``EngineConfig.with_overrides``), and ``workloads.load_workload(workload,
    ...)``, ending on EOS when ``stop_on_eos`` (``with_eos_stops``).

    Raises ConfigError for a bad override (before the workload is read),
    WorkloadError or OSError for an unusable workload."""
    config = EngineConfig().with_overrides(overrides)
    wl = load_workload(workload, limit=limit, time_scale=time_scale, seed=seed,
                       priority_levels=priority_levels)
    return config, with_eos_stops(wl) if stop_on_eos else wl


def requests_ended(rec: StepRecord) -> int:
    """Requests that ended in the step of ``rec``, over every data-parallel
    rank (``rec.peers``): finished by its update, aborted, or rejected at
    arrival (a recording's progress, in requests)."""
    return sum(len(r.update.finished if r.update else ()) + len(r.aborts) + len(r.rejections)
               + sum(isinstance(a, FinishedRequest) for a in r.actions)
               for r in [rec, *rec.peers])


def record(workload: Workload, config: EngineConfig, out_path: str | Path, *, seed: int = 0,
           engine: str = "reference", candidate_factory: CandidateFactory = Scheduler,
           on_progress: Callable[[StepRecord], None] | None = None,
           runner_factory: RunnerFactory | None = None,
           model: dict[str, Any] | None = None,
           on_crash: Callable[[BaseException], None] | None = None) -> EngineSummary:
    """Run ``workload`` on the engine and write the trace to ``out_path``.

    The file appears only when the run completes (temp file + rename); on any
    exception nothing is left behind and an existing ``out_path`` is kept.
    A stalled engine (EngineStalled) is a finding, not a crash: the trace up to
    the stall is written, ``summary.stalled`` says why, and ``harness check``
    reports the requests left behind (LIVENESS). A candidate that raises in a
    step (CandidateCrash) is a finding too: the trace up to it, ending on its
    ``crash`` row, is written, ``summary.crashed`` holds the crash's one line
    (also in the footer) and ``harness check`` reports ENGINE-CRASH; a
    factory that raises (CandidateError) writes nothing. ``runner_factory`` (e.g. the
    torch runner's) replaces the scripted model; ``model`` describes it in
    the metadata. ``on_crash`` (optional) is handed the CandidateCrash (its
    ``__cause__`` the candidate's own exception: ``harness record --traceback``).
    """
    meta = trace_metadata(workload, config, seed, engine, model)
    # A factory may describe what it runs (vllm@PATH: the version found, the
    # git commit; a scheduler class): harness/candidates/vllm/candidate.py.
    meta.update(getattr(candidate_factory, "trace_metadata", None) or {})
    engine_obj = Engine(config, seed=seed, candidate_factory=candidate_factory,
                        runner_factory=runner_factory)
    with TraceWriter(out_path, meta) as writer:
        def on_step(rec: StepRecord) -> None:
            writer.add_step(step_rows(rec), copy=False)  # fresh rows, not kept
            if on_progress is not None:
                on_progress(rec)
        try:
            summary = engine_obj.run(workload, on_step)
        except EngineStalled as exc:
            summary = engine_obj.summary
            summary.stalled = writer.stalled = str(exc)
        except CandidateCrash as exc:
            summary = engine_obj.summary
            summary.crashed = writer.crashed = str(exc)
            if on_crash is not None:
                on_crash(exc)
    return summary


def run_to_rows(workload: Workload, config: EngineConfig, *, seed: int = 0,
                candidate_factory: CandidateFactory = Scheduler,
                on_step_rows: Callable[[int, list[Row]], None],
                runner_factory: RunnerFactory | None = None) -> EngineSummary:
    """Run the engine and hand each step's rows to ``on_step_rows`` (no file)."""
    engine_obj = Engine(config, seed=seed, candidate_factory=candidate_factory,
                        runner_factory=runner_factory)
    return engine_obj.run(workload, lambda rec: on_step_rows(rec.step, step_rows(rec)))
