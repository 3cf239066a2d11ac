"""The offline variant: vLLM's in-process engine runs a real model, arrivals at exact steps.

``record_offline`` starts ``harness/serve/offline_runner.py`` under the serving
env (``harness/serve/env.py``), with the recording scheduler, and drives it one
``EngineCore.step`` at a time. When requests arrive and are aborted is decided
here by the reference engine's own arrival rules (``reference.engine._Arrivals``:
by ``arrival_time`` on the virtual clock, by ``arrival_step``, ``after`` another
request; aborts by ``abort_time`` / ``abort_step``) and the same virtual clock
(``step_fixed_s + step_per_token_s * scheduled tokens`` per step, jumping over
idle time), so the recording is a deterministic function of the workload, the
config, the model and the seed: no thread or socket races, wall-clock times
never reach the trace (each request's ``arrival_time`` given to vLLM is the
virtual clock). Two recordings of one scenario are identical row for row.

Files beside the trace ``T.parquet``: ``T.jsonl`` (the recording scheduler's log,
kept: ``convert`` reads it) and ``T.log`` (vLLM's output). The trace is
converted with ``recording_convert.convert`` and written through its temp file
and rename; the runner process is stopped by its PID on every path.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from reference.config import EngineConfig
from reference.engine import _Arrivals
from reference.workload import RequestSpec, Workload

from harness.candidates.vllm.recording_convert import convert
from harness.candidates.vllm.recording_scheduler import ENV_BASE_CLS
from harness.children import GroupWatchdog, die_with_parent, stop_gracefully
from harness.serve.candidate_class import CandidateClass
from harness.serve.config import engine_args
from harness.serve.env import require_serving_env

RUNNER = Path(__file__).with_name("offline_runner.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


class ServeError(RuntimeError):
    """The engine or server could not be run; the message is one line (the log is named)."""


def side_files(trace_path: str | Path) -> tuple[Path, Path]:
    """``(T.jsonl, T.log)`` beside trace ``T.parquet``: the recording and vLLM's log."""
    p = Path(trace_path)
    return p.with_suffix(".jsonl"), p.with_suffix(".log")


def finished_or_salvaged(jsonl: Path) -> tuple[Path | None, bool]:
    """``(recording, salvaged)``: ``jsonl`` if the recording scheduler finished it,
    else its newest temporary file (``.NAME.<pid>.tmp``: written and flushed every
    step, so a killed engine leaves one whose complete steps convert), else None."""
    if jsonl.is_file():
        return jsonl, False
    tmps = sorted(jsonl.parent.glob(f".{jsonl.name}.*.tmp"), key=lambda p: p.stat().st_mtime)
    return (tmps[-1], True) if tmps else (None, False)


def log_tail(log_path: Path, lines: int = 15) -> str:
    """The last ``lines`` non-empty lines of ``log_path`` (for a failure message)."""
    try:
        text = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join([ln for ln in text if ln.strip()][-lines:])


