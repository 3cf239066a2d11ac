"""A KV connector's traces are judged, not skipped (issue 22).

A vLLM recording whose connector answers were recorded (config
``kv_connector_matches`` / ``kv_connector_outputs``) is followed by the
checker's model: the external tokens of each admission (synchronous: counted
as computed at once; asynchronous: a ``kv_load`` into WAITING_FOR_REMOTE_KVS),
the loads' reports and promotions, and a skip while the connector cannot tell
yet. So the block rules (BLOCK-CONSERVATION, ALLOC-FROM-HEAD, BLOCKS-COVER,
COMPUTED-CONTINUITY, BLOCK-EXCLUSIVE, FREE-ORDER, PREFIX-HIT-RULES,
HIT-UNCOMPUTED-BLOCK) and the REMOTE-KV-* rules run on them
(``harness.check.checker.unjudged_rules``). A recording without the answers
keeps them skipped, with the note naming the connector.

The recordings are vLLM 0.33.0's own tests under the recorder (``harness
vllm-tests 0.33.0 --files tests/v1/core/test_scheduler.py -k connector``):
``vllm-0.33.0-kv-connector-async.jsonl.gz`` is test_kv_connector_basic[True]
(two 64-token requests, MockKVConnector answering 32 tokens, async);
``vllm-0.33.0-kv-connector-sync-preempt.jsonl.gz`` is
test_kv_connector_handles_preemption[False-None-False-False] (block size 2,
6 usable blocks, MockKVConnector answering 2 tokens, synchronous; request 1 is
preempted and resumes with a 4-token local hit plus 2 external tokens);
``vllm-0.33.0-kv-producer-sending.jsonl.gz`` is
tests/v1/kv_connector/unit/test_remote_decode_lifecycle.py::test_basic_lifecycle
(a producer: its free delayed until finished_sending, which stays unjudged). Each
is checked clean as recorded, then broken one field at a time (a deliberately
wrong engine): the rule that catches it fires with an exact witness. The
last test runs the selection in vLLM 0.33.0's env (``HARNESS_SKIP_VLLM=1``
skips it).
"""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from harness.check.checker import check_trace, unjudged_rules
from harness.check.invariants import RECORDED_CONNECTOR_UNJUDGED, UNMODELLED_RULES
from harness.trace import open_trace
from harness.trace.recorder import record

DATA = Path(__file__).with_name("data")
ASYNC = DATA / "vllm-0.33.0-kv-connector-async.jsonl.gz"
SYNC = DATA / "vllm-0.33.0-kv-connector-sync-preempt.jsonl.gz"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"

CONNECTOR_RULES = ("BLOCK-CONSERVATION, ALLOC-FROM-HEAD, BLOCKS-COVER, BLOCKS-EXACT, COMPUTED-CONTINUITY, BLOCK-EXCLUSIVE, "
                   "FREE-ORDER, PREFIX-HIT-RULES, HIT-UNCOMPUTED-BLOCK, REMOTE-KV-LOADING, "
                   "REMOTE-KV-RESERVATION, REMOTE-KV-ABORT-HOLDS")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def _trace(tmp_path: Path, records: list[dict]):
    from harness.candidates.vllm.recording_convert import convert

    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    convert(src, tmp_path / "rec.parquet")
    return open_trace(tmp_path / "rec.parquet")


def _event(records: list[dict], step: int, kind: str, req_id: str) -> dict:
    return next(e for r in records if r.get("t") == "schedule" and r["step"] == step
                for e in r["output"]["events"] if e["type"] == kind and e["request_id"] == req_id)


def _update(records: list[dict], step: int) -> dict:
    return next(r for r in records if r.get("t") == "update" and r["step"] == step)


def _witnesses(result) -> list[tuple]:
    return [(v.step, v.invariant, v.request, v.message) for v in result.violations]


# -- correct vLLM: judged, clean -----------------------------------------------------------------
def test_the_connector_rules_are_judged_when_its_answers_were_recorded(tmp_path: Path) -> None:
    # (Empty: harness.trace.reader's Trace.incomplete counts such a trace a whole pass.)
    assert RECORDED_CONNECTOR_UNJUDGED == ()
    trace = _trace(tmp_path, _records(ASYNC))
    assert trace.meta["vllm_recording"]["unmodelled"] == {"kv_connector": "a KV connector (MockKVConnector)"}
    assert unjudged_rules(trace.meta) == {}
    result = check_trace(trace)
    assert result.ok and not any("not judged" in n for n in result.notes)
    assert (result.steps, result.finished, result.remote_kv_loads, result.failed_kv_loads, result.events) == (
        5, 2, 2, 0, 44)


