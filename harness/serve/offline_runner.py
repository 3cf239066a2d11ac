"""vLLM's in-process engine executing a real model, stepped on command (runs in the serving env).

STANDALONE: run under the serving env's Python (``harness/serve/env.py``) with
``PYTHONPATH`` = the repository (so that vLLM can load
``harness.candidates.vllm.recording_scheduler.RecordingScheduler`` by name);
imports only the standard library and vLLM. ``harness/serve/offline.py`` starts it
and speaks JSON lines with it: one request object per stdin line, one answer
object per line on the original stdout (vLLM's own prints go to stderr).

Ops (answers carry ``"ok": true``, or ``"ok": false`` and a one-line ``"error"``):

- ``init {model, engine_args, record}``: builds ``vllm.LLM(model, **engine_args)``
  with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the EngineCore and its scheduler live
  in this process, so nothing races: a request is added exactly before the
  ``schedule()`` the harness says) and, when ``record``, ``scheduler_cls`` = the
  recording scheduler (its output file is ``SCHED_HARNESS_TRACE``; the
  ``AsyncRecordingScheduler`` when ``engine_args`` has ``async_scheduling``, which
  is then kept on despite the CPU platform: ``cpu_async.py``; testing only). Answers
  ``vllm_version``, ``init_s``.
- ``add {request}``: ``LLMEngine.add_request`` with a token-id prompt, greedy
  ``SamplingParams`` (``max_tokens``, ``min_tokens``, ``ignore_eos``,
  ``stop_token_ids``), ``priority`` and ``arrival_time`` (the harness's virtual
  clock, so the recording does not depend on the wall clock). A prompt vLLM's
  input processor refuses answers ``rejected`` (its message).
- ``abort {request_ids}``: ``LLMEngine.abort_request`` (the scheduler's
  ``finish_requests``, at once in-process).
- ``step``: one ``LLMEngine.step()``, i.e. one ``EngineCore.step``: ``schedule()``,
  the model, ``update_from_output()``. Answers ``total`` (tokens scheduled),
  ``finished`` (``[request id, output token ids, finish reason]`` of the requests
  that ended), ``unfinished`` and, per step, the seconds spent in the scheduler:
  ``sched_s`` (the whole ``schedule()`` + ``update_from_output()`` calls, recording
  included; CPU seconds of the engine's thread, ``time.thread_time``: on a shared
  machine the waits for a core are nobody's) and ``vllm_s`` (vLLM's own ``Scheduler`` methods, recording excluded)
  when ``init`` was given ``timing``, and ``hooks_s``: the part of ``vllm_s`` that
  is the recorder's decision hooks (``events.DecisionHooks``: its wrappers of
  ``KVCacheManager.allocate_slots`` and ``free`` and of ``Scheduler._preempt_request``,
  timed around, less the wrapped vLLM methods timed inside).
- ``close``: shuts the engine down (the recording scheduler's ``shutdown()``
  finishes and renames its file) and exits.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("OMP_NUM_THREADS", "1")  # in-process engine: ~15x slower without it
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

RECORDING_CLS = "harness.candidates.vllm.recording_scheduler.RecordingScheduler"
ASYNC_RECORDING_CLS = "harness.candidates.vllm.recording_scheduler.AsyncRecordingScheduler"


#: The clock of the scheduler timers (``timing``): CPU seconds of the calling
#: thread (the in-process engine core runs the scheduler on this one). Wall time
#: on a machine shared with other work counts the waits for a core, which made the
#: recording's share swing 3x with the load (issue 24).
_clock = time.thread_time


class Runner:
    """One in-process vLLM engine and the bookkeeping the answers need."""

    def __init__(self) -> None:
        self.llm = None
        self.engine = None
        self.timing = False
        self.sched_s = 0.0
        self.vllm_s = 0.0
        self.hooks_s = 0.0
        self._in_hook = 0

    def init(self, msg: dict) -> dict:
        t0 = time.monotonic()
        import vllm
        from vllm import LLM

        args = dict(msg.get("engine_args") or {})
        if args.get("async_scheduling"):
            # cpu_async.py beside this script (stdlib + vLLM), loaded by path: no package here.
            runpy.run_path(str(Path(__file__).with_name("cpu_async.py")))["keep_async_scheduling_on_cpu"]()
        if msg.get("record", True):
            args["scheduler_cls"] = ASYNC_RECORDING_CLS if args.get("async_scheduling") else RECORDING_CLS
        self.timing = bool(msg.get("timing"))
        if self.timing:
            self._time_vllm_scheduler()
            self._time_hooked_methods()
        self.llm = LLM(model=msg["model"], **args)
        self.engine = self.llm.llm_engine
        if self.timing:
            self._time_outer(self._scheduler())
            self._time_hooks(self._scheduler())
        return {"vllm_version": vllm.__version__, "init_s": round(time.monotonic() - t0, 3)}

    def _scheduler(self):
        return self.engine.engine_core.engine_core.scheduler

    def _time_vllm_scheduler(self) -> None:
        """Time vLLM's own Scheduler.schedule/update_from_output (what the recording
        scheduler's overrides call through super()): the cost without recording."""
        from vllm.v1.core.sched.scheduler import Scheduler

        runner = self
        for name in ("schedule", "update_from_output"):
            inner = getattr(Scheduler, name)

            def timed(*a, __inner=inner, **k):
                t = _clock()
                try:
                    return __inner(*a, **k)
                finally:
                    runner.vllm_s += _clock() - t
            setattr(Scheduler, name, timed)

    HOOKED = (("vllm.v1.core.kv_cache_manager", "KVCacheManager", "allocate_slots", "kv_cache_manager"),
              ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "free", "kv_cache_manager"),
              ("vllm.v1.core.sched.scheduler", "Scheduler", "_preempt_request", None))

    def _time_hooked_methods(self) -> None:
        """Before the engine is built: time the vLLM methods the recorder's decision
        hooks wrap, counting only calls made through a hook (``_time_hooks``)."""
        import importlib

        runner = self
        for module, cls_name, name, _ in self.HOOKED:
            cls = getattr(importlib.import_module(module), cls_name)
            inner = getattr(cls, name, None)
            if inner is None:
                continue

            def timed_inner(*a, __inner=inner, **k):
                if not runner._in_hook:
                    return __inner(*a, **k)
                t = _clock()
                try:
                    return __inner(*a, **k)
                finally:
                    runner.hooks_s -= _clock() - t
            setattr(cls, name, timed_inner)

    def _time_hooks(self, sched) -> None:
        """After: time the hooks themselves (the instance attributes the recorder set
        on the KV-cache manager and the scheduler); hooks_s is their time less the
        vLLM methods' inside them."""
        runner = self
        for _, _, name, owner_attr in self.HOOKED:
            owner = getattr(sched, owner_attr) if owner_attr else sched
            outer = vars(owner).get(name)
            if outer is None:
                continue  # not hooked (not recording, or a vLLM without it)

            def timed_outer(*a, __outer=outer, **k):
                runner._in_hook += 1
                t = _clock()
                try:
                    return __outer(*a, **k)
                finally:
                    runner.hooks_s += _clock() - t
                    runner._in_hook -= 1
            setattr(owner, name, timed_outer)

    def _time_outer(self, sched) -> None:
        """Time the scheduler object's calls as the EngineCore makes them (recording included)."""
        runner = self
        for name in ("schedule", "update_from_output"):
            bound = getattr(sched, name)

            def timed(*a, __bound=bound, **k):
                t = _clock()
                try:
                    return __bound(*a, **k)
                finally:
                    runner.sched_s += _clock() - t
            setattr(sched, name, timed)

    def add(self, msg: dict) -> dict:
        from vllm import SamplingParams

        r = msg["request"]
        params = SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], min_tokens=r.get("min_tokens", 0),
                                ignore_eos=r.get("ignore_eos", True),
                                stop_token_ids=list(r.get("stop_token_ids") or ()), detokenize=False)
        try:
            self.engine.add_request(r["request_id"], {"prompt_token_ids": list(r["prompt_token_ids"])},
                                    params, arrival_time=float(r.get("arrival_time", 0.0)),
                                    priority=int(r.get("priority", 0)))
        except (ValueError, TypeError) as exc:  # the input processor's refusal
            return {"rejected": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
        return {}

    def abort(self, msg: dict) -> dict:
        self.engine.abort_request(list(msg["request_ids"]))
        return {}

    def step(self, msg: dict) -> dict:
        s0, v0, h0 = self.sched_s, self.vllm_s, self.hooks_s
        self._scheduler()._sched_harness_last_total = 0  # no schedule() call: nothing scheduled
        t = time.perf_counter()
        outputs = self.engine.step()
        wall = time.perf_counter() - t
        total = getattr(self._scheduler(), "_sched_harness_last_total", None)
        finished = [[o.request_id, list(o.outputs[0].token_ids) if o.outputs else [],
                     o.outputs[0].finish_reason if o.outputs else None]
                    for o in outputs if o.finished]
        out = {"finished": finished, "unfinished": self.engine.get_num_unfinished_requests()
               if hasattr(self.engine, "get_num_unfinished_requests") else None,
               "has_unfinished": bool(self.engine.has_unfinished_requests()), "wall_s": wall,
               "total": total, "in_flight": len(getattr(self.engine.engine_core.engine_core,
                                                        "batch_queue", None) or ())}
        if self.timing:
            out.update(sched_s=self.sched_s - s0, vllm_s=self.vllm_s - v0, hooks_s=self.hooks_s - h0)
        return out

    def close(self, msg: dict) -> dict:
        if self.engine is not None:
            core = self.engine.engine_core
            core.shutdown()  # EngineCore.shutdown -> scheduler.shutdown(): the recording is finished
        return {}


def _track_totals(sched_cls) -> None:
    """Every scheduler of this process notes the tokens its last schedule() scheduled."""
    original = sched_cls.schedule

    def schedule(self, *a, **k):
        out = original(self, *a, **k)
        self._sched_harness_last_total = int(out.total_num_scheduled_tokens)
        return out
    sched_cls.schedule = schedule


def main() -> int:
    answer = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM's prints and logs go to stderr, the protocol owns the real stdout
    sys.stdout = sys.stderr
    runner = Runner()
    tracked = False
    for line in sys.stdin:
        if not line.strip():
            continue
        msg = json.loads(line)
        op = msg.get("op")
        try:
            if op == "init" and not tracked:
                from vllm.v1.core.sched.scheduler import Scheduler

                _track_totals(Scheduler)
                tracked = True
            resp = getattr(runner, op)(msg)
            resp["ok"] = True
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}".strip().splitlines()
            resp = {"ok": False, "error": (text[0] if text else type(exc).__name__)[:400]}
            import traceback

            traceback.print_exc()
        answer.write(json.dumps(resp) + "\n")
        if op == "close":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
