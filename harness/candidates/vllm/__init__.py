"""Real vLLM as a candidate.

- ``env``: builds one CPU-only virtual environment per vLLM version
  (``harness vllm-env``), from ``pins.txt``; ``layered``: every other release
  as vLLM alone over one shared dependency layer; ``dedupe``: the files envs
  hold in common (torch, the pins) hard-linked after each build.
- ``driver``: a standalone script run by that environment's Python; it drives
  vLLM's own ``Scheduler`` over JSON lines (stdlib + vLLM only), with its
  ``driver_*`` modules, one vLLM concept each (loaded by ``driver`` from this
  folder): ``driver_engine_core`` (the ``Driver``: the Scheduler built as
  ``EngineCore`` builds it), ``driver_vllm_config`` (our config keys onto
  ``VllmConfig``), ``driver_scheduler_cls``, ``driver_kv_cache_config``,
  ``driver_kv_connector``, ``driver_requests``, ``driver_step`` (schedule,
  update, drafts), ``driver_model_runner_output``, ``driver_platform``,
  ``driver_errors``.
- ``candidate``: ``VLLMCandidate``, the harness-side half of that protocol.
- ``events``: shared normalisation of vLLM's ``SchedulerOutput`` into our
  events (imported by path from the driver and the recording scheduler).
- ``recording_scheduler``: a ``Scheduler`` subclass for ``vllm serve
  --scheduler-cls`` that logs JSON lines; ``recording_convert``: ``convert()``
  of those lines to a trace (in the harness).

``driver`` (and its ``driver_*``), ``events`` and ``recording_scheduler`` import only the standard
library and vLLM (they run inside vLLM's environment); ``candidate`` and
``env`` run in the harness.
"""
