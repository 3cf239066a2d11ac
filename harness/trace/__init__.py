"""Traces: the Parquet file every run is recorded to, and the runs that make them.

- ``schema``: columns, event kinds, schema versions, footer keys (pure data).
- ``reader``: ``open_trace`` validates a file (digest, page checksums, types) and streams its steps.
- ``validate``: every step's rows checked against their kind before use.
- ``queues``: the queue snapshots stored as changes (schema 8) and rebuilt.
- ``writer``: ``TraceWriter`` writes crash-safe segments, joins them with the digest, renames.
- ``salvage``: a killed run's complete segments made into a trace.
- ``rows``: ``spec_from_row``, the workload's request from an arrival row.
- ``recorder``: turns engine steps into rows; ``record`` runs a workload to a trace.
- ``playback``: a model runner that replays a trace's recorded tokens.

May import ``reference`` and ``workloads``; never ``harness.check``,
``harness.candidates`` or the tools. The names most callers need are
re-exported here (``from harness.trace import open_trace``).
"""

from harness.trace.reader import Trace, TraceError, open_trace
from harness.trace.schema import (COLUMNS, EVENT_KINDS, METADATA_KEY, READABLE_VERSIONS, SCENARIO_COLUMNS,
                                  SCENARIO_SCHEMA_VERSION, SCHEMA, SCHEMA_VERSION, SUMMARY_KEY)
from harness.trace.writer import TraceWriter

__all__ = ["COLUMNS", "EVENT_KINDS", "METADATA_KEY", "READABLE_VERSIONS", "SCENARIO_COLUMNS",
           "SCENARIO_SCHEMA_VERSION", "SCHEMA", "SCHEMA_VERSION",
           "SUMMARY_KEY", "Trace", "TraceError", "TraceWriter", "open_trace"]
