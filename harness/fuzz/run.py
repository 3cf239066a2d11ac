"""Running a fuzz case and the search: each case runs in memory on the
reference and on the candidate, every invariant is checked
(``harness.check.check_steps``) and, for a candidate other than the
reference, its rows are compared step by step with the reference's
(``harness.replay.first_difference``): ``evaluate``. ``fuzz`` drives
hypothesis over ``fuzz_cases`` until the first failure, which hypothesis
shrinks to a minimal case. The reference's known findings, which the
strategies reach, are recognised by ``known_reference_finding``
(``fuzz(known=...)``, the CLI unless ``--report-known``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hypothesis import HealthCheck, Phase, Verbosity, given, seed as hyp_seed, settings

from reference.config import EngineConfig
from reference.candidate import CandidateCrash, CandidateError, CandidateFactory, CandidateRefused
from reference.engine import EngineStalled
from reference.kv_connector import held_prefix_tokens
from reference.scheduler import Scheduler
from reference.workload import Workload

from harness.check import CheckResult, check_steps
from harness.check.profiles import Profile, reference_profile
from harness.trace.recorder import Row, run_to_rows
from harness.replay import first_difference
from harness.fuzz.strategies import FuzzCase, fuzz_cases, request_subsets

# ----------------------------------------------------------------- evaluation

@dataclass
class Run:
    """One in-memory run: its steps (rows), how it ended, its check result."""

    steps: list[tuple[int, list[Row]]]
    # "" normally, "stalled: ...", "crashed: ...", "refused: ..." (the candidate
    # declined the drawn config: CandidateRefused) or "exception: ..." (the factory)
    ended: str
    result: CheckResult


@dataclass
class Failure:
    """Why a case fails. ``kind``: reference-violation, violation, divergence,
    exception or stall; ``refused`` is no failure: the candidate declined the
    drawn config (``fuzz`` counts it as a skip, never a finding)."""

    kind: str
    message: str
    invariants: dict[str, int] = field(default_factory=dict)
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message, "invariants": self.invariants,
                "step": self.step, **self.details}


class _Prepared(NamedTuple):
    """What every run of one case shares (``evaluate`` runs the reference
    and the candidate on it): the validated config, its dict (what the check
    reads) and the workload (its sha256 is the JSON of the whole case)."""

    config: EngineConfig
    config_dict: dict[str, Any]
    workload: Workload


def _prepare(case: FuzzCase) -> _Prepared:
    """``case``'s config (ConfigError if it is not one), its dict and its workload."""
    config = case.engine_config()
    return _Prepared(config, config.to_dict(), case.workload())


def run_case(factory: CandidateFactory, case: FuzzCase, profile: Profile | None = None) -> Run:
    """Run ``case`` in memory with ``factory``'s scheduler and check the rows
    under ``profile`` (default: the reference's). A stall, a refusal or a
    candidate exception ends the run (``Run.ended``), never raises; a crash
    inside a step is in the rows too (its ``crash`` row: ENGINE-CRASH)."""
    return _run_prepared(factory, case, _prepare(case), profile)


def _run_prepared(factory: CandidateFactory, case: FuzzCase, prepared: _Prepared,
                  profile: Profile | None = None) -> Run:
    """``run_case`` of ``case`` with its config and workload already built (``_prepare``)."""
    steps: list[tuple[int, list[Row]]] = []
    ended = ""
    built: list[Any] = []

    def build(cfg):
        candidate = factory(cfg)
        built.append(candidate)
        return candidate
    try:
        run_to_rows(prepared.workload, prepared.config, seed=case.seed,
                    candidate_factory=factory if isinstance(factory, type) else build,
                    on_step_rows=lambda s, rows: steps.append((s, rows)))
    except EngineStalled as exc:
        ended = f"stalled: {exc}"
    except CandidateCrash as exc:
        ended = f"crashed: {exc}"
    except CandidateError as exc:
        if isinstance(exc.__cause__, CandidateRefused):
            ended = "refused: " + " ".join(str(exc.__cause__).split())
        else:
            ended = f"exception: {exc}"
    finally:
        close_candidates(built)
    return Run(steps, ended, check_steps(prepared.config_dict, steps, profile))


