"""The candidate protocol: the small step-level API the engine loop drives.

A candidate is any scheduler the harness can record or re-drive: the
reference ``Scheduler``, a mutant, a user's own implementation, or (issue 4)
real vLLM behind a subprocess. It is built by a *factory*
``factory(config: EngineConfig) -> Candidate`` and must be deterministic.

Per engine step the loop calls, in order: ``add_request`` for each arrival,
``finish_requests`` for each abort, the workload's actions due
(``finish_requests`` for an abort action, ``reset_prefix_cache`` for a
reset), ``snapshot()``, ``schedule()``,
``snapshot()``, then ``update_from_output`` with the scripted model's tokens
(and, with the KV connector on, the simulated worker's KV-connector output),
then ``snapshot()``, and with speculative decoding ``update_draft_token_ids`` and
``snapshot()`` again. Decisions come back in the reference's normalised types
(``SchedulerOutput``, ``UpdateResult``, ``FinishedRequest``), which is what
the trace records and the checker reads.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from reference.config import EngineConfig
from reference.output import FinishedRequest, PrefixCacheReset, SchedulerOutput, SchedulerSnapshot, UpdateResult
from reference.request import Request, RequestStatus

if TYPE_CHECKING:
    from reference.kv_connector import KVConnectorOutput


@runtime_checkable
class Candidate(Protocol):
    """What the engine loop needs from a scheduler (vLLM ``SchedulerInterface``
    names, ``vllm/v1/core/sched/interface.py``)."""

    def add_request(self, request: Request) -> None:
        """Enqueue a new request (status WAITING)."""

    def finish_requests(self, request_ids: list[str],
                        finished_status: RequestStatus) -> list[FinishedRequest]:
        """Finish requests from outside (abort); ignore unknown/finished ids."""

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> PrefixCacheReset:
        """vLLM ``Scheduler.reset_prefix_cache``: with ``reset_running_requests``
        preempt every running request (from the tail of running) first; the
        reset succeeds only when no block is held. Only called for a
        workload with a ``reset_prefix_cache`` action."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """Decide one step."""

    def update_from_output(self, output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]],
                           kv_connector_output: KVConnectorOutput | None = None) -> UpdateResult:
        """Apply the model's sampled tokens for ``output``.

        ``kv_connector_output`` (only passed when ``config.kv_connector`` is
        on; a candidate without a connector may omit the parameter): the
        simulated worker-side connector's report for this batch (vLLM
        ``ModelRunnerOutput.kv_connector_output``): ``finished_recving``, the
        async loads that finished (in load start order), and
        ``invalid_block_ids``, the blocks whose load failed. The candidate
        reports back, in ``UpdateResult``, the transfers it processed
        (``finished_recving``), the failed blocks (``invalid_block_ids``), the
        frees of requests that finished while loading (``kv_freed``, with
        fences) and, under ``kv_load_failure_policy="fail"``, the requests it
        finished with FINISHED_ERROR (in ``finished``, after the others)."""

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> dict[str, list[int]]:
        """Store drafts for the next step (only called with speculative
        decoding on); return what was stored per request."""

    def has_request(self, request_id: str) -> bool:
        """True while the request is known and unfinished."""

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished."""

    def snapshot(self) -> SchedulerSnapshot:
        """Queues and free blocks now, and ``request_states``: the status,
        computed tokens and held drafts of every unfinished request that is
        not RUNNING and holds draft tokens, and of every request the latest
        ``schedule()`` reported preempted (None: not reported; the trace then
        holds no ``request_state`` rows)."""


CandidateFactory = Callable[[EngineConfig], Candidate]


class CandidateError(RuntimeError):
    """The candidate raised; ``step`` is where, ``__cause__`` the exception."""

    def __init__(self, step: int, exc: BaseException) -> None:
        name = getattr(exc, "crash_type", None) or type(exc).__name__  # another process's exception
        super().__init__(f"candidate raised {name} at step {step}: "
                         f"{' '.join(str(exc).split())[:300]}")
        self.step = step


class UserInterrupt(KeyboardInterrupt):
    """The user's own interrupt (Ctrl-C, or SIGTERM from CI or ``timeout``),
    raised by the harness's signal handler (``harness.signals``): the one
    KeyboardInterrupt the engine's candidate guard lets through. A candidate
    raising a plain KeyboardInterrupt has crashed; ``signum`` is the signal."""

    def __init__(self, signum: int = 2) -> None:
        super().__init__(signum)
        self.signum = signum