def child_env(trace_jsonl: Path | None, candidate: CandidateClass | None = None) -> dict[str, str]:
    """The environment of a vLLM process we start: the repository on PYTHONPATH (vLLM
    loads the recording scheduler by name), offline hub, 127.0.0.1, no usage stats;
    with ``candidate`` (``--candidate-class``) its name in ``SCHED_HARNESS_BASE_CLS``
    and its PYTHONPATH entries after the repository."""
    env = dict(os.environ)
    env.update(PYTHONPATH=str(REPO_ROOT), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_HOST_IP="127.0.0.1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.pop("SCHED_HARNESS_TRACE", None)
    env.pop(ENV_BASE_CLS, None)
    if trace_jsonl is not None:
        env["SCHED_HARNESS_TRACE"] = str(trace_jsonl)
        # A client's disconnect between schedule() and update_from_output() is applied
        # after the update, where the trace can hold it (recording_scheduler.py).
        env.setdefault("SCHED_HARNESS_MID_STEP_ABORTS", "defer")
    if candidate is not None:
        env.update(candidate.env(str(REPO_ROOT)))
    return env


#: Seconds one engine op may take (``--time-limit`` bounds them further).
STEP_TIMEOUT_S = 300.0


class OfflineEngine:
    """The runner process: ``call`` one op, get its answer (JSON lines, see offline_runner.py)."""

    def __init__(self, jsonl: Path | None, log_path: Path, candidate: CandidateClass | None = None) -> None:
        python = require_serving_env()
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([str(python), str(RUNNER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=child_env(jsonl, candidate), start_new_session=True, bufsize=1,
                                     preexec_fn=die_with_parent())
        self.watchdog = GroupWatchdog(self.proc.pid)
        self.hung = False

    def call(self, msg: dict, timeout: float = 300.0) -> dict:
        """Send ``msg``, return the answer; ServeError (with the log's last line) on a
        refusal, a dead process or ``timeout`` seconds without an answer."""
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._died(msg["op"]) from None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.hung = True  # still inside the op: asking it to close would wait in vain
            raise ServeError(f"vLLM gave no answer to {msg['op']!r} within {timeout:.0f} s "
                             f"(log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise self._died(msg["op"])
        resp = json.loads(line)
        if not resp.get("ok"):
            raise ServeError(f"vLLM failed in {msg['op']!r}: {resp.get('error')} (log: {self.log_path})")
        return resp

    def _died(self, op: str) -> ServeError:
        try:  # its pipe closed as it exited: give the exit a moment to be reaped
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.log.flush()
        last = log_tail(self.log_path, 1)
        return ServeError(f"vLLM exited (code {code}) during {op!r}: {last[:300]} (log: {self.log_path})")

    def close(self) -> None:
        """Shut vLLM down cleanly (the recording is finished), else stop it by PID."""
        try:
            if self.proc.poll() is None and not self.hung:
                self.call({"op": "close"}, timeout=60)
                self.proc.wait(timeout=30)
        except (ServeError, subprocess.TimeoutExpired, ValueError, OSError):
            pass
        finally:
            stop_gracefully(self.proc)
            self.watchdog.release()
            self.log.close()


@dataclass
class OfflineResult:
    """What an offline run did: counts, per-request outputs, the scheduler's time."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    rejected: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    init_s: float = 0.0
    vllm_version: str = ""
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str | None] = field(default_factory=dict)
    sched_s: list[float] = field(default_factory=list)   # per step: schedule+update, recording included
    vllm_s: list[float] = field(default_factory=list)    # per step: vLLM's own methods
    hooks_s: list[float] = field(default_factory=list)   # per step: the recorder's hooks inside vllm_s
    convert: dict | None = None
    error: str | None = None   # vLLM failed mid-run (the trace holds the steps up to it)


def request_message(spec: RequestSpec, clock: float) -> dict:
    """The ``add`` op of ``spec``, arriving at virtual time ``clock`` (seconds)."""
    return {"request_id": spec.request_id, "prompt_token_ids": list(spec.prompt_token_ids),
            "max_tokens": spec.max_tokens, "min_tokens": spec.min_tokens, "ignore_eos": spec.ignore_eos,
            "stop_token_ids": list(spec.stop_token_ids), "priority": spec.priority,
            "arrival_time": clock}


def check_offline_workload(wl: Workload, vocab: int | None) -> None:
    """ServeError for what a real engine cannot be fed: actions, encoder inputs,
    scripted outputs, a prompt token outside the model's vocabulary."""
    if wl.actions:
        raise ServeError("a scenario with [[actions]] cannot be run on a real engine (requests only)")
    for r in wl.requests:
        if r.mm_positions:
            raise ServeError(f"request {r.request_id}: encoder inputs cannot be served by the tiny model")
        if vocab is not None and max(r.prompt_token_ids) >= vocab:
            raise ServeError(f"request {r.request_id}: prompt token {max(r.prompt_token_ids)} is outside "
                             f"the model's vocabulary of {vocab} (harness model tiny --vocab)")


def record_offline(wl: Workload, config: EngineConfig, out_path: str | Path, model_dir: str | Path, *,
                   seed: int = 0, record: bool = True, timing: bool = False, max_steps: int = 100_000,
                   time_limit_s: float = 1800.0,
                   on_step: Callable[[int, int], None] | None = None,
                   candidate: CandidateClass | None = None) -> OfflineResult:
    """Run ``wl`` on vLLM's in-process engine with model ``model_dir``; write trace ``out_path``.

    ``on_step(step, requests ended so far)`` after each step. ``record=False``
    runs vLLM's own scheduler (no trace; for the benchmark); ``timing`` measures
    the scheduler's calls per step (``OfflineResult.sched_s``/``vllm_s``);
    ``candidate`` (checked by ``check_candidate_class``) is the user's
    ``Scheduler`` subclass the recording scheduler runs over.
    Raises ServeError (one line naming the log) when vLLM fails, exceeds
    ``max_steps`` or ``time_limit_s``; the runner is stopped on every path,
    KeyboardInterrupt included.
    """
    from harness.serve.model import read_vocab_size

    check_offline_workload(wl, read_vocab_size(model_dir))
    args = engine_args(config, seed=seed)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    jsonl, log_path = side_files(out)
    for stale in [jsonl, *jsonl.parent.glob(f".{jsonl.name}.*.tmp")]:  # an earlier run's
        stale.unlink(missing_ok=True)
    result = OfflineResult(requests=len(wl.requests))
    started = time.monotonic()
    engine = OfflineEngine(jsonl if record else None, log_path, candidate)
    try:
        init = engine.call({"op": "init", "model": str(Path(model_dir).resolve()), "engine_args": args,
                            "record": record, "timing": timing}, timeout=600)
        result.vllm_version, result.init_s = init["vllm_version"], init["init_s"]
        try:
            _drive(engine, wl, config, result, max_steps, started + time_limit_s, on_step)
        except ServeError as exc:  # mid-run: what was recorded up to it is still a trace
            if not record:
                raise
            result.error = str(exc)
    finally:
        engine.close()
    result.wall_s = time.monotonic() - started
    if record:
        result.convert = convert_recording(jsonl, out, log_path, result.error)
    return result


def convert_recording(jsonl: Path, out: Path, log_path: Path, error: str | None = None) -> dict:
    """Convert the finished recording ``jsonl`` (or, if the engine died first, its
    temporary file's complete steps) to trace ``out``; ``convert``'s summary, with a
    warning when the temporary file was used. ServeError when there is neither
    (with ``error``, the failure that came first, as its message)."""
    found, salvaged = finished_or_salvaged(jsonl)
    if found is None:
        raise ServeError(error or f"vLLM left no recording at {jsonl} (log: {log_path})")
    summary = convert(found, out)
    if salvaged:
        summary["warnings"].append(f"vLLM did not finish the recording: converted the complete steps "
                                   f"of {found.name}")
    return summary


def _drive(engine: OfflineEngine, wl: Workload, config: EngineConfig, result: OfflineResult,
           max_steps: int, deadline: float, on_step) -> None:
    """The engine loop of ``reference.engine.Engine.run``, for a real engine: arrivals
    and aborts before each step, the virtual clock after it."""
    arrivals = _Arrivals(wl, config.step_fixed_s)
    live: set[str] = set()
    clock, step, ended = 0.0, 0, 0
    in_flight = 0  # batches EngineCore still holds (async scheduling): stepped until drained

    def left() -> float:
        # Regression: each op waited up to 300 s whatever the time limit, so a
        # --candidate-class that hangs in schedule() ran 400 s with --time-limit 40.
        return max(1.0, min(STEP_TIMEOUT_S, deadline - time.monotonic()))
    while arrivals.pending() or live or in_flight:
        if not live and not in_flight and not arrivals.due_now(step, clock):
            step, clock = arrivals.next_event(step, clock, stuck=False)
        if step >= max_steps or time.monotonic() > deadline:
            raise ServeError(f"the run did not finish within {max_steps} steps / the time limit "
                             f"(step {step}, {len(live)} requests unfinished)")
        for spec in arrivals.take_due(step, clock):
            resp = engine.call({"op": "add", "request": request_message(spec, clock)}, timeout=left())
            if "rejected" in resp:
                result.rejected += 1
                ended += 1
                arrivals.ended(spec.request_id, step)
            else:
                live.add(spec.request_id)
        aborts = [r for r in arrivals.take_aborts(step, clock) if r in live]
        if aborts:
            engine.call({"op": "abort", "request_ids": aborts}, timeout=left())
            for r in aborts:
                live.discard(r)
                arrivals.ended(r, step)
            result.aborted += len(aborts)
            ended += len(aborts)
        resp = engine.call({"op": "step"}, timeout=left())
        for req_id, tokens, reason in resp["finished"]:
            if req_id in live:
                live.discard(req_id)
                result.outputs[req_id] = tokens
                result.finish_reasons[req_id] = reason
                result.finished += 1
                result.output_tokens += len(tokens)
                ended += 1
                arrivals.ended(req_id, step)
        if "sched_s" in resp:
            result.sched_s.append(resp["sched_s"])
            result.vllm_s.append(resp["vllm_s"])
            result.hooks_s.append(resp.get("hooks_s", 0.0))
        total = resp.get("total") or 0
        in_flight = int(resp.get("in_flight") or 0)
        step += 1
        result.steps = step
        clock += config.step_fixed_s + config.step_per_token_s * total
        if on_step is not None:
            on_step(step, ended)
