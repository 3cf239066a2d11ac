"""Candidates: the schedulers the harness can record, replay and judge.

- ``resolve``: turns a SPEC (``reference``, ``mutant:NAME``, ``vllm@VERSION``,
  ``package.module:factory``) into a factory.
- ``isolated`` and ``isolated_child``: a ``package.module:factory``
  candidate in its own process, each call bounded by ``--step-timeout``.
- ``mutants``: deliberately broken schedulers, one fault each (the mutation
  self-test kills each with its target invariant).
- ``vllm/``: real vLLM as a candidate (its environments, the subprocess driver,
  event normalisation, the ``--scheduler-cls`` recording scheduler).

May import ``reference`` and ``harness.trace``; never ``harness.check`` or the
tools. Nothing is imported here so that ``vllm/`` modules stay importable
inside a vLLM environment that lacks our dependencies.
"""