def test_synchronous_external_tokens_are_counted_at_admission(tmp_path: Path) -> None:
    """r000001 resumes at step 4 with num_computed_tokens 6: a 4-token local
    hit (blocks 4, 5) plus the connector's 2 synchronous external tokens
    (block 6), and block 3 for the token it computes."""
    trace = _trace(tmp_path, _records(SYNC))
    assert trace.config.kv_connector_matches == (("r000000", ((2, False),)),
                                                 ("r000001", ((2, False), (2, False), (2, False))))
    assert unjudged_rules(trace.meta) == {} and trace.incomplete is None  # a whole pass: exit 0
    result = check_trace(trace)
    assert result.ok and result.notes == []
    assert (result.steps, result.finished, result.preemptions, result.prefix_hit_tokens, result.events) == (
        6, 2, 1, 4, 46)


def test_a_recording_without_the_answers_keeps_the_rules_skipped_with_its_note(tmp_path: Path) -> None:
    records = _records(SYNC)
    records[0].pop("kv_answers")
    for r in records:
        r.pop("kv_matches", None)
        r.pop("kv", None)
    trace = _trace(tmp_path, records)
    assert trace.config.kv_connector_matches is None
    assert list(unjudged_rules(trace.meta)) == list(UNMODELLED_RULES["kv_connector"])
    result = check_trace(trace)
    assert result.ok  # the sync external tokens are not judged (COMPUTED-CONTINUITY skipped)
    assert result.notes == [f"{CONNECTOR_RULES}: not judged (a KV connector (MockKVConnector): the model "
                            f"cannot follow it)"]


def test_a_reference_recorded_connector_trace_is_clean(tmp_path: Path) -> None:
    """The reference with a RecordedKVConnector (tests/test_kv_connector_recorded.py's
    answers: r0 'cannot tell yet' then 8 tokens async, r1 4 tokens sync): clean.
    Regression: r0's skip at step 0 was STALE-OUTPUT ("skipped (KV connector
    cannot tell yet) without stale output in flight"). Under a config whose r0
    never answered None, that skip has no reason and STALE-OUTPUT fires."""
    from harness.check.checker import check_steps
    from test_kv_connector_recorded import recorded_config, workload

    path = tmp_path / "kv.parquet"
    record(workload(), recorded_config(), path)
    trace = open_trace(path)
    result = check_trace(trace)
    assert _witnesses(result) == [] and (result.remote_kv_loads, result.finished) == (1, 2)
    config = dict(trace.meta["config"], kv_connector_matches=[["r0", [[8, True]]], ["r1", [[4, False]]]])
    assert _witnesses(check_steps(config, trace.iter_steps())) == [
        (0, "STALE-OUTPUT", "r0", "skipped (KV connector cannot tell yet) without stale output in flight")]


def test_a_decision_without_a_recorded_answer_leaves_the_connector_unfollowed(tmp_path: Path) -> None:
    """The resumed admission at step 4 computes 2 tokens past its hit, but its
    step recorded no answer (vLLM's tests that swap in a mocked connector after
    the scheduler was built: the recorder never sees the calls). Regression:
    COMPUTED-CONTINUITY fired on correct vLLM (test_sync_load_failure)."""
    records = _records(SYNC)
    next(r for r in records if r.get("t") == "schedule" and r["step"] == 4).pop("kv_matches")
    trace = _trace(tmp_path, records)
    assert trace.config.kv_connector_matches is None
    assert trace.meta["vllm_recording"]["warnings"][-1] == (
        "the KV connector's recorded answers are not replayable: 1 connector decision(s) without a recorded "
        "answer (first: request '1' at line 12)")
    assert list(unjudged_rules(trace.meta)) == list(UNMODELLED_RULES["kv_connector"])
    assert trace.incomplete == "not every rule judged: the model cannot follow kv_connector"
    result = check_trace(trace)
    assert result.ok and result.notes == [
        f"{CONNECTOR_RULES}: not judged (a KV connector (MockKVConnector): the model cannot follow it)"]


def test_a_producers_delayed_free_is_not_judged(tmp_path: Path) -> None:
    """vLLM 0.33.0's test_remote_decode_lifecycle.py::test_basic_lifecycle (NixlPullConnector,
    a producer): the finished request frees nothing (request_finished delays it) until
    finished_sending, reported in the update of an idle step the trace drops. Regression:
    FREE-WHOLE-TABLE ("freed [], but its table is [1, 2, 3]") on correct vLLM."""
    trace = _trace(tmp_path, _records(DATA / "vllm-0.33.0-kv-producer-sending.jsonl.gz"))
    assert trace.meta["vllm_recording"]["unmodelled"] == {
        "kv_connector": "a KV connector (NixlPullConnector)",
        "kv_connector_sending": "1 finished_sending report(s): a KV producer's blocks held while sending"}
    assert trace.config.kv_connector_matches is None
    result = check_trace(trace)
    assert result.ok and (result.steps, result.finished) == (1, 1)
    assert result.notes == [
        f"{CONNECTOR_RULES}: not judged (a KV connector (NixlPullConnector): the model cannot follow it)",
        "FREE-WHOLE-TABLE: not judged (1 finished_sending report(s): a KV producer's blocks held while "
        "sending: the model cannot follow it)"]


