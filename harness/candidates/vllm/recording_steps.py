"""Read a recording scheduler's JSONL into vLLM's ``EngineCore`` steps (this project's venv).

The first half of ``recording_convert.convert``: ``read_records`` yields the
JSON lines, ``raw_steps`` groups them by vLLM's loop (each ``schedule()`` with
the inputs before it and the ``update_from_output()`` that completes its
batch, at most ``max_concurrent_batches`` in flight) and ``engine_steps``
tells the steps the trace keeps from the idle ones vLLM makes only to report
finished ids. A driver that leaves EngineCore's protocol (a unit test calling
``schedule()`` twice, editing the queues by hand, a hand-made model output)
raises ``ProtocolBreak``: the trace keeps the complete steps before it; a
log that cannot be read raises ``ConvertError``, naming the file and line.
"""

from __future__ import annotations

import gzip
import json
from collections import deque
from pathlib import Path
from typing import Any


class ConvertError(ValueError):
    """The JSONL cannot be turned into a trace; the message names the file and line."""


class ProtocolBreak(Exception):
    """The recorded run left the trace's step protocol here: its driver left
    EngineCore's (a unit test calling
    ``schedule()`` twice, ``update_from_output()`` with a SchedulerOutput that
    no ``schedule()`` returned, editing the queues by hand) or did what the
    model cannot follow (a prefix-cache reset, a streaming-input update, an
    abort between ``schedule()`` and ``update_from_output()`` at vLLM's
    timing). The trace keeps the complete steps before it; the footer's
    ``protocol`` names it (``harness check`` then claims no end-of-trace
    rule)."""


def _lines(path: Path):
    """The text lines of ``path``, gzip-compressed (``.gz``) or not. A gzip
    stream cut short (a copy interrupted) ends quietly, as a torn last line
    does; a file that is not text (or a ``.gz`` that is not gzip) raises
    ConvertError naming it."""
    opener = gzip.open if Path(path).suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            yield from fh
    except EOFError:  # a truncated gzip stream: the lines read so far
        return
    except UnicodeDecodeError:
        raise ConvertError(f"{path}: not a text file (a recording is JSON lines, or gzip-compressed "
                           f"JSON lines named .gz)") from None
    except gzip.BadGzipFile:
        raise ConvertError(f"{path}: named .gz but not gzip-compressed") from None


def read_records(path: Path, after: int = 0):
    """Yield (line number, record) of the lines after line ``after`` of the
    recording ``path`` (JSON lines; gzip-compressed when named ``.gz``); stop
    quietly at a torn last line. Raises ConvertError naming the file and line."""
    pending = None
    for number, line in enumerate(_lines(path), 1):
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


