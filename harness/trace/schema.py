"""The trace schema: one Parquet row per event (docs/trace-format.md).

Column names and types, the event kinds, the schema version this harness
writes and the older ones it still reads, and the footer metadata keys. Pure
data: the reader (``harness.trace.reader``) and writer
(``harness.trace.writer``) both build on it.
"""

from __future__ import annotations

import pyarrow as pa

#: The version every one-group trace is written in: SINGLE_GROUP_SCHEMA
#: (a hybrid model's: HYBRID_SCHEMA_VERSION, all of SCHEMA's columns).
#: Schema 6 = schema 5 (whose scenario columns are now always present, null
#: when unused) plus OBSERVED_COLUMNS and the ``request_state`` event kind:
#: what each step's decisions leave behind, observed rather than assumed.
SCHEMA_VERSION = 8
#: Schema 8 = schema 7 with the queue snapshots stored as changes
#: (QUEUE_DELTA_COLUMNS; harness.trace.queues): the version that first did.
QUEUE_DELTA_SINCE = 8
# Schema 8: a snapshot queue's kept slice of the previous one and the ids before it.
QUEUE_DELTA_COLUMNS = ("waiting_kept", "waiting_head", "running_kept", "running_head")
#: The version that first wrote page checksums and the footer digest
#: (``trace_sha256`` in SUMMARY_KEY, writer.digest_of_file): schema 7 is schema 6's
#: columns and rows with tamper evidence. Older traces are read without it.
DIGEST_SINCE = 7
#: Schema 5: schema 4 plus SCENARIO_COLUMNS (and the ``reset_prefix_cache``
#: event kind); it was written only for runs that used a scenario input.
SCENARIO_SCHEMA_VERSION = 5
# A scenario request's step-indexed inputs (docs/scenario-format.md).
SCENARIO_COLUMNS = ("arrival_step", "after", "abort_step", "output_token_ids", "draft_acceptance_pattern")
# Schema 6: the ids the step's request data carried (schedule_end).
OBSERVED_COLUMNS = ("request_data_ids",)
#: The version a hybrid model's trace (several KV-cache groups: the config's
#: ``sliding_window`` / ``layer_types``) is written in: schema 8 plus
#: GROUP_COLUMNS and the ``skipped_free`` event kind. One-group traces stay
#: schema 8, byte for byte (``schema_for``).
HYBRID_SCHEMA_VERSION = 9
# Schema 9: each KV-cache group's block ids, beside the pool-wide ``block_ids``.
GROUP_COLUMNS = ("group_block_ids",)
#: Older versions this harness still reads, with the schema-4 columns each
#: lacks (read as null); every version below 5 also lacks SCENARIO_COLUMNS,
#: every version below 6 OBSERVED_COLUMNS (and has no ``request_state`` rows).
READABLE_VERSIONS = {3: ("num_external_tokens", "reserved_blocks", "mm_positions", "encoder_input_ids",
                         "free_encoder_mm_hashes"), 4: (), 5: (), 6: (), 7: ()}
#: The version that first recorded the ``request_state`` rows and
#: OBSERVED_COLUMNS (the checks that need them say "not checkable" below it).
OBSERVED_SINCE = 6


def absent_columns(version: int) -> tuple[str, ...]:
    """The columns a trace of ``version`` (a readable one) lacks: they read as null."""
    absent = READABLE_VERSIONS.get(version, ())
    if version < SCENARIO_SCHEMA_VERSION:
        absent += SCENARIO_COLUMNS
    if version < OBSERVED_SINCE:
        absent += OBSERVED_COLUMNS
    if version < QUEUE_DELTA_SINCE:
        absent += QUEUE_DELTA_COLUMNS  # null: every queue stored whole
    if version < HYBRID_SCHEMA_VERSION:
        absent += GROUP_COLUMNS  # null: one KV-cache group
    return absent


def is_hybrid_config(config: dict) -> bool:
    """A trace config (``EngineConfig.to_dict``) naming several attention
    types or a sliding window: its trace is written in schema 9."""
    return config.get("sliding_window") is not None or config.get("layer_types") is not None


def schema_for(meta: dict) -> tuple[int, pa.Schema]:
    """The version and columns a trace with metadata ``meta`` is written in:
    HYBRID_SCHEMA_VERSION with GROUP_COLUMNS for a hybrid model's config,
    SCHEMA_VERSION without them for every other."""
    if is_hybrid_config(meta.get("config") or {}):
        return HYBRID_SCHEMA_VERSION, SCHEMA
    return SCHEMA_VERSION, SINGLE_GROUP_SCHEMA


def rows_as_of(version: int, rows: list[dict]) -> list[dict]:
    """``rows`` (one step's, as this harness writes them) as a trace of
    ``version`` records them: below 6 without ``request_state`` rows and
    with OBSERVED_COLUMNS null (``event_index`` renumbered), so an older
    trace compares equal to a re-recording of the same decisions (replay,
    golden update, diff)."""
    if version >= OBSERVED_SINCE:
        return rows
    blank = dict.fromkeys(OBSERVED_COLUMNS)
    kept = [row for row in rows if row["kind"] != "request_state"]
    return [{**row, **blank, "event_index": i} for i, row in enumerate(kept)]


METADATA_KEY = b"sched_harness"
# Written in the footer when the run ends: {"steps", "events", "stalled"}, plus
# "crashed" (the crash's one line) when the candidate raised.
SUMMARY_KEY = b"sched_harness_summary"

_i32 = pa.int32()
_ids = pa.list_(pa.int32())
_strs = pa.list_(pa.string())