# -- deliberately broken connector traces: each rule fires with an exact witness -------------------
def _reserve_none(rs):  # r000001's async load leaves nothing for r000000's in-flight prefill
    _event(rs, 0, "kv_load", "1")["reserved_blocks"] = 0


def _load_out_of_order(rs):  # r000000's load takes block 2 before the free queue's head 1
    _event(rs, 0, "kv_load", "0")["block_ids"] = [2, 1]


def _load_into_held_block(rs):  # r000001's load takes block 2, which r000000's load holds
    _event(rs, 0, "kv_load", "1")["block_ids"] = [2, 4]


def _load_one_block_short(rs):  # 32 external tokens (block size 16) into one block
    _event(rs, 0, "kv_load", "0")["block_ids"] = [1]


def _free_count_off(rs):  # the pool reports one free block too many after step 0's loads
    _update(rs, 0)["num_free_blocks"] = 9996


def _no_transfer_report(rs):  # the worker never reported the loads done, yet both are promoted
    for r in rs:
        r.pop("kv", None)


def _promote_short(rs):  # promoted with 16 computed tokens although all 32 arrived
    _event(rs, 2, "kv_promote", "0")["num_computed_tokens"] = 16


def _free_head_first(rs):  # a finished request frees its table head first
    _update(rs, 4)["finished"][0]["freed_block_ids"] = [1, 2, 5, 6, 9]


def _no_sync_answer(rs):  # the connector answered no external tokens, yet admissions count 2
    for r in rs:
        for match in r.get("kv_matches") or ():
            match[2] = 0


def _later_answers_zero(rs):  # request 1's calls after its first answered 0: its readmission may not count 2
    seen = 0
    for r in rs:
        for match in r.get("kv_matches") or ():
            if match[0] == "1":
                seen += 1
                if seen > 1:
                    match[2] = 0


def _hit_blocks_swapped(rs):  # the resumed request's 4-token hit in the wrong blocks
    _event(rs, 4, "schedule", "1")["new_block_ids"] = [5, 4, 6, 3]


def _external_block_missing(rs):  # the 2 synchronous external tokens get no block
    _event(rs, 4, "schedule", "1")["new_block_ids"] = [4, 5, 3]


def _abort_frees_while_loading(rs):  # request 1 aborted after step 0, its loading blocks freed at once
    i = next(i for i, r in enumerate(rs) if r.get("t") == "update" and r["step"] == 0)
    rs.insert(i + 1, {"t": "abort", "mid_step": False, "status": "FINISHED_ABORTED", "finished": [
        {"request_id": "1", "status": "FINISHED_ABORTED", "finish_reason": "abort", "stop_reason": None,
         "num_output_tokens": 0, "freed_block_ids": [4, 3], "fence": None}]})


