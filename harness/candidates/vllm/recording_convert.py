"""Convert a recording scheduler's JSONL into a sched-harness trace (this project's venv).

The writer is ``harness/candidates/vllm/recording_scheduler.py`` (inside vLLM;
its docstring lists the records and what each holds); this is the one reader
of that JSONL: ``convert(jsonl_path, parquet_path)`` turns it into a Parquet
trace (``docs/trace-format.md``) that ``harness check`` and ``harness replay``
read, through ``harness.trace.TraceWriter`` (temp folder and rename). It
reads formats ``READABLE_FORMATS``; pyarrow and the ``reference`` package are
imported inside ``convert``. Grouping the JSONL into EngineCore steps (and
the protocol breaks) lives in ``recording_steps``; mapping vLLM's config and
KV-cache groups onto ``EngineConfig`` in ``recording_config``.

What ``convert`` does with them (the trace is replayable because of it):

* Request ids become ``r000000``, ``r000001``, ... in the order requests were
  added (the originals and their wall-clock arrival times are kept in the
  metadata under ``workload.params``).
* One trace step per ``EngineCore`` step: its ``schedule()`` call and the
  ``update_from_output()`` it made, of the oldest batch in flight (the same
  batch when synchronous; under async scheduling the one scheduled a step
  before, so its tokens arrive a step late, the trace's ``batch_step``). The
  records are grouped by vLLM's loop and checked: batches scheduled in order,
  at most ``max_concurrent_batches`` in flight, each update completing the
  oldest (a log out of order is refused, naming the line). The
  ``schedule()`` calls vLLM makes with nothing unfinished (only to report
  finished ids) are no batch of the trace (the reference engine makes no such
  call): dropped with their updates -- their step's aborts, or the update of
  an earlier batch it made, stay as a step without a schedule part -- and their
  ``finished_req_ids`` move to the next step that schedules.
* Times are virtual, on the reference engine's clock (``step_fixed_s +
  step_per_token_s * scheduled tokens`` per step): a request's
  ``arrival_time_s`` is the clock of the step it arrived in and its
  ``abort_time_s`` that of the step it was aborted in, so ``harness replay``
  delivers every arrival and abort in the step where vLLM saw it. Several
  aborts in one step get times a few ulps apart so that replay frees their
  blocks in vLLM's order.
* ``scripted_output_len`` is the output length of a request that stopped on
  EOS (the scripted model emits EOS there); null otherwise.
* ``finish_requests`` calls between ``schedule()`` and ``update_from_output()``
  (vLLM's ``_process_aborts_queue``: a client that disconnected while the
  model ran) cannot be placed in the trace's step order. By default
  (``SCHED_HARNESS_MID_STEP_ABORTS`` unset or ``record``) vLLM's timing is kept
  and the recording's ``abort`` record says ``mid_step``: the trace ends before
  that step (the footer's ``protocol``; the steps before it are checked). With
  ``SCHED_HARNESS_MID_STEP_ABORTS=defer`` (what ``harness serve-record`` sets;
  a server of your own sets it too) the recording scheduler applies such an
  abort right after ``update_from_output()`` (``_defer_mid_step_abort``: as if
  the disconnect had reached the engine a moment later), so it is recorded
  before the next ``schedule()``, where the trace has it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from harness.candidates.vllm.recording_config import (ENCODER_KEYS, ENCODER_UNMODELLED, hybrid_config,
                                                       items_unmodelled, map_config)
from harness.candidates.vllm.recording_scheduler import READABLE_FORMATS
from harness.candidates.vllm.recording_steps import ConvertError, engine_steps, new_notes, read_records

__all__ = ["ConvertError", "convert", "hybrid_config", "recording_path"]


def _unanswered_kv_decisions(sched: dict, line: int, promoted: set[str]) -> list[str]:
    """The requests of one ``schedule`` record whose connector decision has no
    recorded ``get_num_new_matched_tokens`` answer in that step (``kv_matches``):
    an async load (``kv_load``), or a fresh admission computing more than its
    local prefix hit (synchronous external tokens; not one resuming after its
    load was promoted, ``promoted``: the ids promoted and not yet admitted,
    kept across steps). vLLM 0.33.0 asks the connector at
    every fresh admission (``Scheduler.schedule``), so a missing answer means
    the recorder did not see the call: the answers cannot be followed."""
    answered = {m[0] for m in sched.get("kv_matches") or ()}
    out = []
    for e in sched["output"]["events"]:
        rid = e.get("request_id")
        if e["type"] == "kv_promote":
            promoted.add(rid)
        elif e["type"] == "schedule" and rid in promoted:
            promoted.discard(rid)  # the admission after its load: no lookup, no answer
        elif rid not in answered and rid not in promoted and (
                e["type"] == "kv_load" or (e["type"] == "schedule" and e["kind"] != "running"
                                           and e["num_computed_tokens"] > e["num_prefix_hit_tokens"])):
            out.append(f"request {rid!r} at line {line}")
    return out


def _unmodelled(meta_rec: dict, unsupported: dict[str, int]) -> dict[str, str]:
    """The recording's features the model cannot follow (the recorder's
    ``unmodelled``; read from its warnings in a recording made before it wrote
    one; streaming-input requests): ``harness check`` skips the rules they keep
    it from judging."""
    out = dict(meta_rec.get("unmodelled") or {})
    for what, n in sorted(unsupported.items()):  # request features the reference does not model
        out.setdefault(what, f"{n} request(s) with {what.replace('_', ' ')}")
    for w in meta_rec.get("warnings", ()):
        if w.startswith("a KV connector is configured"):
            out.setdefault("kv_connector", "a KV connector")
        elif "KV-cache groups (the trace keeps group 0" in w:
            out.setdefault("kv_cache_groups", w.split(" (")[0])
    return out


def recording_path(jsonl_path: str | os.PathLike[str]) -> Path:
    """The recording file for ``jsonl_path``: itself, or with data parallelism the
    one rank file the recorder wrote beside it (``NAME.dp<rank>.jsonl``,
    ``recording_scheduler._output_path``). Raises ConvertError when there is none,
    or several (convert each rank's file)."""
    src = Path(jsonl_path)
    if src.is_file():
        return src
    ranks = sorted(src.parent.glob(f"{src.stem}.dp*{src.suffix or '.jsonl'}")) if src.parent.is_dir() else []
    ranks = [p for p in ranks if p.stem[len(src.stem) + 3:].isdigit()]
    if len(ranks) == 1:
        return ranks[0]
    if ranks:
        raise ConvertError(f"{src}: no such file; a data-parallel engine wrote one file per rank "
                           f"({', '.join(p.name for p in ranks)}): convert each")
    raise ConvertError(f"{src}: no such file")


def _ulps_below(x: float, n: int) -> float:
    for _ in range(n):
        x = math.nextafter(x, -math.inf)
    return x


def convert(jsonl_path: str | os.PathLike[str], parquet_path: str | os.PathLike[str], *,
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert a RecordingScheduler JSONL log into a Parquet trace.

    ``overrides`` sets EngineConfig fields vLLM has no value for (the harness
    keys ``step_fixed_s``, ``step_per_token_s``, ``draft_acceptance_rate``) or
    corrects mapped ones; they are listed in the metadata
    (``vllm_recording.config_overrides``). Returns a summary dict: ``steps``,
    ``events``, ``requests``, ``finished``, ``aborted``, ``preemptions``,
    ``prefix_hit_tokens``, ``dropped_idle_steps``, ``reordered_abort_steps`` (steps whose aborts got
    ulp-spaced times), ``crashed`` (only when vLLM raised: the crash's one
    line; the trace ends on its ``crash`` row, as the footer says), ``warnings`` (also stored in the trace metadata
    under ``vllm_recording``, with ``unmapped_config``). Raises ConvertError
    for an unusable log or a config that ``EngineConfig`` refuses. The trace
    is written to a temporary file and renamed on success.
    """
    # Our venv only: the reference package, and pyarrow through harness.trace.
    from harness.trace.recorder import step_rows, trace_metadata
    from harness.trace import TraceWriter
    from reference.config import DERIVED_KEYS, ConfigError, EngineConfig
    from reference.candidate import crash_line
    from reference.engine import Crash, StepRecord, holds_drafts
    from reference.output import (
        EncoderPlan,
        FinishedRequest,
        KVTransferFree,
        Preemption,
        Promotion,
        RemoteLoad,
        RequestState,
        ScheduledRequest,
        SchedulerOutput,
        Skip,
        SkippedFree,
        UpdateResult,
        Withdrawal,
    )
    from reference.request import RequestStatus
    from reference.words import plural
    from reference.workload import RequestSpec, Workload, WorkloadError

    src = recording_path(jsonl_path)
    meta_rec = next((rec for _, rec in read_records(src)), None)
    if meta_rec is None or meta_rec.get("t") != "meta":
        raise ConvertError(f"{src}: does not start with a sched-harness meta record")
    if meta_rec.get("format") not in READABLE_FORMATS:
        raise ConvertError(f"{src}: unknown recording format {meta_rec.get('format')!r} "
                           f"(this converter reads {', '.join(map(str, READABLE_FORMATS))})")
    for _, rec in read_records(src, after=1):
        # The config a unit test set by hand before the first schedule() (the recorder's
        # ``config`` record): what vLLM's schedule() used.
        if rec["t"] in ("schedule", "crash", "update", "protocol", "error", "end"):
            break
        if rec["t"] == "config":
            meta_rec["config"] = {**meta_rec.get("config", {}), **rec["config"]}
    values, unmapped_config = map_config(meta_rec, EngineConfig, DERIVED_KEYS)
    dp_rank_note = None
    raw = meta_rec.get("vllm_config", {})
    if (raw.get("parallel_config.data_parallel_size") or 1) > 1:
        # One rank's scheduler: its own queues and pool (the coordinator's routing
        # is not in the recording).
        dp_rank_note = (f"rank {raw.get('parallel_config.data_parallel_rank', '?')} of a data-parallel "
                        f"engine (data_parallel_size {raw['parallel_config.data_parallel_size']}): "
                        f"converted as one scheduler")
        values["data_parallel_size"] = 1
    hybrid_keys, groups_unmodelled = hybrid_config(
        meta_rec.get("kv_cache_groups"), values.get("block_size", 16),
        max_model_len=values.get("max_model_len"),
        num_speculative_tokens=values.get("num_speculative_tokens") or 0,
        enable_prefix_caching=bool(values.get("enable_prefix_caching")),
        cache_mamba_mode=raw.get("cache_config.mamba_cache_mode"))
    values.update(hybrid_keys)
    values.update(overrides or {})
    try:
        config = EngineConfig.from_dict(values, accept_vllm_crash=True)  # what vLLM ran
    except ConfigError as exc:
        raise ConvertError(f"{src}: the recorded vLLM config does not map to an EngineConfig: "
                           f"{exc}") from None
    status_names = {s.name for s in RequestStatus}
    batches = config.max_concurrent_batches  # 2 with async scheduling (vLLM's derivation)
    if batches > 1 and meta_rec.get("format") in (1, 2):
        # Regression: such a log converted, its batches implicit, so updates
        # swapped between two batches in flight went unnoticed. Recorders of
        # formats 1 and 2 refused to start under async scheduling.
        raise ConvertError(f"{src}: a format {meta_rec.get('format')} recording with {batches} batches in "
                           f"flight (async scheduling): only format 3 records async scheduling (its "
                           f"batches numbered); the log was edited")

    # -- pass 1: request ids, the virtual clock, abort times, EOS lengths --------
    notes = new_notes()
    ids: dict[str, str] = {}          # vLLM request id -> rNNNNNN (add order)
    original: list[str] = []
    arrival_unix: list[float] = []
    abort_time: dict[str, float] = {}
    eos_len: dict[str, int] = {}
    plan: list[tuple[float, float]] = []   # per kept step: (clock, arrival time)
    unsupported: dict[str, int] = {}
    inversions = 0
    last_unix = -math.inf
    clock = 0.0
    dropped_idle = 0
    reordered_aborts = 0
    # A recorded KV connector (meta ``kv_answers``): what its scheduler side
    # answered, per request in call order, and the worker's output per batch
    # (keyed by the trace step that scheduled it): the config's
    # kv_connector_matches / kv_connector_outputs.
    kv_matches: dict[str, list[tuple]] = {}
    # (vLLM 0.33.0 bounded replay: whether each load restored the window
    # groups, per request in call order: the config's kv_connector_window_loads.)
    kv_window_loads: dict[str, list[bool]] = {}
    kv_outputs: list[tuple] = []
    kv_sending = 0
    # Encoder inputs (the arrival's ``mm_features``): each request's recorded
    # identifiers, the config's mm_identifiers.
    mm_identifiers: dict[str, tuple[str, ...]] = {}
    # LoRA requests (the arrival's ``lora_int_id``): the config's lora_int_ids.
    lora_int_ids: dict[str, int] = {}
    # Streaming-input sessions (the arrival's ``resumable``; a recorder before it
    # wrote one: its ``unsupported`` streaming_input): the config's resumable_request_ids.
    resumable: list[str] = []
    # ... unless the model cannot follow vLLM's encoder (meta ``unmodelled``).
    encoder_why = next((k for k in ENCODER_UNMODELLED if k in (meta_rec.get("unmodelled") or {})), None)
    budgets = [meta_rec.get("config", {}).get(k) for k in ENCODER_KEYS[:2]]
    if encoder_why is None and not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                       for b in budgets):
        # (vLLM's budgets are 0 for a model without multimodal inputs; a test may set 0.)
        encoder_why = (f"encoder budgets max_num_encoder_input_tokens {budgets[0]}, encoder cache size "
                       f"{budgets[1]} (the model needs both positive)")
    if encoder_why is None:
        encoder_why = items_unmodelled(src)
    encoder_modelled = encoder_why is None
    dropped_mm = 0  # requests whose recorded encoder inputs are left out (not encoder_modelled)
    kept_of_batch: dict[int, int] = {}

    def rid(vllm_id: str, where: int) -> str:
        try:
            return ids[vllm_id]
        except KeyError:
            raise ConvertError(f"{src}:{where}: request {vllm_id!r} was never added") from None

    kv_unanswered: list[str] = []  # "request at line": a connector decision with no answer recorded
    # A hybrid model's loads: decisions recorded without each group's blocks (a
    # recorder before it wrote them), and updates reporting failed loads.
    kv_ungrouped = kv_invalid = 0
    kv_promoted: set[str] = set()
    for step, idle in engine_steps(src, notes, batches):
        # A KV producer's reports count in every update, kept or not (regression: a
        # finished_sending in the update of a dropped idle step left its delayed free
        # judged, and FREE-WHOLE-TABLE / BLOCK-CONSERVATION fired on correct vLLM).
        kv_sending += len(((step["update"] or {}).get("kv") or {}).get("finished_sending") or ())
        if idle is None:
            dropped_idle += 1
            continue
        if step["schedule"] is not None and idle is False:
            kv_unanswered.extend(_unanswered_kv_decisions(step["schedule"], step["line"], kv_promoted))
            kv_ungrouped += sum(e["type"] in ("kv_load", "kv_promote") and "group_block_ids" not in e
                                for e in step["schedule"]["output"]["events"])
        kv_invalid += bool(((step["update"] or {}).get("kv") or {}).get("invalid_block_ids"))
        for kind, a in step["inputs"]:
            if kind != "arrival":
                continue
            if a["request_id"] in ids:
                raise ConvertError(f"{src}:{step['line']}: request {a['request_id']!r} added twice")
            ids[a["request_id"]] = f"r{len(original):06d}"
            original.append(a["request_id"])
            arrival_unix.append(a["arrival_time"])
            inversions += a["arrival_time"] < last_unix
            last_unix = max(last_unix, a["arrival_time"])
            for what in a.get("unsupported", ()):
                unsupported[what] = unsupported.get(what, 0) + 1
            if a.get("lora_int_id") is not None:
                lora_int_ids[ids[a["request_id"]]] = int(a["lora_int_id"])
            if a.get("resumable") or "streaming_input" in a.get("unsupported", ()):
                resumable.append(ids[a["request_id"]])
            if a.get("mm_features"):
                if encoder_modelled:
                    mm_identifiers[ids[a["request_id"]]] = tuple(f[2] for f in a["mm_features"])
                else:  # converted text-only, as before the recorder kept them
                    unsupported["encoder_inputs"] = unsupported.get("encoder_inputs", 0) + 1
                    dropped_mm += 1
        aborts = [f["request_id"] for k, r in step["inputs"] if k == "abort" for f in r["finished"]]
        # Replay aborts equal times in request-id order: when vLLM freed them
        # in another order, space their times by ulps (arrivals go first).
        order = [rid(a, step["line"]) for a in aborts]
        spread = len(order) - 1 if order != sorted(order) else 0
        reordered_aborts += bool(spread)
        base = _ulps_below(clock, spread)
        t = base
        for a in aborts:
            abort_time[a] = t
            t = math.nextafter(t, math.inf) if spread else t
        if step["schedule"] is not None and idle is False:
            kept_of_batch[step["batch"]] = len(plan)
            for req_id, _, external, load_kv_async in step["schedule"].get("kv_matches") or ():
                kv_matches.setdefault(rid(req_id, step["line"]), []).append((external, bool(load_kv_async)))
            for req_id, restored in step["schedule"].get("kv_window_loads") or ():
                kv_window_loads.setdefault(rid(req_id, step["line"]), []).append(bool(restored))
        if step["update_kept"]:
            batch_index = kept_of_batch.pop(step["update_batch"], None)
            kv = (step["update"] or {}).get("kv")
            if kv is not None and batch_index is not None:
                kv_outputs.append((batch_index, tuple(rid(r, step["line"]) for r in kv["finished_recving"]),
                                   tuple(kv["invalid_block_ids"])))
        plan.append((clock, base))
        for f in step["update"]["finished"] if step["update"] is not None else ():
            if f["status"] == "FINISHED_STOPPED" and f["stop_reason"] is None:
                eos_len[f["request_id"]] = f["num_output_tokens"]
        total = 0 if idle or step["schedule"] is None else \
            step["schedule"]["output"]["total_num_scheduled_tokens"]
        # The reference engine's clock, same operations in the same order.
        clock += config.step_fixed_s + config.step_per_token_s * total

    def spec_of(a: dict, index: int) -> RequestSpec:
        vid, eos = a["request_id"], a["eos_token_id"]
        try:
            return RequestSpec(
                request_id=ids[vid], arrival_time=plan[index][1],
                prompt_token_ids=tuple(a["prompt_token_ids"]), max_tokens=a["max_tokens"],
                min_tokens=a["min_tokens"], ignore_eos=a["ignore_eos"], eos_token_id=eos,
                stop_token_ids=tuple(a["stop_token_ids"]), priority=a["priority"],
                scripted_output_len=eos_len.get(vid) if eos is not None else None,
                abort_time=abort_time.get(vid),
                mm_positions=tuple((f[0], f[1]) for f in a.get("mm_features") or ()) if encoder_modelled else ())
        except WorkloadError as exc:
            raise ConvertError(f"{src}: request {vid!r}: {exc}") from None

    # -- pass 2: the workload's sha256 (the metadata is written first) -----------
    digest = hashlib.sha256()
    index = 0
    for step, idle in engine_steps(src, new_notes(), batches):
        if idle is None:
            continue
        for kind, a in step["inputs"]:
            if kind == "arrival":
                digest.update(json.dumps(dataclasses.asdict(spec_of(a, index)), sort_keys=True,
                                         separators=(",", ":")).encode() + b"\n")
        index += 1

    recorded = meta_rec.get("config", {})
    lora_unmodelled = None
    if lora_int_ids and recorded.get("max_loras") is None:
        lora_unmodelled = f"{len(lora_int_ids)} request(s) with lora (max_loras not recorded)"
    elif lora_int_ids and values.get("enable_prefix_caching"):
        # vLLM's block hashes of a LoRA request key on its adapter
        # (kv_cache_utils._gen_lora_extra_hash_keys): the reference's do not.
        lora_unmodelled = (f"{len(lora_int_ids)} request(s) with lora and prefix caching (the block "
                           f"hashes of a LoRA request key on its adapter)")
    if mm_identifiers or (lora_int_ids and lora_unmodelled is None) or resumable:
        if resumable:
            # The sessions the reference parks when they stop (its streaming updates
            # are protocol breaks: recording_steps.raw_steps).
            values["resumable_request_ids"] = tuple(resumable)
        if mm_identifiers:
            # Encoder inputs: the budgets vLLM derived and the items' identifiers.
            values.update({k: recorded[k] for k in ENCODER_KEYS if k in recorded})
            values["mm_identifiers"] = tuple(sorted(mm_identifiers.items()))
        if lora_int_ids and lora_unmodelled is None:
            # LoRA: vLLM's max_loras and each LoRA request's adapter.
            values["max_loras"] = recorded["max_loras"]
            values["lora_int_ids"] = tuple(sorted(lora_int_ids.items()))
        try:
            config = EngineConfig.from_dict(values, accept_vllm_crash=True)
        except ConfigError as exc:
            raise ConvertError(f"{src}: the recorded vLLM config does not map to an EngineConfig: "
                               f"{exc}") from None
    warnings = list(meta_rec.get("warnings", ()))
    recorded_kv = None  # why the connector is not replayed as recorded (None: it is)
    if meta_rec.get("kv_answers"):
        hybrid_loads = config.kv_cache_groups and any(ext for answers in kv_matches.values()
                                                      for ext, _ in answers)
        if hybrid_loads and kv_ungrouped:
            # (A load on a hybrid KV cache is followed in every group: its kv_load and
            # kv_promote rows need each group's blocks, which recorders before them lacked.)
            recorded_kv = (f"a hybrid KV cache ({plural(kv_ungrouped, 'load decision')} recorded "
                           f"without each group's blocks)")
        elif hybrid_loads and "linear_attention" in (config.layer_types or ()):
            recorded_kv = ("a hybrid KV cache with Mamba groups (vLLM schedules a load on the groups' "
                           "common block size: not modelled)")
        elif hybrid_loads and kv_invalid:
            # (vLLM 0.33.0's _update_requests_with_invalid_blocks reads one group's table.)
            recorded_kv = (f"a hybrid KV cache ({plural(kv_invalid, 'update')} reporting invalid blocks: "
                           f"failed loads are modelled for one group)")
        elif kv_sending:
            recorded_kv = f"{kv_sending} finished_sending report(s) (a KV producer's frees are not modelled)"
        elif kv_unanswered:
            # (vLLM's tests that swap in a mocked connector after the scheduler was
            # built: the recorder's hook never sees its answers.)
            recorded_kv = (f"{len(kv_unanswered)} connector decision(s) without a recorded answer "
                           f"(first: {kv_unanswered[0]})")
        else:
            try:
                config = EngineConfig.from_dict(
                    {**values, "kv_connector": True,
                     "kv_connector_matches": tuple((r, tuple(a)) for r, a in sorted(kv_matches.items())),
                     "kv_connector_outputs": tuple(kv_outputs),
                     "kv_connector_window_loads": tuple((r, tuple(a)) for r, a in sorted(kv_window_loads.items()))
                     if kv_window_loads else None}, accept_vllm_crash=True)
            except ConfigError as exc:
                recorded_kv = str(exc)
        if recorded_kv:
            warnings.append(f"the KV connector's recorded answers are not replayable: {recorded_kv}")
    if meta_rec["format"] == 1:
        warnings.append("format 1 recording: what requests hold after schedule() (request_state rows) "
                        "was not recorded, and the request data's ids are taken from the decisions")
    if dp_rank_note:
        warnings.append(dp_rank_note)
    if inversions:
        warnings.append(f"{inversions} request(s) added after one with a later wall-clock "
                        f"arrival time (PRIORITY ties may replay differently)")
    for what, n in sorted(unsupported.items()):
        warnings.append(f"{n} request(s) with {what} (not modelled by the reference)")
    for what in sorted(set(notes["notes"])):
        warnings.append(f"{notes['notes'].count(what)} {what} event(s) (not representable in a trace)")
    if notes["error"]:
        warnings.append(f"recording stopped early: {notes['error']}")
    if notes["protocol"]:
        warnings.append(f"the trace ends before a protocol break: {notes['protocol']}")
    if notes["dropped_incomplete_step"] or notes["trailing_inputs"]:
        warnings.append(f"incomplete tail dropped (a step without its update: "
                        f"{notes['dropped_incomplete_step']}; inputs after the last step: "
                        f"{notes['trailing_inputs']})")
    if not notes["complete"] and not notes["error"]:
        warnings.append("no end record: the server did not shut down cleanly")

    workload = Workload(source="live", sha256=digest.hexdigest(),
                        params={"jsonl": src.name, "vllm_request_ids": original,
                                "arrival_unix_s": arrival_unix}, requests=())
    engine = f"vllm@{meta_rec['vllm_version']}"
    base_cls = meta_rec.get("scheduler_cls")
    if base_cls:  # the user's Scheduler subclass ran: named as a scheduler_cls candidate's trace is
        engine += f",scheduler_cls={base_cls}"
    meta = trace_metadata(workload, config, 0, engine)
    # A live recording's requests are what reached the server (its rows): no count to hold
    # it to; its own markers ("protocol", "salvaged", warnings) say when it stopped early.
    meta.pop("num_requests", None)
    if base_cls:
        meta["engine_version"] = meta_rec["vllm_version"]
        meta["vllm_source"] = {"version": meta_rec["vllm_version"], "scheduler_cls": base_cls}
    meta["vllm_recording"] = {
        "format": meta_rec["format"], "jsonl": src.name, "started_unix": meta_rec.get("started_unix"),
        "unmapped_config": unmapped_config, "config_overrides": dict(overrides or {}),
        "dropped_idle_steps": dropped_idle,
        "mid_step_aborts": notes["mid_step_aborts"], "warnings": warnings,
        "unmodelled": _unmodelled(meta_rec, unsupported),
    }
    if kv_sending:
        # A KV producer: vLLM's request_finished delays a finished request's free until
        # its blocks are reported sent (finished_sending); the trace has no row for that.
        meta["vllm_recording"]["unmodelled"].setdefault(
            "kv_connector_sending", f"{kv_sending} finished_sending report(s): a KV producer's blocks "
                                    f"held while sending")
    if lora_unmodelled:
        meta["vllm_recording"]["unmodelled"]["lora"] = lora_unmodelled
    if not dropped_mm:
        # An encoder-cache connector or another encoder cache manager touches only
        # encoder inputs: with none in the recording the model follows it all
        # (regression: vLLM's test_kv_connector_* [ec_consumer] traces, text only,
        # were no longer replayed once the recorder named the EC connector).
        for feature in ("ec_connector", "encoder_cache_manager"):
            meta["vllm_recording"]["unmodelled"].pop(feature, None)
    if dropped_mm and encoder_why not in ENCODER_UNMODELLED:
        meta["vllm_recording"]["unmodelled"]["encoder_inputs"] = (
            f"{dropped_mm} request(s) with encoder inputs ({encoder_why})")
    if groups_unmodelled and "kv_cache_spec" not in meta["vllm_recording"]["unmodelled"]:
        # (A spec the recorder knows the model lacks is marked kv_cache_spec already.)
        for feature, why in groups_unmodelled.items():
            meta["vllm_recording"]["unmodelled"].setdefault(
                feature, f"{len(meta_rec['kv_cache_groups'])} KV-cache groups ({why})")
    # Every group's blocks, where the config names the groups (trace schema 9).
    hybrid = bool(config.kv_cache_groups)

    def groups_of(e: dict):
        return e.get("group_block_ids") if hybrid else None

    def finished_of(f: dict, where: int) -> FinishedRequest:
        if f["status"] not in status_names:
            raise ConvertError(f"{src}:{where}: request {f['request_id']!r} ended with status "
                               f"{f['status']} (the reference has no such status)")
        stop = f["stop_reason"]
        return FinishedRequest(rid(f["request_id"], where), RequestStatus[f["status"]],
                               f["finish_reason"], None if stop is None else str(stop),
                               f["num_output_tokens"], list(f["freed_block_ids"]),
                               group_block_ids=groups_of(f))

    def states_of(items, where: int) -> list[RequestState]:
        out = []
        for req_id, status, computed, drafts in items:
            if status not in status_names:
                raise ConvertError(f"{src}:{where}: request {req_id!r} in status {status} "
                                   f"(the reference has no such status)")
            out.append(RequestState(rid(req_id, where), RequestStatus[status], computed, tuple(drafts)))
        # By trace id, as the engine loop lists them: the recorder sorted vLLM's own ids, and a
        # server's ids (``cmpl-<random>-0``) do not sort in add order (regression: replay of a
        # served recording diverged on the order of two victims' request_state rows).
        return sorted(out, key=lambda st: st.request_id)

    def encoder_ids(e: dict) -> list[int]:
        return list(e.get("encoder_input_ids") or ()) if encoder_modelled else []

    def decision(e: dict, where: int):
        if e["type"] == "schedule":
            return ScheduledRequest(rid(e["request_id"], where), e["kind"], e["num_computed_tokens"],
                                    e["num_scheduled_tokens"], e["num_prefix_hit_tokens"],
                                    list(e["new_block_ids"]), list(e.get("spec_token_ids") or ()),
                                    encoder_ids(e), group_block_ids=groups_of(e))
        if e["type"] == "withdraw":
            return Withdrawal(rid(e["request_id"], where), e["num_scheduled_tokens"],
                              list(e["block_ids"]), encoder_ids(e), group_block_ids=groups_of(e))
        if e["type"] == "encoder_plan":
            if not encoder_modelled:
                return None
            return EncoderPlan(rid(e["request_id"], where), e["num_computed_tokens"],
                               e["num_scheduled_tokens"], list(e["encoder_input_ids"]))
        if e["type"] == "preempt":
            return Preemption(rid(e["request_id"], where), e["num_computed_tokens"],
                              list(e["freed_block_ids"]), group_block_ids=groups_of(e))
        if e["type"] == "skipped_free":  # a hybrid model's window frees (None: groups not followed)
            return (SkippedFree(rid(e["request_id"], where), list(e["freed_block_ids"]),
                                e["group_block_ids"]) if hybrid else None)
        # Regression: "unknown decision 'kv_load'" (the recorder writes the KV
        # connector's decisions as the vLLM driver normalises them).
        if e["type"] == "skip":
            return Skip(rid(e["request_id"], where), e["reason"])
        if e["type"] == "kv_load":
            return RemoteLoad(rid(e["request_id"], where), e["num_prefix_hit_tokens"],
                              e["num_external_tokens"], list(e["block_ids"]), e["reserved_blocks"],
                              groups_of(e))
        if e["type"] == "kv_promote":
            if e["status"] not in status_names:
                raise ConvertError(f"{src}:{where}: request {e['request_id']!r} promoted to status "
                                   f"{e['status']} (the reference has no such status)")
            return Promotion(rid(e["request_id"], where), RequestStatus[e["status"]],
                             e["num_computed_tokens"], bool(e["load_failed"]),
                             list(e["freed_block_ids"]), groups_of(e))
        raise ConvertError(f"{src}:{where}: unknown decision {e['type']!r}")

    # -- pass 3: the rows, through the recorder's own step_rows -------------------
    out_fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    summary = {"steps": 0, "events": 0, "requests": len(original), "finished": 0, "aborted": 0,
               "preemptions": 0, "prefix_hit_tokens": 0}
    carry: set[str] = set()
    batch_step: dict[int, int] = {}  # batch in flight -> the trace step that scheduled it
    with TraceWriter(parquet_path, meta) as writer:
        # A recording that ends before the run did (no end record: the server was cut
        # off; or the recorder stopped early): requests still live at its end are not
        # LIVENESS findings (``harness check`` says why in a note).
        if notes["protocol"]:
            # Worded for a server's recording and a unit test's driver alike (regression:
            # "the driver left ..." on a server recording, where there is no driver).
            writer.protocol = f"the recorded run left the trace's step protocol at {src.name}:{notes['protocol']}"
        if notes["error"]:
            writer.salvaged = f"a vLLM recording stopped early ({notes['error']})"
        elif not notes["complete"]:
            writer.salvaged = "a vLLM recording without its end record (the server was cut off)"
        index = 0
        for step, idle in engine_steps(src, new_notes(), batches):
            where, sched_rec, update_rec = step["line"], step["schedule"], step["update"]
            output = sched_rec["output"] if sched_rec is not None else None
            if step["schedule"] is not None and idle is not False:  # schedule() with nothing unfinished
                carry.update(rid(i, where) for i in output["finished_req_ids"])
            if idle is None:
                continue
            clock_s, _ = plan[index]
            rec = StepRecord(step=index, clock=clock_s)
            rec.arrivals = [spec_of(a, index) for k, a in step["inputs"] if k == "arrival"]
            rec.aborts = [finished_of(f, where) for k, r in step["inputs"] if k == "abort"
                          for f in r["finished"]]
            summary["aborted"] += len(rec.aborts)
            crash = step["crash"]
            if crash is not None:
                stage = {"schedule": "schedule", "update_from_output": "update"}.get(crash["call"],
                                                                                    "update_end")
                if crash["call"] != "schedule" and not step["update_kept"]:
                    stage = "inputs"  # in the update of an empty batch, no part of the trace: the row alone
                rec.crash = Crash(crash["call"], crash.get("exc_type") or "?",
                                  crash.get("exc_message") or "?", crash.get("where") or "", stage)
                writer.crashed = summary["crashed"] = crash_line(index, rec.crash.call, rec.crash.message,
                                                                 rec.crash.where)
            if sched_rec is None and crash is not None and crash["call"] == "schedule":
                # vLLM raised in schedule(): the queues before it are known
                before = crash.get("before")
                if before is not None:
                    rec.waiting_before = [rid(i, where) for i in before["waiting"]]
                    rec.running_before = [rid(i, where) for i in before["running"]]
                    rec.num_free_blocks_before = before["num_free_blocks"]
                    rec.throttle_prefills = bool(crash.get("throttle_prefills"))
                else:  # the snapshot failed too: only the crash row
                    rec.crash = dataclasses.replace(rec.crash, stage="inputs")
            elif not idle:
                batch_step[step["batch"]] = index
                events = [d for d in (decision(e, where) for e in output["events"]) if d is not None]
                extra = {k: output[k] for k in ("throttle_prefills", "defer_prefills",
                                                "prefill_capacity_bound")
                         if k in out_fields and k in output}
                rec.output = SchedulerOutput(
                    events=events,
                    num_scheduled_tokens={rid(k, where): v for k, v in output["num_scheduled_tokens"]},
                    total_num_scheduled_tokens=output["total_num_scheduled_tokens"],
                    preempted_req_ids={rid(i, where) for i in output["preempted_req_ids"]},
                    finished_req_ids={rid(i, where) for i in output["finished_req_ids"]} | carry,
                    token_budget=output["token_budget"], **extra,
                    free_encoder_mm_hashes=list(output.get("free_encoder_mm_hashes") or ())
                    if encoder_modelled else [],
                    request_data_ids=None if output.get("request_data_ids") is None else
                    [rid(i, where) for i in output["request_data_ids"]])
                carry = set()
                before, after = sched_rec["before"], sched_rec["after"]
                rec.waiting_before = [rid(i, where) for i in before["waiting"]]
                rec.running_before = [rid(i, where) for i in before["running"]]
                rec.num_free_blocks_before = before["num_free_blocks"]
                rec.waiting_after = [rid(i, where) for i in after["waiting"]]
                rec.running_after = [rid(i, where) for i in after["running"]]
                rec.num_free_blocks_after_schedule = after["num_free_blocks"]
                # What requests hold after schedule(), chosen as the engine
                # loop chooses them (format 2).
                rec.states_after_schedule = [
                    st for st in states_of(after.get("request_states") or (), where)
                    if st.request_id in rec.output.preempted_req_ids or holds_drafts(st)]
                summary["preemptions"] += len(rec.output.preemptions)
                summary["prefix_hit_tokens"] += sum(s.num_prefix_hit_tokens
                                                    for s in rec.output.scheduled)
            if step["update_kept"]:
                # The update of the oldest batch in flight: this step's own
                # (synchronous), or one scheduled max_concurrent_batches - 1
                # steps before (async: its tokens arrive a step late).
                rec.update_batch_step = batch_step.pop(step["update_batch"])
                if update_rec is None:  # vLLM raised in update_from_output(): its tokens are known
                    rec.sampled = {rid(r, where): list(t) for r, t in crash.get("sampled") or ()}
                else:
                    rec.sampled = {rid(r, where): list(t) for r, t in update_rec["sampled"]}
                    rec.update = UpdateResult(
                        finished=[finished_of(f, where) for f in update_rec["finished"]])
                    kv = update_rec.get("kv")
                    if kv is not None and config.kv_connector_matches is not None:
                        # The worker's KVConnectorOutput, and what the update made of it.
                        rec.update.invalid_block_ids = list(kv["invalid_block_ids"])
                        rec.update.finished_recving = [rid(r, where) for r in kv["finished_recving"]]
                        rec.update.kv_freed = [KVTransferFree(rid(r, where), list(b), f,
                                                              groups[0] if hybrid and groups else None)
                                               for r, b, f, *groups in kv["kv_freed"]]
                    rec.num_free_blocks_after_update = update_rec["num_free_blocks"]
                    rec.drafts = {rid(r, where): list(t) for r, t in step["drafts"]}
                    # ... and after the draft update.
                    rec.states_after_drafts = [st for st in states_of(step["draft_states"], where)
                                               if holds_drafts(st)]
                    summary["finished"] += len(rec.update.finished)
            writer.add_step(step_rows(rec))
            index += 1
        live = summary["requests"] - summary["finished"] - summary["aborted"]
        if writer.protocol is None and live > 0 and notes["ended_by"] in ("driver", "exit"):
            # A unit test stops driving with requests live (no shutdown(): the recorder
            # was closed by the test runner, or at exit): not a LIVENESS finding.
            writer.protocol = (f"stopped by the driver after step {index - 1} with {live} request(s) "
                               f"live (the recording was closed by {notes['ended_by']}, not by "
                               f"shutdown())")
    summary["protocol"] = writer.protocol
    summary.update(steps=index, events=writer.num_rows, dropped_idle_steps=dropped_idle,
                   reordered_abort_steps=reordered_aborts, warnings=warnings,
                   path=str(parquet_path))
    return summary
