"""A vLLM recording with encoder inputs and LoRA adapters converts, checks clean and replays
identical on the reference (issue 22: the clean vLLM-test recordings that were "not replayed: an
unmodelled feature").

``tests/data/vllm-0.33.0-encoder-lora-budget.jsonl.gz`` was written by the recording scheduler
(``harness vllm-tests 0.33.0 --files tests/v1/core/test_scheduler.py -k
test_max_loras_counts_running_request_skipped_for_encoder_budget``): vLLM's test sets the encoder
compute budget to 100 embeds and a 1000-embed ``EncoderCacheManager`` by hand after
``Scheduler.__init__`` (the recorder's ``config`` record), adds request ``a`` (300 tokens, items
``hash0_0`` at [0, 100) and ``hash0_1`` at [150, 250), adapter 1) and ``b`` (300 tokens, item
``hash1_0`` at [50, 150), adapter 2) with ``max_loras`` 2: a's window stops before its second item
(150 tokens), b's before its item (50). The second step has no update (the trace keeps one step).
No vLLM is needed: the stored recording is converted. Exact values throughout; every recorded input
has a mutant that makes the replay diverge where it matters.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from harness.candidates.vllm.recording_convert import convert
from harness.check.checker import check_trace
from harness.replay import replay
from harness.trace import open_trace
from harness.vllm_tests_report import replay_blocked_by
from reference.scheduler import Scheduler

RECORDING = Path(__file__).with_name("data") / "vllm-0.33.0-encoder-lora-budget.jsonl.gz"


def _convert(tmp_path, edit=None):
    records = [json.loads(line) for line in gzip.decompress(RECORDING.read_bytes()).decode().splitlines()]
    if edit is not None:
        edited = edit(records)  # edits in place, or returns the new records
        if isinstance(edited, list) and all(isinstance(r, dict) for r in edited):
            records = edited
    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    convert(src, tmp_path / "rec.parquet")
    return open_trace(tmp_path / "rec.parquet")


def test_encoder_inputs_and_adapters_convert_check_clean_and_replay_identical(tmp_path) -> None:
    trace = _convert(tmp_path)
    config = trace.config
    # The budgets the test set by hand (not the 8192 Scheduler.__init__ derived), vLLM's identifiers.
    assert (config.max_num_encoder_input_tokens, config.encoder_cache_size) == (100, 1000)
    assert config.mm_identifiers == (("r000000", ("hash0_0", "hash0_1")), ("r000001", ("hash1_0",)))
    assert (config.max_loras, config.lora_int_ids) == (2, (("r000000", 1), ("r000001", 2)))
    rows = pq.read_table(tmp_path / "rec.parquet").to_pylist()
    assert [(r["kind"], r["request_id"], r["mm_positions"]) for r in rows if r["kind"] == "arrival"] == [
        ("arrival", "r000000", [[0, 100], [150, 100]]), ("arrival", "r000001", [[50, 100]])]
    assert [(r["kind"], r["request_id"], r["num_computed_tokens"], r["num_scheduled_tokens"],
             r["encoder_input_ids"]) for r in rows if r["kind"] in ("encoder_plan", "schedule")] == [
        ("encoder_plan", "r000000", 0, 150, [0]), ("schedule", "r000000", 0, 150, [0]),
        ("encoder_plan", "r000001", 0, 50, []), ("schedule", "r000001", 0, 50, None)]
    assert (trace.meta["vllm_recording"]["unmodelled"], replay_blocked_by(trace)) == ({}, [])
    assert all(check_trace(trace, s).ok for s in ("auto", "safety"))
    assert replay(trace, Scheduler) == (None, 1)


def _drop_config_record(records):
    return [r for r in records if r["t"] != "config"]


def _larger_budget(records):
    for r in records:
        if r["t"] == "config":
            r["config"]["max_num_encoder_input_tokens"] = 250


def _same_identifier(records):
    for r in records:
        if r["t"] == "arrival" and r["request_id"] == "b":
            r["mm_features"][0][2] = "hash0_0"  # b's item is then a's first: a cache hit


def _item_earlier(records):
    for r in records:
        if r["t"] == "arrival" and r["request_id"] == "b":
            r["mm_features"][0][0] = 40  # b's item at [40, 140): its window stops at 40


@pytest.mark.parametrize("edit, where", [
    # A budget of 250 embeds (not the 100 the test set) lets a's window reach both its items.
    (_larger_budget, (0, "r000000", "encoder_input_ids", [0], [0, 1])),
    # With b's identifier equal to a's first item's, b's item is a hit (cached by a in this step):
    # b's window is not cut.
    (_same_identifier, (0, "r000001", "num_scheduled_tokens", 50, 300)),
    # b's item recorded 10 tokens earlier: the reference cuts b's window there.
    (_item_earlier, (0, "r000001", "num_scheduled_tokens", 50, 40)),
])
def test_a_mutated_recorded_input_diverges_at_step_0(tmp_path, edit, where) -> None:
    trace = _convert(tmp_path, edit)
    divergence, _ = replay(trace, Scheduler)
    assert divergence is not None
    assert (divergence.step, divergence.request, divergence.field, divergence.expected,
            divergence.actual) == where


def test_a_recording_made_before_the_features_were_kept_is_not_replayed(tmp_path) -> None:
    """An older recording (arrivals without ``mm_features`` / ``lora_int_id``, marked
    ``unsupported``): converted text-only, as before, and not replayed."""
    def old(records):
        for r in records:
            if r["t"] == "arrival":
                r.pop("mm_features", None)
                r.pop("lora_int_id", None)
                r["unsupported"] = ["encoder_inputs", "lora"]
            if r["t"] == "schedule":
                r["output"]["events"] = [e for e in r["output"]["events"] if e["type"] != "encoder_plan"]
                for e in r["output"]["events"]:
                    e.pop("encoder_input_ids", None)
        return _drop_config_record(records)

    trace = _convert(tmp_path, old)
    assert trace.config.mm_identifiers is None and trace.config.max_loras is None
    assert replay_blocked_by(trace) == ["encoder_inputs", "lora"]
    assert trace.meta["vllm_recording"]["unmodelled"] == {
        "encoder_inputs": "2 request(s) with encoder inputs", "lora": "2 request(s) with lora"}


@pytest.mark.parametrize("edit, unmodelled", [
    # An encoder-only instance (vLLM's mm_encoder_only: it samples no tokens): its requests'
    # encoder inputs are left out, the trace is not replayed.
    (lambda rs: rs[0]["unmodelled"].update(mm_encoder_only="an encoder-only instance"),
     {"mm_encoder_only": "an encoder-only instance", "encoder_inputs": "2 request(s) with encoder inputs"}),
    # A budget of 0 (vLLM's for a model without multimodal inputs; a test may set it).
    (lambda rs: [r["config"].update(max_num_encoder_input_tokens=0) for r in rs if r["t"] == "config"],
     {"encoder_inputs": "2 request(s) with encoder inputs (encoder budgets max_num_encoder_input_tokens 0, "
                        "encoder cache size 1000 (the model needs both positive))"}),
    # LoRA with prefix caching: vLLM's block hashes of a LoRA request key on its adapter.
    (lambda rs: rs[0]["config"].update(enable_prefix_caching=True),
     {"lora": "2 request(s) with lora and prefix caching (the block hashes of a LoRA request key on "
              "its adapter)"}),
])
def test_what_the_model_does_not_follow_is_left_unmodelled(tmp_path, edit, unmodelled) -> None:
    trace = _convert(tmp_path, edit)
    assert trace.meta["vllm_recording"]["unmodelled"] == unmodelled
    assert replay_blocked_by(trace) == sorted(unmodelled)
    rows = pq.read_table(tmp_path / "rec.parquet", columns=["kind", "mm_positions"]).to_pylist()
    has_items = any(r["mm_positions"] for r in rows if r["kind"] == "arrival")
    assert has_items == ("encoder_inputs" not in unmodelled)
    assert ("encoder_plan" in {r["kind"] for r in rows}) == has_items


def test_normalise_reads_encoder_plans_and_a_withdrawn_requests_inputs() -> None:
    """``events.normalise`` on a hand-made hook sequence and SchedulerOutput (vLLM 0.33.0's shapes):
    each ``_try_schedule_encoder_inputs`` plan is an ``encoder_plan`` event; a ``schedule`` event
    carries the plan's inputs, replaced by ``scheduled_encoder_inputs`` for a request the output
    keeps; a PRIORITY victim's ``withdraw`` gives back its plan's inputs (vLLM's output no longer
    names them); ``free_encoder_mm_hashes`` is kept when not empty."""
    from types import SimpleNamespace

    from harness.candidates.vllm.events import normalise

    seq = [("encoder_plan", "v", 10, 20, [1]),
           ("alloc", "v", "RUNNING", 10, 20, 0, [5], [], None, None),
           ("encoder_plan", "w", 0, 30, [0]),
           ("preempt", "v", 10, [5, 4], None, None),
           ("alloc", "w", "RUNNING", 0, 30, 0, [6], [], None, None)]
    so = SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=["w"], new_block_ids=[([6],)], num_computed_tokens=[0],
                                              resumed_req_ids=set()),
        num_scheduled_tokens={"w": 30}, scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={"w": [0]},
        free_encoder_mm_hashes=["hash9_0"], preempted_req_ids={"v"}, total_num_scheduled_tokens=30,
        finished_req_ids=set())
    out = normalise(so, seq, use_v2=False, max_num_scheduled_tokens=100)
    assert [(e["type"], e["request_id"], e.get("num_scheduled_tokens"), e.get("encoder_input_ids"))
            for e in out["events"]] == [
        ("encoder_plan", "v", 20, [1]), ("schedule", "v", 20, [1]), ("encoder_plan", "w", 30, [0]),
        ("withdraw", "v", 20, [1]), ("preempt", "v", None, None), ("schedule", "w", 30, [0])]
    assert out["free_encoder_mm_hashes"] == ["hash9_0"]
    # Without encoder inputs the keys are left out (a text-only recording is unchanged).
    text = normalise(SimpleNamespace(**{**vars(so), "scheduled_encoder_inputs": {}, "free_encoder_mm_hashes": []}),
                     [item for item in seq if item[0] != "encoder_plan"], use_v2=False,
                     max_num_scheduled_tokens=100)
    assert "free_encoder_mm_hashes" not in text and not any("encoder_input_ids" in e for e in text["events"])


@pytest.mark.parametrize("item, why", [
    # An is_embed mask: 100 placeholder tokens, 60 embeds.
    ([50, 100, "hash1_0", 60], "request 'b': an item of 100 tokens has 60 embeds"),
    # An item past the prompt's 300 tokens.
    ([250, 100, "hash1_0", 100], "request 'b': items [[250, 100, 'hash1_0', 100]] are not sorted, "
                                 "non-overlapping spans of its prompt"),
])
def test_items_the_model_cannot_take_leave_the_encoder_inputs_unmodelled(tmp_path, item, why) -> None:
    def edit(records):
        for r in records:
            if r["t"] == "arrival" and r["request_id"] == "b":
                r["mm_features"] = [item]

    trace = _convert(tmp_path, edit)
    assert trace.meta["vllm_recording"]["unmodelled"] == {
        "encoder_inputs": f"2 request(s) with encoder inputs ({why})"}
    assert trace.config.mm_identifiers is None and replay_blocked_by(trace) == ["encoder_inputs"]