def raw_steps(path: Path, notes: dict, max_batches: int = 1):
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
            raise ProtocolBreak(
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
            raise ProtocolBreak(f"line {number}: update_from_output() without a schedule(): the "
                                 f"driver left EngineCore's protocol")
        oldest = in_flight[0][0]
        batch = rec.get("batch")
        if batch is None and numbered and rec["t"] == "update":
            # The recorder writes no batch for a SchedulerOutput it did not see returned.
            raise ProtocolBreak(f"line {number}: update_from_output() given a SchedulerOutput that "
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
        for number, rec in read_records(path):
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
                    raise ProtocolBreak(f"line {number}: request id {rec['request_id']!r} added again "
                                         f"after it finished (a trace needs unique ids)")
                if rec.get("num_computed_tokens"):
                    raise ProtocolBreak(f"line {number}: request {rec['request_id']!r} added with "
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
                    raise ProtocolBreak(
                        f"line {number}: {len(rec['finished'])} request(s) aborted between schedule() "
                        f"and update_from_output() (a trace step has no place for it; "
                        f"SCHED_HARNESS_MID_STEP_ABORTS=defer records it after the update)")
                if rec.get("status", "FINISHED_ABORTED") != "FINISHED_ABORTED":
                    # EngineCore finishes requests from outside only by aborting them.
                    raise ProtocolBreak(f"line {number}: finish_requests() with {rec['status']} (EngineCore "
                                         f"calls it only to abort): the driver left EngineCore's protocol")
                for f in rec["finished"]:
                    known.pop(f["request_id"], None)
                inputs.append(("abort", rec))
            elif kind == "schedule":
                placeholders = [e["request_id"] for e in rec["output"].get("events") or ()
                                if async_class_sync_config and e.get("kind") == "running"
                                and -1 in (e.get("spec_token_ids") or ())]
                if placeholders:
                    raise ProtocolBreak(
                        f"line {number}: an AsyncScheduler under a synchronous config scheduled "
                        f"placeholder drafts -1 for {placeholders[0]!r} (EngineCore builds an "
                        f"AsyncScheduler only with async scheduling; here scheduler_config."
                        f"async_scheduling was off, as vLLM's CPU platform sets it): the driver "
                        f"left EngineCore's protocol")
                resolve(rec["before"])
                resolve(rec["after"])
                check_queues_untouched(rec["before"], last_after, arrived, number)
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
                check_sampled(step["update_schedule"], rec, known, number)
                step["update"] = rec
                # Streaming-input sessions the update parked (vLLM put them back in a
                # waiting queue itself; regression: taken for a preemption by hand).
                arrived.update(rec.get("continued") or ())
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
                    raise ProtocolBreak(f"line {number}: the prefix cache was reset (the model "
                                         f"cannot follow a reset: its hits and frees differ after it)")
                if what == "pause_state" and rec.get("state") != "UNPAUSED":
                    raise ProtocolBreak(f"line {number}: the scheduler was paused ({rec.get('state')}; "
                                         f"pausing is not modelled)")
                if what == "streaming_update":
                    raise ProtocolBreak(f"line {number}: a streaming-input update of request "
                                         f"{rec.get('request_id')!r} (add_request() of a live resumable "
                                         f"request: vLLM appends the chunk to its session, "
                                         f"_update_request_as_session; the trace has no row for an "
                                         f"input chunk, so the model parks a stopped session and "
                                         f"stops there)")
            elif kind == "protocol":
                raise ProtocolBreak(f"line {number}: {rec.get('what', '?')}: the driver left "
                                     f"EngineCore's protocol")
            elif kind == "error":
                notes["error"] = rec.get("error", "?")
                # The recorder stops here; only its end record may follow.
                for number, rec in read_records(path, after=number):
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
    except ProtocolBreak as brk:
        notes["protocol"] = str(brk)
        # Whether the recording has its end record past the break (regression: never
        # read, so every trace ended by a protocol break was also "salvaged: a vLLM
        # recording without its end record (the server was cut off)").
        for _, rec in read_records(path, after=number):
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


def check_sampled(schedule: dict, update: dict, known: dict[str, int], number: int) -> None:
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
            raise ProtocolBreak(
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
            raise ProtocolBreak(
                f"line {number}: the model output samples a token for request {rid!r}, whose step "
                f"reached {end} of its {known[rid]} tokens (a partial prefill chunk: EngineCore's "
                f"model runner samples none there; a hand-made ModelRunnerOutput)")
    for rid, n in sampled.items():
        if rid in known:
            known[rid] += n
    for f in update.get("finished") or ():
        known.pop(f["request_id"], None)


def check_queues_untouched(before: dict, last_after: dict | None, arrived: set[str], number: int) -> None:
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
            raise ProtocolBreak(f"line {number}: the running queue changed outside schedule() "
                                 f"(edited by hand): the driver left EngineCore's protocol")
        last_after = {"running": [], "waiting": []}
    prev = iter(last_after["running"])
    if not all(any(r == p for p in prev) for r in before["running"]):
        raise ProtocolBreak(f"line {number}: the running queue changed outside schedule() "
                             f"(edited by hand): the driver left EngineCore's protocol")
    allowed = set(last_after["waiting"]) | arrived
    extra = [r for r in before["waiting"] if r not in allowed]
    if extra:
        raise ProtocolBreak(f"line {number}: request(s) {', '.join(map(repr, extra[:3]))} entered the "
                             f"waiting queue outside schedule() and add_request() (by hand: a "
                             f"preemption, a queue edited): the driver left EngineCore's protocol")


def new_notes() -> dict[str, Any]:
    return {"mid_step_aborts": 0, "notes": [], "error": None, "complete": False,
            "dropped_incomplete_step": False, "trailing_inputs": 0, "crash": None,
            "protocol": None, "ended_by": None}


def is_idle(src: Path, sched_rec: dict) -> bool:
    """vLLM's ``schedule()`` with nothing unfinished (only to report finished ids)."""
    before = sched_rec["before"]
    idle = not before["waiting"] and not before["running"]
    if idle and sched_rec["output"]["total_num_scheduled_tokens"]:
        raise ConvertError(f"{src}: batch {sched_rec.get('batch', '?')}: tokens scheduled with "
                           f"empty queues")
    return idle


def engine_steps(src: Path, notes: dict, max_batches: int = 1):
    """Yield (step, idle) for the steps the trace keeps, and (step, None) for
    the ones it drops. A ``schedule()`` with nothing unfinished is no batch of
    the trace (the reference engine makes no such call): only its
    ``finished_req_ids`` matter, and its update is dropped too. ``idle`` is
    False for a step whose schedule is kept; True for one whose inputs or
    update are kept without a schedule part; None when nothing is kept. Sets
    ``step["update_kept"]``: the step's update (or crashed update) completes
    a batch of the trace."""
    for step in raw_steps(src, notes, max_batches):
        done = step["update_schedule"]
        step["update_kept"] = done is not None and not is_idle(src, done)
        if done is not None and not step["update_kept"] and step["update"] is not None and (
                step["update"]["sampled"] or step["update"]["finished"]):
            raise ConvertError(f"{src}:{step['line']}: the update of an empty batch sampled or "
                               f"finished requests")
        if step["schedule"] is None and step["crash"] is not None and step["crash"]["call"] == "schedule":
            yield step, False  # vLLM crashed in schedule(): a step of the trace
            continue
        if step["schedule"] is not None and not is_idle(src, step["schedule"]):
            yield step, False
        elif step["inputs"] or step["update_kept"] or step["crash"] is not None:
            yield step, True  # a crash is never dropped (regression: one in an empty batch's update was)
        else:
            yield step, None
