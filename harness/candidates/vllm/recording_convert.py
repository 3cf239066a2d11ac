"""Convert a recording scheduler's JSONL into a sched-harness trace (this project's venv).

The writer is ``harness/candidates/vllm/recording_scheduler.py`` (inside vLLM;
its docstring lists the records and what each holds); this is the one reader
of that JSONL: ``convert(jsonl_path, parquet_path)`` turns it into a Parquet
trace (``docs/trace-format.md``) that ``harness check`` and ``harness replay``
read, through ``harness.trace.TraceWriter`` (temp folder and rename). It
reads formats ``READABLE_FORMATS``; pyarrow and the ``reference`` package are
imported inside ``convert``.

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
  model ran) cannot be placed in the trace's step order. By default the
  recording scheduler applies such an abort right after
  ``update_from_output()`` (``_defer_mid_step_abort``: as if the disconnect had
  reached the engine a moment later), so it is recorded before the next
  ``schedule()``; with ``SCHED_HARNESS_MID_STEP_ABORTS=record`` vLLM's timing is
  kept, and convert moves those aborts to the next step and counts them in
  ``vllm_recording.warnings``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections import deque
from pathlib import Path
from typing import Any

from harness.candidates.vllm.recording_scheduler import READABLE_FORMATS


class ConvertError(ValueError):
    """The JSONL cannot be turned into a trace; the message names the file and line."""


class _ProtocolBreak(Exception):
    """The recorded driver left EngineCore's protocol here (a unit test calling
    ``schedule()`` twice, ``update_from_output()`` with a SchedulerOutput that
    no ``schedule()`` returned, editing the queues by hand) or did what the
    model cannot follow (a prefix-cache reset, a streaming-input update, an
    abort between ``schedule()`` and ``update_from_output()`` at vLLM's
    timing). The trace keeps the complete steps before it; the footer's
    ``protocol`` names it (``harness check`` then claims no end-of-trace
    rule)."""


def _read_records(path: Path, after: int = 0):
    """Yield (line number, record) of the lines after line ``after``; stop
    quietly at a torn last line."""
    with open(path, encoding="utf-8") as fh:
        pending = None
        for number, line in enumerate(fh, 1):
            if number <= after:
                continue
            if pending is not None:
                raise ConvertError(f"{path}:{pending}: not a JSON object")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                pending = number  # fine only if it is the (torn) last line
                continue
            if not isinstance(record, dict) or "t" not in record:
                raise ConvertError(f"{path}:{number}: not a sched-harness record")
            yield number, record


def _raw_steps(path: Path, notes: dict, max_batches: int = 1):
    """Group records into vLLM's ``EngineCore`` steps: the inputs since the
    previous step, its ``schedule`` (None: vLLM made no schedule() call, or it
    raised), the ``update`` it made (of the oldest batch in flight:
    ``update_batch`` and that batch's schedule record ``update_schedule``; None
    while ``max_batches`` batches are not yet in flight), drafts, and a
    ``crash`` (None, or the record that ends the step and the log). Yields
    dicts; stops at an ``error`` or a crash.

    ``EngineCore.step_with_batch_queue`` schedules at most once per step and
    first, then processes the oldest batch once ``max_batches`` are in flight
    (or when it scheduled nothing); sync scheduling is ``max_batches`` 1, a
    schedule and its update in every step. Invariants checked here (a log that
    breaks one is out of order: ConvertError naming the line): batches are
    scheduled in order (format 3 numbers them), never more than
    ``max_batches`` in flight, and every update completes the oldest batch in
    flight (its ``batch``)."""
    inputs: list[tuple[str, dict]] = []
    current: dict | None = None
    in_flight: deque = deque()   # (batch, schedule record), oldest first
    steps: list[dict] = []       # steps ended by the current record, to yield
    next_batch = 0
    crashed = False
    ended = False
    numbered = False  # format 3: every schedule and update record names its batch
    # meta ``async_scheduler_sync_config``: vLLM's AsyncScheduler with async scheduling
    # off (1 batch in flight); its -1 placeholder drafts end the trace (protocol).
    async_class_sync_config = False
    number = 0
    # Format 3 leaves a snapshot's unchanged queue out: it is the previous
    # snapshot's (in file order: a schedule's ``before`` follows the last
    # ``after`` or crash ``before``, its ``after`` follows its ``before``).
    fill = False
    shown: dict[str, list] = {}

    def resolve(snapshot: dict) -> None:
        if not fill:
            return
        for key in ("waiting", "running"):
            if key in snapshot:
                shown[key] = snapshot[key]
            elif key in shown:
                snapshot[key] = shown[key]
            else:
                raise ConvertError(f"{path}:{number}: a snapshot without {key!r} and none before it")

    def new_step(schedule: dict | None, crash: dict | None) -> dict:
        return {"line": number, "inputs": inputs, "schedule": schedule, "update": None,
                "drafts": [], "draft_states": [], "crash": crash, "batch": None,
                "update_batch": None, "update_schedule": None}

    def start_batch(rec: dict) -> int:
        nonlocal next_batch
        if len(in_flight) >= max_batches:
            # Regression: refused as a whole ("an update is missing"), losing the
            # complete steps before it (vLLM's own tests call schedule() twice).
            raise _ProtocolBreak(
                f"line {number}: schedule() called with {len(in_flight)} batch(es) in flight and no "
                f"update_from_output() (max_concurrent_batches={max_batches}): the driver left "
                f"EngineCore's protocol")
        batch = rec.get("batch")
        if batch is None and numbered:
            raise ConvertError(f"{path}:{number}: schedule record without its batch (a format 3 "
                               f"recording numbers every batch): the log was edited")
        batch = next_batch if batch is None else batch  # format 1 and 2: implicit
        if batch != next_batch:
            raise ConvertError(f"{path}:{number}: schedule of batch {batch} where batch {next_batch} "
                               f"was next: the log is out of order")
        next_batch += 1
        in_flight.append((batch, rec))
        return batch

    def complete_batch(rec: dict, step: dict) -> None:
        if not in_flight:
            raise _ProtocolBreak(f"line {number}: update_from_output() without a schedule(): the "
                                 f"driver left EngineCore's protocol")
        oldest = in_flight[0][0]
        batch = rec.get("batch")
        if batch is None and numbered and rec["t"] == "update":
            # The recorder writes no batch for a SchedulerOutput it did not see returned.
            raise _ProtocolBreak(f"line {number}: update_from_output() given a SchedulerOutput that "
                                 f"no schedule() returned (built by hand): the driver left "
                                 f"EngineCore's protocol")
        batch = oldest if batch is None else batch  # format 1 and 2 (and a crash record): implicit
        if batch != oldest:
            raise ConvertError(f"{path}:{number}: update of batch {batch} while batch {oldest} is the "
                               f"oldest in flight (vLLM completes batches in schedule order): "
                               f"the log is out of order")
        step["update_batch"], step["update_schedule"] = in_flight.popleft()

    def update_step() -> dict:
        """The step an update belongs to: the current one, unless it already
        made its update (then vLLM made no schedule() call: a new step)."""
        nonlocal current, inputs
        if current is None or current["update"] is not None or current["update_batch"] is not None:
            if current is not None:
                steps.append(current)
            current = new_step(None, None)
            inputs = []
        return current

    last_after: dict | None = None   # the previous schedule's ``after`` snapshot
    arrived: set[str] = set()         # requests added since it
    added: set[str] = set()           # every request id added
    known: dict[str, int] = {}        # live request -> its known tokens (prompt + sampled so far)
    try:
        for number, rec in _read_records(path):
            kind = rec["t"]
            if ended:
                # Regression: records after the end (or after an ``error``, where
                # the recorder stops and writes only its end) were converted, or
                # silently dropped; no recorder writes them.
                raise ConvertError(f"{path}:{number}: a {kind!r} record after the recording's end: "
                                   f"the log was edited")
            if kind == "meta":
                if number != 1:
                    raise ConvertError(f"{path}:{number}: a second meta record")
                numbered = fill = isinstance(rec.get("format"), int) and rec["format"] >= 3
                async_class_sync_config = bool(rec.get("async_scheduler_sync_config"))
                continue
            if crashed and kind != "end":
                raise ConvertError(f"{path}:{number}: a {kind!r} record after the crash")
            if kind == "arrival":
                if rec["request_id"] in added:
                    # vLLM's ids are unique among live requests only; a trace's for the run.
                    raise _ProtocolBreak(f"line {number}: request id {rec['request_id']!r} added again "
                                         f"after it finished (a trace needs unique ids)")
                if rec.get("num_computed_tokens"):
                    raise _ProtocolBreak(f"line {number}: request {rec['request_id']!r} added with "
                                         f"num_computed_tokens {rec['num_computed_tokens']} set by hand "
                                         f"(EngineCore adds a request with none computed): the driver "
                                         f"left EngineCore's protocol")
                added.add(rec["request_id"])
                known[rec["request_id"]] = len(rec.get("prompt_token_ids") or ())
                inputs.append(("arrival", rec))
                arrived.add(rec["request_id"])
            elif kind == "abort":
                if rec.get("mid_step"):
                    # vLLM's timing (SCHED_HARNESS_MID_STEP_ABORTS unset or record): the
                    # trace's step has no place between schedule and update for it.
                    raise _ProtocolBreak(
                        f"line {number}: {len(rec['finished'])} request(s) aborted between schedule() "
                        f"and update_from_output() (a trace step has no place for it; "
                        f"SCHED_HARNESS_MID_STEP_ABORTS=defer records it after the update)")
                if rec.get("status", "FINISHED_ABORTED") != "FINISHED_ABORTED":
                    # EngineCore finishes requests from outside only by aborting them.
                    raise _ProtocolBreak(f"line {number}: finish_requests() with {rec['status']} (EngineCore "
                                         f"calls it only to abort): the driver left EngineCore's protocol")
                for f in rec["finished"]:
                    known.pop(f["request_id"], None)
                inputs.append(("abort", rec))
            elif kind == "schedule":
                placeholders = [e["request_id"] for e in rec["output"].get("events") or ()
                                if async_class_sync_config and e.get("kind") == "running"
                                and -1 in (e.get("spec_token_ids") or ())]
                if placeholders:
                    raise _ProtocolBreak(
                        f"line {number}: an AsyncScheduler under a synchronous config scheduled "
                        f"placeholder drafts -1 for {placeholders[0]!r} (EngineCore builds an "
                        f"AsyncScheduler only with async scheduling; here scheduler_config."
                        f"async_scheduling was off, as vLLM's CPU platform sets it): the driver "
                        f"left EngineCore's protocol")
                resolve(rec["before"])
                resolve(rec["after"])
                _check_queues_untouched(rec["before"], last_after, arrived, number)
                last_after, arrived = rec["after"], set()
                if current is not None:
                    steps.append(current)
                batch = start_batch(rec)
                current = new_step(rec, None)
                current["batch"] = batch
                inputs = []
            elif kind == "update":
                step = update_step()
                complete_batch(rec, step)
                _check_sampled(step["update_schedule"], rec, known, number)
                step["update"] = rec
            elif kind == "drafts":
                if rec["stored"] or rec.get("states"):
                    if current is None or current["update"] is None:
                        raise ConvertError(f"{path}:{number}: drafts outside a step")
                    current["drafts"].extend(rec["stored"])
                    current["draft_states"].extend(rec.get("states") or ())
            elif kind == "note":
                what = rec.get("what", "?")
                notes["notes"].append(what)
                if what == "reset_prefix_cache" and rec.get("result") is not False \
                        and last_after is not None:  # before the first schedule() nothing is cached
                    raise _ProtocolBreak(f"line {number}: the prefix cache was reset (the model "
                                         f"cannot follow a reset: its hits and frees differ after it)")
                if what == "pause_state" and rec.get("state") != "UNPAUSED":
                    raise _ProtocolBreak(f"line {number}: the scheduler was paused ({rec.get('state')}; "
                                         f"pausing is not modelled)")
                if what == "streaming_update":
                    raise _ProtocolBreak(f"line {number}: a streaming-input update of request "
                                         f"{rec.get('request_id')!r} (streaming input is not modelled)")
            elif kind == "protocol":
                raise _ProtocolBreak(f"line {number}: {rec.get('what', '?')}: the driver left "
                                     f"EngineCore's protocol")
            elif kind == "error":
                notes["error"] = rec.get("error", "?")
                # The recorder stops here; only its end record may follow.
                for number, rec in _read_records(path, after=number):
                    if rec["t"] != "end" or notes["complete"]:
                        raise ConvertError(f"{path}:{number}: a {rec['t']!r} record after the recording's "
                                           f"error record: the log was edited")
                    notes["complete"] = True
                break
            elif kind == "crash":
                call = rec.get("call")
                if call == "schedule":
                    if rec.get("before") is not None:
                        resolve(rec["before"])
                    if current is not None:
                        steps.append(current)
                    current = new_step(None, rec)
                    inputs = []
                elif call == "update_from_output" and in_flight:
                    step = update_step()
                    complete_batch(rec, step)
                    step["crash"] = rec
                elif call == "update_draft_token_ids" and current is not None and current["update"] is not None:
                    current["crash"] = rec
                else:
                    raise ConvertError(f"{path}:{number}: crash in {call!r} outside its step")
                notes["crash"] = rec
                steps.append(current)
                current, crashed = None, True
            elif kind == "end":
                notes["complete"] = True
                notes["ended_by"] = rec.get("by")
                ended = True
            yield from steps
            steps.clear()
    except _ProtocolBreak as brk:
        notes["protocol"] = str(brk)
        # Whether the recording has its end record past the break (regression: never
        # read, so every trace ended by a protocol break was also "salvaged: a vLLM
        # recording without its end record (the server was cut off)").
        for _, rec in _read_records(path, after=number):
            if rec.get("t") == "end":
                notes["complete"] = True
                notes["ended_by"] = rec.get("by")
        # The complete steps before the break are kept; a step cut off after its
        # schedule() (no update) is not.
        for step in steps + ([current] if current is not None else []):
            if step["schedule"] is None or step["update"] is not None or step["crash"] is not None:
                yield step
        notes["trailing_inputs"] = 0
        return
    if current is not None:
        if current["update"] is not None:
            yield current
        else:  # cut off after its schedule (a synchronous step always updates)
            notes["dropped_incomplete_step"] = True
            inputs = current["inputs"] + inputs
    notes["trailing_inputs"] = len(inputs)


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


def _check_sampled(schedule: dict, update: dict, known: dict[str, int], number: int) -> None:
    """Every live request whose scheduled step reached the end of its known
    tokens sampled one (EngineCore's model runner for a generating model always
    samples there; vLLM's ``Scheduler`` appends it), then advance ``known`` by
    the tokens sampled and drop the requests that finished. A hand-made
    ``ModelRunnerOutput`` with an empty list there (a unit test feeding
    ``[[]]`` for a complete prefill), or a model that appends no sampled token
    after prefill (vLLM's ``num_sampled_tokens_per_step`` 0: pooling, an
    encoder-only instance, a diffusion model), is a fact of the model output,
    not a scheduler finding: a protocol break at this update (regression:
    OUTPUT-ONLY-COMPLETE "sampled nothing" reported as a violation, and
    converting such a request that later finished FINISHED_STOPPED at 0 output
    tokens was refused as an EOS at 0 tokens). ``known`` holds the requests
    added and not yet finished (``len(prompt_token_ids)`` at arrival)."""
    sampled = {r: len(t) for r, t in update.get("sampled") or () if t}
    # The batch: what schedule() returned (a request scheduled and then withdrawn
    # or preempted in the same schedule() is not in it; regression: one was taken
    # for a request that should have sampled).
    batch = {r for r, _ in schedule["output"]["num_scheduled_tokens"]}
    for e in schedule["output"]["events"]:
        rid = e["request_id"]
        if e["type"] != "schedule" or rid not in batch or rid not in known or rid in sampled:
            continue
        end = e["num_computed_tokens"] + e["num_scheduled_tokens"] - len(e.get("spec_token_ids") or ())
        if end >= known[rid]:
            raise _ProtocolBreak(
                f"line {number}: the model output samples no token for request {rid!r}, whose step "
                f"reached {end} of its {known[rid]} tokens (EngineCore's model runner samples one for "
                f"a generating model: a hand-made ModelRunnerOutput, or a pooling, encoder-only or "
                f"diffusion model that appends none after prefill)")
    for e in schedule["output"]["events"]:
        rid = e["request_id"]
        if e["type"] != "schedule" or rid not in batch or rid not in known or rid not in sampled:
            continue
        end = e["num_computed_tokens"] + e["num_scheduled_tokens"] - len(e.get("spec_token_ids") or ())
        if end < known[rid]:
            # Regression: vLLM 0.33.0's test_priority_preemption_bug.py samples a token for
            # every scheduled request, a 15-token chunk of a 200-token prompt too; vLLM
            # appends it, and OUTPUT-ONLY-COMPLETE was reported as a violation.
            raise _ProtocolBreak(
                f"line {number}: the model output samples a token for request {rid!r}, whose step "
                f"reached {end} of its {known[rid]} tokens (a partial prefill chunk: EngineCore's "
                f"model runner samples none there; a hand-made ModelRunnerOutput)")
    for rid, n in sampled.items():
        if rid in known:
            known[rid] += n
    for f in update.get("finished") or ():
        known.pop(f["request_id"], None)


def _check_queues_untouched(before: dict, last_after: dict | None, arrived: set[str], number: int) -> None:
    """The queues at a ``schedule()`` hold what the previous one left: running
    only loses requests between them (update_from_output, aborts: never one
    added or reordered), and a waiting request was waiting then, or arrived
    since. Anything else was done by hand (a unit test appending to
    ``running``, calling ``_preempt_request``): a protocol break. At the
    first ``schedule()`` (``last_after`` None) the queues hold only requests
    added since the scheduler was built (regression: vLLM 0.29.0's
    ``test_scheduler_stats_waiting_queues`` puts requests into
    ``skipped_waiting`` by hand, and the recording was refused as a whole,
    "request '3' was never added")."""
    if last_after is None:
        if before["running"]:
            raise _ProtocolBreak(f"line {number}: the running queue changed outside schedule() "
                                 f"(edited by hand): the driver left EngineCore's protocol")
        last_after = {"running": [], "waiting": []}
    prev = iter(last_after["running"])
    if not all(any(r == p for p in prev) for r in before["running"]):
        raise _ProtocolBreak(f"line {number}: the running queue changed outside schedule() "
                             f"(edited by hand): the driver left EngineCore's protocol")
    allowed = set(last_after["waiting"]) | arrived
    extra = [r for r in before["waiting"] if r not in allowed]
    if extra:
        raise _ProtocolBreak(f"line {number}: request(s) {', '.join(map(repr, extra[:3]))} entered the "
                             f"waiting queue outside schedule() and add_request() (by hand: a "
                             f"preemption, a queue edited): the driver left EngineCore's protocol")


def _new_notes() -> dict[str, Any]:
    return {"mid_step_aborts": 0, "notes": [], "error": None, "complete": False,
            "dropped_incomplete_step": False, "trailing_inputs": 0, "crash": None,
            "protocol": None, "ended_by": None}


def _is_idle(src: Path, sched_rec: dict) -> bool:
    """vLLM's ``schedule()`` with nothing unfinished (only to report finished ids)."""
    before = sched_rec["before"]
    idle = not before["waiting"] and not before["running"]
    if idle and sched_rec["output"]["total_num_scheduled_tokens"]:
        raise ConvertError(f"{src}: batch {sched_rec.get('batch', '?')}: tokens scheduled with "
                           f"empty queues")
    return idle


def _steps(src: Path, notes: dict, max_batches: int = 1):
    """Yield (step, idle) for the steps the trace keeps, and (step, None) for
    the ones it drops. A ``schedule()`` with nothing unfinished is no batch of
    the trace (the reference engine makes no such call): only its
    ``finished_req_ids`` matter, and its update is dropped too. ``idle`` is
    False for a step whose schedule is kept; True for one whose inputs or
    update are kept without a schedule part; None when nothing is kept. Sets
    ``step["update_kept"]``: the step's update (or crashed update) completes
    a batch of the trace."""
    for step in _raw_steps(src, notes, max_batches):
        done = step["update_schedule"]
        step["update_kept"] = done is not None and not _is_idle(src, done)
        if done is not None and not step["update_kept"] and step["update"] is not None and (
                step["update"]["sampled"] or step["update"]["finished"]):
            raise ConvertError(f"{src}:{step['line']}: the update of an empty batch sampled or "
                               f"finished requests")
        if step["schedule"] is None and step["crash"] is not None and step["crash"]["call"] == "schedule":
            yield step, False  # vLLM crashed in schedule(): a step of the trace
            continue
        if step["schedule"] is not None and not _is_idle(src, step["schedule"]):
            yield step, False
        elif step["inputs"] or step["update_kept"] or step["crash"] is not None:
            yield step, True  # a crash is never dropped (regression: one in an empty batch's update was)
        else:
            yield step, None


def _ulps_below(x: float, n: int) -> float:
    for _ in range(n):
        x = math.nextafter(x, -math.inf)
    return x


#: The recorded KV-cache specs the harness models (``reference.kv``), by the
#: layer type a model config names for them (``MambaSpec``: mode "none" only,
#: see ``hybrid_config``).
_LAYER_TYPE_OF_SPEC = {"FullAttentionSpec": "full_attention", "SlidingWindowSpec": "sliding_attention",
                       "MambaSpec": "linear_attention"}


def _mamba_unmodelled(groups: list[list], max_model_len: int | None, num_speculative_tokens: int,
                      enable_prefix_caching: bool, cache_mamba_mode: str | None) -> str | None:
    """Why the recording's ``MambaSpec`` groups are not the reference's
    (``reference.kv.kv_cache_spec.MambaSpec``: vLLM 0.33.0's
    ``mamba_cache_mode`` "none", one state block of ``max_model_len`` tokens
    plus ``num_speculative_tokens`` blocks), or None when they are.

    vLLM 0.33.0 caches Mamba states in mode "align" when prefix caching is on
    (its default for a hybrid model, ``MambaModelConfig``): the
    ``MambaManager``'s blocks are ``block_size`` tokens, one state cached per
    block boundary, the previous state freed at the next allocation, prefill
    checkpoints (``single_type_kv_cache_manager.py::MambaManager``), and the
    ``Scheduler`` cuts prefill chunks at block boundaries
    (``_mamba_block_aligned_split``, on when ``cache_config.mamba_cache_mode``
    is "align"). None of that is modelled. ``cache_mamba_mode`` is the
    recorded ``cache_config.mamba_cache_mode`` (None: not recorded)."""
    for i, g in enumerate(groups):
        if g[0] != "MambaSpec":
            continue
        fields = g[4] if len(g) > 4 and isinstance(g[4], dict) else None
        if fields is None or "mamba_cache_mode" not in fields:
            return f"group {i}: MambaSpec recorded without its mamba_cache_mode (a recorder before issue 28's Mamba groups)"
        mode = fields["mamba_cache_mode"]
        if mode != "none":
            return (f"group {i}: MambaSpec mamba_cache_mode {mode!r} (vLLM's Mamba prefix caching: a state "
                    f"block per {g[2]} tokens, block-aligned prefill chunks, checkpoints; the model has 'none')")
        if g[2] != max_model_len:
            return (f"group {i}: MambaSpec block_size {g[2]} (mode 'none' keeps the whole state in one "
                    f"block of max_model_len {max_model_len} tokens; the model has only that)")
        blocks = fields.get("num_speculative_blocks", 0)
        if blocks != num_speculative_tokens:
            return (f"group {i}: MambaSpec num_speculative_blocks {blocks} (the model has "
                    f"num_speculative_tokens {num_speculative_tokens})")
    if cache_mamba_mode not in (None, "none"):
        return (f"cache_config.mamba_cache_mode {cache_mamba_mode!r}: vLLM's Scheduler cuts prefill chunks "
                f"at Mamba block boundaries (_mamba_block_aligned_split; the model has 'none')")
    if enable_prefix_caching:
        # vLLM's MambaManager asserts "align" with caching: a recording cannot hold this.
        return "MambaSpec mamba_cache_mode 'none' with prefix caching (vLLM requires 'align' for it)"
    return None


def hybrid_config(groups: list[list] | None, block_size: int, *, max_model_len: int | None = None,
                  num_speculative_tokens: int = 0, enable_prefix_caching: bool = False,
                  cache_mamba_mode: str | None = None) -> tuple[dict, dict[str, str]]:
    """A hybrid recording's KV-cache groups (meta ``kv_cache_groups``:
    ``[spec name, sliding_window, block_size, layers]`` each, group order, a
    ``MambaSpec`` group with its fields fifth: ``events.describe_groups``) as
    the harness's config keys.

    Returns ``({"sliding_window": w, "layer_types": [...], ...}, {})`` when
    one layer per group, grouped as vLLM 0.33.0 groups them
    (``reference.kv.kv_cache_spec.kv_cache_groups_for`` with
    ``max_model_len`` and ``num_speculative_tokens``), gives back the same
    groups in the same order; else ``({}, {feature: why})``: ``kv_cache_spec``
    for a spec the reference does not model (Mamba in any mode but "none",
    ``_mamba_unmodelled``; chunked local attention, MLA, ...), ``kv_cache_groups``
    for groups it models in a shape a config cannot name (block sizes or
    windows that differ, an order the grouping does not give, several
    full-attention groups). ``({}, {})`` for no groups recorded.

    With Mamba groups the keys also set ``block_size``: the attention
    groups' (vLLM's ``Scheduler`` runs on the least common multiple of every
    group's block size, ``kv_cache_utils.resolve_kv_cache_block_sizes``,
    which the recorder writes as ``block_size``; in mode "none" without a KV
    connector it reads it nowhere, as the vLLM driver does,
    ``driver.Driver.init``). ``block_size`` is the recorded one."""
    from reference.kv.kv_cache_spec import kv_cache_groups_for

    if not groups:
        return {}, {}
    names = [g[0] for g in groups]
    other = sorted(set(names) - set(_LAYER_TYPE_OF_SPEC))
    if other:
        return {}, {"kv_cache_spec": f"KV-cache spec {', '.join(other)} is not modelled"}
    mamba = "MambaSpec" in names
    if mamba:
        why = _mamba_unmodelled(groups, max_model_len, num_speculative_tokens, enable_prefix_caching,
                                cache_mamba_mode)
        if why is not None:
            return {}, {"kv_cache_spec": why}
        attention = sorted({g[2] for g in groups if g[0] != "MambaSpec"})
        if len(attention) > 1:
            return {}, {"kv_cache_groups": f"attention block sizes {attention} per group (the model has one)"}
        if attention:
            block_size = attention[0]
    elif any(g[2] != block_size for g in groups):
        return {}, {"kv_cache_groups": f"block sizes {[g[2] for g in groups]} per group "
                                       f"(the model has one, {block_size})"}
    windows = sorted({g[1] for g in groups if g[0] == "SlidingWindowSpec"})
    if len(windows) > 1:
        return {}, {"kv_cache_groups": f"sliding windows {windows} (the model has one)"}
    window = windows[0] if windows else None
    layer_types = tuple(_LAYER_TYPE_OF_SPEC[n] for n in names)
    rebuilt = [[type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None)]
               for g in kv_cache_groups_for(layer_types, block_size, window, max_model_len=max_model_len,
                                            num_speculative_tokens=num_speculative_tokens)]
    if rebuilt != [[g[0], g[1] if g[0] == "SlidingWindowSpec" else None] for g in groups]:
        return {}, {"kv_cache_groups": f"groups {names} in an order vLLM's grouping does not give"}
    if window is not None and set(layer_types) == {"sliding_attention"}:
        return {"sliding_window": window}, {}  # every layer a sliding-window layer
    if window is None and not mamba:
        return {}, {"kv_cache_groups": f"{len(groups)} full-attention groups"}
    keys: dict = {"layer_types": list(layer_types)}
    if window is not None:
        keys["sliding_window"] = window
    if mamba:
        keys["block_size"] = block_size
    return keys, {}


