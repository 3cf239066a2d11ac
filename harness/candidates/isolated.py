"""A ``module:factory`` candidate in its own process, bounded in time per call.

A user's candidate is untrusted code. In the harness's process it could end
the command itself (``os._exit(0)``: exit 0, nothing printed), crash it (a
segfault in an extension), hang it, or corrupt the interpreter. So, as the
vLLM driver already is (``harness/candidates/vllm/candidate.py``), it runs in
a child process and every call crosses a pipe:

* ``IsolatedCandidate`` implements ``reference.candidate.Candidate`` here and
  forwards each call (method name, arguments) to the child
  (``harness/candidates/isolated_child.py``), which calls the real candidate
  and answers with its return value or a description of what it raised.
  Frames are pickled (both sides run this project's Python and types; the
  vLLM driver needs JSON only because it runs another interpreter);
* a call not answered within ``step_timeout`` seconds (``--step-timeout``;
  ``DEFAULT_STEP_TIMEOUT_S``) kills the child and raises
  ``CandidateProcessError`` (``StepTimeout``); a child that exits
  (``os._exit(0)``) or is killed by a signal (SIGSEGV) mid-call raises it
  too (``CandidateDied``). The engine's guard turns either into a crash of
  that step (a ``crash`` row, exit 1, one line naming the step);
* the child's stdout is its stderr (fd 1 is pointed at fd 2 before the
  candidate is imported): what it prints, even from C, never reaches the
  harness's stdout;
* the child dies with its parent (``PR_SET_PDEATHSIG`` on Linux, and every
  child is killed at exit or when its candidate is dropped after a
  failure); healthy children go back to a small pool per spec and are
  re-initialised with the next config (``fuzz`` builds thousands of
  candidates).

The reference and the mutants stay in the harness's process: they are ours.
A crash inside ``schedule()`` still reports the decisions taken before it
(``reference.engine.decisions_before_crash``, computed in the child).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import pickle
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from harness.candidates.isolated_child import MUTATING
from harness.children import ChildPool, GroupWatchdog, relay_stderr, shim_command, stop_process_group
from reference.candidate import CandidateRefused
from reference.config import EngineConfig
from reference.output import SchedulerOutput

#: Seconds a candidate call may take before the run is ended as a hang.
DEFAULT_STEP_TIMEOUT_S = 60.0
#: Seconds allowed for the child's start (Python, the candidate's import, the factory).
START_TIMEOUT_S = 60.0
#: Idle children kept per spec (2: a data-parallel run with two ranks).
POOL_SIZE = 2
_HEADER = struct.Struct("!I")
#: Seconds between checks, while waiting for an answer, that the child is still alive.
_EXIT_POLL_S = 0.5
_BOOT = ("import json, os, sys; sys.path[:] = json.loads(os.environ['HARNESS_ISOLATED_SYS_PATH']); "
         "from harness.candidates.isolated_child import serve; serve()")


#: Builtin types an answer may contain besides this project's own classes.
_SAFE_BUILTINS = frozenset({"set", "frozenset", "list", "dict", "tuple", "int", "float", "complex", "str",
                            "bytes", "bytearray", "bool", "range", "slice"})
_SAFE_COLLECTIONS = frozenset({"OrderedDict", "defaultdict", "deque", "Counter"})
#: The modules of the values the protocol returns (reference/output.py's types, RequestStatus).
_RESULT_MODULES = frozenset({"reference.output", "reference.request"})


class _AnswerUnpickler(pickle.Unpickler):
    """Reads the child's answer without running the candidate's code here.

    ``pickle.loads`` would call whatever callable the answer names (an object
    whose ``__reduce__`` returns ``(os._exit, (0,))`` would end the harness
    with exit 0): only the dataclasses and enums of ``reference.output`` and
    ``reference.request`` and plain builtin containers may be named; anything
    else is a ``ProtocolError``."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "collections" and name in _SAFE_COLLECTIONS:
            return super().find_class(module, name)
        if module in _RESULT_MODULES and "." not in name and not name.startswith("_"):
            obj = super().find_class(module, name)
            # Data only: a dataclass or an enum of the result modules, never a
            # class whose construction does something (a writer, a process).
            if (isinstance(obj, type) and getattr(obj, "__module__", "") == module
                    and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))):
                return obj
        raise pickle.UnpicklingError(f"the answer names {module}.{name}, which is not one of the "
                                     f"harness's result types")


