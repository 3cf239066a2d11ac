"""Real vLLM 0.33.0 replays a recorded KV connector run (``--candidate vllm@0.33.0``).

The driver's stand-in connector answers ``get_num_new_matched_tokens`` from the trace config's
``kv_connector_matches`` and the engine feeds the recorded ``KVConnectorOutput`` to vLLM's
``update_from_output``: vLLM's own recording (``test_kv_connector_basic[True]``,
``tests/data/vllm-0.33.0-kv-connector-async.jsonl.gz``) replays identical, and the same recording
with an edited answer diverges on vLLM exactly where it does on the reference.
``HARNESS_SKIP_VLLM=1`` skips it.
"""

from __future__ import annotations

import os

import pytest

from tests.test_kv_connector_recorded import _answer, _recording

SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"


@pytest.mark.vllm
@pytest.mark.parametrize("edit, where", [
    (None, None),
    (lambda rs: _answer(rs, "1", [16, True]), (0, "r000001", "block_ids", [3, 4], [3])),
    (lambda rs: _answer(rs, "1", [32, False]), (0, "r000001", "event", "kv_load r000001", "schedule r000001")),
])
def test_vllm_replays_a_recorded_connector_run(tmp_path, edit, where) -> None:
    if SKIP:
        pytest.skip("HARNESS_SKIP_VLLM=1")
    from harness.candidates.resolve import resolve_candidate
    from harness.candidates.vllm.env import is_ready
    from harness.candidates.vllm.recording_convert import convert
    from harness.replay import replay
    from harness.trace import open_trace

    if not is_ready("0.33.0"):
        pytest.skip("no vLLM 0.33.0 env (harness vllm-env 0.33.0)")
    convert(_recording(tmp_path, edit), tmp_path / "rec.parquet")
    divergence, steps = replay(open_trace(tmp_path / "rec.parquet"), resolve_candidate("vllm@0.33.0"))
    if where is None:
        assert (divergence, steps) == (None, 5)
    else:
        assert divergence is not None
        assert (divergence.step, divergence.request, divergence.field, divergence.expected,
                divergence.actual) == where
