"""A simulated KV connector (consumer side): an external prefix store and
asynchronous KV loads.

Plays the two halves of a vLLM v1 KV connector
(``vllm/distributed/kv_transfer/kv_connector/v1/base.py``) for a KV consumer
such as a P/D decode instance or an offloading store:

* scheduler side, ``SimulatedKVConnector.get_num_new_matched_tokens``: how many
  prompt tokens past the local prefix-cache hit the external store holds, and
  that they load asynchronously (spec 3.4 step 6, 7.2);
* worker side, ``SimulatedKVWorker``: a load started by step s finishes
  ``kv_load_steps`` steps later and is reported in that step's model output as
  ``finished_recving`` (vLLM ``KVConnectorOutput``); a load may fail, reported
  as ``invalid_block_ids`` (the first external block that did not arrive).

The store is defined by content, not by request: block i of a prompt is held
iff a hash of the prompt's first (i + 1) blocks falls below
``kv_store_fraction``; a request is offered the longest held prefix of full
prompt blocks (so with fraction 1.0 the whole prompt, as a P/D prefill
instance would transfer). Everything is a pure function of the config, the
engine seed and the prompt: replays regenerate the same loads.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field

from reference.config import EngineConfig
from reference.output import SchedulerOutput
from reference.request import Request


#: The ``Skip`` reason of a request whose connector answered None (vLLM's
#: "the KVConnector couldn't determine the number of matched tokens").
KV_MATCH_PENDING = "KV connector cannot tell yet"


@dataclass(frozen=True)
class KVConnectorOutput:
    """What the worker-side connector reports with one model output (vLLM
    ``KVConnectorOutput``): loads that finished (in start order) and the
    blocks whose load failed."""

    finished_recving: tuple[str, ...] = ()
    invalid_block_ids: frozenset[int] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.finished_recving or self.invalid_block_ids)


def _unit(data: bytes) -> float:
    """A uniform number in [0, 1) from bytes."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") / 2**64


def held_prefix_tokens(prompt_token_ids: list[int] | tuple[int, ...], block_size: int,
                       fraction: float) -> int:
    """Tokens of the longest prefix of full prompt blocks the store holds.

    Block i is held iff ``_unit(chain_i) < fraction``, where ``chain_i``
    hashes the prompt's first (i + 1) blocks (content, chained as vLLM's
    block hashes are). Returns a multiple of ``block_size`` (tokens), at most
    the prompt length.
    """
    held = 0
    parent = b"kv-store"
    for start in range(0, len(prompt_token_ids) - block_size + 1, block_size):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", prompt_token_ids[start:start + block_size]).tobytes())
        parent = digest.digest()
        if _unit(parent) >= fraction:
            break
        held += block_size
    return held


