"""Recordings of drivers outside EngineCore's protocol (issue 22: vLLM's own unit tests as a corpus).

Without vLLM: the format-2 recording of ``tests/data/vllm-0.32.0-format2.jsonl.gz`` (148 steps,
8 requests) rewritten in format 3 (``test_vllm_recording_formats._to_format3``), then edited the
way vLLM's own tests drive a scheduler: ``schedule()`` twice, ``update_from_output()`` with no
schedule, the running queue edited by hand, an abort between schedule and update at vLLM's timing,
a run stopped with requests live. Each converts to the complete steps before the break, the
footer's ``protocol`` names it, and ``harness check`` claims no end-of-trace rule for it.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.candidates.vllm import recording_convert as rc
from harness.check.checker import check_trace, unjudged_rules
from harness.trace.reader import open_trace
from reference.config import ConfigError, EngineConfig
from tests.test_vllm_recording_formats import _records, _to_format3, _write


def _format3() -> list[dict]:
    return _to_format3(_records())


def _index(records: list[dict], kind: str, n: int) -> int:
    """The list index of the ``n``-th record of ``kind``."""
    return [i for i, r in enumerate(records) if r["t"] == kind][n]


def _convert(tmp_path: Path, records: list[dict]) -> tuple[dict, object]:
    summary = rc.convert(_write(tmp_path / "rec.jsonl", records), tmp_path / "rec.parquet")
    return summary, open_trace(tmp_path / "rec.parquet")


def test_schedule_twice_without_update_keeps_the_complete_steps_before_it(tmp_path: Path) -> None:
    """Regression: the whole recording was refused ("an update is missing or out of order")."""
    records = _format3()
    i = _index(records, "update", 10)  # the 11th step's update: the driver schedules instead
    records[i] = dict(records[i + 1], batch=11) if records[i + 1]["t"] == "schedule" else records[i]
    del records[i + 1:]
    records.append({"t": "end", "steps": 10, "by": "driver"})
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 10
    line = f"line {i + 1}: schedule() called with 1 batch(es) in flight and no update_from_output()"
    assert summary["protocol"].startswith(f"the recorded run left the trace's step protocol at rec.jsonl:{line}")
    assert trace.summary["protocol"] == summary["protocol"]
    result = check_trace(trace)
    assert result.ok and result.steps == 10
    assert any(n.startswith(summary["protocol"]) and "LIVENESS and the end-of-trace checks not run" in n
               for n in result.notes)


def test_update_without_schedule_is_a_protocol_break(tmp_path: Path) -> None:
    records = _format3()
    i = _index(records, "update", 4)
    records.insert(i + 1, dict(records[i]))  # the same update again: no batch in flight
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 5
    assert f"line {i + 2}: update_from_output() without a schedule()" in summary["protocol"]
    assert check_trace(trace).ok


def test_a_hand_built_scheduler_output_is_a_protocol_break(tmp_path: Path) -> None:
    records = _format3()
    i = _index(records, "update", 6)
    records[i]["batch"] = None  # what the recorder writes for an output schedule() did not return
    summary, _ = _convert(tmp_path, records)
    assert summary["steps"] == 6
    assert "no schedule() returned (built by hand)" in summary["protocol"]


def test_a_running_queue_edited_by_hand_is_a_protocol_break(tmp_path: Path) -> None:
    records = _format3()
    # Step 3's schedule sees a running queue in another order than step 2 left it.
    j = _index(records, "schedule", 3)
    prev = records[_index(records, "schedule", 2)]
    running = next(r["after"]["running"] for r in reversed(records[:j])
                   if r["t"] == "schedule" and "running" in r["after"])
    assert len(running) >= 2, prev
    records[j]["before"]["running"] = list(reversed(running))
    summary, _ = _convert(tmp_path, records)
    assert summary["steps"] == 3
    assert f"line {j + 1}: the running queue changed outside schedule() (edited by hand)" in summary["protocol"]


def test_a_request_queued_by_hand_before_the_first_schedule_is_a_protocol_break(tmp_path: Path) -> None:
    """Regression: vLLM 0.29.0's ``test_scheduler_stats_waiting_queues`` puts requests into
    ``skipped_waiting`` by hand before its first ``schedule()``; the recording was refused as a
    whole ("request '3' was never added")."""
    records = _format3()
    j = _index(records, "schedule", 0)
    records[j]["before"]["waiting"] = ["by-hand", *records[j]["before"]["waiting"]]
    summary = rc.convert(_write(tmp_path / "rec.jsonl", records), tmp_path / "rec.parquet")
    assert summary["steps"] == 0
    assert (f"line {j + 1}: request(s) 'by-hand' entered the waiting queue outside schedule() and "
            f"add_request() (by hand: a preemption, a queue edited)") in summary["protocol"]
    records = _format3()
    records[j]["before"]["running"] = ["by-hand"]  # appended to running by hand
    (tmp_path / "b").mkdir()
    summary = rc.convert(_write(tmp_path / "b" / "rec.jsonl", records), tmp_path / "b" / "rec.parquet")
    assert summary["steps"] == 0
    assert f"line {j + 1}: the running queue changed outside schedule()" in summary["protocol"]


def test_an_abort_between_schedule_and_update_at_vllms_timing_ends_the_trace_before_its_step(
        tmp_path: Path) -> None:
    """SCHED_HARNESS_MID_STEP_ABORTS unset (vLLM's behaviour untouched): the abort record says
    mid_step; the trace keeps the steps before it."""
    records = _format3()
    i = _index(records, "schedule", 7)
    rid = records[i]["output"]["num_scheduled_tokens"][0][0]
    records.insert(i + 1, {"t": "abort", "mid_step": True, "status": "FINISHED_ABORTED",
                           "finished": [{"request_id": rid}]})
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 7
    assert "1 request(s) aborted between schedule() and update_from_output()" in summary["protocol"]
    assert check_trace(trace).ok


def test_a_run_stopped_by_the_driver_with_live_requests_claims_no_liveness(tmp_path: Path) -> None:
    records = _format3()
    i = _index(records, "update", 20)
    del records[i + 1:]
    records.append({"t": "end", "steps": 21, "by": "driver"})
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 21
    assert summary["protocol"].startswith("stopped by the driver after step 20 with ")
    result = check_trace(trace)
    assert result.ok and not result.by_invariant
    # Closed by vLLM's shutdown(): the run ended there, LIVENESS is claimed.
    records[-1]["by"] = "shutdown"
    summary, trace = _convert(tmp_path / "b", records)
    assert summary["protocol"] is None
    assert "LIVENESS" in check_trace(trace).by_invariant


def test_unknown_decision_kv_load_converts(tmp_path: Path) -> None:
    """Regression: "unknown decision 'kv_load'" (and 'skip', 'kv_promote')."""
    records = _format3()
    i = _index(records, "schedule", 0)
    rid = records[i]["output"]["num_scheduled_tokens"][0][0]
    records[i]["output"]["events"] += [
        {"type": "skip", "request_id": rid, "reason": "waiting for remote KV"},
        {"type": "kv_load", "request_id": rid, "num_prefix_hit_tokens": 0, "num_external_tokens": 32,
         "block_ids": [3], "reserved_blocks": 0},
        {"type": "kv_promote", "request_id": rid, "status": "WAITING", "num_computed_tokens": 31,
         "load_failed": False, "freed_block_ids": []}]
    rc.convert(_write(tmp_path / "rec.jsonl", records), tmp_path / "rec.parquet")
    rows = [r for r in open_trace(tmp_path / "rec.parquet").iter_steps()][0][1]
    assert [r["kind"] for r in rows if r["kind"] in ("skip", "kv_load", "kv_promote")] == [
        "skip", "kv_load", "kv_promote"]


def test_a_data_parallel_rank_file_is_found_and_converted_as_one_scheduler(tmp_path: Path) -> None:
    """Regression: the recorder writes NAME.dp<rank>.jsonl, which convert(NAME.jsonl) did not find."""
    records = _format3()
    records[0]["vllm_config"].update({"parallel_config.data_parallel_size": 2,
                                      "parallel_config.data_parallel_rank": 0})
    _write(tmp_path / "rec.dp0.jsonl", records)
    assert rc.recording_path(tmp_path / "rec.jsonl") == tmp_path / "rec.dp0.jsonl"
    summary = rc.convert(tmp_path / "rec.jsonl", tmp_path / "rec.parquet")
    assert summary["steps"] == 148
    assert "rank 0 of a data-parallel engine (data_parallel_size 2): converted as one scheduler" in \
        summary["warnings"]
    assert open_trace(tmp_path / "rec.parquet").config.data_parallel_size == 1
    _write(tmp_path / "rec.dp1.jsonl", records)
    with pytest.raises(rc.ConvertError, match=r"one file per rank \(rec.dp0.jsonl, rec.dp1.jsonl\)"):
        rc.recording_path(tmp_path / "rec.jsonl")


def test_a_pool_smaller_than_one_max_model_len_request_is_read_from_a_trace() -> None:
    """Regression: refused, though vLLM's Scheduler accepts it (only the engine's start-up checks)."""
    small = {"num_gpu_blocks": 5, "block_size": 16, "max_model_len": 8192, "max_num_batched_tokens": 8192}
    with pytest.raises(ConfigError, match="needs 512 KV blocks"):
        EngineConfig.from_dict(small)
    assert EngineConfig.from_dict(small, accept_vllm_crash=True).num_gpu_blocks == 5


def test_spec_tokens_allows_zero_to_k_stored_drafts() -> None:
    """Regression: exactly num_speculative_tokens were required; vLLM's n-gram proposer gives fewer
    near the end of the context (its -1 padding stripped)."""
    from harness.check.spec_decode import check_stored_drafts

    found = []
    m = SimpleNamespace(num_spec=3, violate=lambda inv, rid, msg: found.append((inv, rid, msg)))
    decoding = SimpleNamespace(prefill_chunk=False)
    for drafts in ([], [7], [7, 8, 9]):
        assert check_stored_drafts(m, "r0", decoding, drafts)
    assert found == []
    check_stored_drafts(m, "r0", decoding, [1, 2, 3, 4])
    check_stored_drafts(m, "r0", SimpleNamespace(prefill_chunk=True), [1])
    assert [f[2] for f in found] == [
        "stored 4 drafts (num_speculative_tokens 3) while decoding",
        "stored 1 drafts (num_speculative_tokens 3) while prefilling"]


def test_rules_a_feature_keeps_the_model_from_judging_are_skipped_with_a_note(tmp_path: Path) -> None:
    records = _format3()
    records[0]["unmodelled"] = {"kv_cache_groups": "2 KV-cache groups (group 0's blocks recorded)"}
    _, trace = _convert(tmp_path, records)
    skip = unjudged_rules(trace.meta)
    assert sorted(skip) == ["ALLOC-FROM-HEAD", "BLOCK-CONSERVATION", "BLOCK-EXCLUSIVE", "BLOCKS-COVER", "BLOCKS-EXACT",
                            "COMPUTED-CONTINUITY", "FREE-ORDER", "HIT-UNCOMPUTED-BLOCK", "PREFIX-HIT-RULES"]
    result = check_trace(trace)
    assert result.ok
    assert ("BLOCK-CONSERVATION, ALLOC-FROM-HEAD, BLOCKS-COVER, BLOCKS-EXACT, COMPUTED-CONTINUITY, BLOCK-EXCLUSIVE, "
            "FREE-ORDER, PREFIX-HIT-RULES, HIT-UNCOMPUTED-BLOCK: not judged (2 KV-cache groups (group 0's "
            "blocks recorded): the model cannot follow it)") in result.notes
    assert json.loads(json.dumps(unjudged_rules({"vllm_recording": {}}))) == {}


def test_a_complete_prefill_that_samples_no_token_is_a_model_output_fact(tmp_path: Path) -> None:
    """Regression: a hand-made ModelRunnerOutput feeding ``[[]]`` for a prefill that reached the
    end of its prompt (vLLM's own tests; a pooling, encoder-only or diffusion model does the same)
    was reported as OUTPUT-ONLY-COMPLETE "sampled nothing". It is a fact of the model output: the
    trace keeps the steps before that update, the footer names it."""
    records = _format3()
    i = _index(records, "update", 1)  # step 1: r000000 decodes, r000001's 69-token prefill completes
    records[i]["sampled"] = records[i]["sampled"][:1]
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 1
    assert (f"line {i + 1}: the model output samples no token for request 'r000001-95820865', whose "
            f"step reached 69 of its 69 tokens") in summary["protocol"]
    from harness.vllm_tests_report import protocol_kind
    assert protocol_kind(summary["protocol"]) == "model-output-no-token"
    result = check_trace(trace)
    assert result.ok and result.steps == 1


def test_a_partial_prefill_chunk_that_samples_no_token_is_no_break(tmp_path: Path) -> None:
    """The fact is claimed only where the step reached the end of the known tokens: vLLM 0.32.0's
    own recording (every prefill and decode sampled) converts whole, and a chunk of a longer prompt
    that samples nothing is no break."""
    records = _format3()
    summary, _ = _convert(tmp_path, records)
    assert summary["protocol"] is None and summary["steps"] == 148
    i, j = _index(records, "schedule", 1), _index(records, "update", 1)
    ev = next(e for e in records[i]["output"]["events"] if e["request_id"] == "r000001-95820865")
    ev["num_scheduled_tokens"] = 68  # one token short of its 69-token prompt
    records[j]["sampled"] = records[j]["sampled"][:1]
    summary = rc.convert(_write(tmp_path / "b.jsonl", records), tmp_path / "b.parquet")
    assert summary["protocol"] is None and summary["steps"] == 148


def test_eos_at_zero_output_tokens_of_a_request_that_sampled_nothing_converts(tmp_path: Path) -> None:
    """Regression: an encoder-only instance's request finishes FINISHED_STOPPED after its prefill
    with 0 output tokens (no token sampled); the converter read that as an EOS at 0 tokens and
    refused the whole recording. The update that samples nothing is the break; the steps before it
    convert."""
    records = _format3()
    i = _index(records, "update", 1)
    records[i]["sampled"] = records[i]["sampled"][:1]
    records[i]["finished"] = [{"request_id": "r000001-95820865", "status": "FINISHED_STOPPED",
                               "finish_reason": "stop", "stop_reason": None, "num_output_tokens": 0,
                               "freed_block_ids": [], "fence": None}]
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 1 and summary["finished"] == 0
    assert "samples no token for request 'r000001-95820865'" in summary["protocol"]
    assert check_trace(trace).ok


def test_a_request_withdrawn_in_its_schedule_is_not_expected_to_sample(tmp_path: Path) -> None:
    """Regression: a request scheduled and then preempted in the same ``schedule()`` (vLLM's
    priority preemption: a ``withdraw`` event, the request left out of ``num_scheduled_tokens``)
    that sampled nothing was taken for a model output that leaves out a token (0.33.0's
    ``test_priority_scheduling_preemption_and_resumption_when_out_of_kv``, clean before)."""
    records = _format3()
    i, j = _index(records, "schedule", 1), _index(records, "update", 1)
    out = records[i]["output"]
    out["num_scheduled_tokens"] = [p for p in out["num_scheduled_tokens"] if p[0] != "r000001-95820865"]
    out["events"].append({"type": "withdraw", "request_id": "r000001-95820865", "num_scheduled_tokens": 69,
                          "block_ids": [3, 4, 5]})
    records[j]["sampled"] = records[j]["sampled"][:1]
    summary = rc.convert(_write(tmp_path / "rec.jsonl", records), tmp_path / "rec.parquet")
    assert summary["protocol"] is None and summary["steps"] == 148
