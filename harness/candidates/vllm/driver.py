#!/usr/bin/env python3
"""Drive vLLM's real v1 ``Scheduler`` step by step, over newline-delimited JSON.

STANDALONE: this script runs under a vLLM virtual environment's Python
(``harness/candidates/vllm/env.py`` builds those) and imports only the standard library,
``vllm`` and ``torch`` -- never this project's packages. The harness side is
``harness/candidates/vllm/candidate.py``.

Protocol: one JSON object per line on stdin, one answer per line on stdout
(the original stdout file descriptor; everything vLLM prints goes to stderr).
Each request is ``{"op": NAME, ...}``; each answer is ``{"ok": true, ...}`` or
``{"ok": false, "error": "one line", "traceback": "...", "exc_type", "exc_message",
"where"}`` (the exception as the trace's ``crash`` row records it: ``events.crash_info``). Ops:

- ``hello``    -> ``{vllm_version, protocol, import_s}`` (no scheduler needed)
- ``init``     ``{config: EngineConfig dict, seed}``: build (or rebuild) the
  scheduler on a CPU platform, no tokenizer (see "Pipelining" below).
- ``add``      ``{request: {request_id, prompt_token_ids, max_tokens, min_tokens,
  ignore_eos, eos_token_id, stop_token_ids, priority, arrival_time}}``
- ``abort``    ``{request_ids}`` -> ``{finished: [FinishedRequest]}``
- ``schedule`` ``{throttle_prefills}`` -> ``{output: SchedulerOutput, snapshot}``
- ``update``   ``{sampled: {request_id: [token ids]}, kv?: {finished_recving,
  invalid_block_ids}}`` -> ``{new_token_ids, finished, num_draft_tokens,
  num_rejected_draft_tokens, drained, snapshot}`` (applies to the oldest
  ``schedule`` output not yet updated); with ``kv`` (KV connector on) also
  ``{finished_recving, invalid_block_ids, kv_freed: [[id, blocks, fence]]}``
- ``drafts``   ``{drafts: {request_id: [token ids]}}`` -> ``{stored, snapshot}``
  (``Scheduler.update_draft_token_ids``; speculative decoding with synchronous
  scheduling only: under async scheduling ``EngineCore.post_step`` hands no
  drafts to the scheduler, which schedules ``-1`` placeholders the worker
  fills, so the op is refused there)
- ``snapshot`` -> ``{snapshot: {waiting, running, num_free_blocks, request_states}}``
  (``request_states``: ``events.request_states`` for the latest
  ``schedule``'s preempted ids: ``[[id, status, num_computed_tokens,
  spec_token_ids], ...]``)
- ``stats``    -> op counts and seconds spent inside vLLM per op
- ``shutdown`` -> answers, then exits 0

How decisions come back: ``driver_step.py``. The rest of the driver, one
vLLM concept a module, each loaded from this folder (see "Loading" below):

- ``driver_engine_core.py``: ``Driver``, vLLM's ``Scheduler`` built as
  ``EngineCore`` builds it, with the decision hooks; pipelining (batches in
  flight, ``defer_block_free``, data parallelism);
- ``driver_vllm_config.py``: our config keys mapped onto vLLM's ``VllmConfig``;
- ``driver_scheduler_cls.py``: vLLM's ``Scheduler``, ``AsyncScheduler`` or a
  ``scheduler_cls``;
- ``driver_kv_cache_config.py``: the ``KVCacheConfig`` (hybrid models' groups);
- ``driver_kv_connector.py``: the KV-connector stand-in and its config;
- ``driver_requests.py``: ``add``, ``abort``, ``reset_prefix_cache``;
- ``driver_step.py``: ``schedule``, ``update``, ``drafts`` (the batch queue);
- ``driver_model_runner_output.py``: the model-output stub
  (``ModelRunnerOutput``, ``KVConnectorOutput``);
- ``driver_platform.py``: the environment defaults and the CPU platform;
- ``driver_errors.py``: ``DriverError`` and ``SchedulerClassError``.

This module is the process: it answers the protocol above on stdin/stdout,
as ``EngineCoreProc``'s input loop hands client requests to its engine core
(``vllm/v1/engine/core.py``, ``_handle_client_request``).

Loading: STANDALONE, the driver runs as a script by path under vLLM's own
virtual environment (``candidate.py``), where this project's packages are not
importable. Its siblings are loaded from this folder as the submodules of a
private package, ``sched_harness_vllm`` (``load_sibling``), so they import
each other relatively and every name stays private (this folder is not on
``sys.path``: see below). Imported as ``harness.candidates.vllm.driver``
(tests, ``from ... import Driver``) it loads them the same way, so the
driver's ``events`` stays its own copy, apart from the recording
scheduler's ``harness.candidates.vllm.events`` (a test patching the
recorder's ``normalise`` does not reach the driver). ``events.py`` keeps the
private name it has always been loaded under, ``sched_harness_vllm_events``.
Every module is checked by ``tests/test_vllm.py::test_driver_is_standalone``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path

# Run as a script, the driver has its own folder first on sys.path, where our
# events.py, spec.py, env.py, ... would shadow a scheduler_cls module of the
# same name that `vllm serve --scheduler-cls` finds (adversarial trial:
# `scheduler_cls=events:MyScheduler` loaded our events.py). Nothing here is
# imported from that folder through sys.path (load_sibling), so it goes.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

#: The private package the driver's modules are loaded under (see "Loading").
PACKAGE = "sched_harness_vllm"


def load_sibling(stem: str) -> types.ModuleType:
    """The module ``stem`` of this folder (``driver_step``, ``events``, ...),
    imported as ``sched_harness_vllm.<stem>``: the private package is made on
    the first call (its path: this folder only), with ``events.py`` loaded
    first under its own private name. Raises what the module's import raises."""
    package = sys.modules.get(PACKAGE)
    if package is None:
        package = types.ModuleType(PACKAGE, "The vLLM driver's modules (driver.py's load_sibling).")
        package.__path__ = [str(_HERE)]
        sys.modules[PACKAGE] = package
        # The driver runs as a script with the vLLM env's python (no access to our
        # package), so its sibling module is loaded by file path, under a private name
        # (a top-level "events" could shadow or be shadowed by another package).
        spec = importlib.util.spec_from_file_location("sched_harness_vllm_events", _HERE / "events.py")
        events = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = events
        spec.loader.exec_module(events)
        sys.modules[f"{PACKAGE}.events"] = package.events = events
    return importlib.import_module(f"{PACKAGE}.{stem}")