BROKEN = {
    "REMOTE-KV-RESERVATION": (ASYNC, _reserve_none, [
        (0, "REMOTE-KV-RESERVATION", "r000001", "reserved 0 blocks, but in-flight prefills ['r000000'] still need 2")]),
    "ALLOC-FROM-HEAD": (ASYNC, _load_out_of_order, [
        (0, "ALLOC-FROM-HEAD", "r000000", "allocated block 2 but the free queue starts [1, 2, 3, 4, 5, 6, 7, 8]; "
                                          "the queue order can no longer be inferred, so this check stops here"),
        (2, "BLOCKS-COVER", "r000000", "admitted with table [1, 2, 5, 6], but it held [2, 1]"),
        (4, "FREE-ORDER", "r000000", "freed [9, 6, 5, 2, 1], expected its table tail first [9, 6, 5, 1, 2]")]),
    "BLOCK-EXCLUSIVE": (ASYNC, _load_into_held_block, [
        (0, "BLOCK-EXCLUSIVE", "r000001", "newly allocated block 2 is still held by ['r000000']")]),
    "BLOCKS-COVER": (ASYNC, _load_one_block_short, [
        (0, "BLOCKS-COVER", "r000000", "table has 1 block for 32 loaded tokens")]),
    "BLOCK-CONSERVATION": (ASYNC, _free_count_off, [
        (0, "BLOCK-CONSERVATION", None, "at update_end: 9996 free + 4 held != 9999 usable blocks "
                                        "(the trace implies 9995 free); since schedule_end at step 0 (9995 free) "
                                        "the engine's count changed by +1, the trace's events by +0 (no event "
                                        "changed it): 1 block more than the trace frees")]),
    "REMOTE-KV-LOADING": (ASYNC, _no_transfer_report, [
        (2, "REMOTE-KV-LOADING", "r000000", "promoted with status WAITING_FOR_REMOTE_KVS before its transfer "
                                            "was reported finished"),
        (2, "REMOTE-KV-LOADING", "r000001", "promoted with status WAITING_FOR_REMOTE_KVS before its transfer "
                                            "was reported finished")]),
    "REMOTE-KV-LOADING:count": (ASYNC, _promote_short, [
        (2, "REMOTE-KV-LOADING", "r000000", "promoted to WAITING with 16 computed tokens; expected WAITING with 32")]),
    # (Only its first witness: the rest of the recording still drives request 1.)
    "REMOTE-KV-ABORT-HOLDS": (ASYNC, _abort_frees_while_loading, [
        (1, "REMOTE-KV-ABORT-HOLDS", "r000001", "abort freed [4, 3] while its KV load was still in flight")]),
    "FREE-ORDER": (ASYNC, _free_head_first, [
        (4, "FREE-ORDER", "r000000", "freed [1, 2, 5, 6, 9], expected its table tail first [9, 6, 5, 2, 1]")]),
    "COMPUTED-CONTINUITY": (SYNC, _no_sync_answer, [
        (0, "COMPUTED-CONTINUITY", "r000000", "admitted with num_computed_tokens 2 != prefix hit 0; its connector "
                                              "answered no synchronous external tokens"),
        (0, "COMPUTED-CONTINUITY", "r000001", "admitted with num_computed_tokens 2 != prefix hit 0; its connector "
                                              "answered no synchronous external tokens"),
        (4, "COMPUTED-CONTINUITY", "r000001", "admitted with num_computed_tokens 6 != prefix hit 4; its connector "
                                              "answered no synchronous external tokens")]),
    # Regression (adversarial trial): the answers are used in call order; the
    # readmission at step 4 may not count the 2 tokens request 1's first call gave.
    "COMPUTED-CONTINUITY:answers-in-order": (SYNC, _later_answers_zero, [
        (4, "COMPUTED-CONTINUITY", "r000001", "admitted with num_computed_tokens 6 != prefix hit 4; its "
                                              "connector's answers [external tokens, load_kv_async] in call "
                                              "order [[2, False], [0, False], [0, False]] (the first 1 used "
                                              "before) give no 2 synchronous external tokens")]),
    "PREFIX-HIT-RULES": (SYNC, _hit_blocks_swapped, [
        (4, "PREFIX-HIT-RULES", "r000001", "hit block 5 (#0) does not hold this request's prefix block"),
        (5, "FREE-ORDER", "r000001", "freed [3, 6, 5, 4], expected its table tail first [3, 6, 4, 5]")]),
    "BLOCKS-COVER:sync": (SYNC, _external_block_missing, [
        (4, "ALLOC-FROM-HEAD", "r000001", "allocated block 3 but the free queue starts [6, 3, 2, 1]; the queue "
                                          "order can no longer be inferred, so this check stops here"),
        (4, "BLOCKS-COVER", "r000001", "table has 3 blocks for 7 tokens, needs 4")]),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_connector_trace_fires_its_rule(tmp_path: Path, name: str) -> None:
    recording, edit, expected = BROKEN[name]
    records = _records(recording)
    edit(records)
    witnesses = _witnesses(check_trace(_trace(tmp_path, records)))
    # The rule's own witnesses, exactly, first (what follows from them is listed after).
    assert witnesses[:len(expected)] == expected
    assert name.split(":")[0] in {w[1] for w in expected}


# -- vLLM 0.33.0's connector tests, run --------------------------------------------------------------
@pytest.mark.vllm
def test_vllm_0_33_0s_connector_tests_are_judged_and_clean(tmp_path: Path, vllm_0_33_0_tests) -> None:
    from click.testing import CliRunner

    from harness.cli import main

    result = CliRunner().invoke(main, ["vllm-tests", "0.33.0", "--files", "tests/v1/core/test_scheduler.py",
                                       "-k", "test_kv_connector_basic or test_kv_connector_unable_to_allocate "
                                       "or test_kv_connector_handles_preemption",
                                       "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output[-3000:]
    report = json.loads(result.output)
    assert report["broken_by_recorder"] == [] and report["violations"] == []
    assert report["plain_passed"] == report["injected_passed"] == 12
    # 8 recordings with a complete step; every one judged (no rule skipped) and clean.
    assert report["checkable"] == report["clean"] == report["replay_identical"] == 8
    judged = 0
    for trace_path in sorted((tmp_path / "traces").glob("*.parquet")):
        try:
            trace = open_trace(trace_path)
        except Exception:  # a recording without a complete step: no rows
            continue
        assert unjudged_rules(trace.meta) == {}
        judged += 1
    assert judged == 8