class SimulatedKVConnector:
    """Scheduler side of the simulated consumer connector.

    Mirrors ``KVConnectorBase_V1.get_num_new_matched_tokens``: for a request
    with ``num_computed_tokens`` local (block-aligned) hit tokens, returns
    ``(external tokens, load_kv_async)``; external tokens are the held prefix
    past the local hit (0 if none), always loaded asynchronously.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.block_size = config.block_size
        self.fraction = config.kv_store_fraction
        self._held: dict[str, int] = {}  # request id -> held prefix tokens (memo)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        held = self._held.get(request.request_id)
        if held is None:
            held = self._held[request.request_id] = held_prefix_tokens(
                request.prompt_token_ids, self.block_size, self.fraction)
        external = max(held - num_computed_tokens, 0)
        return external, external > 0

    def loads_replay_window(self, request: Request, group_ids: tuple[int, ...]) -> bool:
        """Whether a load restores the bounded-replay groups ``group_ids``
        (vLLM 0.33.0 ``Scheduler._load_restores_replay_window`` over the
        connector's ``get_loaded_kv_cache_group_ids``): never, a prefix store
        holds no sliding window (vLLM's base connector answers none)."""
        return False

    def request_finished(self, request_id: str) -> None:
        """Forget the memo of a finished request."""
        self._held.pop(request_id, None)


@dataclass
class _Load:
    ready_step: int
    request_id: str
    invalid_block_id: int | None


@dataclass
class SimulatedKVWorker:
    """Worker side: loads in flight and when each reports.

    ``start_loads(step, output)`` starts every ``RemoteLoad`` of a scheduled
    step; ``poll(step)`` returns what finished by ``step`` (a load started at
    step s is reported at step s + kv_load_steps - 1, i.e. with
    ``kv_load_steps`` = 1 in the output of the step that started it). A load
    fails with probability ``kv_load_failure_rate`` (a seeded coin per
    request and attempt); a failed load reports one invalid block, chosen
    among the externally loaded ones.
    """

    config: EngineConfig
    seed: int
    pending: list[_Load] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    def start_loads(self, step: int, output: SchedulerOutput) -> None:
        for event in output.remote_loads:
            attempt = self.attempts.get(event.request_id, 0)
            self.attempts[event.request_id] = attempt + 1
            key = f"{self.seed}:{event.request_id}:{attempt}".encode()
            invalid = None
            if _unit(b"kv-fail:" + key) < self.config.kv_load_failure_rate:
                first = event.num_prefix_hit_tokens // self.config.block_size
                external_blocks = event.block_ids[first:]
                invalid = external_blocks[int(_unit(b"kv-block:" + key) * len(external_blocks))]
            self.pending.append(_Load(step + self.config.kv_load_steps - 1, event.request_id, invalid))

    def poll(self, step: int) -> KVConnectorOutput:
        done = [load for load in self.pending if load.ready_step <= step]
        if not done:
            return KVConnectorOutput()
        self.pending = [load for load in self.pending if load.ready_step > step]
        return KVConnectorOutput(
            tuple(load.request_id for load in done),
            frozenset(load.invalid_block_id for load in done if load.invalid_block_id is not None))


class RecordedKVConnector:
    """Scheduler side of a recorded connector: answers as vLLM's did.

    Chosen instead of ``SimulatedKVConnector`` when the config carries
    ``kv_connector_matches`` (a recording of vLLM running its own connector,
    ``harness/candidates/vllm/recording_convert.py``). Mirrors
    ``KVConnectorBase_V1.get_num_new_matched_tokens(request,
    num_computed_tokens) -> (int | None, bool)``
    (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``): the k-th call
    for a request returns the k-th answer recorded for it, ``(external
    tokens, load_kv_async)``, where external tokens None means "cannot tell
    yet" (vLLM's scheduler skips the request that step). The connector's
    answers are inputs from outside the scheduler: a call past the recorded
    ones repeats the last answer (none recorded: ``(0, False)``); the
    replay's first divergence is met before that matters for an identical run.
    ``request_finished`` mirrors the base's scheduler-side hook (nothing held).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.answers: dict[str, tuple[tuple[int | None, bool], ...]] = {
            req_id: tuple(answers) for req_id, answers in config.kv_connector_matches or ()}
        self.calls: dict[str, int] = {}
        self.window_loads: dict[str, tuple[bool, ...]] = {
            req_id: tuple(answers) for req_id, answers in config.kv_connector_window_loads or ()}
        self.window_calls: dict[str, int] = {}

    def loads_replay_window(self, request: Request, group_ids: tuple[int, ...]) -> bool:
        """Whether the load for ``request`` restored every bounded-replay group
        (vLLM 0.33.0 ``Scheduler._load_restores_replay_window``, the groups
        ``group_ids``): the k-th call for a request returns the k-th answer
        recorded for it (``kv_connector_window_loads``), a call past them the
        last one, none recorded False."""
        answers = self.window_loads.get(request.request_id, ())
        k = self.window_calls.get(request.request_id, 0)
        self.window_calls[request.request_id] = k + 1
        return bool(answers[min(k, len(answers) - 1)]) if answers else False

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        answers = self.answers.get(request.request_id, ())
        k = self.calls.get(request.request_id, 0)
        self.calls[request.request_id] = k + 1
        if not answers:
            return 0, False
        external, load_kv_async = answers[min(k, len(answers) - 1)]
        return external, bool(load_kv_async)

    def request_finished(self, request_id: str) -> None:
        """Nothing to forget: the answers are the recording's."""


#: Steps a recorded load never reported done keeps the engine stepping (vLLM
#: would wait on it for ever; the recording ended before it reported).
PENDING_LOAD_STEPS = 1000


@dataclass
class RecordedKVWorker:
    """Worker side of a recorded connector: the ``KVConnectorOutput`` vLLM's
    worker reported with each batch's model output (``finished_recving``,
    ``invalid_block_ids``), from the config's ``kv_connector_outputs``, keyed
    by the step that scheduled the batch. Same interface as
    ``SimulatedKVWorker``: ``start_loads`` (nothing to start), ``poll(step)``
    (the output the batch scheduled at ``step`` carries), ``busy`` (an output
    is still to come: the engine keeps stepping for it)."""

    config: EngineConfig
    seed: int = 0
    last_step: int = -1
    # Loads started and not yet reported done (request ids): a load in flight
    # keeps the engine stepping, as vLLM's does (regression: a recording that
    # ends with a load in flight, vLLM's test_pause_new_drains_async_kv_loads,
    # replayed as "engine stalled" at its first step).
    # (Request id -> the step that started it; one never reported stops
    # counting after PENDING_LOAD_STEPS steps, so a run outside a replay ends.)
    pending: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.outputs = {step: KVConnectorOutput(tuple(recving), frozenset(invalid))
                        for step, recving, invalid in self.config.kv_connector_outputs or ()}

    @property
    def busy(self) -> bool:
        return (any(self.last_step - start < PENDING_LOAD_STEPS for start in self.pending.values())
                or any(step > self.last_step for step in self.outputs))

    def start_loads(self, step: int, output: SchedulerOutput) -> None:
        for event in output.remote_loads:
            self.pending[event.request_id] = step

    def poll(self, step: int) -> KVConnectorOutput:
        self.last_step = max(self.last_step, step)
        output = self.outputs.get(step, KVConnectorOutput())
        for req_id in output.finished_recving:
            self.pending.pop(req_id, None)
        return output


def make_kv_connector(config: EngineConfig) -> SimulatedKVConnector | RecordedKVConnector | None:
    """The scheduler-side connector ``config`` names (None without one)."""
    if not config.kv_connector:
        return None
    return RecordedKVConnector(config) if config.kv_connector_matches is not None else SimulatedKVConnector(config)


def make_kv_worker(config: EngineConfig, seed: int) -> SimulatedKVWorker | RecordedKVWorker | None:
    """The worker-side connector ``config`` names (None without one)."""
    if not config.kv_connector:
        return None
    return RecordedKVWorker(config, seed) if config.kv_connector_outputs is not None \
        else SimulatedKVWorker(config, seed)
