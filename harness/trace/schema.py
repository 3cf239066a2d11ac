"""The trace schema: one Parquet row per event (docs/trace-format.md).

Column names and types, the event kinds, the schema version this harness
writes and the older ones it still reads, and the footer metadata keys. Pure
data: the reader (``harness.trace.reader``) and writer
(``harness.trace.writer``) both build on it.
"""

from __future__ import annotations

import pyarrow as pa

#: The version of a trace whose requests use no scenario input (every golden).
SCHEMA_VERSION = 4
#: The version of a trace whose requests use a scenario input, or whose
#: workload has ``[[actions]]``: schema 4 plus SCENARIO_COLUMNS (and the
#: ``reset_prefix_cache`` event kind). The writer picks the lowest version that holds the run
#: (``TraceWriter(..., scenario_columns=...)``), so a recording without
#: scenario inputs keeps schema 4's bytes: goldens need no re-recording for it.
SCENARIO_SCHEMA_VERSION = 5
# A scenario request's step-indexed inputs (docs/scenario-format.md).
SCENARIO_COLUMNS = ("arrival_step", "after", "abort_step", "output_token_ids", "draft_acceptance_pattern")
#: Older versions this harness still reads, with the schema-4 columns each
#: lacks (read as null); every version below 5 also lacks SCENARIO_COLUMNS.
READABLE_VERSIONS = {3: ("num_external_tokens", "reserved_blocks", "mm_positions", "encoder_input_ids",
                         "free_encoder_mm_hashes")}


def absent_columns(version: int) -> tuple[str, ...]:
    """The columns a trace of ``version`` (a readable one) lacks: they read as null."""
    return READABLE_VERSIONS.get(version, ()) + (() if version == SCENARIO_SCHEMA_VERSION
                                                 else SCENARIO_COLUMNS)
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
])
COLUMNS = tuple(SCHEMA.names)
#: Schema 4: the columns of a trace without scenario inputs.
BASE_SCHEMA = pa.schema([f for f in SCHEMA if f.name not in SCENARIO_COLUMNS])

EVENT_KINDS = ("arrival", "reject", "abort", "schedule_begin", "encoder_plan", "schedule", "withdraw",
               "preempt", "skip", "kv_load", "kv_promote", "schedule_end", "update_begin", "free_drain",
               "kv_invalid", "output", "finish", "kv_finished", "kv_free", "draft", "update_end",
               # Schema 5 only: a scenario action (docs/scenario-format.md).
               "reset_prefix_cache",
               # The candidate raised: the step's last row (status: the call,
               # message: "<Type>: <text>", stop_reason: where, "path:line").
               "crash")