def close_candidates(candidates: list[Any]) -> None:
    """Close each candidate that has ``close()`` (a ``vllm@`` or ``module:factory``
    candidate: its process goes back to the pool, healthy, or is killed).

    ``run_case`` calls it when an example ends, whatever way it ended, so the
    driver is free for the next example at once rather than when the garbage
    collector gets to the candidate: one kept alive past its example (by a
    reference cycle through an exception's traceback, say) would make the
    next example start another driver and import vLLM again (issue 24)."""
    for candidate in candidates:
        close = getattr(candidate, "close", None)
        if callable(close):
            close()


def _violation_failure(kind: str, result: CheckResult) -> Failure:
    first = result.violations[0]
    return Failure(kind, f"{first.invariant} at step {first.step}"
                   + (f", request {first.request}" if first.request else "") + f": {first.message}",
                   dict(result.by_invariant), first.step,
                   {"violations": [v.to_dict() for v in result.violations[:5]]})


def evaluate(factory: CandidateFactory | None, case: FuzzCase,
             profile: Profile | None = None) -> Failure | None:
    """None if ``case`` passes; ``factory`` None or Scheduler means the reference alone.

    ``profile`` (default: the reference's, every rule of the version it
    mirrors): what the candidate's run is checked under. A profile without
    that version's semantics (``safety``, the ``fork`` gate) makes only
    violations, crashes and stalls findings: a decision that differs from the
    reference's is the fork's own policy, never a failure (issue 23). A
    candidate that refuses the drawn config gives ``Failure("refused")``,
    which ``fuzz`` counts as a skip."""
    prepared = _prepare(case)  # once for both runs
    ref = _run_prepared(Scheduler, case, prepared)
    if not ref.result.ok:
        return _violation_failure("reference-violation", ref.result)
    if ref.ended.startswith("exception"):
        return Failure("reference-violation", f"the reference raised: {ref.ended}")
    if factory is None or factory is Scheduler:
        return None
    profile = profile if profile is not None else reference_profile()
    cand = _run_prepared(factory, case, prepared, profile)
    if cand.ended.startswith("refused"):
        return Failure("refused", cand.ended.removeprefix("refused: "))
    if cand.ended.startswith("crashed"):
        # A crash is a violation (ENGINE-CRASH) of the candidate's own trace:
        # its witness is recorded with the candidate, checked, and fails.
        return _violation_failure("violation", cand.result)
    if cand.ended.startswith("exception"):
        return Failure("exception", cand.ended, step=cand.steps[-1][0] + 1 if cand.steps else 0)
    if cand.ended and cand.ended != ref.ended:
        return Failure("stall", cand.ended, dict(cand.result.by_invariant),
                       cand.steps[-1][0] if cand.steps else 0)
    if not cand.result.ok:
        return _violation_failure("violation", cand.result)
    if not compares_decisions(profile):
        return None
    for (rs, rrows), (cs, crows) in zip(ref.steps, cand.steps):
        if rs != cs:
            return Failure("divergence", f"step numbers differ: reference {rs}, candidate {cs}", step=rs)
        d = first_difference(rs, rrows, crows)
        if d is not None:
            return Failure("divergence", f"step {d.step}, event #{d.event_index} ({d.kind or '-'}), "
                           f"request {d.request or '-'}, field {d.field}: expected {d.expected!r}, "
                           f"got {d.actual!r}", step=d.step, details={"divergence": d.to_dict()})
    if len(ref.steps) != len(cand.steps):
        return Failure("divergence", f"reference ran {len(ref.steps)} steps, candidate {len(cand.steps)}",
                       step=min(len(ref.steps), len(cand.steps)))
    return None


def compares_decisions(profile: Profile) -> bool:
    """Whether a run under ``profile`` must also decide as the reference does:
    only under a profile holding the reference's version semantics (the
    safety layer and the fork gate judge the candidate's trace alone)."""
    return bool(profile.semantics) and profile.name == reference_profile().name


# ----------------------------------------------------------------- known findings

#: Reference findings the strategy reaches, each mirroring vLLM 0.33.0 (see
#: ``known_reference_finding`` and the regression tests named).
KNOWN_REFERENCE_FINDINGS = {
    "give-back-uncomputed-hit": "tests/test_finding_give_back_uncomputed_hit.py",
    "priority-tie-preemption-livelock": "tests/regressions/fuzz-finding-priority-tie-preemption-livelock.json",
    "kv-failed-load-wedge": "tests/regressions/fuzz-finding-kv-failed-load-wedge.json",
    "kv-spec-reservation-wedge": "tests/regressions/fuzz-finding-kv-spec-reservation-wedge.json",
}
_WEDGE_INVARIANTS = frozenset({"IDLE-ADMISSION", "LIVENESS", "NO-PROGRESS"})


