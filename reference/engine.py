"""The engine loop: a virtual clock, arrivals, aborts, schedule, execute, update.

Plays vLLM's ``EngineCore.step`` (``vllm/v1/engine/core.py``) in synchronous
mode, with the scripted model runner and a virtual clock instead of a GPU:

* a request arrives when the clock passes its ``arrival_time``, or just
  before the ``schedule()`` of step ``arrival_step``, or (``after``) just
  before the ``schedule()`` of the step after the one in which another
  request ended (its update finished it, it was aborted or rejected); a
  step's arrivals are added timed first (by ``(arrival_time, request_id)``),
  then step and ``after`` arrivals in workload (file) order; the input
  processor's checks run first (``vllm/v1/engine/input_processor.py``): an
  empty prompt or one of ``max_model_len`` tokens or more is rejected and
  recorded, never clipped or dropped;
* a request is aborted when the clock passes its ``abort_time``, or just
  before the ``schedule()`` of step ``abort_step`` (after that step's
  arrivals; at arrival if it arrives later);
* a workload's actions (``Action``: a scenario's ``[[actions]]``) apply
  just before the ``schedule()`` of their step, after that step's arrivals
  and request aborts, in workload order: ``abort`` finishes its ids
  (FINISHED_ABORTED, ids already ended ignored), ``reset_prefix_cache``
  calls the candidate's ``reset_prefix_cache`` on every rank. One whose step
  falls in an idle stretch applies at the next step the engine runs (an
  idle engine holds no block and no request: the effect is the same); a
  stuck engine jumps to it like to a step abort. Actions still ahead when
  the last request has ended are not applied;
* steps are numbered 0, 1, ...: one per ``schedule()`` call. A step with
  requests but nothing to schedule still counts, as vLLM 0.33.0's
  ``EngineCore.step`` calls ``schedule()`` whenever
  ``scheduler.has_requests()``; an idle engine (no request, nothing in
  flight) makes no call (``step`` returns early), so while idle the step
  counter jumps straight to the next step arrival (the clock by
  ``step_fixed_s`` per skipped step), as the clock jumps to the next timed
  arrival; an engine stuck with nothing schedulable jumps the same way to
  the next arrival or abort (the skipped steps would schedule nothing).
  Trace step numbers therefore skip idle stretches;
* a step lasts ``step_fixed_s + step_per_token_s * total_num_scheduled_tokens``
  seconds of virtual time;
* a candidate that raises (any BaseException but the user's own interrupt:
  a ``sys.exit`` inside ``schedule()`` is a crash, not an exit; see
  ``reference.guard.Guarded``) or returns a value of the wrong shape ends the run
  in that step: the step's record so far, with its ``crash`` (``Crash``), goes
  to ``on_step`` and ``CandidateCrash`` is raised, as vLLM's ``EngineCore``
  dies on a scheduler exception.

Every step is handed to ``on_step`` as a ``StepRecord`` (the recorder writes
it to the trace).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from reference.async_spec import WorkerDrafts
from reference.config import ConfigError, EngineConfig
from reference.kv_connector import RecordedKVWorker, SimulatedKVWorker, make_kv_worker
from reference.runners.scripted import RequestScript, ScriptedModelRunner
from reference.request import Request, RequestStatus, SamplingParams
from reference.runners.base import ModelRunner, RunnerFactory, ScriptedRunnerAdapter
from reference.candidate import Candidate, CandidateCrash, CandidateError, CandidateFactory, is_user_interrupt
from reference.guard import Guarded as _Guarded
from reference.output import FinishedRequest, PrefixCacheReset, RequestState, SchedulerOutput, UpdateResult
from reference.scheduler import Scheduler
from reference.workload import Action, RequestSpec, Workload


def check_config_supported(config: EngineConfig) -> None:
    """Raise ConfigError for a config no workload can be recorded under: a
    hybrid KV cache (``sliding_window``, ``layer_types`` with more than one
    KV-cache group) together with the simulated KV connector. A recorded
    connector (``kv_connector_matches``: vLLM's own answers) is followed on
    a hybrid KV cache, its loads allocated in every group as vLLM 0.33.0's
    coordinator does (``reference.kv``); failed loads there are not (vLLM
    0.33.0's ``_update_requests_with_invalid_blocks`` reads one group), nor
    loads beside Mamba groups, so a recorded connector reporting invalid
    blocks, or loading with ``linear_attention`` layers, is refused too. The
    scenario loader calls it to name the file and line;
    ``check_workload_supported`` too."""
    if not (config.kv_cache_groups and config.kv_connector):
        return
    if config.kv_connector_matches is None:
        # The simulated worker's loads and failures are drawn for one group.
        raise ConfigError("sliding_window / layer_types (a hybrid KV cache) with kv_connector is not "
                          "modelled: the simulated connector's loads fill one full-attention KV-cache group")
    loads = any(external for _, answers in config.kv_connector_matches for external, _ in answers)
    if loads and "linear_attention" in (config.layer_types or ()):
        # vLLM schedules a load on the least common multiple of every group's
        # block size (kv_cache_utils.resolve_kv_cache_block_sizes): a Mamba
        # group's max_model_len-token blocks change it.
        raise ConfigError("linear_attention (Mamba) layers with a recorded KV connector that loads are not "
                          "modelled (vLLM schedules the load on the groups' common block size)")
    if any(invalid for _, _, invalid in config.kv_connector_outputs or ()):
        raise ConfigError("sliding_window / layer_types (a hybrid KV cache) with a recorded KV connector "
                          "that reports invalid blocks is not modelled (vLLM 0.33.0 handles failed loads "
                          "for one KV-cache group)")


def check_workload_supported(config: EngineConfig, workload: Workload) -> None:
    """Raise ConfigError for a workload this engine cannot run under ``config``.

    A hybrid KV cache (``sliding_window``, ``layer_types``) with the
    simulated KV connector, or a recorded one reporting invalid blocks, is
    refused (``check_config_supported``). A forced reset (an action with
    ``reset_running_requests``) is modelled for a
    synchronous engine only: vLLM also drops in-flight output there and refuses
    while a remote KV load holds blocks. ``Engine.run`` checks it, so a config
    override (``--set``) cannot slip past the scenario loader's own check.
    """
    check_config_supported(config)
    if any(a.reset_running_requests for a in workload.actions) and (
            config.async_scheduling or config.max_concurrent_batches > 1 or config.kv_connector):
        raise ConfigError("reset_running_requests needs a synchronous engine without a KV connector "
                          "(async_scheduling, batches in flight or kv_connector are not supported)")


#: How far a step had got when its candidate raised (``Crash.stage``), in order:
#: taking inputs (arrivals, aborts, actions, the snapshot before scheduling);
#: inside ``schedule()``; after it (the snapshot after); inside
#: ``update_from_output``; after it (the snapshot after, the draft update).
CRASH_STAGES = ("inputs", "schedule", "schedule_end", "update", "update_end")


@dataclass(frozen=True)
class Crash:
    """A candidate's exception inside a step (the trace's ``crash`` row).

    ``call``: the candidate method that raised (``schedule``,
    ``update_from_output``, ``update_draft_token_ids``, ``add_request``, ...);
    ``message``: ``"<ExceptionType>: <text>"``; ``where``: the innermost frame
    of candidate code, ``"path:line"`` (``reference.candidate.crash_site``);
    ``stage``: one of ``CRASH_STAGES`` (which of the step's rows are known);
    ``decisions``: for a crash inside ``schedule()``, the decisions it had
    taken before (``decisions_before_crash``; empty where unknown)."""

    call: str
    exc_type: str
    message: str
    where: str
    stage: str
    decisions: tuple = ()


def decisions_before_crash(exc: BaseException | None) -> tuple:
    """The decisions a reference ``Scheduler.schedule`` (the reference's own,
    or a subclass calling it) had taken when ``exc`` escaped it: its local
    ``events`` list, read from the traceback's frame of that function (or,
    for a candidate in another process, the ``crash_decisions`` attribute
    its proxy set from that process's traceback). Empty for any other
    candidate (its decisions are unknown until it returns)."""
    remote = getattr(exc, "crash_decisions", None)
    if isinstance(remote, tuple):
        return remote  # taken in the candidate's own process (harness.candidates.isolated)
    tb = exc.__traceback__ if exc is not None else None
    while tb is not None:
        if tb.tb_frame.f_code is Scheduler.schedule.__code__:
            events = tb.tb_frame.f_locals.get("events")
            return tuple(events) if isinstance(events, list) else ()
        tb = tb.tb_next
    return ()


class EngineStalled(RuntimeError):
    """A liveness failure: unfinished requests remain but the scheduler
    schedules nothing and no future arrival or abort can change that, or no
    token was sampled for ``2 * max_model_len + 1000`` steps (a livelock)."""


@dataclass
class Rejection:
    """A request refused at arrival by the input processor's checks."""

    spec: RequestSpec
    reason: str


@dataclass
class StepRecord:
    """Everything one engine step saw and decided, in order.

    Inputs: ``arrivals`` (admitted to the scheduler), ``rejections``,
    ``aborts`` (finished by the client before scheduling), ``actions``
    (the workload actions applied before scheduling, in order: an abort
    action's FinishedRequests, a reset's PrefixCacheReset). State before
    scheduling: ``waiting_before``, ``running_before`` (ids, queue order),
    ``num_free_blocks_before``. Decisions: ``output``; then ``waiting_after``,
    ``running_after``, ``num_free_blocks_after_schedule`` (``output`` is None
    when nothing was unfinished) and ``states_after_schedule``: what the
    requests ``output`` preempted, and every request not RUNNING that holds
    draft tokens, hold now (``RequestState``, by id). Update of the oldest
    batch in flight (None while the pipeline fills): ``update_batch_step``
    (the step that scheduled it), its model output ``sampled``, ``update``,
    ``num_free_blocks_after_update``, and ``drafts`` stored for the next
    step (speculative decoding), then ``states_after_drafts``: every request
    not RUNNING that holds draft tokens after that draft update. Both state
    lists stay empty when the candidate's snapshot does not report states.
    In sync mode both parts concern one batch.
    ``clock`` is the virtual time (seconds) at step start.
    """

    step: int
    clock: float
    arrivals: list[RequestSpec] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    aborts: list[FinishedRequest] = field(default_factory=list)
    actions: list[FinishedRequest | PrefixCacheReset] = field(default_factory=list)
    waiting_before: list[str] = field(default_factory=list)
    running_before: list[str] = field(default_factory=list)
    num_free_blocks_before: int = 0
    output: SchedulerOutput | None = None
    waiting_after: list[str] = field(default_factory=list)
    running_after: list[str] = field(default_factory=list)
    num_free_blocks_after_schedule: int = 0
    sampled: dict[str, list[int]] = field(default_factory=dict)
    update: UpdateResult | None = None
    update_batch_step: int | None = None
    num_free_blocks_after_update: int = 0
    drafts: dict[str, list[int]] = field(default_factory=dict)
    states_after_schedule: list[RequestState] = field(default_factory=list)
    states_after_drafts: list[RequestState] = field(default_factory=list)
    rank: int = 0
    peers: list[StepRecord] = field(default_factory=list)  # the other DP ranks' records
    throttle_prefills: bool = False  # the throttle flag passed to schedule()
    crash: Crash | None = None  # the candidate raised in this step (the record stops there)


@dataclass
class _Rank:
    """One data-parallel rank: its scheduler and its batches in flight
    (vLLM EngineCore.batch_queue): (step, output, sampled tokens)."""

    index: int
    sched: _Guarded
    kv_worker: SimulatedKVWorker | RecordedKVWorker | None = None
    in_flight: deque = field(default_factory=deque)
    # Async scheduling with speculative decoding: the worker's drafts.
    worker_drafts: WorkerDrafts | None = None

    @property
    def loading(self) -> bool:
        """KV loads in flight (the rank must keep stepping to report them)."""
        return self.kv_worker is not None and self.kv_worker.busy


@dataclass
class EngineSummary:
    """Totals of one run (counts of requests, steps, tokens)."""

    steps: int = 0
    requests: int = 0
    finished: int = 0
    rejected: int = 0
    aborted: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    scheduled_tokens: int = 0
    draft_tokens: int = 0
    rejected_draft_tokens: int = 0
    remote_kv_loads: int = 0
    failed_kv_loads: int = 0
    clock: float = 0.0
    stalled: str | None = None
    crashed: str | None = None  # the candidate raised: CandidateCrash's one line


def reject_reason(spec: RequestSpec, config: EngineConfig) -> str | None:
    """Why vLLM's input processor would refuse ``spec``, or None.

    vLLM 0.33.0 ``InputProcessor._validate_prompt_len``: an empty prompt, a
    prompt longer than ``max_model_len``, and, for generation, a prompt of
    exactly ``max_model_len`` tokens (no room for one output token); then
    ``_validate_model_input``: an encoder input of more embeds than the
    encoder cache. Also refused, as items vLLM's budgets are sized never to
    meet (``compute_mm_encoder_budget`` raises the compute budget to the
    model's largest item, and with ``disable_chunked_mm_input`` refuses to
    start if that item exceeds ``max_num_batched_tokens``): an item of more
    embeds than the encoder compute budget, and with
    ``disable_chunked_mm_input`` one longer than a step's token budget or
    than ``long_prefill_token_threshold``. Without these it could never be
    scheduled (the last one: never while another request is eligible; vLLM
    accepts it and livelocks once two such requests wait at such an item).
    """
    n = len(spec.prompt_token_ids)
    if n == 0:
        return "empty prompt"
    if n > config.max_model_len:
        return f"prompt of {n} tokens is longer than max_model_len {config.max_model_len}"
    if n == config.max_model_len:
        return (f"prompt of {n} tokens plus at least 1 output token is longer than "
                f"max_model_len {config.max_model_len}")
    step_tokens = min(config.token_budget, config.max_num_batched_tokens)
    if config.long_prefill_token_threshold > 0:
        step_tokens = min(step_tokens, config.long_prefill_token_threshold)
    for i, (_, length) in enumerate(spec.mm_positions):
        if length > config.encoder_cache_capacity:
            return (f"encoder input {i} has {length} embeds, more than the encoder cache size "
                    f"{config.encoder_cache_capacity}")
        if length > config.encoder_compute_budget:
            return (f"encoder input {i} has {length} embeds, more than the encoder compute budget "
                    f"{config.encoder_compute_budget} (max_num_encoder_input_tokens)")
        if config.disable_chunked_mm_input and length > step_tokens:
            return (f"encoder input {i} has {length} tokens, more than a step's {step_tokens} "
                    f"with disable_chunked_mm_input")
    return None


class _Arrivals:
    """When each request of a workload arrives and is aborted (the engine's inputs).

    Three arrival modes (``RequestSpec``): by ``arrival_time`` (the clock
    passes it), by ``arrival_step`` (just before that step's ``schedule()``)
    and ``after`` another request (just before the ``schedule()`` of the step
    after the one in which that request ended: finished by an update, aborted
    or rejected). A step's arrivals are taken in this order: timed ones by
    ``(arrival_time, request_id)`` (every loader's order), then step and
    ``after`` ones in workload order (a scenario's file order). Aborts: timed
    ones by ``(abort_time, request_id)``, stopping at the first whose request
    has not arrived yet (as before step arrivals existed); then step ones
    (``abort_step`` <= step, workload order) of requests that have arrived.
    ``step_fixed_s`` (seconds) is what a skipped empty step would have lasted.
    """

    def __init__(self, workload: Workload, step_fixed_s: float) -> None:
        self.step_fixed_s = step_fixed_s
        order = {spec.request_id: i for i, spec in enumerate(workload.requests)}
        self.timed = sorted((r for r in workload.requests if r.by_time),
                            key=lambda r: (r.arrival_time, r.request_id))
        self.next_timed = 0
        # (arrival_step, workload index, spec), sorted.
        self.stepped = sorted(((r.arrival_step, order[r.request_id], r) for r in workload.requests
                               if r.arrival_step is not None), key=lambda e: e[:2])
        self.next_stepped = 0
        self.after: dict[str, list[RequestSpec]] = {}  # request id -> requests waiting for it to end
        for r in workload.requests:
            if r.after is not None:
                self.after.setdefault(r.after, []).append(r)
        self.released: list[tuple[int, int, RequestSpec]] = []  # (due step, index, spec)
        self.order = order
        self.timed_aborts = sorted((r.abort_time, r.request_id) for r in workload.requests
                                   if r.abort_time is not None)
        self.next_timed_abort = 0
        self.step_aborts = sorted((r.abort_step, order[r.request_id], r.request_id)
                                  for r in workload.requests if r.abort_step is not None)
        self.arrived: set[str] = set()
        self.actions: list[Action] = list(workload.actions)  # not yet applied, file order

    def take_actions(self, step: int) -> list[Action]:
        """The actions due at ``step`` (their step <= it), in workload order."""
        due = [a for a in self.actions if a.step <= step]
        self.actions = [a for a in self.actions if a.step > step]
        return due

    def pending(self) -> bool:
        """Some request has not arrived yet."""
        return (self.next_timed < len(self.timed) or self.next_stepped < len(self.stepped)
                or bool(self.released) or any(self.after.values()))

    def due_now(self, step: int, clock: float) -> bool:
        """Some request arrives at ``step``."""
        return ((self.next_timed < len(self.timed) and self.timed[self.next_timed].arrival_time <= clock)
                or (self.next_stepped < len(self.stepped) and self.stepped[self.next_stepped][0] <= step)
                or any(due <= step for due, _, _ in self.released))

    def take_due(self, step: int, clock: float) -> list[RequestSpec]:
        """The requests arriving at ``step`` (at ``clock`` seconds), in order."""
        due: list[RequestSpec] = []
        while self.next_timed < len(self.timed) and self.timed[self.next_timed].arrival_time <= clock:
            due.append(self.timed[self.next_timed])
            self.next_timed += 1
        by_order: list[tuple[int, RequestSpec]] = []
        while self.next_stepped < len(self.stepped) and self.stepped[self.next_stepped][0] <= step:
            by_order.append(self.stepped[self.next_stepped][1:])
            self.next_stepped += 1
        by_order += [(i, spec) for d, i, spec in self.released if d <= step]
        self.released = [e for e in self.released if e[0] > step]
        due += [spec for _, spec in sorted(by_order, key=lambda e: e[0])]
        self.arrived.update(spec.request_id for spec in due)
        return due

    def ended(self, request_id: str, step: int) -> None:
        """``request_id`` ended in ``step``: its dependents arrive at ``step + 1``."""
        for spec in self.after.pop(request_id, ()):
            self.released.append((step + 1, self.order[spec.request_id], spec))

    def abort_on_arrival(self, request_id: str, step: int) -> None:
        """Abort ``request_id`` (named by an abort action of ``step`` before it arrived) in
        the step it arrives, after that step's arrivals, as an ``abort_step`` would."""
        self.step_aborts.append((step, self.order[request_id], request_id))
        self.step_aborts.sort()

    def take_aborts(self, step: int, clock: float) -> list[str]:
        """The request ids aborted at ``step`` (after its arrivals), in order."""
        out: list[str] = []
        while self.next_timed_abort < len(self.timed_aborts):
            abort_time, req_id = self.timed_aborts[self.next_timed_abort]
            if abort_time > clock or req_id not in self.arrived:
                break  # aborts apply once the request has arrived
            self.next_timed_abort += 1
            out.append(req_id)
        ready = [e for e in self.step_aborts if e[0] <= step and e[2] in self.arrived]
        self.step_aborts = [e for e in self.step_aborts if e not in ready]
        return out + [req_id for _, _, req_id in ready]

    def upcoming(self) -> bool:
        """An arrival or abort is still ahead (something that may unblock a stuck engine)."""
        return (self.pending() or self.next_timed_abort < len(self.timed_aborts) or bool(self.step_aborts)
                or bool(self.actions))

    def waiting_on(self) -> list[str]:
        """Requests still waiting for a request to end (at the end of a run)."""
        return [spec.request_id for specs in self.after.values() for spec in specs]

    def next_event(self, step: int, clock: float, *, stuck: bool) -> tuple[int, float]:
        """The (step, clock) to jump to when nothing arrives now and the engine
        is idle (no request: vLLM's EngineCore makes no ``schedule()`` call)
        or ``stuck`` (requests, but nothing scheduled and nothing changed:
        the skipped steps would schedule nothing). The next timed arrival
        (and, when stuck, timed abort) moves only the clock, as before step
        arrivals existed; the next step arrival (and, when stuck, step abort
        of an arrived request) moves the step counter there and the clock by
        ``step_fixed_s`` per skipped step, whichever comes first in time.
        Raises EngineStalled when there is neither."""
        times = [self.timed[self.next_timed].arrival_time] if self.next_timed < len(self.timed) else []
        if stuck and self.next_timed_abort < len(self.timed_aborts):
            times.append(self.timed_aborts[self.next_timed_abort][0])
        steps = [self.stepped[self.next_stepped][0]] if self.next_stepped < len(self.stepped) else []
        steps += [d for d, _, _ in self.released]
        if stuck:
            steps += [s for s, _, req_id in self.step_aborts if req_id in self.arrived]
            steps += [a.step for a in self.actions]
        if steps:
            target = max(step, min(steps))
            at = clock + self.step_fixed_s * (target - step)
            if not times or min(times) > at:
                return target, at
        if times:
            return step, max(clock, min(times))
        raise EngineStalled(f"step {step}: requests {', '.join(self.waiting_on())} wait on requests "
                            f"that never ended")


class Engine:
    """One candidate scheduler + a model runner, driven by a workload.

    ``candidate_factory(config)`` builds the scheduler (default: the
    reference); see ``reference.candidate`` for the protocol.
    ``runner_factory(config, seed)`` builds one model runner per
    data-parallel rank (``reference.runners.ModelRunner``, e.g. the torch
    runner); default: the scripted runner, shared by the ranks. ``max_steps``
    bounds the run. Anything the candidate raises in a step is re-raised as
    CandidateCrash naming the step and the call (its factory's exception as
    CandidateError, step 0).
    """

    def __init__(self, config: EngineConfig, *, seed: int = 0,
                 candidate_factory: CandidateFactory = Scheduler,
                 runner_factory: RunnerFactory | None = None,
                 max_steps: int = 10_000_000) -> None:
        self.config = config
        # Recorded encoder-input identifiers, per request (config mm_identifiers).
        self._mm_identifiers: dict[str, tuple[str, ...]] = dict(config.mm_identifiers or ())
        # Recorded LoRA adapters, per request (config lora_int_ids).
        self._lora_int_ids: dict[str, int] = dict(config.lora_int_ids or ())
        # Recorded streaming-input sessions (config resumable_request_ids).
        self._resumable: frozenset[str] = frozenset(config.resumable_request_ids or ())
        try:
            # One scheduler (and KV pool) per data-parallel rank.
            self.schedulers: list[Candidate] = [candidate_factory(config)
                                                for _ in range(config.data_parallel_size)]
        except KeyboardInterrupt as exc:
            if is_user_interrupt(exc):
                raise
            raise CandidateError(0, exc) from exc
        except BaseException as exc:  # a factory's sys.exit(0) is a failure too
            raise CandidateError(0, exc) from exc
        for sched in self.schedulers:
            if not callable(getattr(sched, "schedule", None)):
                raise CandidateError(0, TypeError(f"the candidate factory returned {type(sched).__name__}, "
                                                  f"not a scheduler (no schedule() method)"))
        self.seed = seed
        self.runner = ScriptedModelRunner(seed)
        # One runner per rank; rank i's is runners[i].
        self.runners: list[ModelRunner] = (
            [ScriptedRunnerAdapter(self.runner)] * config.data_parallel_size if runner_factory is None
            else [runner_factory(config, seed) for _ in range(config.data_parallel_size)])
        self.max_steps = max_steps
        # A prefill of max_model_len tokens at one token per step, twice over:
        # longer without any sampled token is a livelock, not slowness.
        # (A KV load adds its latency: nothing is sampled while it runs.)
        self.progress_window = 2 * config.max_model_len + 1000 + config.kv_load_steps
        self.summary = EngineSummary()
        self.current_step = 0  # the step being run (named in CandidateError)

    def run(self, workload: Workload,
            on_step: Callable[[StepRecord], None] | None = None) -> EngineSummary:
        """Run ``workload`` to completion. Raises EngineStalled on a livelock,
        CandidateCrash if the candidate raises (after handing ``on_step`` the
        crashed step's record: its rows so far and ``crash``; a call between
        two steps belongs to the next, a record of the crash alone).
        ``summary.crashed`` then holds the crash's one line.
        """
        self._records: list[StepRecord] | None = None  # the step being run, until on_step has it
        self._stage = "inputs"  # how far the crashing rank's step got (CRASH_STAGES)
        try:
            return self._run(workload, on_step)
        except CandidateCrash as crash:
            records = self._records or [StepRecord(step=self.current_step, clock=self.summary.clock, rank=i)
                                        for i in range(len(self.schedulers))]
            crash.at_step(records[0].step)
            crash.stage = self._stage if self._records is not None else "inputs"
            decisions = decisions_before_crash(crash.__cause__) if crash.stage == "schedule" else ()
            records[crash.rank].crash = Crash(crash.call, crash.exc_type, crash.message, crash.where,
                                              crash.stage, decisions)
            self.summary.steps += 1  # the crashed step is in the trace
            self.summary.crashed = str(crash)
            if on_step is not None:
                records[0].peers = records[1:]
                on_step(records[0])
            raise

    def _run(self, workload: Workload, on_step: Callable[[StepRecord], None] | None) -> EngineSummary:
        """The loop of ``run``.

        Data parallelism (``data_parallel_size`` > 1): the ranks step in
        lockstep, each with its own scheduler and KV pool. The coordinator
        routes each arrival to the rank with the fewest unfinished requests
        (ties: the lowest rank) and, with ``prefill_schedule_interval`` > 1,
        passes ``throttle_prefills`` on every step not aligned to it (vLLM's DP
        prefill cadence, spec 7.1). ``on_step`` gets rank 0's record, the
        other ranks' in ``peers``.
        """
        config = self.config
        check_workload_supported(config, workload)
        ranks = [_Rank(i, _Guarded(s, self, i),
                       make_kv_worker(config, self.seed),
                       worker_drafts=(WorkerDrafts() if config.async_scheduling
                                      and config.num_speculative_tokens else None))
                 for i, s in enumerate(self.schedulers)]
        dp_interval = config.prefill_schedule_interval if len(ranks) > 1 else 1
        arrivals = _Arrivals(workload, config.step_fixed_s)
        summary = self.summary = EngineSummary()
        clock = 0.0
        step = 0
        owner: dict[str, _Rank] = {}  # request id -> the rank it was routed to
        last_progress = 0

        def unfinished() -> int:
            return sum(r.sched.get_num_unfinished_requests() for r in ranks)

        def busy() -> bool:
            return bool(unfinished() or any(r.in_flight or r.loading for r in ranks))

        while arrivals.pending() or busy():
            if not busy() and not arrivals.due_now(step, clock):
                # Idle (vLLM's EngineCore makes no schedule() call without
                # requests): jump to the next step arrival, else the next timed one.
                jumped, clock = arrivals.next_event(step, clock, stuck=False)
                if jumped != step:
                    step = last_progress = jumped
            summary.clock = clock
            if step >= self.max_steps:
                raise EngineStalled(f"no completion within {self.max_steps} steps")
            records = [StepRecord(step=step, clock=clock, rank=r.index) for r in ranks]
            self._records, self._stage = records, "inputs"
            self.current_step = step
            for spec in arrivals.take_due(step, clock):
                summary.requests += 1
                reason = reject_reason(spec, config)
                if reason is not None:
                    records[0].rejections.append(Rejection(spec, reason))
                    summary.rejected += 1
                    arrivals.ended(spec.request_id, step)
                    continue
                rank = min(ranks, key=lambda r: (r.sched.get_num_unfinished_requests(), r.index))
                owner[spec.request_id] = rank
                records[rank.index].arrivals.append(spec)
                rank.sched.add_request(self._make_request(spec, clock))
                self.runners[rank.index].add_request(spec, RequestScript(
                    len(spec.prompt_token_ids), spec.scripted_output_len, spec.eos_token_id,
                    spec.output_token_ids, spec.draft_acceptance_pattern))
            for req_id in arrivals.take_aborts(step, clock):
                rank = owner.get(req_id)
                if rank is None:
                    continue  # rejected at arrival
                for fin in rank.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
                    records[rank.index].aborts.append(fin)
                    self.runners[rank.index].finish(req_id)
                    summary.aborted += 1
                    arrivals.ended(req_id, step)
            for action in arrivals.take_actions(step):
                self._apply_action(action, ranks, records, owner, arrivals, summary)

            throttle = dp_interval > 1 and step % dp_interval != 0
            # A batch that ran tokens and is processed this step makes its
            # requests' deferred blocks freeable: a running loop that gave up
            # on such a victim (its free would wait for the fence) may preempt
            # it next step.
            ran_in_flight = any(batch[1].total_num_scheduled_tokens for r in ranks for batch in r.in_flight)
            totals = [self._rank_step(rank, records[rank.index], throttle, summary) for rank in ranks]
            progressed = any((rec.update is not None and (rec.update.new_token_ids or rec.update.finished))
                             or rec.aborts or rec.actions for rec in records)
            if progressed:
                last_progress = step
            elif step - last_progress > self.progress_window:
                raise EngineStalled(
                    f"step {step}: no token sampled and nothing finished for "
                    f"{self.progress_window} steps (livelock)")
            summary.steps += 1
            # Requests waiting on one that ended here arrive at the next step.
            for rec in records:
                for fin in rec.update.finished if rec.update is not None else ():
                    arrivals.ended(fin.request_id, step)
            if on_step is not None:
                records[0].peers = records[1:]
                on_step(records[0])
            self._records = None
            step += 1
            self.current_step = step  # a candidate call before the next step belongs to it

            # Lockstep: the step lasts as long as its busiest rank.
            clock += config.step_fixed_s + config.step_per_token_s * max(totals)
            # Nothing ran and nothing changed (a preemption or a deferred
            # prefill changes what the next step does): only a new arrival or
            # abort can unblock us.
            changed = any(rec.output is not None and (rec.output.preemptions or rec.output.defer_prefills)
                          for rec in records)
            # A KV load in flight, or one just reported done, will change the next step.
            changed |= any(r.loading or (rec.update is not None and rec.update.finished_recving)
                           for r, rec in zip(ranks, records))
            # So will blocks returned by drained deferred frees.
            changed |= any(rec.update is not None and rec.update.drained for rec in records)
            # (Empty batches may sit in flight: they change nothing, unless
            # they carry a KV-connector output: finished or failed loads.)
            working = any(batch[1].total_num_scheduled_tokens or batch[3]
                          for r in ranks for batch in r.in_flight)
            working |= ran_in_flight
            if not any(totals) and not working and not progressed and unfinished() and not changed \
                    and not arrivals.due_now(step, clock):
                if not arrivals.upcoming():
                    raise EngineStalled(
                        f"step {step - 1}: {unfinished()} unfinished "
                        f"requests but nothing scheduled and no arrival or abort ahead")
                # The steps skipped would schedule nothing and change nothing.
                jumped, clock = arrivals.next_event(step, clock, stuck=True)
                if jumped != step:
                    step = last_progress = jumped
        if arrivals.waiting_on():
            raise EngineStalled(f"requests {', '.join(arrivals.waiting_on())} wait on requests "
                                f"that never ended")
        summary.clock = clock
        return summary

    def _apply_action(self, action: Action, ranks: list[_Rank], records: list[StepRecord],
                      owner: dict[str, _Rank], arrivals: _Arrivals, summary: EngineSummary) -> None:
        """Apply one workload action before this step's ``schedule()``; its
        outcome goes to the records' ``actions``."""
        if action.kind == "abort":
            for req_id in action.request_ids:
                if req_id not in arrivals.arrived:
                    # Not arrived yet (a later timed, step or `after` request): it is aborted
                    # when it arrives, as its own abort_step would be.
                    arrivals.abort_on_arrival(req_id, action.step)
                    continue
                rank = owner.get(req_id)
                if rank is None or not rank.sched.has_request(req_id):
                    continue  # rejected at arrival, or already ended
                for fin in rank.sched.finish_requests([req_id], RequestStatus.FINISHED_ABORTED):
                    records[rank.index].actions.append(fin)
                    self.runners[rank.index].finish(req_id)
                    summary.aborted += 1
                    arrivals.ended(req_id, records[0].step)
            return
        # reset_prefix_cache: every rank resets its own pool (vLLM's DP
        # engines each get the utility call).
        for rank in ranks:
            reset = rank.sched.reset_prefix_cache(action.reset_running_requests)
            summary.preemptions += len(reset.preemptions)
            records[rank.index].actions.append(reset)

    def _rank_step(self, rank: _Rank, rec: StepRecord, throttle: bool,
                   summary: EngineSummary) -> int:
        """One rank's share of a step, as vLLM 0.33.0
        ``EngineCore.step_with_batch_queue``: while the rank has requests,
        schedule and launch a batch every step, even an empty one, and
        process the oldest batch only once ``max_concurrent_batches`` are in
        flight; with no request left, process one batch per step until the
        queue drains. Batches are never "done early": the pipeline stays
        full. Returns the tokens scheduled."""
        config, sched, runner = self.config, rank.sched, self.runners[rank.index]
        self._stage = "inputs"  # how far this rank's step got, for a crash (CRASH_STAGES)
        total = 0
        scheduled = False
        # A rank keeps stepping while a KV load is in flight, even with no
        # request left (one aborted while loading waits for its transfer).
        if sched.get_num_unfinished_requests() or rank.loading:
            scheduled = True
            before = sched.snapshot()
            rec.waiting_before, rec.running_before = list(before.waiting), list(before.running)
            rec.num_free_blocks_before = before.num_free_blocks
            rec.throttle_prefills, self._stage = throttle, "schedule"
            output = sched.schedule(throttle) if throttle else sched.schedule()
            rec.output, self._stage = output, "schedule_end"
            after = sched.snapshot()
            rec.waiting_after, rec.running_after = list(after.waiting), list(after.running)
            rec.num_free_blocks_after_schedule = after.num_free_blocks
            rec.states_after_schedule = [s for s in after.request_states or ()
                                         if s.request_id in output.preempted_req_ids or holds_drafts(s)]
            if rank.worker_drafts is None:
                sampled = runner.execute(output, rec.step)
            else:
                # Async scheduling with drafts: the worker fills the -1
                # placeholders with its own drafts and proposes the next ones
                # right after the batch runs (reference.async_spec).
                view = rank.worker_drafts.worker_view(output)
                sampled = runner.execute(view, rec.step)
                proposals = runner.propose_drafts(
                    WorkerDrafts.sampled_ids(view, sampled), config.num_speculative_tokens,
                    config.draft_acceptance_rate, config.draft_acceptance_pattern)
                rank.worker_drafts.after_execute(view, sampled, proposals)
            kv_output = None
            if rank.kv_worker is not None:
                rank.kv_worker.start_loads(rec.step, output)
                kv_output = rank.kv_worker.poll(rec.step)
                summary.remote_kv_loads += len(output.remote_loads)
                # vLLM records prefix-cache stats at every admission, async loads included.
                summary.prefix_hit_tokens += sum(e.num_prefix_hit_tokens for e in output.remote_loads)
                summary.failed_kv_loads += len(kv_output.invalid_block_ids)
            rank.in_flight.append((rec.step, output, sampled, kv_output))
            total = output.total_num_scheduled_tokens
            summary.preemptions += len(output.preemptions)
            summary.prefix_hit_tokens += sum(s.num_prefix_hit_tokens for s in output.scheduled)
            summary.scheduled_tokens += total
        if rank.in_flight and (len(rank.in_flight) >= config.max_concurrent_batches or not scheduled):
            batch_step, batch, rec.sampled, kv_output = rank.in_flight.popleft()
            rec.update_batch_step = batch_step
            runner.batch_done(batch_step)
            self._stage = "update"
            if kv_output is None:
                rec.update = sched.update_from_output(batch, rec.sampled)
            else:
                rec.update = sched.update_from_output(batch, rec.sampled, kv_output)
            self._stage = "update_end"
            rec.num_free_blocks_after_update = sched.snapshot().num_free_blocks
            for fin in rec.update.finished:
                runner.finish(fin.request_id)
            if config.num_speculative_tokens > 0 and rank.worker_drafts is None:
                # Sync scheduling: EngineCore.post_step hands the drafts to the
                # scheduler (never under async scheduling, reference.async_spec).
                finished = {f.request_id for f in rec.update.finished}
                proposals = runner.propose_drafts(
                    [s.request_id for s in batch.scheduled if s.request_id not in finished],
                    config.num_speculative_tokens, config.draft_acceptance_rate,
                    config.draft_acceptance_pattern)
                rec.drafts = sched.update_draft_token_ids(proposals)
                rec.states_after_drafts = [s for s in sched.snapshot().request_states or ()
                                           if holds_drafts(s)]
            summary.finished += len(rec.update.finished)
            summary.draft_tokens += rec.update.num_draft_tokens
            summary.rejected_draft_tokens += rec.update.num_rejected_draft_tokens
        return total

    def _make_request(self, spec: RequestSpec, clock: float) -> Request:
        """The scheduler's Request; a step or ``after`` arrival's
        ``arrival_time`` is the clock when it arrived (vLLM stamps it on
        receipt), a timed one's its spec's."""
        params = SamplingParams(
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            ignore_eos=spec.ignore_eos,
            eos_token_id=spec.eos_token_id,
            stop_token_ids=tuple(spec.stop_token_ids),
        )
        return Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling_params=params,
            arrival_time=spec.arrival_time if spec.by_time else clock,
            priority=spec.priority,
            block_size=self.config.block_size,
            mm_positions=spec.mm_positions,
            mm_identifiers=self._mm_identifiers.get(spec.request_id, ()),
            lora_int_id=self._lora_int_ids.get(spec.request_id, 0),
            resumable=spec.request_id in self._resumable,
        )


def holds_drafts(state: RequestState) -> bool:
    """A request outside the running queue that holds draft tokens: the
    trace records it (a correct scheduler never leaves one)."""
    return state.status != RequestStatus.RUNNING and bool(state.spec_token_ids)
