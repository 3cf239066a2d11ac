"""The child side of ``harness.candidates.isolated``: serve one candidate.

Started by ``IsolatedCandidate`` as ``python -c <boot>`` with the parent's
``sys.path``. Reads length-prefixed pickled frames on stdin and answers on
the original stdout; before anything else it points fd 1 at fd 2, so what
the candidate prints (from Python or C) goes to stderr, never into the
protocol or the harness's stdout. Frames:

* ``("resolve", spec)``: import ``spec``'s module and find its factory here
  (answered with None, or the CandidateSpecError's text): the harness never
  imports a candidate's module itself, whose import may ``os._exit(0)``;
* ``("init", spec, config)``: resolve ``spec`` (``module:factory``; once)
  and build the candidate with ``config``, dropping the previous one;
* ``("call", name, args, kwargs)``: call the candidate's method. A
  ``SchedulerOutput`` returned by ``schedule()`` is kept and answered with a
  token; ``update_from_output`` gets the kept object back for the token.

Answers: ``("ok", value, state)``, ``("refused", info, None)``
(CandidateRefused; ``info`` as below, plus its ``text``), or ``("raised", info, None)``. ``state``, after a call
that changes the candidate (``MUTATING``), holds what ``snapshot()`` and
``get_num_unfinished_requests()`` return right after it (the protocol's
queries, free of side effects): the parent answers the engine's next
queries from it, which saves most round trips (``bench/bench_isolation.py``).
``info`` has the exception's ``type``, ``message``, ``where``
(``reference.candidate.describe_exception``) and, from ``schedule()``, the
``decisions`` taken before it (``reference.engine.decisions_before_crash``).
Every BaseException of the candidate is answered (``sys.exit`` included);
only the end of stdin ends the loop. SIGINT is ignored (the parent handles
the user's Ctrl-C and kills this process); on Linux this process gets
SIGKILL when its parent dies.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import traceback
from typing import Any

from harness.children import set_parent_death_signal

_HEADER = struct.Struct("!I")


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


#: Calls that change the candidate's state: their answer carries the state
#: after them (``_state``), which the parent serves the next queries from.
MUTATING = frozenset({"add_request", "finish_requests", "reset_prefix_cache", "schedule", "update_from_output",
                      "update_draft_token_ids"})


def _state(candidate: Any) -> dict:
    """``snapshot()`` and ``get_num_unfinished_requests()`` now, each left out
    if it raises (the parent then asks, and the error comes from that call)."""
    state: dict[str, Any] = {}
    for key, name in (("snapshot", "snapshot"), ("num_unfinished", "get_num_unfinished_requests")):
        try:
            state[key] = getattr(candidate, name)()
        except BaseException:  # noqa: B036 - reported when the parent asks
            pass
    return state


def serve() -> None:
    """The loop (see the module docstring); returns at the end of stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal(signal.SIGKILL)  # not Linux: the parent's finally blocks still kill it
    proto_in = os.dup(0)
    proto_out = os.dup(1)
    os.dup2(2, 1)  # the candidate's stdout is our stderr
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = sys.stderr
    if os.getppid() == 1:
        return  # the parent is already gone

    from reference.candidate import CandidateRefused, describe_exception
    from reference.engine import decisions_before_crash
    from reference.output import SchedulerOutput

    factory = None
    candidate: Any = None
    outputs: dict[int, Any] = {}
    next_token = 0

    def answer(kind: str, value: Any, state: dict | None = None) -> None:
        try:
            data = pickle.dumps((kind, value, state), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # the candidate returned something that does not pickle
            data = pickle.dumps(("raised", {"type": "TypeError", "where": "",
                                            "message": f"TypeError: the return value cannot be sent to the "
                                                       f"harness ({type(exc).__name__}: {exc})"}, None))
        os.write(proto_out, _HEADER.pack(len(data)))
        view = memoryview(data)
        while view:
            view = view[os.write(proto_out, view):]

    while True:
        header = _read_exact(proto_in, _HEADER.size)
        if header is None:
            return
        (size,) = _HEADER.unpack(header)
        data = _read_exact(proto_in, size)
        if data is None:
            return
        msg = pickle.loads(data)
        try:
            if msg[0] == "resolve":  # import the module here, never in the harness
                from harness.candidates.resolve import CandidateSpecError, resolve_candidate

                try:
                    factory = resolve_candidate(msg[1], isolate=False)
                except CandidateSpecError as exc:
                    answer("ok", str(exc))
                    continue
                answer("ok", None)
                continue
            if msg[0] == "init":
                _, spec, config = msg
                if factory is None:
                    from harness.candidates.resolve import resolve_candidate

                    factory = resolve_candidate(spec, isolate=False)
                candidate, outputs = None, {}
                candidate = factory(config)
                if not callable(getattr(candidate, "schedule", None)):
                    raise TypeError(f"the candidate factory returned {type(candidate).__name__}, "
                                    f"not a scheduler (no schedule() method)")
                answer("ok", None)
                continue
            _, name, args, kwargs = msg
            if name == "update_from_output" and args and type(args[0]).__name__ == "_OutputRef":
                args = (outputs.pop(args[0].token),) + tuple(args[1:])
            result = getattr(candidate, name)(*args, **kwargs)
            if name == "schedule" and isinstance(result, SchedulerOutput):
                outputs[next_token] = result
                result = (result, next_token)
                next_token += 1
            answer("ok", result, _state(candidate) if name in MUTATING else None)
        except CandidateRefused as exc:
            exc_type, message, where = describe_exception(exc, skip=1)
            answer("refused", {"type": exc_type, "message": message, "where": where,
                               "text": " ".join(str(exc).split())})
        except BaseException as exc:  # noqa: B036 - a candidate's sys.exit is a crash too
            exc_type, message, where = describe_exception(exc, skip=1)
            info = {"type": exc_type, "message": message, "where": where,
                    "traceback": "".join(traceback.format_exception(exc))}
            if msg[0] == "call" and msg[1] == "schedule":
                info["decisions"] = decisions_before_crash(exc)
            answer("raised", info)
