"""Record a real vLLM server's scheduler decisions, then convert them to a sched-harness trace.

Two halves in one file:

* ``RecordingScheduler`` -- a subclass of vLLM's v1 ``Scheduler`` for
  ``--scheduler-cls``. It runs inside the server's engine-core process and
  imports only the standard library, ``vllm`` and ``harness/candidates/vllm/events.py``
  (stdlib only; msgspec, a vLLM dependency, encodes when present): no pyarrow,
  no ``reference`` package. As the server runs it writes newline-delimited
  JSON (one file per engine core) with one ``os.write`` at the end of every
  step (at most every ``SCHED_HARNESS_FLUSH_S`` seconds when that is set).
* ``convert(jsonl_path, parquet_path)`` -- runs in this project's venv and
  turns that JSONL into a Parquet trace (``docs/trace-format.md``) that
  ``harness check`` and ``harness replay`` read. pyarrow is imported inside it.

The module imports neither vLLM nor pyarrow at import time:
``RecordingScheduler`` is built on first access (PEP 562 ``__getattr__``,
which is what vLLM's ``resolve_obj_by_qualname`` triggers).

Usage on a GPU server (vLLM 0.33.0)::

    PYTHONPATH=/path/to/sched-harness SCHED_HARNESS_TRACE=/tmp/run1.jsonl \\
      vllm serve MODEL --no-async-scheduling \\
        --scheduler-cls harness.candidates.vllm.recording_scheduler.RecordingScheduler
    # ... send traffic, then stop the server (Ctrl-C): the scheduler's
    # shutdown() renames the temporary file to /tmp/run1.jsonl

    .venv/bin/python -c 'from harness.candidates.vllm.recording_scheduler import convert; \\
      print(convert("/tmp/run1.jsonl", "/tmp/run1.parquet"))'
    .venv/bin/harness check /tmp/run1.parquet

With async scheduling (vLLM's default on GPU) name ``AsyncRecordingScheduler``
instead (the same recorder on vLLM's ``AsyncScheduler``; vLLM uses a
``--scheduler-cls`` as given, so ``RecordingScheduler`` refuses to start under
async scheduling rather than run without output placeholders).

``SCHED_HARNESS_TRACE`` (default ``./sched-harness-trace.jsonl``, relative to
the engine core's working directory) names the output; with data parallelism
each rank writes ``NAME.dp<rank>.jsonl``. While the server runs the data goes
to ``.NAME.<pid>.tmp`` in the same folder (flushed at step ends, so a killed
server leaves a usable temporary file: ``convert`` accepts it and drops an
incomplete last step). ``SCHED_HARNESS_STRICT=1`` makes recording errors raise
(tests); by default a recording error is logged, written to the file as an
``error`` record and recording stops while the server keeps serving.
``SCHED_HARNESS_BASE_CLS=pkg.mod:Class`` layers the recording over that
subclass of vLLM's ``Scheduler`` (your own ``--scheduler-cls`` class, found on
``PYTHONPATH``) instead of vLLM's ``Scheduler``; the trace's metadata names it.

Refused at start-up (``RuntimeError``): pipeline parallelism, any number of
batches in flight but 1 (the synchronous ``EngineCore.step``: schedule,
execute, update) or 2 (async scheduling, ``EngineCore.step_with_batch_queue``:
``schedule()`` of step N+1 runs before ``update_from_output()`` of step N), and
async scheduling under the synchronous ``RecordingScheduler``.

JSONL records (one object per line, key ``t``): ``meta`` (first line: vLLM
version, config values under our ``EngineConfig`` names, every other captured
vLLM config value, warnings, and ``scheduler_cls`` when the recorder runs over
the user's own class, ``SCHED_HARNESS_BASE_CLS``: see ``_base_scheduler_class``),
``arrival`` (a request added: prompt and
sampling parameters), ``abort`` (``finish_requests``: the requests it
finished, in free order, and whether it happened between ``schedule`` and
``update_from_output``), ``schedule`` (its ``batch``: the number of the
schedule() call; queues and free blocks before and after, the normalised
decisions with the request data's ids, and after it the ``request_states`` of
its victims and of requests not running that hold drafts; under async
scheduling each scheduled request's ``num_output_placeholders``; a queue is
left out of a snapshot when it holds the same requests in the same order as
the snapshot written before it, and ``request_states`` out when empty),
``update`` (the ``batch`` it completes; tokens sampled per scheduled request
-- under async scheduling also for a request that ended while the batch ran,
whose token vLLM ignores --, requests finished, free blocks after), ``drafts`` (``update_draft_token_ids``: drafts
stored, and the ``states`` of requests not running that hold drafts),
``note`` (things the trace cannot represent: a prefix-cache reset, a
streaming-input update), ``crash`` (vLLM raised in ``schedule()``,
``update_from_output()`` or ``update_draft_token_ids()``: the call, vLLM's
exception type, message and innermost frame (``events.crash_info``), the
queues before a crashed schedule, the tokens a crashed update was given; the
exception is re-raised, so the server fails as it would, and the log is
closed: ``end`` follows), ``error`` and ``end``.

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

One file over ~500 lines on purpose: it is loaded inside vLLM's engine-core
process (``--scheduler-cls``), where only the standard library, vLLM and
``events.py`` (by path) may be imported, and the JSONL it writes and
``convert``, the one reader of that JSONL, change together; keeping both in
one file keeps the format in one place.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import hashlib
import json
import logging
import math
import operator
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

try:  # as a package module (our venv; PYTHONPATH=repo in the server)
    from harness.candidates.vllm import events as _ev
except ImportError:  # pragma: no cover - loaded by file path
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "sched_harness_vllm_events", Path(__file__).resolve().with_name("events.py"))
    _ev = importlib.util.module_from_spec(_spec)  # type: ignore[no-redef]
    sys.modules[_spec.name] = _ev
    _spec.loader.exec_module(_ev)

# 2: schedule outputs carry request_data_ids, snapshots request_states, drafts
# records the states after the draft update. 3: schedule and update records
# carry ``batch`` (which schedule() an update completes: async scheduling),
# an async schedule its ``placeholders``; a snapshot's waiting and running are
# left out when they are the requests of the snapshot written before it, in
# the same order (``_Recorder.snap``); request_states only in ``after``, and
# only when not empty. convert also reads formats 1 and 2.
FORMAT = 3
READABLE_FORMATS = (1, 2, FORMAT)
ENV_PATH = "SCHED_HARNESS_TRACE"
ENV_STRICT = "SCHED_HARNESS_STRICT"
ENV_FLUSH_S = "SCHED_HARNESS_FLUSH_S"
DEFAULT_PATH = "sched-harness-trace.jsonl"

_log = logging.getLogger("sched_harness.vllm_recording")

# RecordingScheduler is built on first access (it imports vLLM): not in __all__.
__all__ = ["FORMAT", "ConvertError", "convert"]


class RecordingError(RuntimeError):
    """The recording scheduler cannot record this configuration or run."""


# ---------------------------------------------------------------------------
# Server side: stdlib + vllm only
# ---------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    """A JSON-safe rendering of a config value (primitives kept, others as str)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return _jsonable(value.value)
    if isinstance(value, (list, tuple, set, frozenset)) and all(
            v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return [_jsonable(v) for v in value]
    text = str(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _capture_config(obj: Any, prefix: str, names: tuple[str, ...] | None = None) -> dict[str, Any]:
    if obj is None:
        return {}
    if names is None:
        names = tuple(f.name for f in dataclasses.fields(obj)) if dataclasses.is_dataclass(obj) else ()
    out = {}
    for name in names:
        try:
            out[f"{prefix}.{name}"] = _jsonable(getattr(obj, name))
        except Exception:  # a property that raises: skip it
            continue
    return out


def _output_path(vllm_config) -> Path:
    path = Path(os.environ.get(ENV_PATH) or DEFAULT_PATH)
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and getattr(pc, "data_parallel_size", 1) > 1:
        rank = getattr(pc, "data_parallel_rank", 0)
        path = path.with_name(f"{path.stem}.dp{rank}{path.suffix or '.jsonl'}")
    return path.absolute()


def _encode_default(value: Any) -> Any:
    """What neither encoder takes natively: integer-like values (numpy's, torch's
    scalars) as ints, float-like as floats; anything else is an error (the
    record is refused, recording stops: ``_Recorder.guard``)."""
    if hasattr(value, "__index__"):
        return int(value)
    if hasattr(value, "__float__"):
        return float(value)
    raise TypeError(f"cannot record a {type(value).__name__}")


def _json_line(record: dict) -> bytes:
    """``record`` as one JSON line by the standard library (the fallback encoder)."""
    return json.dumps(record, separators=(",", ":"), default=_encode_default).encode() + b"\n"


try:  # vLLM depends on msgspec; about 10x faster than json.dumps on our records
    import msgspec as _msgspec

    _MSGSPEC_ENCODER = _msgspec.json.Encoder(enc_hook=_encode_default)
except ImportError:  # pragma: no cover - a vLLM without it
    _MSGSPEC_ENCODER = None


class _LineWriter:
    """The recording's file: records are encoded as JSON lines into a buffer
    (msgspec's encoder when vLLM brought it, else ``json``; both read back with
    ``json.loads`` to the same values) and the buffer is written with one
    ``os.write`` at the end of every step, or at most every
    ``SCHED_HARNESS_FLUSH_S`` seconds when that is set above 0 (a killed server
    then loses up to that much of the tail, the complete steps before it still
    convert), or when it passes 1 MiB. What reached ``os.write`` survives a
    SIGKILL (it is the kernel's)."""

    LIMIT = 1 << 20

    def __init__(self, path: Path, *, use_msgspec: bool = True) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self.interval = max(0.0, float(os.environ.get(ENV_FLUSH_S, "0")))
        except ValueError:
            self.interval = 0.0
        self._last = time.monotonic()
        self._buf = bytearray()
        self._encoder = _MSGSPEC_ENCODER if use_msgspec else None
        self.name = str(path)

    def write(self, record: dict) -> None:
        """Append ``record`` as one line (TypeError, ValueError for what JSON cannot
        hold; the buffer is then left as it was)."""
        buf, start = self._buf, len(self._buf)
        if self._encoder is not None:
            try:
                self._encoder.encode_into(record, buf, start)
            except Exception:  # e.g. a lone surrogate, an int over 64 bits: json's rules
                del buf[start:]
                buf += _json_line(record)
                return
            buf += b"\n"
        else:
            buf += _json_line(record)

    def flush(self, force: bool = False) -> None:
        buf = self._buf
        if not buf:
            return
        if self.interval:
            now = time.monotonic()
            if not force and len(buf) < self.LIMIT and now - self._last < self.interval:
                return
            self._last = now
        done = os.write(self._fd, buf)
        if done < len(buf):  # a short write (a full disk, a signal): write the rest
            with memoryview(buf) as view:
                while done < len(buf):
                    done += os.write(self._fd, view[done:])
        buf.clear()

    def close(self) -> None:
        try:
            self.flush(force=True)
        finally:
            os.close(self._fd)


class _Recorder:
    """The recording state of one RecordingScheduler (kept off vLLM's namespace)."""

    def __init__(self, sched) -> None:
        import vllm

        self.sched = sched
        self.strict = os.environ.get(ENV_STRICT) == "1"
        self.enabled = True
        self.closed = False
        self.steps = 0
        self.mid_step = False  # between schedule() and update_from_output()
        self.in_abort = False
        vc = sched.vllm_config
        self.max_batches = self._check_supported(vc)
        self.batches = 0        # schedule() calls so far (each one's ``batch`` number)
        self.in_flight: dict[int, tuple[int, Any]] = {}  # id(SchedulerOutput) -> (batch, it)
        self.hooks = _ev.DecisionHooks(sched)
        self.use_v2 = bool(getattr(sched, "use_v2_model_runner",
                                   os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0") == "1"))
        self.path = _output_path(vc)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        self.fh = _LineWriter(self.tmp)
        # The queues of the last snapshot written (Request objects, in order):
        # format 3 leaves out a queue that has not changed since.
        self.shown_waiting: list | None = None
        self.shown_running: list | None = None
        # RequestStatus member -> Request.is_finished() for it: in every vLLM
        # release that is RequestStatus.is_finished(self.status), a function of
        # the status alone; cached, since the method calls cost ~1 us each per
        # scheduled request, twice a step.
        self.finished_by_status: dict = {}
        meta = {"t": "meta", "format": FORMAT, "vllm_version": vllm.__version__,
                "pid": os.getpid(), "started_unix": time.time(), "path": str(self.path),
                "config": self._engine_config(vc), "vllm_config": self._raw_config(vc),
                "warnings": self._warnings(vc)}
        if getattr(sched, "_sched_harness_base", None):  # the user's class under the recorder
            meta["scheduler_cls"] = sched._sched_harness_base
        self._write(meta)
        self.fh.flush(force=True)
        atexit.register(self.close)

    # -- configuration -----------------------------------------------------
    def _check_supported(self, vc) -> int:
        """The batches in flight this recorder follows (1 synchronous, 2 async).

        vLLM's ``EngineCore.step_with_batch_queue`` runs ``max_concurrent_batches``
        batches in flight: ``schedule()`` of step N+1 comes before
        ``update_from_output()`` of step N. The trace models that for async
        scheduling (an ``AsyncScheduler``: 2 batches); pipeline parallelism
        (its stages are not modelled) and a synchronous ``Scheduler`` under
        async scheduling (vLLM warns it runs degraded: no output placeholders)
        are refused (``RecordingError``)."""
        sc = vc.scheduler_config
        batches = int(getattr(vc, "max_concurrent_batches", 1))
        is_async = bool(getattr(sc, "async_scheduling", False))
        pp = int(getattr(getattr(vc, "parallel_config", None), "pipeline_parallel_size", 1) or 1)
        if pp != 1:
            raise RecordingError(
                f"RecordingScheduler does not record pipeline parallelism "
                f"(pipeline_parallel_size={pp}, {batches} batches in flight)")
        if is_async and not getattr(self.sched, "_sched_harness_async", False):
            raise RecordingError(
                "vLLM enabled async scheduling (its default on GPU): use --scheduler-cls "
                "harness.candidates.vllm.recording_scheduler.AsyncRecordingScheduler, or start "
                "the server with --no-async-scheduling")
        if batches != (2 if is_async else 1):
            raise RecordingError(
                f"RecordingScheduler records 1 batch in flight, or 2 with async scheduling; "
                f"this config runs {batches}")
        return batches

    def _engine_config(self, vc) -> dict[str, Any]:
        """Values under our EngineConfig names (the converter keeps those it knows)."""
        sched = self.sched
        sc, cc = vc.scheduler_config, vc.cache_config
        spec = getattr(vc, "speculative_config", None)
        budget = getattr(sched, "max_num_scheduled_tokens", sc.max_num_batched_tokens)
        out = {
            "num_gpu_blocks": int(sched.kv_cache_config.num_blocks),
            "block_size": int(getattr(sched, "block_size", cc.block_size)),
            "max_model_len": int(vc.model_config.max_model_len),
            "max_num_seqs": int(sc.max_num_seqs),
            "max_num_batched_tokens": int(sc.max_num_batched_tokens),
            "max_num_scheduled_tokens": None if budget == sc.max_num_batched_tokens else int(budget),
            "policy": str(_jsonable(sc.policy)),
            "enable_prefix_caching": bool(cc.enable_prefix_caching),
            "enable_chunked_prefill": bool(sc.enable_chunked_prefill),
            "long_prefill_token_threshold": int(sc.long_prefill_token_threshold or 0),
            "num_speculative_tokens": int(getattr(spec, "num_speculative_tokens", 0) or 0)
            if spec is not None else 0,
            # vLLM derives max_concurrent_batches from these two (captured
            # under vllm_config.max_concurrent_batches; _map_config checks it).
            "pipeline_parallel_size": int(getattr(getattr(vc, "parallel_config", None),
                                                  "pipeline_parallel_size", 1)),
            "async_scheduling": bool(getattr(sc, "async_scheduling", False)),
            "defer_block_free": bool(getattr(sched, "defer_block_free", False)),
        }
        for name in ("watermark", "scheduler_reserve_full_isl", "prefill_schedule_interval"):
            if hasattr(sc, name):
                out[name] = _jsonable(getattr(sc, name))
        return out

    @staticmethod
    def _raw_config(vc) -> dict[str, Any]:
        raw = {}
        raw.update(_capture_config(vc.scheduler_config, "scheduler_config"))
        raw.update(_capture_config(vc.cache_config, "cache_config"))
        raw.update(_capture_config(vc.model_config, "model_config",
                                   ("model", "served_model_name", "dtype", "max_model_len",
                                    "runner_type", "seed")))
        raw.update(_capture_config(getattr(vc, "parallel_config", None), "parallel_config",
                                   ("tensor_parallel_size", "pipeline_parallel_size",
                                    "data_parallel_size", "data_parallel_rank")))
        raw.update(_capture_config(getattr(vc, "speculative_config", None), "speculative_config",
                                   ("method", "num_speculative_tokens")))
        raw["vllm_config.num_lookahead_tokens"] = _jsonable(getattr(vc, "num_lookahead_tokens", 0))
        raw["vllm_config.max_concurrent_batches"] = _jsonable(getattr(vc, "max_concurrent_batches", 1))
        return raw

    def _warnings(self, vc) -> list[str]:
        """Configuration the reference does not model: the trace is still written."""
        sched, sc = self.sched, vc.scheduler_config
        out = []
        if getattr(sched, "connector", None) is not None:
            out.append("a KV connector is configured (remote KV loads/frees are not modelled)")
        groups = len(getattr(sched.kv_cache_config, "kv_cache_groups", ()) or ())
        if groups != 1:
            out.append(f"{groups} KV-cache groups (the trace keeps group 0's block ids only)")
        if getattr(vc, "num_lookahead_tokens", 0):
            out.append(f"speculative decoding reserves {vc.num_lookahead_tokens} lookahead slots "
                       f"(the reference models an n-gram proposer: none)")
        spec = getattr(vc, "speculative_config", None)
        if spec is not None and getattr(spec, "method", "ngram") != "ngram":
            out.append(f"speculative method {spec.method!r} (the reference models n-gram drafts)")
        if getattr(sc, "max_num_partial_prefills", 1) != 1:
            out.append(f"max_num_partial_prefills={sc.max_num_partial_prefills} is not modelled")
        if getattr(vc, "lora_config", None) is not None:
            out.append("LoRA is enabled (max_loras limits are not modelled)")
        return out

    # -- writing -------------------------------------------------------------
    def _write(self, record: dict) -> None:
        self.fh.write(record)

    def guard(self, fn, *args):
        """Run a recording step; a failure stops recording (raises in strict mode)."""
        if not self.enabled:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if self.strict:
                raise
            self.enabled = False
            self.hooks.active = False
            self.hooks.freed.clear()
            _log.exception("sched-harness recording stopped: %s", exc)
            try:
                self._write({"t": "error", "step": self.steps,
                             "error": f"{type(exc).__name__}: {exc}"[:500]})
                self.fh.flush(force=True)
            except Exception:
                pass
            return None

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._write({"t": "end", "steps": self.steps, "ended_unix": time.time()})
            self.fh.close()
            os.replace(self.tmp, self.path)
        except Exception as exc:  # shutdown must not fail because of us
            _log.error("sched-harness: could not finish %s: %s", self.path, exc)

    # -- events ----------------------------------------------------------------
    def on_add(self, request, existing: bool) -> None:
        if existing:
            self._write({"t": "note", "what": "streaming_update", "request_id": request.request_id})
            return
        params = request.sampling_params
        unsupported = []
        if params is None:
            unsupported.append("pooling")
        if getattr(request, "use_structured_output", False):
            unsupported.append("structured_output")
        if getattr(request, "has_encoder_inputs", False):
            unsupported.append("encoder_inputs")
        if getattr(request, "lora_request", None) is not None:
            unsupported.append("lora")
        if request.prompt_token_ids is None:
            unsupported.append("prompt_embeds")
        stop_ids = [int(t) for t in (getattr(params, "stop_token_ids", None) or ())]
        eos = getattr(params, "eos_token_id", None)
        if eos is None:
            # With ignore_eos vLLM keeps the EOS id only among all_stop_token_ids.
            extra = set(getattr(params, "all_stop_token_ids", None) or ()) - set(stop_ids)
            eos = next(iter(extra)) if len(extra) == 1 else None
        record = {
            "t": "arrival", "request_id": request.request_id,
            # Encoded before this returns: no copy (ints, or what _encode_default takes).
            "prompt_token_ids": request.prompt_token_ids if isinstance(request.prompt_token_ids, list)
            else list(request.prompt_token_ids or ()),
            "max_tokens": int(request.max_tokens),
            "min_tokens": int(getattr(params, "min_tokens", 0) or 0),
            "ignore_eos": bool(getattr(params, "ignore_eos", False)),
            "eos_token_id": None if eos is None else int(eos),
            "stop_token_ids": stop_ids,
            "priority": int(request.priority),
            "arrival_time": float(request.arrival_time),
        }
        if unsupported:
            record["unsupported"] = unsupported
        self._write(record)

    def begin_abort(self, request_ids) -> dict:
        sched = self.sched
        if request_ids is None:
            ids = list(sched.requests)
        elif isinstance(request_ids, str):
            ids = [request_ids]
        else:
            ids = list(dict.fromkeys(request_ids))
        live = {}
        for i in ids:
            r = sched.requests.get(i)
            if r is not None and not r.is_finished():
                live[i] = r
        self.hooks.free_order = []
        return live

    def end_abort(self, live: dict, status) -> None:
        order, self.hooks.free_order = self.hooks.free_order or [], None
        if not live:
            return
        finished = [r for r in live.values() if r.is_finished()]
        # vLLM frees in set order: record the order its frees happened in.
        rank = {rid: i for i, rid in enumerate(order)}
        finished.sort(key=lambda r: rank.get(r.request_id, len(rank)))
        infos = [_ev.finished_info(r, self.hooks.freed.pop(r.request_id, [])) for r in finished]
        if infos:
            self._write({"t": "abort", "mid_step": self.mid_step,
                         "status": getattr(status, "name", str(status)), "finished": infos})

    def queues(self) -> tuple:
        """``(waiting, running, num_free_blocks)`` now: the queues as lists of
        vLLM's ``Request`` objects (waiting in service order), copied at C speed;
        their ids are read only when ``snap`` writes them (a request's id never
        changes, so reading it later is exact)."""
        sched = self.sched
        return _ev.waiting_in_service_order(sched), list(sched.running), _ev.num_free_blocks(sched)

    def snap(self, queues: tuple, request_states: list | None = None) -> dict:
        """A snapshot for the file (format 3): ``num_free_blocks``; ``waiting`` and
        ``running`` (request ids) each only when it differs from the snapshot
        written before this one, compared by identity, element by element
        (exact: the same objects in the same order are the same ids in the same
        order); ``request_states`` when given and not empty. Call in the order
        the snapshots are written: ``convert`` fills a queue left out from the
        one before it in the file."""
        waiting, running, free = queues
        out: dict[str, Any] = {"num_free_blocks": free}
        shown = self.shown_waiting
        if shown is None or len(shown) != len(waiting) or not all(map(operator.is_, shown, waiting)):
            out["waiting"] = [r.request_id for r in waiting]
            self.shown_waiting = waiting
        shown = self.shown_running
        if shown is None or len(shown) != len(running) or not all(map(operator.is_, shown, running)):
            out["running"] = [r.request_id for r in running]
            self.shown_running = running
        if request_states:
            out["request_states"] = request_states
        return out

    def before_schedule(self, throttle: bool) -> tuple:
        return (self.queues(), _ev.prefill_gate(self.sched, throttle))

    def after_schedule(self, so, pre: tuple, throttle: bool) -> None:
        before, defer = pre
        sched = self.sched
        output = _ev.normalise(so, self.hooks.seq, use_v2=self.use_v2,
                               max_num_scheduled_tokens=sched.max_num_scheduled_tokens,
                               requests=sched.requests)
        output.update(throttle_prefills=bool(throttle), defer_prefills=bool(defer),
                      prefill_capacity_bound=bool(getattr(sched, "prefill_capacity_bound", False)))
        record = {"t": "schedule", "step": self.steps, "batch": self.batches, "before": self.snap(before),
                  "output": output,
                  "after": self.snap(self.queues(), _ev.request_states(sched, output["preempted_req_ids"]))}
        # Invariant: EngineCore pops batches oldest first, so an update completes
        # the oldest schedule() still in flight; the SchedulerOutput object names
        # it (kept referenced here, so its id is not reused while in flight).
        self.in_flight[id(so)] = (self.batches, so)
        self.batches += 1
        if self.max_batches > 1:
            # AsyncScheduler counts the tokens each scheduled decode will sample
            # before they exist (``num_output_placeholders``): on record for a
            # reader of the log (the trace does not store them; its checker
            # derives them from the batches in flight).
            record["placeholders"] = [
                [r, int(getattr(sched.requests[r], "num_output_placeholders", 0))]
                for r in so.num_scheduled_tokens if r in sched.requests]
        self._write(record)
        # Between this schedule() and an update_from_output() of the same
        # EngineCore step: with batches in flight the update comes in this step
        # only once the queue is full (step_with_batch_queue), else the step ends here.
        self.mid_step = len(self.in_flight) >= self.max_batches

    def before_update(self, so, mro) -> tuple:
        """``(live, sampled, batch)``: the scheduled requests not finished before
        the update (vLLM's ``Request`` objects, in output order), the tokens
        sampled for each, copied (vLLM trims a request's list in place), and
        the batch the update completes. With batches in flight a request can
        end (EOS, an abort) while a later batch that scheduled it still runs:
        that batch's token is still delivered (and ignored by vLLM), so every
        scheduled request's tokens are kept, as the trace's async shape
        records them."""
        get = self.sched.requests.get
        index = getattr(mro, "req_id_to_index", None) or {}
        tokens = getattr(mro, "sampled_token_ids", None) or []
        n_tokens = len(tokens)
        done = self.finished_by_status
        every = self.max_batches > 1
        live, sampled = [], []
        for r in so.num_scheduled_tokens:
            request = get(r)
            if request is not None:
                finished = done.get(request.status)
                if finished is None:
                    finished = done[request.status] = request.is_finished()
                if not finished:
                    live.append(request)
                elif not every:
                    continue
            elif not every:
                continue
            i = index.get(r)
            if i is not None and i < n_tokens:
                ids = tokens[i]
                if ids is not None and len(ids):
                    sampled.append([r, list(ids)])
        batch = self.in_flight.pop(id(so), (None, None))[0]
        return live, sampled, batch

    def after_update(self, pre: tuple) -> None:
        live, sampled, batch = pre
        freed, done = self.hooks.freed, self.finished_by_status
        finished = []
        for q in live:
            ended = done.get(q.status)
            if ended is None:
                ended = done[q.status] = q.is_finished()
            if ended:
                finished.append(_ev.finished_info(q, freed.pop(q.request_id, [])))
        self._write({"t": "update", "step": self.steps, "batch": batch, "sampled": sampled,
                     "finished": finished, "num_free_blocks": _ev.num_free_blocks(self.sched)})
        self.steps += 1
        self.mid_step = False
        self.fh.flush()

    def on_drafts(self, draft_token_ids) -> None:
        stored = []
        for req_id in list(getattr(draft_token_ids, "req_ids", ()) or ()):
            request = self.sched.requests.get(req_id)
            if request is not None and not request.is_finished() and request.spec_token_ids:
                stored.append([req_id, [int(t) for t in request.spec_token_ids]])
        self._write({"t": "drafts", "step": self.steps - 1, "stored": stored,
                     "states": _ev.request_states(self.sched)})
        self.fh.flush()

    def note(self, what: str, **fields) -> None:
        self._write({"t": "note", "what": what, "step": self.steps, **fields})

    def on_crash(self, call: str, exc: BaseException, pre, throttle: bool = False) -> None:
        """vLLM raised in ``call``: write the ``crash`` record (with what the
        step had got to: the queues before a ``schedule``, the tokens an
        ``update_from_output`` was given) and close the log; recording stops."""
        record = {"t": "crash", "step": self.steps, "call": call, **_ev.crash_info(exc)}
        if call == "schedule" and pre is not None:
            record.update(before=self.snap(pre[0]), throttle_prefills=bool(throttle))
        elif call == "update_from_output" and pre is not None:
            record["sampled"], record["batch"] = pre[1], pre[2]
        self._write(record)
        self.enabled = False
        self.hooks.active = False
        self.close()


# -- a recorder that cannot start must not stop the server -----------------

class _NotRecording:
    """Stands in for ``_Recorder`` when it could not start: every hook is a no-op,
    so the scheduler is vLLM's own."""

    enabled = False
    closed = True
    in_abort = False
    mid_step = False
    steps = 0

    def guard(self, fn, *args):
        return None

    def close(self) -> None:
        return None

    def __getattr__(self, name: str):  # on_add, begin_abort, ...: never called through guard
        return lambda *args, **kwargs: None


def _start_recorder(sched):
    """The scheduler's ``_Recorder``; a configuration it refuses (``RecordingError``:
    async scheduling, several batches in flight) still stops the start-up, so that
    a run nobody can check is not mistaken for a recorded one, but any other
    failure to start (an unwritable ``SCHED_HARNESS_TRACE``, a vLLM attribute that
    moved) is logged once and the server runs unrecorded (raised under
    ``SCHED_HARNESS_STRICT=1``)."""
    try:
        return _Recorder(sched)
    except RecordingError:
        raise
    except Exception as exc:
        if os.environ.get(ENV_STRICT) == "1":
            raise
        _log.error("sched-harness recording could not start (%s: %s); serving without recording",
                   type(exc).__name__, exc)
        return _NotRecording()


# -- aborts that arrive between schedule() and update_from_output() ---------
#
# vLLM's EngineCore.step processes the aborts that came in while the model ran
# (``_process_aborts_queue``) after ``schedule()`` and before
# ``update_from_output()``. The trace's step has no such point: its aborts are
# inputs before ``schedule()``. Recorded where they happen, such an abort would
# leave a step whose request reached the end of its tokens but sampled
# nothing, with blocks freed under the step (OUTPUT-ONLY-COMPLETE and
# BLOCK-CONSERVATION on a correct server). So by default (``SCHED_HARNESS_MID_STEP_ABORTS``
# unset or ``defer``) the recording scheduler applies such an abort right after
# ``update_from_output()`` instead, as if the client had gone away a moment
# later (when a disconnect reaches the engine is a race anyway): the request
# gets this step's token (or finishes by itself) and is aborted before the
# next ``schedule()``, where the trace has it. ``record`` keeps vLLM's timing
# and the converter moves the abort to the next step with a warning.

ENV_MID_STEP_ABORTS = "SCHED_HARNESS_MID_STEP_ABORTS"


def _defer_mid_step_abort(rec, request_ids, finished_status) -> bool:
    """True (and the ids kept for later) when this ``finish_requests`` call is an
    abort between schedule() and update_from_output() that is to be deferred."""
    if not (rec.enabled and rec.mid_step and os.environ.get(ENV_MID_STEP_ABORTS, "defer") == "defer"):
        return False
    if getattr(finished_status, "name", "") != "FINISHED_ABORTED" or request_ids is None:
        return False
    ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
    pending = rec.__dict__.setdefault("deferred_aborts", [])
    pending.append((ids, finished_status))
    return True


def _apply_deferred_aborts(sched, rec) -> None:
    """Apply the aborts ``_defer_mid_step_abort`` kept (in arrival order), now that
    the step's update is done; they are recorded as inputs of the next step."""
    pending = rec.__dict__.pop("deferred_aborts", None)
    rec.mid_step = False
    for ids, status in pending or ():
        sched.finish_requests(ids, status)


# -- the user's own Scheduler subclass under the recorder --------------------
#
# ``harness serve-record --candidate-class pkg.mod:Class`` runs the user's
# ``Scheduler`` subclass (what ``vllm serve --scheduler-cls`` takes) with the
# recording layered over it: ``SCHED_HARNESS_BASE_CLS`` names it, and the
# RecordingScheduler subclasses it instead of vLLM's ``Scheduler``, so every
# override below observes what the user's class decided (its super() calls
# reach vLLM's). The harness checked the class in the serving env before the
# engine started (``harness/serve/candidate_class.py``); here it is imported
# again from this process's ``sys.path`` (the caller's PYTHONPATH).

ENV_BASE_CLS = "SCHED_HARNESS_BASE_CLS"


def _base_scheduler_class(scheduler: type) -> tuple[type, str | None]:
    """``(class, name)``: the class ``SCHED_HARNESS_BASE_CLS`` names
    (``pkg.mod:Class``, or vLLM's dotted ``pkg.mod.Class``) and that name, or
    ``(scheduler, None)`` when it is unset. Mirrors vLLM's
    ``SchedulerConfig.get_scheduler_cls`` (``resolve_obj_by_qualname``).
    Raises RecordingError (one line) for a module that does not import, a
    missing attribute or a class that is not a subclass of ``scheduler``
    (vLLM's ``vllm.v1.core.sched.scheduler.Scheduler``: the hooks need its
    internals)."""
    import importlib

    name = (os.environ.get(ENV_BASE_CLS) or "").strip()
    if not name:
        return scheduler, None
    module_name, sep, attr = name.partition(":")
    if not sep:
        module_name, _, attr = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except BaseException as exc:  # an import can fail in any way, SystemExit included
        raise RecordingError(f"{ENV_BASE_CLS}={name}: cannot import it: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:200]}") from None
    if not isinstance(obj, type) or not issubclass(obj, scheduler):
        raise RecordingError(f"{ENV_BASE_CLS}={name} is not a subclass of "
                             f"vllm.v1.core.sched.scheduler.Scheduler")
    return obj, name


def _build_recording_scheduler(async_scheduling: bool = False):
    """The recording subclass of vLLM's ``Scheduler``, or with ``async_scheduling``
    of its ``AsyncScheduler`` (``vllm/v1/core/sched/async_scheduler.py``: what
    ``SchedulerConfig.get_scheduler_cls`` picks under async scheduling; a custom
    ``--scheduler-cls`` is used as given, so the async one must be named).
    ``SCHED_HARNESS_BASE_CLS`` (``_base_scheduler_class``) puts the user's own
    subclass under the recorder instead, async or not."""
    from vllm.v1.core.sched.scheduler import Scheduler

    if async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as default
    else:
        default = Scheduler

    base, base_name = _base_scheduler_class(Scheduler)
    if base_name is None:
        base = default

    class RecordingScheduler(base):  # type: ignore[misc, valid-type]
        """vLLM's ``Scheduler`` (or the subclass ``SCHED_HARNESS_BASE_CLS``
        names) writing a sched-harness JSONL log as it runs (see
        ``harness/candidates/vllm/recording_scheduler.py``). Behaviour is
        unchanged: every override calls the parent and only observes."""

        #: ``pkg.mod:Class`` of the user's class under the recorder, or None.
        _sched_harness_base = base_name

        _sched_harness_async = async_scheduling

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._sched_harness = _start_recorder(self)

        def add_request(self, request) -> None:
            rec = self._sched_harness
            existing = request.request_id in self.requests
            super().add_request(request)
            rec.guard(rec.on_add, request, existing)

        def finish_requests(self, request_ids, finished_status):
            rec = self._sched_harness
            if rec.in_abort:  # re-entered (e.g. from add_request): outer call records
                return super().finish_requests(request_ids, finished_status)
            if _defer_mid_step_abort(rec, request_ids, finished_status):
                return []
            live = rec.guard(rec.begin_abort, request_ids) or {}
            rec.in_abort = True
            try:
                result = super().finish_requests(request_ids, finished_status)
            finally:
                rec.in_abort = False
            rec.guard(rec.end_abort, live, finished_status)
            return result

        def schedule(self, *args, **kwargs):
            rec = self._sched_harness
            if not rec.enabled:
                return super().schedule(*args, **kwargs)
            throttle = bool(kwargs.get("throttle_prefills", args[0] if args else False))
            pre = rec.guard(rec.before_schedule, throttle)
            rec.hooks.begin()
            try:
                so = super().schedule(*args, **kwargs)
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:  # recorded, then vLLM's own failure goes on
                rec.guard(rec.on_crash, "schedule", exc, pre, throttle)
                raise
            finally:
                rec.hooks.end()
            if pre is not None:
                rec.guard(rec.after_schedule, so, pre, throttle)
            return so

        def update_from_output(self, scheduler_output, model_runner_output):
            rec = self._sched_harness
            pre = rec.guard(rec.before_update, scheduler_output, model_runner_output)
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:
                rec.guard(rec.on_crash, "update_from_output", exc, pre)
                raise
            if pre is not None:
                rec.guard(rec.after_update, pre)
            _apply_deferred_aborts(self, rec)
            return outputs

        def update_draft_token_ids(self, draft_token_ids) -> None:
            rec = self._sched_harness
            try:
                super().update_draft_token_ids(draft_token_ids)
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:
                rec.guard(rec.on_crash, "update_draft_token_ids", exc, None)
                raise
            rec.guard(rec.on_drafts, draft_token_ids)

        def reset_prefix_cache(self, *args, **kwargs):
            result = super().reset_prefix_cache(*args, **kwargs)
            rec = self._sched_harness
            rec.guard(rec.note, "reset_prefix_cache", result=_jsonable(result))
            return result

        def shutdown(self) -> None:
            try:
                super().shutdown()
            finally:
                self._sched_harness.close()

    RecordingScheduler.__module__ = __name__
    if async_scheduling:
        RecordingScheduler.__name__ = RecordingScheduler.__qualname__ = "AsyncRecordingScheduler"
    return RecordingScheduler


def __getattr__(name: str):
    if name in ("RecordingScheduler", "AsyncRecordingScheduler"):
        cls = _build_recording_scheduler(async_scheduling=name == "AsyncRecordingScheduler")
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---------------------------------------------------------------------------
# Harness side: convert the JSONL to a Parquet trace (our venv)
# ---------------------------------------------------------------------------

class ConvertError(ValueError):
    """The JSONL cannot be turned into a trace; the message names the file and line."""


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
            raise ConvertError(
                f"{path}:{number}: schedule with {len(in_flight)} batch(es) in flight and no update "
                f"(max_concurrent_batches={max_batches}): an update is missing or out of order")
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
            raise ConvertError(f"{path}:{number}: update without a schedule")
        oldest = in_flight[0][0]
        batch = rec.get("batch")
        if batch is None and numbered and rec["t"] == "update":
            raise ConvertError(f"{path}:{number}: update record without its batch (a format 3 "
                               f"recording numbers every batch): the log was edited")
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
            continue
        if crashed and kind != "end":
            raise ConvertError(f"{path}:{number}: a {kind!r} record after the crash")
        if kind == "arrival":
            inputs.append(("arrival", rec))
        elif kind == "abort":
            if rec.get("mid_step"):
                notes["mid_step_aborts"] += len(rec["finished"])
            inputs.append(("abort", rec))
        elif kind == "schedule":
            resolve(rec["before"])
            resolve(rec["after"])
            if current is not None:
                steps.append(current)
            batch = start_batch(rec)
            current = new_step(rec, None)
            current["batch"] = batch
            inputs = []
        elif kind == "update":
            step = update_step()
            complete_batch(rec, step)
            step["update"] = rec
        elif kind == "drafts":
            if rec["stored"] or rec.get("states"):
                if current is None or current["update"] is None:
                    raise ConvertError(f"{path}:{number}: drafts outside a step")
                current["drafts"].extend(rec["stored"])
                current["draft_states"].extend(rec.get("states") or ())
        elif kind == "note":
            notes["notes"].append(rec.get("what", "?"))
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
            ended = True
        yield from steps
        steps.clear()
    if current is not None:
        if current["update"] is not None:
            yield current
        else:  # cut off after its schedule (a synchronous step always updates)
            notes["dropped_incomplete_step"] = True
            inputs = current["inputs"] + inputs
    notes["trailing_inputs"] = len(inputs)


def _new_notes() -> dict[str, Any]:
    return {"mid_step_aborts": 0, "notes": [], "error": None, "complete": False,
            "dropped_incomplete_step": False, "trailing_inputs": 0, "crash": None}


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


def _map_config(meta_rec: dict, engine_config_cls,
                derived_keys: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """(values for EngineConfig, unmapped captured values). Names are vLLM's:
    a recorded value under our name wins, then ``scheduler_config.NAME``,
    ``cache_config.NAME``, ``parallel_config.NAME`` and ``vllm_config.NAME``;
    fields with no vLLM counterpart keep their default. The derived
    ``max_concurrent_batches`` (vLLM's ``VllmConfig`` property, or an older
    log's recorded key) is mapped too: ``EngineConfig.from_dict`` checks it
    against ``pipeline_parallel_size`` and ``async_scheduling``."""
    # Text-only recordings (requests with encoder inputs are refused): vLLM's
    # encoder budget keys have no effect there and stay unmapped.
    fields = ({f.name for f in dataclasses.fields(engine_config_cls)} | set(derived_keys)) - {
        "max_num_encoder_input_tokens", "encoder_cache_size", "disable_chunked_mm_input"}
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
        FinishedRequest,
        Preemption,
        RequestState,
        ScheduledRequest,
        SchedulerOutput,
        UpdateResult,
        Withdrawal,
    )
    from reference.request import RequestStatus
    from reference.workload import RequestSpec, Workload, WorkloadError

    src = Path(jsonl_path)
    if not src.is_file():
        raise ConvertError(f"{src}: no such file")
    meta_rec = next((rec for _, rec in _read_records(src)), None)
    if meta_rec is None or meta_rec.get("t") != "meta":
        raise ConvertError(f"{src}: does not start with a sched-harness meta record")
    if meta_rec.get("format") not in READABLE_FORMATS:
        raise ConvertError(f"{src}: unknown recording format {meta_rec.get('format')!r} "
                           f"(this converter reads {', '.join(map(str, READABLE_FORMATS))})")
    values, unmapped_config = _map_config(meta_rec, EngineConfig, DERIVED_KEYS)
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

    def rid(vllm_id: str, where: int) -> str:
        try:
            return ids[vllm_id]
        except KeyError:
            raise ConvertError(f"{src}:{where}: request {vllm_id!r} was never added") from None

    for step, idle in _steps(src, notes, batches):
        if idle is None:
            dropped_idle += 1
            continue
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
                abort_time=abort_time.get(vid))
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

    warnings = list(meta_rec.get("warnings", ()))
    if meta_rec["format"] == 1:
        warnings.append("format 1 recording: what requests hold after schedule() (request_state rows) "
                        "was not recorded, and the request data's ids are taken from the decisions")
    if notes["mid_step_aborts"]:
        warnings.append(f"{notes['mid_step_aborts']} request(s) aborted between schedule and "
                        f"update were moved to the next step (replay diverges there)")
    if inversions:
        warnings.append(f"{inversions} request(s) added after one with a later wall-clock "
                        f"arrival time (PRIORITY ties may replay differently)")
    for what, n in sorted(unsupported.items()):
        warnings.append(f"{n} request(s) with {what} (not modelled by the reference)")
    for what in sorted(set(notes["notes"])):
        warnings.append(f"{notes['notes'].count(what)} {what} event(s) (not representable in a trace)")
    if notes["error"]:
        warnings.append(f"recording stopped early: {notes['error']}")
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
    if base_cls:
        meta["engine_version"] = meta_rec["vllm_version"]
        meta["vllm_source"] = {"version": meta_rec["vllm_version"], "scheduler_cls": base_cls}
    meta["vllm_recording"] = {
        "format": meta_rec["format"], "jsonl": src.name, "started_unix": meta_rec.get("started_unix"),
        "unmapped_config": unmapped_config, "config_overrides": dict(overrides or {}),
        "dropped_idle_steps": dropped_idle,
        "mid_step_aborts": notes["mid_step_aborts"], "warnings": warnings,
    }

    def finished_of(f: dict, where: int) -> FinishedRequest:
        if f["status"] not in status_names:
            raise ConvertError(f"{src}:{where}: request {f['request_id']!r} ended with status "
                               f"{f['status']} (the reference has no such status)")
        stop = f["stop_reason"]
        return FinishedRequest(rid(f["request_id"], where), RequestStatus[f["status"]],
                               f["finish_reason"], None if stop is None else str(stop),
                               f["num_output_tokens"], list(f["freed_block_ids"]))

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

    def decision(e: dict, where: int):
        if e["type"] == "schedule":
            return ScheduledRequest(rid(e["request_id"], where), e["kind"], e["num_computed_tokens"],
                                    e["num_scheduled_tokens"], e["num_prefix_hit_tokens"],
                                    list(e["new_block_ids"]), list(e.get("spec_token_ids") or ()))
        if e["type"] == "withdraw":
            return Withdrawal(rid(e["request_id"], where), e["num_scheduled_tokens"],
                              list(e["block_ids"]))
        if e["type"] == "preempt":
            return Preemption(rid(e["request_id"], where), e["num_computed_tokens"],
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
                events = [decision(e, where) for e in output["events"]]
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
                    rec.num_free_blocks_after_update = update_rec["num_free_blocks"]
                    rec.drafts = {rid(r, where): list(t) for r, t in step["drafts"]}
                    # ... and after the draft update.
                    rec.states_after_drafts = [st for st in states_of(step["draft_states"], where)
                                               if holds_drafts(st)]
                    summary["finished"] += len(rec.update.finished)
            writer.add_step(step_rows(rec))
            index += 1
    summary.update(steps=index, events=writer.num_rows, dropped_idle_steps=dropped_idle,
                   reordered_abort_steps=reordered_aborts, warnings=warnings,
                   path=str(parquet_path))
    return summary
