"""Views of a trace for people, all drawn from one derivation.

- ``series``: ``derive(trace)`` reads a trace once, checking it on the way,
  and returns the per-step series, per-request records and state spans,
  scheduled chunks and violations every view shows.
- ``html``: the self-contained HTML report (plotly, inlined: works offline).
- ``perfetto``: the Chrome trace-event JSON that ui.perfetto.dev opens.
- ``tables``: the SQL-friendly Parquet tables (steps, scheduled, requests).
- ``files``: atomic writes (temp file + rename).
- ``cli``: ``harness report``, ``harness export`` and the ``--report FILE``
  of check, replay and diff.

A tool package: may import ``harness.check``, ``harness.trace``,
``harness.report``, ``harness.diff`` and ``harness.replay`` (and plotly,
pyarrow, click, rich); nothing below it imports it.
"""