def is_user_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` (a KeyboardInterrupt) is the user's and must stop the
    run, rather than a candidate's crash: a ``UserInterrupt``, or any
    KeyboardInterrupt while Python's default SIGINT handler is installed (a
    library caller that installed no handler of its own cannot tell the two
    apart, and Ctrl-C must still stop it). Under the harness's handler
    (``harness.signals``) a candidate's ``raise KeyboardInterrupt`` is a crash."""
    import signal

    if isinstance(exc, UserInterrupt):
        return True
    try:
        return signal.getsignal(signal.SIGINT) is signal.default_int_handler
    except (ValueError, TypeError):
        return True


class CandidateRefused(Exception):
    """Raised by a candidate that cannot run the config or workload it was
    given (a vLLM release without an option the config sets, a key its
    driver cannot map): a refusal before anything it decided, not a crash.
    The engine passes it on as CandidateError (no ``crash`` row, no trace:
    the engine is not at fault, the request was unanswerable); the message
    is one line naming the reason."""


class CandidateCrash(CandidateError):
    """The candidate raised inside a step of the engine loop (a crash: the run
    ends there and the trace records it as a ``crash`` row).

    ``call``: the candidate method that raised (``schedule``,
    ``update_from_output``, ``update_draft_token_ids``, ``add_request``,
    ``finish_requests``, ``reset_prefix_cache``, ``snapshot``, ...);
    ``exc_type``: the exception's class name; ``message``: ``"<Type>: <text>"``
    (``describe_exception``); ``where``: the innermost frame of candidate code,
    ``"path/module.py:line"``; ``rank``: the data-parallel rank whose scheduler
    raised; ``stage``: how far the step had got (``reference.engine``,
    ``CRASH_STAGES``), set by the engine loop. ``__cause__`` is the exception.
    """

    def __init__(self, step: int, exc: BaseException, call: str, rank: int = 0, *, skip: int = 0) -> None:
        self.exc_type, self.message, self.where = describe_exception(exc, skip)
        self.call = call
        self.rank = rank
        self.stage = "inputs"
        super().__init__(step, exc)
        self.args = (self.one_line(),)

    def one_line(self) -> str:
        """``crash_line`` of this crash."""
        return crash_line(self.step, self.call, self.message, self.where)

    def at_step(self, step: int) -> CandidateCrash:
        """The same crash, named at ``step`` (a call between two steps belongs to the next)."""
        self.step = step
        self.args = (self.one_line(),)
        return self


def crash_line(step: int, call: str, message: str, where: str | None) -> str:
    """One line for a crash: ``candidate raised <Type> in <call>() at step S:
    <text> (at <where>)``, from its ``message`` ("<Type>: <text>")."""
    exc_type, _, text = message.partition(": ")
    return (f"candidate raised {exc_type} in {call}() at step {step}" + (f": {text}" if text else "")
            + (f" (at {where})" if where else ""))


def describe_exception(exc: BaseException, skip: int = 0) -> tuple[str, str, str]:
    """``(type name, "<Type>: <text>", where)`` of an exception a candidate raised.

    ``text`` is ``str(exc)`` on one line (at most 300 characters); for a bare
    ``assert`` (no text) the failing source line in backquotes. ``where`` is
    the innermost traceback frame outside the Python standard library
    (``crash_site``, past the traceback's first ``skip`` frames: the
    caller's own), "" without a traceback. An exception that stands for
    one raised in another process (the vLLM driver's) carries that one's
    description in the attributes ``crash_type``, ``crash_message`` and
    ``crash_where``, which win."""
    # Only our own exception classes speak for another process: a candidate's
    # exception with a ``crash_type`` attribute of its own is described as
    # any other (regression: it could forge "StepTimeout" and a multi-line
    # message, which reached the trace and the verdict's output).
    remote = getattr(exc, "crash_type", None) if type(exc).__module__.startswith(_OWN_MODULES) else None
    if isinstance(remote, str) and remote:
        return (_one_line(remote), _one_line(getattr(exc, "crash_message", remote), 1000),
                _one_line(getattr(exc, "crash_where", "")))
    name = type(exc).__name__
    # str() is the candidate's code too: one that raises (regression: the
    # isolated child died with a traceback on stderr) is described, not re-raised.
    text = _one_line(exc, 300)
    frames = _frames(exc.__traceback__)
    if not text and frames:
        line = traceback.extract_tb(frames[-1][1], limit=1)[0].line or ""
        text = f"`{line.strip()}`" if line.strip() else ""
    return name, f"{name}: {text}" if text else name, crash_site(exc.__traceback__, skip)


_OWN_MODULES = ("harness.", "reference.")


def _one_line(value: object, limit: int | None = None) -> str:
    """``str(value)`` on one line (at most ``limit`` characters); never raises:
    a ``__str__`` that fails gives ``<unprintable TYPE>``."""
    try:
        text = " ".join(str(value).split())
    except BaseException:  # noqa: B036 - a candidate's __str__ may raise anything
        try:
            text = f"<unprintable {type(value).__name__}>"
        except BaseException:  # noqa: B036
            text = "<unprintable>"
    return text if limit is None else text[:limit]


def _frames(tb: TracebackType | None) -> list[tuple[object, TracebackType]]:
    out = []
    while tb is not None:
        out.append((tb.tb_frame, tb))
        tb = tb.tb_next
    return out


_STDLIB = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib")})


def _in_stdlib(filename: str) -> bool:
    return filename.startswith(_STDLIB) and "-packages" not in filename


def crash_site(tb: TracebackType | None, skip: int = 0) -> str:
    """The innermost frame of ``tb`` (after its first ``skip`` frames) that is
    not in the standard library, as ``"path:line"``: the path is the frame's
    module name as a path (``reference/scheduler.py``,
    ``vllm/v1/core/sched/scheduler.py``: the same on every machine), its
    file's base name for a script. "" when ``tb`` has no such frame."""
    frames = _frames(tb)[skip:]
    chosen = next((f for f in reversed(frames) if not _in_stdlib(f[0].f_code.co_filename)),
                  frames[-1] if frames else None)
    if chosen is None:
        return ""
    frame, tb_entry = chosen
    filename = frame.f_code.co_filename
    base = filename.replace("\\", "/").rsplit("/", 1)[-1]
    module = frame.f_globals.get("__name__") if isinstance(frame.f_globals, dict) else None
    if isinstance(module, str) and module != "__main__" and module in sys.modules:
        parts = module.split(".")
        path = "/".join((parts if base == "__init__.py" else parts[:-1]) + [base])
    else:
        path = base
    return f"{path}:{tb_entry.tb_lineno}"