#: The recorded encoder config (the budgets vLLM's Scheduler derived, in embeds),
#: mapped onto EngineConfig only for a recording with encoder inputs.
ENCODER_KEYS = ("max_num_encoder_input_tokens", "encoder_cache_size", "disable_chunked_mm_input")
#: The recorder's ``unmodelled`` features under which a request's encoder inputs
#: are left out of the trace (as every recording's were before format 3 kept them).
ENCODER_UNMODELLED = ("encoder_decoder", "mm_encoder_only", "ec_connector", "encoder_cache_manager")


def _items_unmodelled(src: Path) -> str | None:
    """Why the recording's encoder inputs cannot be modelled, from its arrivals
    (None: they can): an item with fewer embeds than placeholder tokens (an
    ``is_embed`` mask), or items that are not sorted, non-overlapping spans
    inside the prompt (``RequestSpec.mm_positions``)."""
    for number, rec in _read_records(src):
        if rec["t"] != "arrival" or not rec.get("mm_features"):
            continue
        end = 0
        for offset, length, _, num_embeds in rec["mm_features"]:
            if num_embeds != length:
                return f"request {rec['request_id']!r}: an item of {length} tokens has {num_embeds} embeds"
            if offset < end or length < 1 or offset + length > len(rec["prompt_token_ids"]):
                return (f"request {rec['request_id']!r}: items {rec['mm_features']!r:.120} are not sorted, "
                        f"non-overlapping spans of its prompt")
            end = offset + length
    return None