SCHEMA = pa.schema([
    # Where: step number, order inside the step, event kind, request.
    pa.field("step", _i32, nullable=False),
    pa.field("event_index", _i32, nullable=False),
    pa.field("kind", pa.string(), nullable=False),
    # Data-parallel rank whose scheduler the row concerns (0 without DP).
    pa.field("rank", _i32),
    pa.field("request_id", pa.string()),
    # schedule_begin: virtual clock at step start (seconds).
    pa.field("clock_s", pa.float64()),
    # arrival / reject: the request as the workload gave it.
    pa.field("arrival_time_s", pa.float64()),
    pa.field("abort_time_s", pa.float64()),
    pa.field("priority", _i32),
    pa.field("prompt_token_ids", _ids),
    pa.field("max_tokens", _i32),
    pa.field("min_tokens", _i32),
    pa.field("ignore_eos", pa.bool_()),
    pa.field("eos_token_id", _i32),
    pa.field("stop_token_ids", _ids),
    pa.field("scripted_output_len", _i32),
    # schedule / preempt decisions.
    pa.field("schedule_kind", pa.string()),
    pa.field("num_computed_tokens", _i32),
    pa.field("num_scheduled_tokens", _i32),
    pa.field("num_prefix_hit_tokens", _i32),
    pa.field("block_ids", _ids),
    pa.field("spec_token_ids", _ids),
    # output / finish / abort / reject.
    pa.field("token_ids", _ids),
    pa.field("status", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("stop_reason", pa.string()),
    pa.field("num_output_tokens", _i32),
    pa.field("message", pa.string()),
    # Per-step state snapshots (schedule_begin, schedule_end, update_end).
    pa.field("waiting", _strs),
    pa.field("running", _strs),
    pa.field("num_free_blocks", _i32),
    pa.field("token_budget", _i32),
    pa.field("total_num_scheduled_tokens", _i32),
    pa.field("preempted_req_ids", _strs),
    pa.field("finished_req_ids", _strs),
    # Pipelining and deferred frees.
    pa.field("batch_step", _i32),
    pa.field("fence", _i32),
    # Prefill gating: the throttle input (schedule_begin), the decision and
    # the capacity guard after it (schedule_end).
    pa.field("throttle_prefills", pa.bool_()),
    # KV connector (schema 4): external tokens of an async load, and the free
    # blocks it had to leave for in-flight prefills.
    pa.field("num_external_tokens", _i32),
    pa.field("reserved_blocks", _i32),
    pa.field("defer_prefills", pa.bool_()),
    pa.field("prefill_capacity_bound", pa.bool_()),
    # Encoder inputs (schema 4): a request's items as [offset, length] pairs
    # (arrival, reject), the inputs a step encodes for it (schedule,
    # encoder_plan, withdraw) and the encoder-cache entries evicted
    # (schedule_end).
    pa.field("mm_positions", pa.list_(_ids)),
    pa.field("encoder_input_ids", _ids),
    pa.field("free_encoder_mm_hashes", _strs),
    # Scenario inputs (schema 5 only; arrival / reject rows, null when unused):
    # arrive at a step or after another request ended, abort at a step, the
    # tokens fixed for the model to sample, the request's draft acceptance.
    pa.field("arrival_step", _i32),
    pa.field("after", pa.string()),
    pa.field("abort_step", _i32),
    pa.field("output_token_ids", _ids),
    pa.field("draft_acceptance_pattern", pa.string()),
    # Observed outcomes (schema 6): on schedule_end, the ids the step's
    # request data carried (vLLM scheduled_new_reqs, then
    # scheduled_cached_reqs.req_ids), recorded apart from the schedule rows
    # (the keys of num_scheduled_tokens).
    pa.field("request_data_ids", _strs),
    # Queue changes (schema 8; harness.trace.queues): on schedule_begin and
    # schedule_end, waiting = waiting_head + previous waiting[start:start +
    # length] + the ids in ``waiting`` (waiting_kept = [start, length]; null:
    # ``waiting`` is the whole list); running alike. The reader rebuilds the
    # whole lists.
    pa.field("waiting_kept", _ids),
    pa.field("waiting_head", _strs),
    pa.field("running_kept", _ids),
    pa.field("running_head", _strs),
    # KV-cache groups (schema 9, hybrid models only): on every row with
    # ``block_ids`` but free_drain, the same blocks per group, in group order
    # (``kv_cache_groups_for``); an admission's lists are each group's whole
    # table with null blocks (sliding window: before the window) as 0.
    pa.field("group_block_ids", pa.list_(_ids)),
])
COLUMNS = tuple(SCHEMA.names)
#: Schema 8's columns (every one-group trace): SCHEMA without GROUP_COLUMNS.
SINGLE_GROUP_SCHEMA = pa.schema([f for f in SCHEMA if f.name not in GROUP_COLUMNS])

EVENT_KINDS = ("arrival", "reject", "abort", "schedule_begin", "encoder_plan", "schedule", "withdraw",
               "preempt", "skip", "kv_load", "kv_promote", "schedule_end", "update_begin", "free_drain",
               "kv_invalid", "output", "finish", "kv_finished", "kv_free", "draft", "update_end",
               # Schema 5 and later: a scenario action (docs/scenario-format.md).
               "reset_prefix_cache",
               # The candidate raised: the step's last row (status: the call,
               # message: "<Type>: <text>", stop_reason: where, "path:line").
               "crash",
               # Schema 6: what a request holds after schedule() (a request it
               # preempted, or one not running that holds drafts) or after the
               # draft update (one not running that holds drafts).
               "request_state",
               # Schema 9: blocks a sliding-window group freed as they left the
               # window (vLLM remove_skipped_blocks, in allocate_slots).
               "skipped_free")
