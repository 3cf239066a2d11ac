"""The model-runner interface the engine drives, and the scripted runner behind it.

A model runner plays vLLM's worker (``vllm/v1/worker/gpu_model_runner.py``):
it is told about requests, executes each scheduled step and returns the
sampled token ids, proposes drafts for speculative decoding and forgets
finished requests. The engine builds one runner per data-parallel rank with
a ``RunnerFactory`` (``Engine(config, runner_factory=...)``); without one it
uses the scripted runner (``reference.runners.scripted``), shared by the ranks.

Runners in this project: the scripted runner (decisions only), the torch
paged-attention runner (``reference.runners.torch_runner``, needs torch) and the
playback runner (``harness.trace.playback``: a recorded trace's tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from reference.config import EngineConfig
from reference.runners.scripted import RequestScript, ScriptedModelRunner
from reference.output import SchedulerOutput
from reference.workload import RequestSpec


class ModelRunner(Protocol):
    """What the engine calls on a runner (one per data-parallel rank).

    * ``add_request(spec, script)``: a request arrived (its RequestSpec and
      the scripted model's view of it);
    * ``execute(output, step) -> {request_id: sampled token ids}``: run the
      batch the scheduler decided at engine step ``step``; every scheduled
      request gets an entry (``[]`` for a partial prefill chunk; with drafts,
      the accepted drafts plus one token). Tokens are produced here, at
      launch, even when the batch is processed steps later (pipelining);
    * ``batch_done(step)``: the batch launched at ``step`` completed; the
      engine processes it right after (batches complete in launch order);
    * ``propose_drafts(request_ids, num_speculative_tokens, acceptance_rate,
      pattern) -> {request_id: drafts}`` (``pattern``:
      ``EngineConfig.draft_acceptance_pattern``);
    * ``finish(request_id)``: the request finished or was aborted.
    """

    def add_request(self, spec: RequestSpec, script: RequestScript) -> None: ...

    def execute(self, output: SchedulerOutput, step: int) -> dict[str, list[int]]: ...

    def batch_done(self, step: int) -> None: ...

    def propose_drafts(self, request_ids: list[str], num_speculative_tokens: int,
                       acceptance_rate: float, pattern: str = "random") -> dict[str, list[int]]: ...

    def finish(self, request_id: str) -> None: ...


# (engine config, run seed) -> a runner for one data-parallel rank.
RunnerFactory = Callable[[EngineConfig, int], ModelRunner]


class ScriptedRunnerAdapter:
    """The scripted runner behind the ``ModelRunner`` interface (its own
    methods keep their historical signatures)."""

    def __init__(self, runner: ScriptedModelRunner) -> None:
        self.runner = runner

    def add_request(self, spec: RequestSpec, script: RequestScript) -> None:
        self.runner.add_request(spec.request_id, script)

    def execute(self, output: SchedulerOutput, step: int) -> dict[str, list[int]]:
        return self.runner.execute(output)

    def batch_done(self, step: int) -> None:
        pass

    def propose_drafts(self, request_ids: list[str], num_speculative_tokens: int,
                       acceptance_rate: float, pattern: str = "random") -> dict[str, list[int]]:
        return self.runner.propose_drafts(request_ids, num_speculative_tokens, acceptance_rate, pattern)

    def finish(self, request_id: str) -> None:
        self.runner.finish(request_id)