def _map_config(meta_rec: dict, engine_config_cls,
                derived_keys: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(values for EngineConfig, unmapped captured values). Names are vLLM's:
    a recorded value under our name wins, then ``scheduler_config.NAME``,
    ``cache_config.NAME``, ``parallel_config.NAME`` and ``vllm_config.NAME``;
    fields with no vLLM counterpart keep their default. The derived
    ``max_concurrent_batches`` (vLLM's ``VllmConfig`` property, or an older
    log's recorded key) is mapped too: ``EngineConfig.from_dict`` checks it
    against ``pipeline_parallel_size`` and ``async_scheduling``."""
    # vLLM's encoder budget keys have no effect on a text-only recording: mapped
    # by ``convert`` only when a request has encoder inputs (ENCODER_KEYS).
    fields = ({f.name for f in dataclasses.fields(engine_config_cls)} | set(derived_keys)) - set(
        ENCODER_KEYS) - {"max_loras"}
    recorded = meta_rec.get("config", {})
    raw = meta_rec.get("vllm_config", {})
    values = {}
    for name in fields:
        for key, source in ((name, recorded), (f"scheduler_config.{name}", raw),
                            (f"cache_config.{name}", raw), (f"parallel_config.{name}", raw),
                            (f"vllm_config.{name}", raw)):
            if key in source:
                values[name] = source[key]
                break
    unmapped = {k: v for k, v in sorted(raw.items()) if k.split(".", 1)[-1] not in fields}
    unmapped.update({k: v for k, v in recorded.items() if k not in fields})
    return values, unmapped


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
    from reference.workload import RequestSpec, Workload, WorkloadError

    src = recording_path(jsonl_path)
    meta_rec = next((rec for _, rec in _read_records(src)), None)
    if meta_rec is None or meta_rec.get("t") != "meta":
        raise ConvertError(f"{src}: does not start with a sched-harness meta record")
    if meta_rec.get("format") not in READABLE_FORMATS:
        raise ConvertError(f"{src}: unknown recording format {meta_rec.get('format')!r} "
                           f"(this converter reads {', '.join(map(str, READABLE_FORMATS))})")
    for _, rec in _read_records(src, after=1):
        # The config a unit test set by hand before the first schedule() (the recorder's
        # ``config`` record): what vLLM's schedule() used.
        if rec["t"] in ("schedule", "crash", "update", "protocol", "error", "end"):
            break
        if rec["t"] == "config":
            meta_rec["config"] = {**meta_rec.get("config", {}), **rec["config"]}
    values, unmapped_config = _map_config(meta_rec, EngineConfig, DERIVED_KEYS)
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
    notes = _new_notes()
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
    kv_outputs: list[tuple] = []
    kv_sending = 0
    # Encoder inputs (the arrival's ``mm_features``): each request's recorded
    # identifiers, the config's mm_identifiers.
    mm_identifiers: dict[str, tuple[str, ...]] = {}
    # LoRA requests (the arrival's ``lora_int_id``): the config's lora_int_ids.
    lora_int_ids: dict[str, int] = {}
    # ... unless the model cannot follow vLLM's encoder (meta ``unmodelled``).
    encoder_why = next((k for k in ENCODER_UNMODELLED if k in (meta_rec.get("unmodelled") or {})), None)
    budgets = [meta_rec.get("config", {}).get(k) for k in ENCODER_KEYS[:2]]
    if encoder_why is None and not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                       for b in budgets):
        # (vLLM's budgets are 0 for a model without multimodal inputs; a test may set 0.)
        encoder_why = (f"encoder budgets max_num_encoder_input_tokens {budgets[0]}, encoder cache size "
                       f"{budgets[1]} (the model needs both positive)")
    if encoder_why is None:
        encoder_why = _items_unmodelled(src)
    encoder_modelled = encoder_why is None
    dropped_mm = 0  # requests whose recorded encoder inputs are left out (not encoder_modelled)
    kept_of_batch: dict[int, int] = {}

    def rid(vllm_id: str, where: int) -> str:
        try:
            return ids[vllm_id]
        except KeyError:
            raise ConvertError(f"{src}:{where}: request {vllm_id!r} was never added") from None

    kv_unanswered: list[str] = []  # "request at line": a connector decision with no answer recorded
    kv_promoted: set[str] = set()
    for step, idle in _steps(src, notes, batches):
        # A KV producer's reports count in every update, kept or not (regression: a
        # finished_sending in the update of a dropped idle step left its delayed free
        # judged, and FREE-WHOLE-TABLE / BLOCK-CONSERVATION fired on correct vLLM).
        kv_sending += len(((step["update"] or {}).get("kv") or {}).get("finished_sending") or ())
        if idle is None:
            dropped_idle += 1
            continue
        if step["schedule"] is not None and idle is False:
            kv_unanswered.extend(_unanswered_kv_decisions(step["schedule"], step["line"], kv_promoted))
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
    for step, idle in _steps(src, _new_notes(), batches):
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
    if mm_identifiers or (lora_int_ids and lora_unmodelled is None):
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
        if config.kv_cache_groups:
            recorded_kv = "a hybrid KV cache (the connector's loads are modelled for one group)"
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
                     "kv_connector_outputs": tuple(kv_outputs)}, accept_vllm_crash=True)
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
                              e["num_external_tokens"], list(e["block_ids"]), e["reserved_blocks"])
        if e["type"] == "kv_promote":
            if e["status"] not in status_names:
                raise ConvertError(f"{src}:{where}: request {e['request_id']!r} promoted to status "
                                   f"{e['status']} (the reference has no such status)")
            return Promotion(rid(e["request_id"], where), RequestStatus[e["status"]],
                             e["num_computed_tokens"], bool(e["load_failed"]),
                             list(e["freed_block_ids"]))
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
            writer.protocol = f"the driver left EngineCore's protocol at {src.name}:{notes['protocol']}"
        if notes["error"]:
            writer.salvaged = f"a vLLM recording stopped early ({notes['error']})"
        elif not notes["complete"]:
            writer.salvaged = "a vLLM recording without its end record (the server was cut off)"
        index = 0
        for step, idle in _steps(src, _new_notes(), batches):
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
                        rec.update.kv_freed = [KVTransferFree(rid(r, where), list(b), f)
                                               for r, b, f in kv["kv_freed"]]
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