def known_reference_finding(case: FuzzCase, failure: Failure) -> str | None:
    """The name (a key of ``KNOWN_REFERENCE_FINDINGS``) of the known finding
    ``failure`` is, or None. Only reference violations are findings; each is
    recognised by its invariants and what caused the first of them:

    * ``give-back-uncomputed-hit``: PRIORITY, HIT-UNCOMPUTED-BLOCK only (a
      prefix hit on a block a withdrawn chunk registered but never computed);
    * ``priority-tie-preemption-livelock``: PRIORITY, LIVENESS only, two
      requests with equal priority and arrival time;
    * ``kv-failed-load-wedge``: KV connector, IDLE-ADMISSION (plus LIVENESS /
      NO-PROGRESS at most), and the first request not admitted was just
      promoted from a load that failed with nothing valid: its new load must
      leave the reservation of ``_inflight_prefills``, which still holds the
      request itself (and finished loads queued behind it), so it waits,
      until something else frees blocks or forever;
    * ``kv-spec-reservation-wedge``: KV connector and speculative decoding,
      the same invariants, and the first request not admitted never ran: its
      held prefix plus one speculative step of blocks (the async-load
      reservation) is more than the whole pool, so it is never admitted.
    """
    if failure.kind != "reference-violation":
        return None
    invariants = set(failure.invariants)
    config = case.config
    if invariants == {"HIT-UNCOMPUTED-BLOCK"} and config["policy"] == "priority":
        return "give-back-uncomputed-hit"
    if invariants == {"LIVENESS"} and config["policy"] == "priority":
        keys = [(r.priority, r.arrival_time) for r in case.requests]
        return "priority-tie-preemption-livelock" if len(set(keys)) < len(keys) else None
    if not (config.get("kv_connector") and "IDLE-ADMISSION" in invariants
            and invariants <= _WEDGE_INVARIANTS):
        return None
    result = run_case(Scheduler, case).result
    first = next(v for v in result.violations if v.invariant == "IDLE-ADMISSION")
    if first.history and first.history[-1].endswith("promoted (load failed): 0 computed tokens"):
        return "kv-failed-load-wedge"
    spec = config.get("num_speculative_tokens", 0)
    request = next((r for r in case.requests if r.request_id == first.request), None)
    if spec and request is not None and len(first.history) == 1 and ": arrived," in first.history[0]:
        bs = config["block_size"]
        held = held_prefix_tokens(request.prompt_token_ids, bs, config.get("kv_store_fraction", 1.0))
        if held and -(-held // bs) + -(-(1 + spec) // bs) > config["num_gpu_blocks"] - 1:
            return "kv-spec-reservation-wedge"
    return None


# ----------------------------------------------------------------- the search

class _StopFuzz(BaseException):
    """Raised inside the property to end generation when the time budget is spent.

    A BaseException, not an Exception: hypothesis takes an Exception for a
    failure and shrinks it, calling the property again and again after the
    budget was spent (the ``--time-budget`` overshoot, issue 16); a
    BaseException (like KeyboardInterrupt) leaves it at once."""


class _Found(AssertionError):
    pass


#: Seconds shrinking may take after the first failure (``fuzz``'s
#: ``shrink_budget_s``; ``harness fuzz --shrink-budget``): every shrink step
#: against a hanging candidate waits out its step timeout (issue 26: 30
#: examples did not finish in 300 s).
SHRINK_BUDGET_S = 120.0


class _Deadline:
    """When the search must end (``time.monotonic()``; None: no bound yet),
    and the candidate factory bounded by it: a candidate in its own process
    (one with a ``step_timeout``: ``module:factory``, ``vllm@``) gets at most
    what is left, so one hanging call cannot overrun the budget (by more than
    ``_MIN_CALL_S``)."""

    def __init__(self, factory: CandidateFactory | None) -> None:
        self.at: float | None = None
        self._factory = factory

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def factory(self) -> CandidateFactory | None:
        if self._factory is None or isinstance(self._factory, type):
            return self._factory  # the reference and the mutants: in this process, never timed
        inner = self._factory

        def bounded(config):
            candidate = inner(config)
            left = self.left()
            if left is not None and getattr(candidate, "step_timeout", None) is not None:
                candidate.step_timeout = max(_MIN_CALL_S, min(candidate.step_timeout, left))
            return candidate
        # What a factory describes of itself (trace metadata, a label) stays visible.
        bounded.__dict__.update({k: v for k, v in getattr(inner, "__dict__", {}).items()
                                 if not k.startswith("__")})
        return bounded


#: The least a bounded candidate call is given (seconds).
_MIN_CALL_S = 1.0


@dataclass
class FuzzResult:
    """Outcome of ``fuzz``: examples generated, wall seconds, the minimal
    failing case and its failure (None when nothing was found), shrinking
    runs, and whether generation stopped on the time budget."""

    examples: int
    elapsed_s: float
    case: FuzzCase | None = None
    failure: Failure | None = None
    shrink_calls: int = 0
    budget_exhausted: bool = False
    #: Generated examples passed over as known reference findings (``fuzz``'s
    #: ``known``), by name.
    known: dict[str, int] = field(default_factory=dict)
    #: Generated examples the candidate refused to run (a config it cannot
    #: take, e.g. async scheduling for a plain Scheduler subclass): skips,
    #: never findings; ``refusal``: the first one's reason.
    refused: int = 0
    refusal: str = ""
    #: The signal (SIGINT: Ctrl-C, or SIGTERM) that ended the search after a
    #: failure was found: ``case`` is the smallest failing one so far (the
    #: shrinking was cut short, or never started); None otherwise.
    interrupted: int | None = None

    @property
    def found(self) -> bool:
        """True if a failing case was found (``case``/``failure`` are set)."""
        return self.failure is not None


def fuzz(factory: CandidateFactory | None, *, max_examples: int = 200, seed: int = 0,
         time_budget_s: float | None = None, shrink_budget_s: float | None = SHRINK_BUDGET_S,
         on_example: Callable[[int, bool], None] | None = None,
         known: Callable[[FuzzCase, Failure], str | None] | None = None,
         base: FuzzCase | None = None, async_spec: bool = False,
         profile: Profile | None = None, hybrid: bool = False) -> FuzzResult:
    """Search for a failing case; deterministic for a given ``seed`` (no
    database, no deadline). On a failure hypothesis shrinks it and the
    returned ``case`` is the minimal one. ``max_examples`` (>= 1) bounds the
    generated examples, ``time_budget_s`` (seconds of wall time, None: no
    limit) the whole search, generation and shrinking: a failure found when
    it runs out is returned as far as it was shrunk; ``shrink_budget_s``
    (seconds from the first failure, None: no limit) bounds shrinking on its
    own. A candidate in its own process gets at most the time left for each
    call, so a hanging candidate ends the search within its budget (issue 26).
    A KeyboardInterrupt (Ctrl-C; the harness's SIGINT/SIGTERM handler raises
    ``UserInterrupt``) once a failure is known ends the search with it: the
    smallest failing case so far, ``FuzzResult.interrupted`` the signal;
    before that, it propagates.
    ``on_example(n, shrinking)`` is called after each example, ``n`` the
    examples generated so far. ``factory`` None means the reference alone.
    ``known`` (e.g. ``known_reference_finding``): a case whose failure it
    names is passed over as a known finding (counted in ``FuzzResult.known``)
    instead of ending the search; None (the default, and the CLI's) reports
    every failure. ``base`` (``harness fuzz --scenario``): instead of generated
    scenarios, subsets of ``base``'s requests (``request_subsets``), ``base``
    itself tried first, so a failure shrinks to the fewest requests that
    still fail. ``async_spec``: only async scheduling with speculative
    decoding (``fuzz_cases(async_spec=True)``; ignored with ``base``).
    ``hybrid``: only hybrid models' KV caches, sliding-window and Mamba
    groups beside full attention (``fuzz_cases(hybrid=True)``; ignored with
    ``base``).
    ``profile``: what the candidate is checked under (``evaluate``). A case
    the candidate refuses is counted (``FuzzResult.refused``), never a finding.
    A factory with a ``prestart()`` (``vllm@``: its driver processes) has it
    called first, so the candidate's processes start while hypothesis draws
    and the reference runs the first example; a prestart that fails is left
    to the first candidate to meet."""
    start = time.monotonic()
    prestart = getattr(factory, "prestart", None)
    if callable(prestart):
        try:
            prestart()
        except Exception:  # noqa: BLE001 - the first candidate built reports it, as without prestart
            pass
    state = {"n": 0, "found": False, "last": None, "shrink": 0, "stopped": False, "refused": 0,
             "refusal": ""}
    known_counts: dict[str, int] = {}
    deadline = _Deadline(factory)
    if time_budget_s is not None:
        deadline.at = start + time_budget_s
    factory = deadline.factory()

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
              phases=[Phase.generate, Phase.shrink], print_blob=False, verbosity=Verbosity.quiet)
    @hyp_seed(seed)
    @given(fuzz_cases(async_spec, hybrid) if base is None else request_subsets(base))
    def prop(case: FuzzCase) -> None:
        if deadline.passed():
            state["stopped"] = True
            raise _StopFuzz()
        if state["found"]:
            state["shrink"] += 1
        else:
            state["n"] += 1
        failure = evaluate(factory, case, profile)
        if failure is not None and failure.kind == "refused":
            if not state["found"]:
                state["refused"] += 1
                state["refusal"] = state["refusal"] or failure.message
            failure = None
        if failure is not None and known is not None:
            name = known(case, failure)
            if name is not None:
                failure = None
                if not state["found"]:
                    known_counts[name] = known_counts.get(name, 0) + 1
        if on_example is not None:
            on_example(state["n"], state["found"])
        if failure is not None:
            if not state["found"] and shrink_budget_s is not None:
                end = time.monotonic() + shrink_budget_s
                deadline.at = end if deadline.at is None else min(deadline.at, end)
            state["found"] = True
            state["last"] = (case, failure)
            raise _Found(failure.message)

    # The whole scenario is tried first, outside hypothesis (an explicit example would
    # not be shrunk); if no generated subset fails, it is the witness, unshrunk.
    base_failure = evaluate(factory, base, profile) if base is not None else None
    if base_failure is not None and base_failure.kind == "refused":
        state["refused"] += 1
        state["refusal"] = base_failure.message
        base_failure = None
    if base_failure is not None and known is not None and known(base, base_failure) is not None:
        base_failure = None

    def done(result: FuzzResult) -> FuzzResult:
        result.refused, result.refusal = state["refused"], state["refusal"]
        return result

    try:
        prop()
    except _StopFuzz:
        if state["found"]:  # the budget ran out while shrinking: the smallest failure so far
            case, failure = state["last"]
            return FuzzResult(state["n"], time.monotonic() - start, case, failure, state["shrink"], True,
                              known_counts)
        if base_failure is not None:
            return done(FuzzResult(state["n"] + 1, time.monotonic() - start, base, base_failure, 0, True,
                                   known_counts))
        return done(FuzzResult(state["n"], time.monotonic() - start, budget_exhausted=True,
                               known=known_counts))
    except _Found:
        case, failure = state["last"]
        return done(FuzzResult(state["n"], time.monotonic() - start, case, failure, state["shrink"],
                               state["stopped"], known_counts))
    except KeyboardInterrupt as exc:
        # Ctrl-C (or SIGTERM: the harness's handler raises UserInterrupt) once a
        # failure is known keeps it: each shrink step that fails replaces
        # state["last"] only after its whole run, so it is the smallest failing
        # case so far (or base's, unshrunk). Nothing found yet: the interrupt goes on.
        signum = getattr(exc, "signum", signal.SIGINT)
        if state["found"]:
            case, failure = state["last"]
            return done(FuzzResult(state["n"], time.monotonic() - start, case, failure, state["shrink"],
                                   False, known_counts, interrupted=signum))
        if base_failure is not None:
            return done(FuzzResult(state["n"] + 1, time.monotonic() - start, base, base_failure, 0, False,
                                   known_counts, interrupted=signum))
        raise
    if base_failure is not None:
        return done(FuzzResult(state["n"] + 1, time.monotonic() - start, base, base_failure, 0, False,
                               known_counts))
    return done(FuzzResult(state["n"], time.monotonic() - start, known=known_counts))


def fuzz_profile(semantics: str) -> Profile | None:
    """The profile ``harness fuzz --semantics`` names: None for ``auto`` (the
    reference's, with the decisions compared), else the named profile
    (``safety``, ``fork``, a release). Raises ProfileError for an unknown name."""
    if semantics == "auto":
        return None
    from harness.check.profiles import resolve

    return resolve(semantics, {})[0]
