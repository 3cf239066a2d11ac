"""Real vLLM as a candidate: ``--engine vllm@0.33.0`` / ``--candidate vllm@0.33.0``.

``VLLMCandidate`` implements ``reference.candidate.Candidate`` in this process
and forwards every call to ``harness/candidates/vllm/driver.py``, a standalone script
running under the vLLM venv's Python (``harness/candidates/vllm/env.py``), over
newline-delimited JSON on the subprocess's stdin/stdout. The driver answers
with decisions already normalised to the shape of ``reference/output.py``;
this module only turns them back into those dataclasses.

Process lifetime: the driver starts lazily (on the first call that needs it;
importing vLLM costs 10-17 s), one per candidate instance. When the instance
is closed or garbage-collected, a healthy driver goes back to a small
per-version pool, so the next candidate of that version (e.g. the next
``replay``) re-initialises it with its config instead of paying the import
again; everything left is killed at interpreter exit. A driver crash, a
timeout or a malformed answer raises ``VLLMDriverError`` with a one-line
message (the engine reports it as a ``CandidateError`` naming the step).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from collections.abc import Callable
from typing import Any

from reference.candidate import CandidateRefused
from reference.config import EngineConfig
from reference.kv_connector import KVConnectorOutput
from reference.output import (FinishedRequest, KVTransferFree, Preemption, PrefixCacheReset, Promotion, RemoteLoad,
                              RequestState, ScheduledRequest, SchedulerOutput, SchedulerSnapshot, Skip,
                              SkippedFree, UpdateResult, Withdrawal)
from reference.request import Request, RequestStatus

from harness.children import ChildPool, GroupWatchdog, die_with_parent, shim_command, stop_process_group
from harness.candidates.vllm.env import VLLMEnvError, is_ready
from harness.candidates.vllm.spec import VLLMTarget, release_target

DRIVER = Path(__file__).with_name("driver.py")
#: Seconds allowed for the first answer (vLLM import + scheduler construction).
START_TIMEOUT_S = float(os.environ.get("HARNESS_VLLM_START_TIMEOUT_S", "300"))
#: Seconds allowed for any other answer.
CALL_TIMEOUT_S = float(os.environ.get("HARNESS_VLLM_TIMEOUT_S", "120"))
#: Idle drivers kept per version for reuse (0 disables reuse); 2 covers a
#: data-parallel run with two ranks (one driver per rank).
POOL_SIZE = int(os.environ.get("HARNESS_VLLM_POOL", "2"))
#: The targets (``VLLMTarget.label``) whose first driver start this process announced.
_ANNOUNCED: set[str] = set()
_ANNOUNCED_LOCK = threading.Lock()


def announce_start(target: VLLMTarget) -> None:
    """One stderr line before this process's first driver start for
    ``target`` (``starting vLLM 0.33.0 drivers (about a minute cold)``), only
    when stderr is not a terminal: piped (a CI log), a cold ``replay``,
    ``golden check``, ``sweep`` or ``bisect`` printed nothing for minutes; on a
    terminal the progress bar says it. Never on stdout (``--json`` stays
    clean). ``HARNESS_VLLM_START_NOTICE=0`` silences it (the test suite's
    conftest does: its exact-output checks)."""
    if os.environ.get("HARNESS_VLLM_START_NOTICE", "1") == "0":
        return
    with _ANNOUNCED_LOCK:
        if target.label in _ANNOUNCED:
            return
        _ANNOUNCED.add(target.label)
    try:
        if sys.stderr is None or sys.stderr.isatty():
            return
        print(f"starting {target.label} drivers (about a minute cold)", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed or broken stderr: nothing to tell
        pass


def driver_config(config: EngineConfig) -> dict[str, Any]:
    """The config as the driver's ``init`` takes it: ``config.to_dict()`` (with
    the derived ``max_concurrent_batches``, which the driver checks against
    vLLM's ``VllmConfig.max_concurrent_batches``) plus ``pipeline_parallel_size``
    always (``to_dict`` leaves it out where the count gives it back)."""
    return {**config.to_dict(), "pipeline_parallel_size": config.pipeline_parallel_size}


class VLLMDriverError(RuntimeError):
    """The vLLM driver crashed, timed out, broke the protocol or raised."""


class VLLMRaised(VLLMDriverError):
    """vLLM (or the driver around it) raised during an op: ``crash_type``,
    ``crash_message`` and ``crash_where`` describe vLLM's own exception (the
    driver's ``events.crash_info``), which is what the engine records as the
    ``crash`` (``reference.candidate.describe_exception``), not this wrapper."""

    def __init__(self, message: str, answer: dict[str, Any]) -> None:
        super().__init__(message)
        self.crash_type = str(answer.get("exc_type") or "")
        self.crash_message = str(answer.get("exc_message") or self.crash_type)
        self.crash_where = str(answer.get("where") or "")


class VLLMStepTimeout(VLLMDriverError):
    """An op got no answer within its timeout (``--step-timeout`` for a
    scheduler's ops): recorded as the crash ``StepTimeout`` at that step, as a
    hung ``module:factory`` candidate is (``harness.candidates.isolated``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.crash_type = "StepTimeout"
        self.crash_message = f"StepTimeout: {message}"
        self.crash_where = ""


class VLLMRefused(CandidateRefused):
    """The driver refused the config at ``init`` (``DriverError``: an option the
    release lacks or a key it cannot map); the message is one line."""


class VLLMSchedulerClassError(VLLMRefused):
    """The ``scheduler_cls`` cannot be used (``SchedulerClassError`` in the
    driver): its module does not import, it is not a vLLM ``Scheduler``
    subclass, or its ``__init__`` raised; the message is one line."""


class _DriverProcess:
    """One driver subprocess: start, call (one JSON line each way), kill."""

    def __init__(self, target: VLLMTarget) -> None:
        self.target = target
        self.version = version = target.version
        self.key = _pool_key(target)
        python = target.python
        if target.release and not is_ready(version):
            raise VLLMEnvError(f"the vLLM {version} env is not built ({python.parent.parent}): "
                               f"run `harness vllm-env {version}`")
        announce_start(target)
        self._log = tempfile.NamedTemporaryFile(prefix=f"sched-harness-vllm-{version}-",
                                                suffix=".log", delete=False)
        env = dict(os.environ)
        # The driver must not see this project's packages; a scheduler_cls
        # module is found on the caller's PYTHONPATH (made absolute: the
        # driver runs in another folder), as `vllm serve --scheduler-cls` would.
        env.pop("PYTHONPATH", None)
        if target.pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(target.pythonpath)
        env.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Under the reaper shim (harness.children, issue 26): what vLLM starts
        # (a model-registry subprocess, a scheduler_cls's daemon) is killed
        # with the driver even after a setsid; stderr goes to the log only.
        self.proc = subprocess.Popen(
            shim_command([str(python), "-u", str(DRIVER)]), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, env=env, cwd=tempfile.gettempdir(), start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGKILL))
        # Regression: SIGKILL of the harness while the driver was busy (a
        # scheduler_cls that hangs) left it running, reparented to init: the
        # kernel now kills it, the watchdog what it started (harness.children).
        self._watchdog = GroupWatchdog(self.proc.pid, grace_s=0.0)
        self.pid = self.proc.pid
        self._buf = b""
        self.broken: str | None = None
        self.started = False  # answered once (vLLM imported)
        self.lock = threading.Lock()
        POOL.add(self)

    def alive(self) -> bool:
        return self.broken is None and self.proc.poll() is None

    def _log_tail(self) -> str:
        try:
            lines = [ln.strip() for ln in Path(self._log.name).read_text(errors="replace").splitlines()
                     if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:240] if lines else ""

    def _fail(self, message: str, kind: type[VLLMDriverError] = VLLMDriverError) -> VLLMDriverError:
        self.broken = message
        self.kill()
        return kind(message)

    def call(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        op = msg.get("op", "?")
        if self.broken is not None:
            raise VLLMDriverError(self.broken)
        if timeout is None:
            timeout = CALL_TIMEOUT_S if self.started else START_TIMEOUT_S
        who = f"{self.target.label} driver (pid {self.pid})"
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps(msg, separators=(",", ":")).encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                code = self.proc.wait(timeout=5) if self.proc.poll() is None else self.proc.returncode
                raise self._fail(f"{who} is gone (exit code {code}) at '{op}'"
                                 + (f": {self._log_tail()}" if self._log_tail() else "")) from None
            line = self._read_line(timeout, who, op)
        try:
            answer = json.loads(line)
        except ValueError:
            raise self._fail(f"{who} sent a malformed answer to '{op}': {line[:120]!r}") from None
        if not isinstance(answer, dict) or "ok" not in answer:
            raise self._fail(f"{who} sent a malformed answer to '{op}': {line[:120]!r}")
        self.started = True
        if not answer["ok"]:
            raise VLLMRaised(f"{self.target.label} raised during '{op}': "
                             f"{answer.get('error', 'unknown error')}", answer)
        return answer

    def _read_line(self, timeout: float, who: str, op: str) -> str:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise self._fail(f"{who} did not answer '{op}' within {timeout:g} s", VLLMStepTimeout)
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    try:
                        code = self.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    tail = self._log_tail()
                    raise self._fail(f"{who} exited with code {code} during '{op}'"
                                     + (f": {tail}" if tail else ""))
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("utf-8", errors="replace")

    def shutdown(self) -> None:
        """Ask politely, then kill."""
        if self.alive():
            try:
                self.call({"op": "shutdown"}, timeout=5)
            except VLLMDriverError:
                pass
        self.kill()

    def kill(self) -> None:
        # The whole group: vLLM's own subprocesses (the model registry probe,
        # an engine core) must not outlive the driver (harness.children).
        if not getattr(self, "_group_killed", False):
            self._group_killed = True
            stop_process_group(self.proc)
            watchdog = getattr(self, "_watchdog", None)
            if watchdog is not None:
                watchdog.release()
        try:
            self._log.close()
            os.unlink(self._log.name)
        except OSError:
            pass
        POOL.forget(self)


#: Every driver, and the idle ones kept for the next candidate with the same key.
POOL = ChildPool(POOL_SIZE)


def _pool_key(target: VLLMTarget) -> str:
    """Drivers are interchangeable when interpreter, PYTHONPATH and
    model-runner layout agree."""
    return f"{target.pool_key}/v2={os.environ.get('VLLM_USE_V2_MODEL_RUNNER', '0')}"


def _release(proc: _DriverProcess, reuse: bool) -> None:
    """A candidate is done with ``proc``: keep it for the next one (once it has
    answered: vLLM imported), or kill it."""
    POOL.release(proc.key, proc, reuse and proc.started)


def _spawn_drivers(target: VLLMTarget, n: int) -> tuple[list[_DriverProcess], list[BaseException]]:
    """Start ``n`` driver processes for ``target`` (each begins importing vLLM
    at once), in the calling thread: a driver's parent-death signal follows
    the thread that started it, so a thread that ends would take its drivers
    with it (SIGTERM). Returns the processes and the error that stopped the
    rest, if any."""
    procs: list[_DriverProcess] = []
    try:
        for _ in range(n):
            procs.append(_DriverProcess(target))
    except BaseException as exc:  # noqa: B036 - the caller decides (raised, or left to the run)
        return procs, [exc]
    return procs, []


def _warm_drivers(procs: list[_DriverProcess], arrived: Callable[[], None] | None = None
                  ) -> list[BaseException]:
    """Wait for each of ``procs`` to answer ``hello`` and build one scheduler
    (``EngineConfig()``), all at once, then release them to the pool
    (``arrived()`` after each, when given). Returns the errors."""
    errors: list[BaseException] = []

    def hello(proc: _DriverProcess) -> None:
        try:
            proc.call({"op": "hello"})
            # The first init costs as much as the import (vLLM inspects the
            # model class in a subprocess, once per process): paid here too.
            proc.call({"op": "init", "config": driver_config(EngineConfig()), "seed": 0})
        except BaseException as exc:  # noqa: B036 - re-raised by the caller, in its thread
            errors.append(exc)

    threads = [threading.Thread(target=hello, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for proc in procs:
        _release(proc, True)
        if arrived is not None:
            arrived()
    return errors


def prestart(version: str | VLLMTarget, count: int = POOL_SIZE) -> list[int]:
    """Start ``count`` (at most ``POOL_SIZE``, less the idle ones already
    there) drivers for ``version`` at once and leave them idle in the pool,
    vLLM imported: their imports overlap instead of the second one waiting
    for an example that needs two schedulers (``data_parallel_size=2``), as
    ``fuzz`` draws early; each builds one scheduler (``EngineConfig()``), as
    the first one in a process costs about what the import does. Returns the
    PIDs started. Raises VLLMEnvError (env
    not built) or VLLMDriverError (a driver that did not answer)."""
    target = version if isinstance(version, VLLMTarget) else release_target(version)
    key = _pool_key(target)
    procs, errors = _spawn_drivers(target, max(0, min(count, POOL_SIZE) - POOL.idle_count(key)))
    errors += _warm_drivers(procs)
    if errors:
        raise errors[0]
    return [p.pid for p in procs]


def prestart_in_background(version: str | VLLMTarget, count: int = POOL_SIZE) -> threading.Thread | None:
    """``prestart`` without waiting: the drivers are started here (their
    imports begin) and a daemon thread waits for them while the caller goes on
    (``fuzz`` drawing its first example, running it on the reference); a
    candidate that needs a driver meanwhile waits for one of them
    (``ChildPool.expect``) instead of starting another. Those already idle or
    being started count toward ``count``. Errors are not raised: a driver
    that does not start is gone from the pool, and the candidate that needs
    one starts its own and meets the error itself. Call it from a thread that
    outlives the drivers (the main one): they die with the thread that started
    them. Returns the waiting thread (None when nothing was started)."""
    target = version if isinstance(version, VLLMTarget) else release_target(version)
    key = _pool_key(target)
    n = max(0, min(count, POOL_SIZE) - POOL.idle_count(key) - POOL.pending_count(key))
    if n == 0:
        return None
    POOL.expect(key, n)
    procs, _errors = _spawn_drivers(target, n)
    for _ in range(n - len(procs)):  # never started
        POOL.arrived(key)
    thread = threading.Thread(target=_warm_drivers, args=(procs, lambda: POOL.arrived(key)),
                              name=f"vllm-prestart-{target.version}", daemon=True)
    thread.start()
    return thread


def shutdown_pool() -> None:
    """Kill every idle driver (tests call this to measure a cold start)."""
    POOL.kill_idle()


def _request_payload(request: Request) -> dict[str, Any]:
    params = request.sampling_params
    return {"request_id": request.request_id, "prompt_token_ids": list(request.prompt_token_ids),
            "max_tokens": params.max_tokens, "min_tokens": params.min_tokens,
            "ignore_eos": params.ignore_eos, "eos_token_id": params.eos_token_id,
            "stop_token_ids": list(params.stop_token_ids), "priority": request.priority,
            "arrival_time": request.arrival_time}


def _finished(item: dict[str, Any]) -> FinishedRequest:
    status = _status(item["status"])
    return FinishedRequest(item["request_id"], status, item["finish_reason"], item["stop_reason"],
                           item["num_output_tokens"], list(item["freed_block_ids"]),
                           item.get("fence"), item.get("group_block_ids"))


def _snapshot(data: dict[str, Any]) -> SchedulerSnapshot:
    states = data.get("request_states")
    return SchedulerSnapshot(tuple(data["waiting"]), tuple(data["running"]), data["num_free_blocks"],
                             None if states is None else
                             tuple(RequestState(i, _status(status), computed, tuple(drafts))
                                   for i, status, computed, drafts in states))


def _status(name: str) -> RequestStatus:
    try:
        return RequestStatus[name]
    except KeyError:
        raise VLLMDriverError(f"unknown request status {name!r} from vLLM") from None


def _output(data: dict[str, Any]) -> SchedulerOutput:
    events: list[ScheduledRequest | Withdrawal | Preemption | Skip | RemoteLoad | Promotion] = []
    for e in data["events"]:
        kind = e["type"]
        if kind == "schedule":
            events.append(ScheduledRequest(e["request_id"], e["kind"], e["num_computed_tokens"],
                                           e["num_scheduled_tokens"], e["num_prefix_hit_tokens"],
                                           list(e["new_block_ids"]),
                                           list(e.get("spec_token_ids") or ()),
                                           group_block_ids=e.get("group_block_ids")))
        elif kind == "withdraw":
            events.append(Withdrawal(e["request_id"], e["num_scheduled_tokens"], list(e["block_ids"]),
                                     group_block_ids=e.get("group_block_ids")))
        elif kind == "preempt":
            events.append(Preemption(e["request_id"], e["num_computed_tokens"],
                                     list(e["freed_block_ids"]), e.get("fence"), e.get("group_block_ids")))
        elif kind == "skipped_free":
            events.append(SkippedFree(e["request_id"], list(e["freed_block_ids"]), e["group_block_ids"]))
        elif kind == "skip":
            events.append(Skip(e["request_id"], e["reason"]))
        elif kind == "kv_load":
            events.append(RemoteLoad(e["request_id"], e["num_prefix_hit_tokens"],
                                     e["num_external_tokens"], list(e["block_ids"]),
                                     e["reserved_blocks"], e.get("group_block_ids")))
        elif kind == "kv_promote":
            events.append(Promotion(e["request_id"], _status(e["status"]),
                                    e["num_computed_tokens"], bool(e["load_failed"]),
                                    list(e["freed_block_ids"]), e.get("group_block_ids")))
        else:
            raise VLLMDriverError(f"unknown event type {kind!r} from the vLLM driver")
    return SchedulerOutput(
        events=events,
        num_scheduled_tokens={k: v for k, v in data["num_scheduled_tokens"]},
        total_num_scheduled_tokens=data["total_num_scheduled_tokens"],
        preempted_req_ids=set(data["preempted_req_ids"]),
        finished_req_ids=set(data["finished_req_ids"]),
        token_budget=data["token_budget"],
        throttle_prefills=data.get("throttle_prefills", False),
        defer_prefills=data.get("defer_prefills", False),
        prefill_capacity_bound=data.get("prefill_capacity_bound", False),
        request_data_ids=data.get("request_data_ids"),
    )


class VLLMCandidate:
    """vLLM's real Scheduler (``target``: a ``VLLMTarget``, or a release
    version string) behind a driver subprocess.

    Implements ``reference.candidate.Candidate``. ``has_request`` and
    ``get_num_unfinished_requests`` are answered locally (and cross-checked
    against vLLM's count after every update and abort); ``snapshot`` is
    answered from the state the driver returns with each schedule and update.
    """

    def __init__(self, config: EngineConfig, version: str | VLLMTarget, *, seed: int = 0,
                 reuse: bool = True, step_timeout: float | None = None) -> None:
        self.config = config
        # Seconds one op (schedule, update_from_output, ...) may take once the
        # driver is up (``--step-timeout``; None: HARNESS_VLLM_TIMEOUT_S, 120):
        # a scheduler class that hangs ends the run as a crash at that step.
        self.step_timeout = step_timeout
        self.target = version if isinstance(version, VLLMTarget) else release_target(version)
        self.version = self.target.version
        self.seed = seed
        self.reuse = reuse
        self._proc: _DriverProcess | None = None
        self._finalizer: weakref.finalize | None = None
        self._live: set[str] = set()
        self._snap: SchedulerSnapshot | None = None
        # Outputs of schedule() not yet updated, oldest first (the driver
        # keeps vLLM's own SchedulerOutputs in the same order).
        self._in_flight: deque[SchedulerOutput] = deque()
        self.info: dict[str, Any] = {}

    # -- process ---------------------------------------------------------------
    def _driver(self) -> _DriverProcess:
        if self._proc is None:
            proc = POOL.acquire(_pool_key(self.target), lambda: _DriverProcess(self.target))
            self._proc = proc
            self._finalizer = weakref.finalize(self, _release, proc, self.reuse)
            msg: dict[str, Any] = {"op": "init", "config": driver_config(self.config),
                                   "seed": self.seed}
            if self.target.scheduler_cls:
                msg["scheduler_cls"] = self.target.scheduler_cls
            try:
                self.info = proc.call(msg)
            except VLLMRaised as exc:
                if exc.crash_type == "SchedulerClassError":
                    text = exc.crash_message.removeprefix("SchedulerClassError: ")
                    raise VLLMSchedulerClassError(text) from None
                if exc.crash_type != "DriverError":
                    raise
                # The driver refused the config (an option this release
                # lacks, a key it cannot map): a refusal, not a crash of vLLM.
                text = exc.crash_message.removeprefix("DriverError: ")
                raise VLLMRefused(f"{self.target.label} cannot run this config: {text}") from None
            self._check_groups()
            self._snap = None
            self._in_flight.clear()
        return self._proc

    def _check_groups(self) -> None:
        """vLLM's KV-cache groups (``init``'s ``kv_cache_groups``) against the
        config's (``EngineConfig.kv_cache_groups``, the reference's grouping;
        a bounded-replay window is vLLM's ``SlidingWindowMLASpec``):
        VLLMDriverError, one line, when they differ."""
        ours = [["SlidingWindowMLASpec" if getattr(g.kv_cache_spec, "bounded_replay", False)
                 else type(g.kv_cache_spec).__name__, getattr(g.kv_cache_spec, "sliding_window", None),
                 list(g.layer_ids)] for g in self.config.kv_cache_groups] or None
        theirs = self.info.get("kv_cache_groups")
        if ours != theirs and not (ours is None and theirs is None):
            raise VLLMDriverError(f"{self.target.label} groups the layers as {theirs}, the reference "
                                  f"as {ours} (reference.kv.kv_cache_spec.kv_cache_groups_for)")

    def _call(self, op: str, **payload: Any) -> dict[str, Any]:
        return self._driver().call({"op": op, **payload}, timeout=self.step_timeout)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        """Release the driver (back to the pool if healthy)."""
        if self._finalizer is not None:
            self._finalizer()
        self._proc = None

    def stats(self) -> dict[str, Any]:
        """Per-op call counts and seconds spent in the driver, and the import time."""
        return self._call("stats")

    def _check_count(self, answer: dict[str, Any]) -> None:
        n = answer.get("num_unfinished")
        if n is not None and n != len(self._live):
            raise VLLMDriverError(f"vLLM reports {n} unfinished requests, the harness "
                                  f"tracks {len(self._live)}")

    # -- Candidate protocol ------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._live:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self._call("add", request=_request_payload(request))
        self._live.add(request.request_id)
        self._snap = None

    def finish_requests(self, request_ids: list[str],
                        finished_status: RequestStatus) -> list[FinishedRequest]:
        if finished_status != RequestStatus.FINISHED_ABORTED:
            raise NotImplementedError(f"only aborts are forwarded to vLLM, not {finished_status.name}")
        ids = [i for i in request_ids if i in self._live]
        if not ids:
            return []
        answer = self._call("abort", request_ids=ids)
        finished = [_finished(item) for item in answer["finished"]]
        self._live.difference_update(f.request_id for f in finished)
        self._snap = None
        self._check_count(answer)
        return finished

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> PrefixCacheReset:
        """vLLM's ``Scheduler.reset_prefix_cache`` in the driver; the forced
        preemptions come back in the order vLLM took them."""
        answer = self._call("reset_prefix_cache", reset_running_requests=reset_running_requests)
        self._snap = _snapshot(answer["snapshot"])
        return PrefixCacheReset(reset_running_requests, list(answer["running_before"]),
                                [Preemption(p["request_id"], p["num_computed_tokens"],
                                            list(p["freed_block_ids"]), p.get("fence"),
                                            p.get("group_block_ids"))
                                 for p in answer["preemptions"]],
                                bool(answer["succeeded"]))

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        answer = self._call("schedule", throttle_prefills=throttle_prefills)
        output = _output(answer["output"])
        self._snap = _snapshot(answer["snapshot"])
        self._in_flight.append(output)
        return output

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]],
                           kv_connector_output: KVConnectorOutput | None = None) -> UpdateResult:
        """``kv_connector_output`` (KV connector only): the simulated worker's
        finished loads (in their order) and failed blocks, forwarded to vLLM
        as ``ModelRunnerOutput.kv_connector_output``."""
        if not self._in_flight or output is not self._in_flight[0]:
            raise VLLMDriverError("update_from_output must be given the oldest schedule() output "
                                  "not yet updated (batches are processed in order)")
        self._in_flight.popleft()
        sampled = {k: list(v) for k, v in sampled_token_ids.items() if k in output.num_scheduled_tokens}
        payload: dict[str, Any] = {"sampled": sampled}
        if kv_connector_output is not None:
            payload["kv"] = {"finished_recving": list(kv_connector_output.finished_recving),
                             "invalid_block_ids": sorted(kv_connector_output.invalid_block_ids)}
        answer = self._call("update", **payload)
        finished = [_finished(item) for item in answer["finished"]]
        self._live.difference_update(f.request_id for f in finished)
        self._snap = _snapshot(answer["snapshot"])
        self._check_count(answer)
        return UpdateResult(new_token_ids={k: list(v) for k, v in answer["new_token_ids"].items()},
                            finished=finished,
                            num_draft_tokens=answer.get("num_draft_tokens", 0),
                            num_rejected_draft_tokens=answer.get("num_rejected_draft_tokens", 0),
                            drained=[(fence, list(blocks))
                                     for fence, blocks in answer.get("drained", [])],
                            finished_recving=list(answer.get("finished_recving", [])),
                            invalid_block_ids=list(answer.get("invalid_block_ids", [])),
                            kv_freed=[KVTransferFree(req_id, list(blocks), fence, *groups)
                                      for req_id, blocks, fence, *groups in answer.get("kv_freed", [])])

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        answer = self._call("drafts", drafts={k: list(v) for k, v in draft_token_ids.items()})
        if "snapshot" in answer:
            self._snap = _snapshot(answer["snapshot"])
        return {k: list(v) for k, v in answer["stored"].items()}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._live

    def get_num_unfinished_requests(self) -> int:
        return len(self._live)

    def snapshot(self) -> SchedulerSnapshot:
        if self._snap is None:
            self._snap = _snapshot(self._call("snapshot")["snapshot"])
        return self._snap


def make_factory(version: str | VLLMTarget, step_timeout: float | None = None):
    """The candidate factory for ``vllm@version`` (or a ``VLLMTarget``):
    ``factory(config) -> VLLMCandidate``, each op bounded by ``step_timeout``
    seconds (None: ``HARNESS_VLLM_TIMEOUT_S``). The factory carries
    ``vllm_version``, ``vllm_target`` and ``trace_metadata`` (what the
    recorder adds to a trace's metadata: ``engine_version`` the version found,
    ``vllm_source`` for a path or a scheduler class) and ``prestart(count)``
    (``prestart_in_background``: drivers started without waiting)."""
    target = version if isinstance(version, VLLMTarget) else release_target(version)

    def factory(config: EngineConfig) -> VLLMCandidate:
        return VLLMCandidate(config, target, step_timeout=step_timeout)

    factory.__name__ = factory.__qualname__ = f"vllm_{target.version.replace('.', '_')}"
    factory.vllm_version = target.version  # type: ignore[attr-defined]
    factory.vllm_target = target  # type: ignore[attr-defined]
    extra: dict[str, Any] = {"engine_version": target.version}
    if target.metadata():
        extra["vllm_source"] = target.metadata()
    factory.trace_metadata = extra  # type: ignore[attr-defined]
    # ``fuzz`` starts the drivers while hypothesis draws (``prestart_in_background``).
    factory.prestart = lambda count=POOL_SIZE: prestart_in_background(target, count)  # type: ignore[attr-defined]
    return factory


def probe_scheduler_class(target: VLLMTarget, config: EngineConfig | None = None) -> dict[str, Any]:
    """Build ``target``'s scheduler class once on ``config`` (default
    ``EngineConfig()``) in a driver, so a class that does not import, is not a
    ``Scheduler`` or raises in ``__init__`` is reported before any run. Returns
    the driver's ``init`` answer; raises VLLMSchedulerClassError (one line) or
    VLLMDriverError. The driver goes back to the pool for the run that follows."""
    candidate = VLLMCandidate(config or EngineConfig(), target)
    try:
        candidate._driver()
        return dict(candidate.info)
    finally:
        candidate.close()
