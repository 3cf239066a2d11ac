"""The invariant catalogue: stable ids, one-line statements, spec sections.

Each id is what ``harness check`` reports; ``harness invariants`` lists them.
The checks themselves live in ``harness.check`` (one streaming pass).
Statements say what must hold, not what vLLM happens to do: where real vLLM
breaks one, that is a finding.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Invariant:
    id: str
    statement: str
    spec: str


INVARIANTS: dict[str, Invariant] = {inv.id: inv for inv in [
    Invariant("ARRIVAL-ADMISSIBLE", "An accepted request has a non-empty prompt shorter than max_model_len (room for one output token) and encoder inputs that fit the encoder cache and compute budget (and, with disable_chunked_mm_input, one step's tokens); a rejected one does not.", "2.3, engine input processor"),
    Invariant("STATE-CONTINUITY", "Queues and counters seen at step start/end follow from the previous step's state and this step's events.", "3.1"),
    Invariant("BUDGET-TOKENS", "total_num_scheduled_tokens = sum of entries <= token budget; every entry > 0; the budget left is consistent.", "8 #1, 10.3"),
    Invariant("BUDGET-THRESHOLD", "With more than one eligible request and long_prefill_token_threshold > 0, no entry exceeds the threshold.", "8 #2, 10.3"),
    Invariant("MAX-NUM-SEQS", "len(running) <= max_num_seqs; a request is admitted only while len(running) < max_num_seqs.", "8 #3, 10.3"),
    Invariant("PREEMPT-ONLY-RUNNING", "Only RUNNING requests in the running queue are preempted.", "4.3, 8 #5"),
    Invariant("NO-ADMIT-AFTER-PREEMPT", "A step that preempted admits nothing from waiting.", "3.1 step 5, 8 #4"),
    Invariant("PREEMPT-EFFECTS", "A preempted request gives back every block it holds, leaves running, and resumes from a fresh prefix lookup (num_computed_tokens reset).", "4.3, 8 #5"),
    Invariant("PREEMPT-WAITING-HEAD", "FCFS: this step's victims sit at the head of waiting in their former running order; PRIORITY: waiting stays in priority order.", "4.4, 8 #11"),
    Invariant("FCFS-VICTIM-TAIL", "FCFS: each victim is the current tail of running.", "4.2, 8 #7"),
    Invariant("PRIORITY-VICTIM-MAX", "PRIORITY: each victim has the largest (priority, arrival_time) among the current running requests.", "4.2, 8 #8"),
    Invariant("PRIORITY-GIVE-BACK", "Only under PRIORITY is a request scheduled earlier in the step withdrawn, exactly its tokens are given back, and it is then preempted; it is absent from the step's output.", "4.2, 8 #9"),
    Invariant("RUNNING-ORDER", "Running requests are scheduled in running-queue order, each at most once per step.", "3.2, 8 #13"),
    Invariant("ADMISSION-ORDER", "Admissions follow waiting-queue order: the admitted requests are the head of waiting, as new (WAITING) or resumed (PREEMPTED).", "3.4, 8 #13-14"),
    Invariant("COMPUTED-CONTINUITY", "num_computed_tokens before a step equals the previous value plus the tokens scheduled since (prefix-hit length at admission).", "3.8, 8 #16"),
    Invariant("SCHEDULED-SPAN", "computed + scheduled <= num_tokens, and <= max_model_len - 1 for running requests.", "3.5, 8 #17"),
    Invariant("PREFIX-HIT-RULES", "A prefix hit is whole blocks, at most num_tokens - 1 tokens, 0 with caching off; hit blocks hold exactly the request's prefix, and the hit is the longest one cached.", "5.6, 8 #29"),
    Invariant("HIT-UNCOMPUTED-BLOCK", "A prefix hit never lands on a block whose KV was never computed, such as one cached at allocation by a chunk that a PRIORITY give-back then withdrew.", "4.2, 5.7 step 10"),
    Invariant("BLOCKS-COVER", "After scheduling, a request's table has exactly ceil((computed + scheduled) / block_size) blocks.", "5.7"),
    Invariant("BLOCK-EXCLUSIVE", "A newly allocated block is held by nobody; a block in two tables is a full, prefix-shared block.", "5.3, 8 #26"),
    Invariant("ALLOC-FROM-HEAD", "New blocks are taken from the head of the free queue, whose order follows from the frees: unhashed (or caching off) blocks to the head, hashed ones to the tail, tail block first.", "5.2, 8 #27-28, 10.7"),
    Invariant("BLOCK-CONSERVATION", "free blocks + distinct held blocks = num_gpu_blocks - 1 (null block excluded).", "5.1, 8 #24"),
    Invariant("FREE-ORDER", "A finished, aborted or preempted request frees exactly its table, tail block first.", "5.2, 5.8"),
    Invariant("OUTPUT-ONLY-COMPLETE", "A request samples exactly one token in a step iff the step reaches the end of its known tokens (none for partial prefill chunks).", "6, 8 #18"),
    Invariant("SPEC-TOKENS", "Drafts are stored only for decoding requests (num_speculative_tokens of them), scheduled only on the positions past num_tokens (the first k pending drafts, never for a prefill chunk), cleared by every scheduling and by preemption; admissions carry none except the -1 padding of a new decode.", "3.2 step 13, 3.4, 4.3, 10.6, 8 #19-20"),
    Invariant("SPEC-ACCEPTANCE", "The model returns the accepted drafts plus one token; rejected drafts roll num_computed_tokens back.", "6 d, 10.8, 8 #21"),
    Invariant("ASYNC-PLACEHOLDERS", "Async scheduling: num_output_placeholders never goes negative, and a request whose in-flight tokens already reach max_tokens is not scheduled again.", "3.2 step 1, 7.3, 8 #38"),
    Invariant("STALE-OUTPUT", "A preempted request whose pre-preemption output is still in flight is skipped, not re-admitted, until that output is delivered; a skip needs that reason.", "10.2, 7.3"),
    Invariant("DEFERRED-FREE-FENCED", "With deferred frees, a request's blocks are freed at once only if no step that writes them is in flight; otherwise they wait behind fence = sched_step_seq, stay unallocatable, and are drained FIFO once processed_step_seq reaches the fence.", "5.10, 8 #34-35"),
    Invariant("PREFILL-DEFER", "defer_prefills = (throttle_prefills or inside the prefill_schedule_interval cadence) and not prefill_capacity_bound and a decode is running; a deferring step runs no prefill chunk and admits no request with more than one token left; the capacity guard is updated only by a waiting phase that ran without deferring.", "7.1, 10.4, 8 #36"),
    Invariant("REMOTE-KV-LOADING", "A request loading remote KV (WAITING_FOR_REMOTE_KVS) is never scheduled, preempted or running, and its loaded blocks are no prefix hit before promotion; it is promoted only after its transfer reported done, to WAITING (PREEMPTED if preempted before) with num_computed_tokens = the loaded prefix (num_tokens - 1 for a whole-sequence load, the valid prefix after a failed one); a failed load under policy 'fail' finishes it with FINISHED_ERROR.", "7.2, 10.2, 8 #37"),
    Invariant("REMOTE-KV-RESERVATION", "An async KV-load admission records, and leaves free, the blocks the in-flight prefills still need for their whole sequence (each plus one spec-decode step) plus one spec-decode step of its own.", "7.2, 8 #37"),
    Invariant("REMOTE-KV-ABORT-HOLDS", "A request finished while its KV load is in flight keeps its blocks until the transfer reports done, then frees exactly its table.", "7.2, 6 step 6"),
    Invariant("ENCODER-BUDGET", "The encoder inputs a step encodes (net of PRIORITY give-back) total at most max_num_encoder_input_tokens embeds, and a withdrawn request gives back exactly the inputs it had scheduled.", "3.2 step 8, 3.3, 4.2"),
    Invariant("ENCODER-INPUTS", "A window's encoder inputs are decided as _try_schedule_encoder_inputs does: every input overlapping a scheduled window is cached (a hit) or encoded in that step, never both; the window stops before the first input that fits neither the encoder budget left (give-back restored) nor the encoder cache (or, with disable_chunked_mm_input, would be split), and only there.", "3.2 step 8, 10.5, 10.6"),
    Invariant("ENCODER-CACHE", "The encoder cache never holds more than encoder_cache_size embeds, evicts unreferenced entries oldest first (listed in free_encoder_mm_hashes), and a request's reference to an input is dropped once its range ends at or before num_computed_tokens - placeholders, at preemption, and at finish.", "4.3, 6 e, 10.8"),
    Invariant("DP-ROUTING", "Data parallelism: each arrival goes to the rank with the fewest unfinished requests (ties: the lowest rank); every row names a valid rank.", "7.1 (engine coordinator)"),
    Invariant("STOP-RULES", "A request finishes exactly when check_stop says so (EOS unless ignore_eos, stop token, length), with that reason; min_tokens never overrides.", "6, 10.8, 8 #22"),
    Invariant("FINISHED-IDS", "preempted_req_ids and finished_req_ids of a step list exactly the requests preempted in it / finished since the previous schedule().", "3.9, 8 #12, #23"),
    Invariant("WAITING-NEVER-PREEMPTS", "Admissions from waiting never preempt: no preemption follows an admission in a step.", "3.4 step 11, 8 #33"),
    Invariant("IDLE-ADMISSION", "With nothing running and requests waiting, a step admits at least one (every accepted request fits an empty engine).", "8 (liveness)"),
    Invariant("NO-PROGRESS", "No two consecutive steps schedule nothing with the same queues and no input in between.", "8 (liveness)"),
    Invariant("LIVENESS", "Every accepted request finishes (stopped, length-capped or aborted) by the end of the trace.", "8"),
]}


def describe(invariant_id: str) -> Invariant:
    """The catalogue entry; KeyError for an unknown id."""
    return INVARIANTS[invariant_id]
