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

from collections.abc import Callable
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
        super().__init__(f"candidate raised {type(exc).__name__} at step {step}: "
                         f"{' '.join(str(exc).split())[:300]}")
        self.step = step
