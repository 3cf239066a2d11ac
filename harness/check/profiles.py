"""Semantics profiles: which version-design rules ``harness check`` applies.

The catalogue has three layers (``Invariant.layer``). *Safety* invariants hold
for every correct engine whatever its version, so every profile checks all
of them; *progress* rules too, so every profile but ``safety`` checks them
(``fork``, the fork gate, is safety + progress and nothing of a version). *Semantics* rules are one vLLM version's design (the free-queue
order, the capacity guard, the prefill cadence, the padding of a new
decode, ...): a profile names the ones a version line has, and the knobs of
the shared model (``harness.check.model``) where a release does the same
thing differently (0.20.2 returns every freed block to the tail of the free
queue: the model follows it instead of dropping ALLOC-FROM-HEAD).

``resolve(semantics, meta)`` picks the profile for ``harness check
--semantics auto|safety|fork|VERSION``: ``auto`` reads the trace's metadata
(``engine``, ``engine_version``, ``vllm_semantics``); the reference and its
mutants get the version the reference mirrors, ``vllm@X`` gets X's profile
when one was measured for X, and anything else (an unmeasured release, a
candidate of unknown origin) gets safety only, and the reason says so. A
profile lists the releases it was measured on: a rule is never assumed of a
release nobody ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference.words import did_you_mean

from harness.check.invariants import INVARIANTS, PROGRESS_IDS, SAFETY_IDS, SEMANTICS_IDS
from harness.check.result import PROGRESS, SAFETY

__all__ = ["PROFILES", "Profile", "ProfileError", "resolve"]


class ProfileError(ValueError):
    """An unknown ``--semantics`` value; the message is one line."""


@dataclass(frozen=True)
class Profile:
    """The semantics rules checked on top of every safety invariant.

    ``name``: what ``--semantics`` takes and the report prints ("0.33.0",
    "safety"); ``versions``: the vLLM releases measured to follow it (real
    vLLM through ``harness/candidates/vllm``); ``semantics``: the
    SEMANTICS-layer ids it checks; the model knobs below say how the shared
    model follows that line's design.
    """

    name: str
    versions: tuple[str, ...]
    semantics: frozenset[str]
    #: Freed blocks without a hash (or every block, caching off) go to the
    #: head of the free queue (vLLM 0.33.0 ``BlockPool.free_blocks``); False:
    #: every freed block is appended to the tail (0.20.2).
    free_unhashed_to_head: bool = True
    #: The synchronous scheduler with speculative decoding caches the blocks
    #: completed by accepted tokens at update (vLLM 0.33.0
    #: ``Scheduler.update_from_output``); False: only the AsyncScheduler
    #: caches at update (``_update_request_with_output``, 0.29.0, 0.25.0 and
    #: 0.20.2).
    cache_at_update_with_spec: bool = True
    #: ``prefill_schedule_interval`` also defers prefills locally (without
    #: DP: vLLM 0.33.0 ``Scheduler.schedule``); False: only the DP
    #: coordinator's throttle uses it (0.29.0).
    local_prefill_cadence: bool = True
    #: ``check_stop`` returns "not stopped" while fewer than min_tokens were
    #: generated, before EOS, stop tokens and length are looked at (0.20.2
    #: ``sched/utils.py``, 0.25.0 ``sched/utils.py:100-101``); False: those are
    #: tested first (0.29.0, 0.33.0).
    min_tokens_first: bool = False
    #: FCFS: a preemption victim is prepended to ``waiting`` proper, behind
    #: the requests the waiting loop skipped earlier: vLLM 0.29.0 keeps those
    #: in a separate ``skipped_waiting`` queue (``Scheduler.__init__``,
    #: ``sched/scheduler.py:200``; re-queued after the loop, 1209-1210) that
    #: ``_select_waiting_queue_for_scheduling`` serves first under FCFS
    #: (2240-2242), while ``_preempt_request`` does
    #: ``self.waiting.prepend_request(request)`` (1445); 0.20.2 the same
    #: (``sched/scheduler.py:169, 858-859, 985, 1580-1582``). False: skipped
    #: requests go back to the head of ``waiting`` itself and a victim is
    #: prepended before them (0.33.0 ``sched/scheduler.py:1609-1610``).
    #: PRIORITY needs no knob: both queues are heaps and the selection
    #: compares their heads (0.29.0 2244-2248), i.e. one merged order.
    #: The capacity guard needs none either: 0.29.0's
    #: ``prefill_capacity_bound = bool(self.waiting)`` (1214-1215) counts
    #: the waiting requests not in ``skipped_waiting``, which is 0.33.0's
    #: ``num_waiting > len(deferred_waiting)`` (1615-1616) with the skipped
    #: set the model tracks.
    victims_behind_skipped: bool = False
    #: The progress layer (``harness.check.progress``) is checked: every
    #: profile but ``safety``; it holds for every correct engine.
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(self.semantics - set(SEMANTICS_IDS))
        assert not unknown, f"profile {self.name}: not semantics ids: {unknown}"

    def checks(self, invariant_id: str) -> bool:
        """True if a violation of ``invariant_id`` counts under this profile."""
        layer = INVARIANTS[invariant_id].layer
        return (layer == SAFETY or (layer == PROGRESS and self.progress)
                or invariant_id in self.semantics)

    @property
    def checked(self) -> tuple[str, ...]:
        """Every id this profile checks, in listing order."""
        return tuple(i for i in INVARIANTS if self.checks(i))


_ALL = frozenset(SEMANTICS_IDS)

# The safety invariants only: what every correct engine satisfies.
SAFETY_ONLY = Profile("safety", (), frozenset(), progress=False)
#: The fork gate: safety + progress, no version's design. What a fork of
#: vLLM runs in CI: a deliberate policy change passes, a bug that corrupts
#: or loses progress does not (issue 23).
FORK = Profile("fork", (), frozenset())

#: Profiles by name. 0.33.0 is the reference's: every semantics rule.
PROFILES: dict[str, Profile] = {p.name: p for p in (
    # vLLM 0.33.0, the version the reference mirrors: every semantics rule.
    Profile("0.33.0", ("0.33.0",), _ALL),
    # Measured with bench/semantics_versions.py (real vLLM through the driver and the recording
    # scheduler on every canonical and bug-shape scenario it can run); each difference with its
    # source lines is in the README's "Safety invariants and version semantics".
    # vLLM 0.29.0: no update-time caching in the synchronous scheduler,
    # prefill_schedule_interval only through the DP coordinator, FCFS victims
    # behind the skipped_waiting queue.
    Profile("0.29.0", ("0.29.0",), _ALL,
            cache_at_update_with_spec=False, local_prefill_cadence=False, victims_behind_skipped=True),
    # vLLM 0.25.0: 0.29.0's design but for check_stop, which tests min_tokens
    # first as 0.20.2 does (v1/core/sched/utils.py:100-101; 0.29.0 moved it after
    # EOS, stop tokens and length, utils.py:122). The same as 0.29.0, each
    # pinned by a trace that fires when the knob is flipped
    # (bench/semantics_versions.py --versions 0.25.0): no update-time caching in
    # the synchronous Scheduler.update_from_output, only in
    # AsyncScheduler._update_request_with_output (sched/async_scheduler.py:70-74;
    # spec-decode fires ALLOC-FROM-HEAD with it on); prefill_schedule_interval
    # read only by DPEngineCoreProc._should_throttle_prefills
    # (v1/engine/core.py:1764, 1915-1923; prefill-cadence fires PREFILL-DEFER x73
    # with a local cadence); the throttle and the capacity guard as 0.29.0
    # (scheduler.py:436-438, 1018-1020); unhashed blocks freed to the head
    # (block_pool.py:628-634: `if block.block_hash is None`, and with caching off
    # no block gets a hash: every free goes to the head, as 0.33.0's `or not
    # enable_caching`); FCFS victims behind skipped_waiting (scheduler.py:183,
    # 1014-1015, 1161, 1867-1869; read from the source: no measured trace
    # preempts while a request is skipped); forced-reset victims listed in
    # preempted_req_ids (reset_prefix_cache 2206-2222 preempts from the tail of
    # running; _preempt_request adds each to reset_preempted_req_ids, 1162,
    # which schedule() reports, 1100).
    Profile("0.25.0", ("0.25.0",), _ALL,
            cache_at_update_with_spec=False, local_prefill_cadence=False, min_tokens_first=True,
            victims_behind_skipped=True),
    # vLLM 0.20.2: every freed block to the tail of the free queue, no prefill
    # gating, min_tokens before every other stop test, forced-reset victims
    # not reported in preempted_req_ids.
    Profile("0.20.2", ("0.20.2",), _ALL - {"PREFILL-DEFER", "RESET-PREEMPTS-RUNNING"},
            free_unhashed_to_head=False, cache_at_update_with_spec=False, min_tokens_first=True,
            victims_behind_skipped=True),
    FORK,
    SAFETY_ONLY,
)}


def _measured(version: str) -> Profile | None:
    for profile in PROFILES.values():
        if version in profile.versions:
            return profile
    return None


def resolve(semantics: str, meta: dict[str, Any]) -> tuple[Profile, str]:
    """The profile for ``--semantics`` (``auto``, ``safety`` or a profile
    name) and a one-line reason naming where it came from. ``meta``: the
    trace's footer metadata. Raises ProfileError for an unknown name."""
    if semantics != "auto":
        profile = PROFILES.get(semantics)
        if profile is None:
            hint = did_you_mean(semantics, ["auto", *PROFILES], list_whole=False)
            raise ProfileError(f"unknown semantics {semantics!r}" + (hint or ": expected auto, "
                                                                      + ", ".join(PROFILES)))
        return profile, "chosen with --semantics"
    engine = str(meta.get("engine") or "")
    if engine == "reference" or engine.startswith("mutant:"):
        version = str(meta.get("vllm_semantics") or "")
        who = "the reference" if engine == "reference" else "a mutant of the reference"
        profile = _measured(version)
        if profile is not None:
            return profile, f"{who} mirrors vLLM {version}"
        return SAFETY_ONLY, f"{who} mirrors vLLM {version or '?'}, for which no profile was measured"
    if engine.startswith("vllm@"):
        # engine_version is the version found (vllm@PATH names a path; a
        # scheduler_cls suffix follows a comma); older traces: the spec's.
        version = str(meta.get("engine_version") or engine.split("@", 1)[1].split(",")[0])
        source = meta.get("vllm_source") if isinstance(meta.get("vllm_source"), dict) else {}
        how = f"recorded by vLLM {version}"
        if source.get("python"):
            how += f" at {source['python']}"
        if source.get("git_commit"):
            how += f" (git {str(source['git_commit'])[:12]}{', dirty' if source.get('git_dirty') else ''})"
        if source.get("scheduler_cls"):
            # A Scheduler subclass: held to its base release's semantics, so
            # what it changes is what the check reports.
            how += f" with scheduler_cls {source['scheduler_cls']}"
        profile = _measured(version.split("+", 1)[0])
        if profile is not None:
            return profile, how
        return SAFETY_ONLY, f"{how}: no semantics profile was measured for it"
    return SAFETY_ONLY, f"engine {engine or '?'} is of unknown origin: safety invariants only"


def reference_profile() -> Profile:
    """The profile of the version the reference mirrors (what the reference,
    its mutants and the fuzz are checked under)."""
    import reference

    return PROFILES[reference.VLLM_VERSION]


assert set(SAFETY_IDS).isdisjoint(_ALL) and set(PROGRESS_IDS).isdisjoint(_ALL)