ev = load_sibling("events")
# Importing it sets the vLLM environment defaults (driver_platform.py).
Driver = load_sibling("driver_engine_core").Driver
DriverError = load_sibling("driver_errors").DriverError

PROTOCOL = 1


def _one_line(exc: BaseException) -> str:
    """``Type: message``; for a bare ``assert`` (no message), where it failed."""
    text = " ".join(str(exc).split())
    if not text:
        frames = traceback.extract_tb(exc.__traceback__)
        if frames:
            f = frames[-1]
            where = "/".join(f.filename.split("/")[-3:])
            text = f"at {where}:{f.lineno} `{(f.line or '').strip()}`"
    return f"{type(exc).__name__}: {text}"[:500]


def _serve(inp, out) -> int:
    driver: Driver | None = None
    t_start = time.perf_counter()
    for line in inp:
        line = line.strip()
        if not line:
            continue
        op = "?"
        try:
            msg = json.loads(line)
            op = msg.get("op", "?")
            if driver is None:
                driver = Driver()
                print(f"vllm {driver.version} imported in {driver.import_s:.1f} s "
                      f"({time.perf_counter() - t_start:.1f} s since start)", file=sys.stderr)
            t0 = time.perf_counter()
            if op == "hello":
                resp = {"vllm_version": driver.version, "protocol": PROTOCOL,
                        "import_s": round(driver.import_s, 3), "pid": os.getpid()}
            elif op == "init":
                resp = driver.init(msg["config"], int(msg.get("seed", 0)),
                                   msg.get("scheduler_cls"))
            elif op == "add":
                resp = driver.add(msg["request"])
            elif op == "abort":
                resp = driver.abort(msg["request_ids"])
            elif op == "reset_prefix_cache":
                resp = driver.reset_prefix_cache(bool(msg.get("reset_running_requests", False)))
            elif op == "schedule":
                resp = driver.schedule(bool(msg.get("throttle_prefills", False)))
            elif op == "update":
                resp = driver.update(msg.get("sampled") or {}, msg.get("kv"))
            elif op == "drafts":
                resp = driver.drafts(msg.get("drafts") or {})
            elif op == "snapshot":
                resp = {"snapshot": driver.snapshot()}
            elif op == "stats":
                resp = {"stats": {k: {"count": len(v), "total_s": sum(v)}
                                  for k, v in driver.stats.items()},
                        "import_s": driver.import_s}
            elif op == "shutdown":
                resp = {}
            else:
                raise DriverError(f"unknown op {op!r}")
            driver.stats.setdefault(op, []).append(time.perf_counter() - t0)
            answer = {"ok": True, **resp}
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:  # reported to the harness, which raises (a SystemExit too)
            answer = {"ok": False, "op": op, "error": _one_line(exc),
                      "traceback": traceback.format_exc()[-4000:], **ev.crash_info(exc)}
            print(answer["traceback"], file=sys.stderr)
        out.write(json.dumps(answer, separators=(",", ":")) + "\n")
        out.flush()
        if op == "shutdown":
            return 0
    return 0


def main() -> int:
    # The protocol owns the original stdout; anything else printed goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return _serve(sys.stdin, proto)


if __name__ == "__main__":
    sys.exit(main())
