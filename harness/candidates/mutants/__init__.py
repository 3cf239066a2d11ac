"""Deliberately broken schedulers: each proves that an invariant checker fires.

Every mutant changes one rule of the reference ``Scheduler`` and names the
invariant that must catch it. Select one with ``--engine mutant:NAME`` or
``--candidate mutant:NAME``.

One module per invariant family, as in ``harness/check/``: ``queues``
(queues, admission, preemption, token budget, max_loras, stop rules, a crash), ``blocks`` (KV
blocks and the prefix cache), ``spec_async`` (speculative decoding, async
scheduling and fences, prefill cadence), ``kv_connector`` (remote KV loads),
``encoder`` (encoder budget and cache) and ``progress`` (the progress layer). A new mutant goes into its
family's module and gets one entry in ``MUTANTS_AND_TARGETS`` below (its
order is the kill matrix's). Imports: ``reference`` only.
"""

from __future__ import annotations

from reference.scheduler import Scheduler

from harness.candidates.mutants.queues import (AdmitAfterPreempt, PreemptHead, IgnoreMaxNumSeqs,
                                               NoStopOnMaxTokens, PreemptWaiting, LifoPriorityVictim,
                                               NoGiveBack, BudgetOverrun, IgnoreThreshold,
                                               ReverseRunningOrder, ForgetFinishedIds, AdmissionPreempts,
                                               ResetPreemptsHead, CrashInSchedule, VictimStaysScheduled,
                                               PreemptKeepsDrafts, IgnoreMaxLoras)
from harness.candidates.mutants.blocks import (LeakOnFinish, HitEvictedBlock, LeakOnAbort, DoubleFreeShared,
                                               FreeUnhashedToTail, PreemptKeepsBlock, OverAllocate,
                                               ReuseHeldBlock, ResetWhileHeld, ResetKeepsCache, FreeHeadFirst,
                                               KeepSkippedBlocks, FreeWindowAhead, MambaFreeState,
                                               MambaExtraStateBlock)
from harness.candidates.mutants.spec_async import (DraftsOnPrefill, NoDraftRollback, FreeBeforeFence,
                                                   NoStaleSkip, NoAsyncMaxTokensGuard, IgnorePrefillCadence,
                                                   IgnoreThrottle, StaleSpecOutput)
from harness.candidates.mutants.kv_connector import (FreeWhileLoading, CacheBeforeLoad, NoLoadReservation,
                                                     PromoteEarly)
from harness.candidates.mutants.progress import (SkipRunningTail, AdmitOnePerStep, EagerPreempt,
                                                 PreemptFenced, StopAfterPreempt)
from harness.candidates.mutants.encoder import (IgnoreEncoderBudget, NoEncoderCacheCheck, EvictNewestFirst,
                                                NoEncoderGiveBack)