def _loads_answer(data: bytes) -> Any:
    import io

    return _AnswerUnpickler(io.BytesIO(data)).load()


class CandidateProcessError(RuntimeError):
    """The candidate's process hung, died or broke the protocol during a call.

    ``crash_type`` (``StepTimeout``, ``CandidateDied``, ``ProtocolError``),
    ``crash_message`` and ``crash_where`` are what the engine records as the
    crash (``reference.candidate.describe_exception``)."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.crash_type = kind
        self.crash_message = f"{kind}: {text}"
        self.crash_where = ""


class CandidateRaised(RuntimeError):
    """The candidate raised inside its process: ``crash_type``,
    ``crash_message``, ``crash_where`` describe its exception,
    ``crash_decisions`` the decisions ``schedule()`` had taken before it and
    ``crash_traceback`` its traceback as the child formatted it."""

    def __init__(self, info: dict[str, Any]) -> None:
        text = info["message"]
        super().__init__(text.removeprefix(f"{info['type']}: ") if text != info["type"] else "")
        self.crash_type = info["type"]
        self.crash_message = info["message"]
        self.crash_where = info["where"]
        self.crash_decisions = tuple(info.get("decisions") or ())
        # The child's formatted traceback (``record --traceback`` prints it).
        self.crash_traceback = info.get("traceback", "")


class IsolatedRefused(CandidateRefused):
    """The candidate refused the run in its process (``CandidateRefused``): the
    message is its text; ``crash_*`` describe it should it count as a crash
    (a refusal after the candidate's first decision, ``reference.engine``)."""

    def __init__(self, info: dict[str, Any]) -> None:
        super().__init__(info["text"])
        self.crash_type = info["type"]
        self.crash_message = info["message"]
        self.crash_where = info["where"]


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class _Child:
    """One child process: start, call (one pickled frame each way), kill."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        env = dict(os.environ)
        env["HARNESS_ISOLATED_SYS_PATH"] = json.dumps([p if p else os.getcwd() for p in sys.path])
        env["PYTHONUNBUFFERED"] = "1"
        # Under the reaper shim (harness.children): a grandchild that leaves the
        # group with setsid is still found and killed with the candidate
        # (issue 26: one held the harness's stderr for minutes after replay);
        # its stderr is a pipe relayed to ours, never our stderr itself.
        self.proc = subprocess.Popen(shim_command([sys.executable, "-c", _BOOT]), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                     start_new_session=True)
        relay_stderr(self.proc.stderr)
        # The child gets SIGKILL when the harness dies (isolated_child.serve);
        # regression: what it started (a subprocess of the candidate's) was
        # left running after SIGKILL of the harness. The watchdog kills the group.
        self._watchdog = GroupWatchdog(self.proc.pid, grace_s=0.0)
        self.broken: str | None = None
        self.lock = threading.Lock()
        POOL.add(self)

    def alive(self) -> bool:
        return self.broken is None and self.proc.poll() is None

    def call(self, msg: tuple, timeout: float, what: str) -> tuple[Any, dict | None]:
        """Send ``msg``, wait up to ``timeout`` seconds for the answer; ``what``
        names the call in errors. Returns the answer's value and the state the
        child sent with it (``isolated_child._state``); raises
        CandidateRaised, CandidateRefused or CandidateProcessError."""
        if self.broken is not None:
            raise CandidateProcessError("CandidateDied", self.broken)
        with self.lock:
            try:
                data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
                self.proc.stdin.write(_HEADER.pack(len(data)) + data)
                self.proc.stdin.flush()
                answer = self._read(timeout, what)
            except (BrokenPipeError, OSError, ValueError):
                raise self._died(what) from None
            except BaseException:
                # Interrupted mid-call (the user's Ctrl-C): the child's state is unknown.
                self.kill("interrupted")
                raise
        kind, value, state = answer
        if kind == "ok":
            return value, state
        if kind == "refused":
            raise IsolatedRefused(value)
        raise CandidateRaised(value)

    def _died(self, what: str) -> CandidateProcessError:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        how = (f"was killed by {_signal_name(code)}" if code is not None and code < 0
               else f"exited with code {code}")
        self.kill(f"the candidate process {how}")
        return CandidateProcessError("CandidateDied", f"the candidate process {how} during {what}")

    def _read_exact(self, n: int, deadline: float, timeout: float, what: str, sel) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks, got = [], 0
        while got < n:
            left = deadline - time.monotonic()
            # In slices: a child that exited while something it forked keeps
            # the pipe open never gives end of stream (regression: the run
            # waited out --step-timeout and ended as a StepTimeout).
            if left > 0 and not sel.select(min(left, _EXIT_POLL_S)):
                if self.proc.poll() is not None and not sel.select(0):
                    raise OSError("the candidate process exited")
                continue
            if left <= 0:
                self.kill(f"no answer from {what} within {timeout:g} s")
                # The factory's call is the child's start: its limit is not
                # --step-timeout alone (adversarial trial: "--step-timeout 5"
                # waited 60 s and the message blamed --step-timeout).
                limit = (f"the start limit: {START_TIMEOUT_S:g} s or --step-timeout if longer"
                         if what.startswith("the factory of ") else "--step-timeout")
                raise CandidateProcessError(
                    "StepTimeout", f"no answer from {what} within {timeout:g} s ({limit}; the "
                                   f"candidate process was killed)")
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise OSError("end of stream")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _read(self, timeout: float, what: str) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout.fileno(), selectors.EVENT_READ)
            (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline, timeout, what, sel))
            data = self._read_exact(size, deadline, timeout, what, sel)
        try:
            answer = _loads_answer(data)
        except Exception as exc:
            self.kill("protocol error")
            raise CandidateProcessError("ProtocolError", f"unreadable answer to {what}: "
                                                         f"{type(exc).__name__}: {exc}") from None
        if not (isinstance(answer, tuple) and len(answer) == 3):
            self.kill("protocol error")
            raise CandidateProcessError("ProtocolError", f"malformed answer to {what}")
        return answer

    def kill(self, why: str = "closed") -> None:
        """Kill the child and its process group (idempotent)."""
        if self.broken is None:
            self.broken = why
        # The group even when the child itself has exited (os._exit, a crash):
        # what it forked is still in it (harness.children).
        if not getattr(self, "_group_killed", False):
            self._group_killed = True
            stop_process_group(self.proc)
            self._watchdog.release()
        POOL.forget(self)


#: Every child, and the idle ones kept for the next candidate of the same spec.
POOL = ChildPool(POOL_SIZE)


def _release(child: _Child, healthy: list[bool]) -> None:
    POOL.release(child.spec, child, healthy[0])


class _OutputRef:
    """Stands for a ``SchedulerOutput`` the child returned (``update_from_output``
    must get back the very object its ``schedule()`` made)."""

    __slots__ = ("token",)

    def __init__(self, token: int) -> None:
        self.token = token


class IsolatedCandidate:
    """The candidate ``spec`` (``module:factory``) built for ``config`` in a child
    process; implements ``reference.candidate.Candidate`` by forwarding.
    Raises CandidateRaised / CandidateProcessError / CandidateRefused from any
    call (the engine's guard reports them as a crash or a refusal)."""

    def __init__(self, spec: str, config: EngineConfig, step_timeout: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        self.spec = spec
        self.step_timeout = step_timeout
        self._child = POOL.acquire(spec, lambda: _Child(spec))
        self._healthy = [True]
        self._finalizer = weakref.finalize(self, _release, self._child, self._healthy)
        self._outputs: list[tuple[SchedulerOutput, int]] = []  # returned, not yet updated
        # The candidate's snapshot() and unfinished count after its last
        # state-changing call, as the child sent them: the next queries are
        # answered from here (no round trip) until the next change.
        self._state: dict[str, Any] = {}
        self._call(("init", spec, config), max(START_TIMEOUT_S, step_timeout), f"the factory of {spec}")

    def _call(self, msg: tuple, timeout: float, what: str) -> Any:
        changes = msg[0] == "init" or msg[1] in MUTATING
        if changes:
            self._state = {}
        try:
            value, state = self._child.call(msg, timeout, what)
        except (CandidateRaised, CandidateRefused):
            raise
        except BaseException:
            self._healthy[0] = False
            raise
        if changes:
            self._state = state or {}
        return value

    def _query(self, key: str, name: str) -> Any:
        if key in self._state:
            return self._state[key]
        return self._forward(name)

    def close(self) -> None:
        """Give the child back (to the pool if healthy)."""
        self._finalizer()

    def _forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._call(("call", name, args, kwargs), self.step_timeout, f"{name}()")

    # -- Candidate protocol --------------------------------------------------------
    def add_request(self, request):
        return self._forward("add_request", request)

    def finish_requests(self, request_ids, finished_status):
        return self._forward("finish_requests", list(request_ids), finished_status)

    def reset_prefix_cache(self, reset_running_requests: bool = False):
        return self._forward("reset_prefix_cache", reset_running_requests)

    def schedule(self, throttle_prefills: bool = False):
        result = self._forward("schedule", throttle_prefills) if throttle_prefills else self._forward("schedule")
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], SchedulerOutput):
            output, token = result
            self._outputs.append((output, token))
            return output
        return result  # not a SchedulerOutput: the engine's check names it

    def update_from_output(self, output, sampled_token_ids, kv_connector_output=None):
        index = next((i for i, (o, _) in enumerate(self._outputs) if o is output), None)
        ref = output if index is None else _OutputRef(self._outputs.pop(index)[1])
        if kv_connector_output is None:
            return self._forward("update_from_output", ref, sampled_token_ids)
        return self._forward("update_from_output", ref, sampled_token_ids, kv_connector_output)

    def update_draft_token_ids(self, draft_token_ids):
        return self._forward("update_draft_token_ids", draft_token_ids)

    def has_request(self, request_id):
        return self._forward("has_request", request_id)

    def get_num_unfinished_requests(self):
        return self._query("num_unfinished", "get_num_unfinished_requests")

    def snapshot(self):
        return self._query("snapshot", "snapshot")


def probe_spec(spec: str, timeout: float = START_TIMEOUT_S) -> str | None:
    """Import ``spec``'s module and look its factory up in a child process
    (the harness never imports a candidate's module: its import may exit,
    hang or print). Returns None when it resolves (the child stays pooled with
    the factory loaded, for the first candidate), else the one-line reason:
    the resolver's own error (no such module, attribute, not callable), or
    what became of the child (``importing it ended the process with exit
    code 0``, no answer within ``timeout`` s)."""
    child = POOL.acquire(spec, lambda: _Child(spec))
    try:
        error, _ = child.call(("resolve", spec), timeout, f"importing {spec!r}")
    except CandidateProcessError as exc:
        # The import is bounded by ``timeout`` (START_TIMEOUT_S), not by --step-timeout
        # (regression: the message named --step-timeout, which does not apply here).
        text = (str(exc).replace(f"during importing {spec!r}", "while importing it")
                .replace(" (--step-timeout; the candidate process was killed)", " (the candidate process was killed)"))
        return f"candidate {spec!r}: {text}"
    except CandidateRaised as exc:  # a BaseException at import (SystemExit, KeyboardInterrupt, ...)
        child.kill()
        where = f" at {exc.crash_where}" if exc.crash_where else ""
        return f"candidate {spec!r}: importing it raised {exc.crash_message}{where}"
    except CandidateRefused as exc:
        child.kill()
        return f"candidate {spec!r}: {exc}"
    POOL.release(spec, child, error is None)
    return error


def isolated_factory(spec: str, step_timeout: float | None = None):
    """``factory(config) -> IsolatedCandidate`` for ``spec`` (``module:factory``),
    each call bounded by ``step_timeout`` seconds (None: ``DEFAULT_STEP_TIMEOUT_S``)."""
    timeout = DEFAULT_STEP_TIMEOUT_S if step_timeout is None else float(step_timeout)

    def factory(config: EngineConfig) -> IsolatedCandidate:
        return IsolatedCandidate(spec, config, timeout)

    factory.__name__ = factory.__qualname__ = f"isolated:{spec}"
    factory.isolated_spec = spec  # type: ignore[attr-defined]
    return factory
