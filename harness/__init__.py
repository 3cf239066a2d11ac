"""sched-harness: record, check, replay and diff scheduler step traces.

The repository in layers, each importing only the layers above it in this list:

- ``reference/``: the engine that mirrors vLLM 0.33.0's v1 scheduler and KV-cache
  manager (config, request, queues, block pool, KV-cache manager, encoder cache,
  KV connector, scheduler, engine loop, outputs, the candidate protocol), with
  the model runners in ``reference/runners/``. Imports only the standard library
  (and torch, lazily, in the torch runner).
- ``workloads/``: the request streams (Azure, Mooncake, synthetic); imports
  ``reference`` for the ``Workload`` types.
- ``harness/trace/``: the Parquet trace (schema, writer, reader), the recorder
  and playback; imports ``reference`` and ``workloads``.
- ``harness/check/``: the invariants, checked from a trace alone; imports
  ``reference`` and ``harness.trace``.
- ``harness/candidates/``: the schedulers the harness drives (SPEC resolution,
  the mutants, a ``module:factory`` candidate in its own process in
  ``isolated``, real vLLM in ``vllm/``); imports ``reference`` and ``harness.trace``.
- The tools, one module each, over all of the above: ``replay``, ``diff``,
  ``golden``, ``mutation``, ``fuzz``, ``outputs`` (the torch output oracle),
  ``conformance`` and ``pytest_plugin``; ``corpus`` (``check`` over many
  traces, in a process pool) and ``corpus_ray`` (the same on Ray, the
  ``[ray]`` extra); ``scenarios`` (the canonical scenarios
  they share: a package that loads one scenario file each,
  ``harness/scenarios/*.toml``); ``cli`` (the ``harness`` command's group; each
  command in a ``*_cli`` module: parse, call, print; ``cli_common`` what they
  share), with ``signals`` (how a command ends: SIGINT/SIGTERM, usage errors,
  stray exceptions) and ``paths`` (where ``-o`` may write).

The import rule, enforced by ``tests/test_layout.py``: imports only go downward.
``reference`` never imports ``harness`` or ``workloads``; ``workloads`` never
imports ``harness``; ``harness.trace`` never imports ``harness.check``,
``harness.candidates`` or a tool; ``harness.check`` never imports
``harness.candidates`` or a tool (a verdict depends on the trace alone, not on
which engine made it); ``harness.candidates`` never imports ``harness.check`` or
a tool. Tests, benchmarks, goldens and example traces live outside the packages
(``tests/``, ``bench/``, ``golden/``, ``traces/``).
"""