# Mutant name -> (class, the invariant that must catch it).
MUTANTS_AND_TARGETS: dict[str, tuple[type[Scheduler], str]] = {
    "admit-after-preempt": (AdmitAfterPreempt, "NO-ADMIT-AFTER-PREEMPT"),
    "preempt-head": (PreemptHead, "FCFS-VICTIM-TAIL"),
    "preempt-waiting": (PreemptWaiting, "PREEMPT-ONLY-RUNNING"),
    "lifo-priority-victim": (LifoPriorityVictim, "PRIORITY-VICTIM-MAX"),
    "no-give-back": (NoGiveBack, "SCHEDULED-NOT-PREEMPTED"),
    "victim-stays-scheduled": (VictimStaysScheduled, "SCHEDULED-HAS-DATA"),
    "preempt-keeps-drafts": (PreemptKeepsDrafts, "PREEMPTED-NO-DRAFTS"),
    "leak-on-finish": (LeakOnFinish, "BLOCK-CONSERVATION"),
    "leak-on-abort": (LeakOnAbort, "FREE-WHOLE-TABLE"),
    "free-head-first": (FreeHeadFirst, "FREE-ORDER"),
    "double-free-shared": (DoubleFreeShared, "BLOCK-CONSERVATION"),
    "free-unhashed-to-tail": (FreeUnhashedToTail, "ALLOC-FROM-HEAD"),
    "hit-evicted-block": (HitEvictedBlock, "PREFIX-HIT-RULES"),
    "budget-overrun": (BudgetOverrun, "BUDGET-TOKENS"),
    "ignore-threshold": (IgnoreThreshold, "BUDGET-THRESHOLD"),
    "preempt-keeps-block": (PreemptKeepsBlock, "PREEMPT-EFFECTS"),
    "reverse-running-order": (ReverseRunningOrder, "RUNNING-ORDER"),
    "over-allocate": (OverAllocate, "BLOCKS-EXACT"),
    "reuse-held-block": (ReuseHeldBlock, "BLOCK-EXCLUSIVE"),
    "forget-finished-ids": (ForgetFinishedIds, "FINISHED-IDS"),
    "admission-preempts": (AdmissionPreempts, "WAITING-NEVER-PREEMPTS"),
    "drafts-on-prefill": (DraftsOnPrefill, "SPEC-TOKENS"),
    "no-draft-rollback": (NoDraftRollback, "COMPUTED-CONTINUITY"),
    "free-before-fence": (FreeBeforeFence, "DEFERRED-FREE-FENCED"),
    "no-stale-skip": (NoStaleSkip, "STALE-OUTPUT"),
    "no-async-max-tokens-guard": (NoAsyncMaxTokensGuard, "ASYNC-PLACEHOLDERS"),
    "ignore-prefill-cadence": (IgnorePrefillCadence, "PREFILL-DEFER"),
    "ignore-throttle": (IgnoreThrottle, "PREFILL-DEFER"),
    "ignore-max-num-seqs": (IgnoreMaxNumSeqs, "MAX-NUM-SEQS"),
    "no-stop-on-max-tokens": (NoStopOnMaxTokens, "STOP-RULES"),
    "free-while-loading": (FreeWhileLoading, "REMOTE-KV-ABORT-HOLDS"),
    "cache-before-load": (CacheBeforeLoad, "PREFIX-HIT-RULES"),
    "no-load-reservation": (NoLoadReservation, "REMOTE-KV-RESERVATION"),
    "promote-early": (PromoteEarly, "REMOTE-KV-LOADING"),
    "ignore-encoder-budget": (IgnoreEncoderBudget, "ENCODER-BUDGET"),
    "no-encoder-cache-check": (NoEncoderCacheCheck, "ENCODER-INPUTS"),
    "evict-newest-first": (EvictNewestFirst, "ENCODER-CACHE"),
    "no-encoder-give-back": (NoEncoderGiveBack, "ENCODER-INPUTS"),
    "crash-in-schedule": (CrashInSchedule, "ENGINE-CRASH"),
    # Killed only by scenarios with a reset_prefix_cache action (ACTION_SCENARIOS).
    "reset-while-held": (ResetWhileHeld, "RESET-ONLY-WHEN-FREE"),
    "reset-keeps-cache": (ResetKeepsCache, "HIT-AFTER-RESET"),
    "reset-preempts-head": (ResetPreemptsHead, "RESET-PREEMPTS-RUNNING"),
    "stale-spec-output": (StaleSpecOutput, "SPEC-TOKENS"),
    # The progress layer (harness/check/progress.py): nothing corrupts, progress is lost.
    "skip-running-tail": (SkipRunningTail, "PROGRESS-RUNNING"),
    "admit-one-per-step": (AdmitOnePerStep, "PROGRESS-ADMIT"),
    "eager-preempt": (EagerPreempt, "PROGRESS-PREEMPT-NEEDED"),
    "preempt-fenced": (PreemptFenced, "PROGRESS-PREEMPT-FREES"),
    "stop-after-preempt": (StopAfterPreempt, "PROGRESS-AFTER-PREEMPT"),
    # A hybrid model's sliding window: killed only by the hybrid scenarios (HYBRID_SCENARIOS).
    "keep-skipped-blocks": (KeepSkippedBlocks, "SLIDING-WINDOW-FREE"),
    "free-window-ahead": (FreeWindowAhead, "SLIDING-WINDOW-HELD"),
    # A hybrid model's Mamba groups: killed only by hybrid-mamba (HYBRID_SCENARIOS).
    "mamba-free-state": (MambaFreeState, "MAMBA-STATE-HELD"),
    "mamba-extra-state-block": (MambaExtraStateBlock, "MAMBA-STATE-BLOCKS"),
    # LoRA adapters: killed only by the LoRA scenarios (LORA_SCENARIOS).
    "ignore-max-loras": (IgnoreMaxLoras, "MAX-LORAS"),
}
MUTANTS: dict[str, type[Scheduler]] = {k: v[0] for k, v in MUTANTS_AND_TARGETS.items()}
EXPECTED_INVARIANT: dict[str, str] = {k: v[1] for k, v in MUTANTS_AND_TARGETS.items()}
