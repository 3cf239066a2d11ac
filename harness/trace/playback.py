"""The playback runner: re-drives an engine with a trace's recorded model outputs.

A trace recorded with a real model (``harness record --model torch``) holds
what that model produced: each ``output`` row is one batch's sampled tokens
for one request, in execution order, and each ``draft`` row the drafts the
scheduler stored. Greedy decoding makes the token at output index i of a
request a function of the request alone, so concatenating a request's
``output`` rows gives its token stream, and a playback runner that returns
``stream[i]`` wherever the model runner sampled output index i reproduces
the run exactly, without torch. Drafts are looked up by (request, number of
output tokens when they were proposed).

``trace_model(trace)`` says which model a trace used (None: the scripted
model, re-created from the seed as before); ``playback_factory(trace)``
builds the runners (``reference.runners.RunnerFactory``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from harness.paths import arrow_source
from harness.trace import Trace, TraceError
from reference.config import EngineConfig
from reference.runners.scripted import RequestScript
from reference.output import SchedulerOutput
from reference.workload import RequestSpec

# Returned for an output index the trace never recorded (the re-driven engine
# has left the recorded run; the divergence shows it).
UNRECORDED_TOKEN_ID = -1


@dataclass
class RecordedOutputs:
    """A trace's model outputs: ``streams[request_id]`` (every token the
    runner produced, in order) and ``drafts[(request_id, num_output_tokens)]``."""

    streams: dict[str, list[int]] = field(default_factory=dict)
    drafts: dict[tuple[str, int], list[int]] = field(default_factory=dict)


def trace_model(trace: Trace) -> dict[str, Any] | None:
    """The ``model`` metadata of a trace recorded with a real model runner,
    or None for the scripted model."""
    model = trace.meta.get("model")
    return model if isinstance(model, dict) else None


def load_recorded_outputs(trace: Trace) -> RecordedOutputs:
    """Read the ``output`` and ``draft`` rows (file order). Raises TraceError
    when they cannot be read."""
    try:
        table = pq.read_table(arrow_source(trace.path), columns=["kind", "request_id", "token_ids", "spec_token_ids"],
                              filters=[("kind", "in", ["output", "draft"])])
    except Exception as exc:  # noqa: BLE001  (pyarrow raises several types for bad files)
        raise TraceError(f"{trace.path}: cannot read model outputs "
                         f"({' '.join(str(exc).split())[:200]})") from None
    recorded = RecordedOutputs()
    for row in table.to_pylist():
        stream = recorded.streams.setdefault(row["request_id"], [])
        if row["kind"] == "output":
            stream.extend(row["token_ids"] or ())
        else:
            recorded.drafts[(row["request_id"], len(stream))] = list(row["spec_token_ids"] or ())
    return recorded


@dataclass
class _State:
    num_tokens: int
    num_outputs: int = 0


class PlaybackRunner:
    """A ``ModelRunner`` returning recorded tokens.

    Samples exactly where the torch runner samples (the step reaches the end
    of the request's known tokens), verifies drafts greedily against the
    recorded stream, and proposes the recorded drafts. Raises KeyError for a
    request it was never given.
    """

    def __init__(self, recorded: RecordedOutputs) -> None:
        self.recorded = recorded
        self._requests: dict[str, _State] = {}

    def add_request(self, spec: RequestSpec, script: RequestScript | None = None) -> None:
        self._requests[spec.request_id] = _State(len(spec.prompt_token_ids))

    def _token(self, request_id: str, index: int) -> int:
        stream = self.recorded.streams.get(request_id, ())
        return stream[index] if index < len(stream) else UNRECORDED_TOKEN_ID

    def execute(self, output: SchedulerOutput, step: int) -> dict[str, list[int]]:
        for req_id in output.finished_req_ids:
            self._requests.pop(req_id, None)
        sampled: dict[str, list[int]] = {}
        for rec in output.scheduled:
            state = self._requests[rec.request_id]
            drafts = rec.spec_token_ids
            end = rec.num_computed_tokens + rec.num_scheduled_tokens - len(drafts)
            if end < state.num_tokens or rec.num_scheduled_tokens <= len(drafts):
                sampled[rec.request_id] = []
                continue
            tokens: list[int] = []
            for draft in drafts:
                tokens.append(self._token(rec.request_id, state.num_outputs + len(tokens)))
                if tokens[-1] != draft:
                    break
            else:
                tokens.append(self._token(rec.request_id, state.num_outputs + len(tokens)))
            state.num_outputs += len(tokens)
            state.num_tokens += len(tokens)
            sampled[rec.request_id] = tokens
        return sampled

    def batch_done(self, step: int) -> None:
        pass

    def propose_drafts(self, request_ids: list[str], num_speculative_tokens: int,
                       acceptance_rate: float, pattern: str = "random") -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {}
        for req_id in request_ids:
            state = self._requests.get(req_id)
            if state is None:
                continue
            found = self.recorded.drafts.get((req_id, state.num_outputs))
            if found is not None:
                drafts[req_id] = list(found)
        return drafts

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)


def playback_factory(trace: Trace):
    """A runner factory replaying ``trace``'s model outputs (read once)."""
    recorded = load_recorded_outputs(trace)

    def factory(config: EngineConfig, seed: int) -> PlaybackRunner:
        return PlaybackRunner(recorded)
    return factory
