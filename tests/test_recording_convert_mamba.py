"""Recordings of vLLM with Mamba KV-cache groups (issue 28): the converter names a ``MambaSpec``
group as a ``linear_attention`` layer when vLLM ran it in ``mamba_cache_mode`` "none" (the
reference's ``MambaManager``), and classifies every other Mamba recording as
``unmodelled-kv_cache_spec`` with the exact reason, never as "N KV-cache groups".

Without vLLM: ``tests/data/vllm-0.33.0-mamba-none.jsonl`` is a recording of vLLM 0.33.0's
``RecordingScheduler`` (made with ``tests/test_vllm_recording.py``'s drive script: one Mamba and
one full-attention layer, ``block_size`` 4, ``max_model_len`` 32, 12 blocks, prefix caching off,
3 requests, a preemption). vLLM scheduled it on block size 32 (the least common multiple of the
groups' 32 and 4), which the recorder writes as ``block_size``; the trace's is the attention
groups' 4. The other cases edit its meta record the way other vLLM configurations record it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm import recording_convert as rc
from harness.check.checker import check_trace, unjudged_rules
from harness.replay import replay
from harness.trace.reader import open_trace

DATA = Path(__file__).resolve().parent / "data" / "vllm-0.33.0-mamba-none.jsonl"
MAMBA = ["MambaSpec", None, 32, 1, {"mamba_cache_mode": "none", "num_speculative_blocks": 0,
                                    "num_prefill_checkpoint_blocks": 0}]
FULL = ["FullAttentionSpec", None, 4, 1]


def _records() -> list[dict]:
    return [json.loads(line) for line in DATA.read_text().splitlines()]


def _convert(tmp_path: Path, records: list[dict]):
    src = tmp_path / "rec.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = rc.convert(src, tmp_path / "rec.parquet")
    return summary, open_trace(tmp_path / "rec.parquet")


def test_the_recording_holds_a_mamba_group_in_mode_none_and_the_lcm_block_size() -> None:
    meta = _records()[0]
    assert meta["kv_cache_groups"] == [MAMBA, FULL]
    assert meta["config"]["block_size"] == 32  # vLLM's scheduler block size: lcm(32, 4)
    assert meta["vllm_config"]["cache_config.mamba_cache_mode"] == "none"
    assert meta["unmodelled"] == {} and meta["warnings"] == []


def test_a_mamba_recording_in_mode_none_converts_with_every_groups_blocks(tmp_path: Path) -> None:
    summary, trace = _convert(tmp_path, _records())
    assert (summary["steps"], summary["preemptions"], summary["warnings"]) == (7, 1, [])
    assert trace.meta["schema_version"] == 9
    config = trace.meta["config"]
    assert (config["layer_types"], config["block_size"], config["max_model_len"]) == (
        ["linear_attention", "full_attention"], 4, 32)
    assert trace.meta["vllm_recording"]["unmodelled"] == {}
    assert unjudged_rules(trace.meta) == {}  # no rule skipped, for kv_cache_groups or anything
    rows = [(r["step"], r["kind"], r["request_id"], r["block_ids"], r["group_block_ids"])
            for _, rs in trace.iter_steps() for r in rs if r.get("group_block_ids") is not None]
    # One state block of max_model_len tokens per request in the Mamba group (group 0), taken
    # at the first allocation and freed with the request; the attention group's blocks of 4.
    assert rows == [
        (0, "schedule", "r000000", [1, 2, 3], [[1], [2, 3]]),
        (1, "schedule", "r000000", [], [[], []]),
        (1, "schedule", "r000001", [4, 5, 6, 7], [[4], [5, 6, 7]]),
        (1, "schedule", "r000002", [8, 9, 10], [[8], [9, 10]]),
        (2, "schedule", "r000000", [], [[], []]),
        (2, "schedule", "r000001", [], [[], []]),
        (2, "schedule", "r000002", [11], [[], [11]]),
        (3, "preempt", "r000002", [8, 11, 10, 9], [[8], [11, 10, 9]]),
        (3, "schedule", "r000000", [11], [[], [11]]),
        (3, "schedule", "r000001", [], [[], []]),
        (3, "finish", "r000000", [1, 11, 3, 2], [[1], [11, 3, 2]]),
        (4, "schedule", "r000001", [], [[], []]),
        (4, "schedule", "r000002", [11, 3, 2, 1, 10], [[11], [3, 2, 1, 10]]),
        (4, "finish", "r000001", [4, 7, 6, 5], [[4], [7, 6, 5]]),
        (5, "schedule", "r000002", [], [[], []]),
        (6, "schedule", "r000002", [], [[], []]),
        (6, "finish", "r000002", [11, 10, 1, 2, 3], [[11], [10, 1, 2, 3]]),
    ]
    for semantics in ("auto", "safety"):
        result = check_trace(trace, semantics)
        assert result.ok and result.by_invariant == {}, (semantics, result.by_invariant)
    assert replay(trace, resolve_candidate("reference")) == (None, 7)


def test_the_mamba_rules_run_on_a_converted_recording(tmp_path: Path) -> None:
    """Not skipped: a recording whose Mamba table holds two state blocks (the first
    admission's blocks given to the Mamba group) fires MAMBA-STATE-BLOCKS."""
    records = _records()
    sched = next(r for r in records if r["t"] == "schedule")
    sched["output"]["events"][0]["group_block_ids"] = [[1, 2], [3]]
    _, trace = _convert(tmp_path, records)
    result = check_trace(trace, "auto")
    assert "MAMBA-STATE-BLOCKS" in result.by_invariant and "BLOCKS-COVER" in result.by_invariant


ALIGN_WHY = ("group 0: MambaSpec mamba_cache_mode 'align' (vLLM's Mamba prefix caching: a state block "
             "per 32 tokens, block-aligned prefill chunks, checkpoints; the model has 'none')")


@pytest.mark.parametrize("edit, feature, why", [
    # vLLM's default with prefix caching (a hybrid model served as is).
    (lambda m: (m["kv_cache_groups"][0][4].update(mamba_cache_mode="align"),
                m["vllm_config"].update({"cache_config.mamba_cache_mode": "align"}),
                m["config"].update(enable_prefix_caching=True)),
     "kv_cache_spec", ALIGN_WHY),
    # A spec in mode "none" under a cache config in "align": vLLM's Scheduler still cuts
    # prefill chunks at block boundaries (need_mamba_block_aligned_split).
    (lambda m: m["vllm_config"].update({"cache_config.mamba_cache_mode": "align"}),
     "kv_cache_spec", "cache_config.mamba_cache_mode 'align': vLLM's Scheduler cuts prefill chunks at "
                      "Mamba block boundaries (_mamba_block_aligned_split; the model has 'none')"),
    (lambda m: m["kv_cache_groups"][0].__setitem__(2, 16),
     "kv_cache_spec", "group 0: MambaSpec block_size 16 (mode 'none' keeps the whole state in one block "
                      "of max_model_len 32 tokens; the model has only that)"),
    (lambda m: m["kv_cache_groups"][0][4].update(num_speculative_blocks=2),
     "kv_cache_spec", "group 0: MambaSpec num_speculative_blocks 2 (the model has num_speculative_tokens 0)"),
    (lambda m: m["kv_cache_groups"][0].pop(),
     "kv_cache_spec", "group 0: MambaSpec recorded without its mamba_cache_mode (a recorder before "
                      "issue 28's Mamba groups)"),
    (lambda m: m["kv_cache_groups"].insert(1, ["FullAttentionSpec", None, 8, 1]),
     "kv_cache_groups", "attention block sizes [4, 8] per group (the model has one)"),
])
def test_a_mamba_recording_the_model_cannot_follow_is_unmodelled_with_its_reason(
        tmp_path: Path, edit, feature, why) -> None:
    records = _records()
    edit(records[0])
    summary, trace = _convert(tmp_path, records)
    assert summary["steps"] == 7
    n = len(records[0]["kv_cache_groups"])
    assert trace.meta["vllm_recording"]["unmodelled"] == {feature: f"{n} KV-cache groups ({why})"}
    assert "layer_types" not in trace.meta["config"]  # the block rules run on no group
    assert trace.meta["schema_version"] == 8
    assert sorted(unjudged_rules(trace.meta)) == [
        "ALLOC-FROM-HEAD", "BLOCK-CONSERVATION", "BLOCK-EXCLUSIVE", "BLOCKS-COVER", "BLOCKS-EXACT", "COMPUTED-CONTINUITY",
        "FREE-ORDER", "HIT-UNCOMPUTED-BLOCK", "PREFIX-HIT-RULES"]
    for semantics in ("auto", "safety"):
        assert check_trace(trace, semantics).ok


def test_a_recording_whose_recorder_marked_the_spec_keeps_that_reason(tmp_path: Path) -> None:
    """A recorder before this change marked MambaSpec itself ("kv_cache_spec"): kept, and no
    "kv_cache_groups" reason is added beside it."""
    records = _records()
    records[0]["unmodelled"] = {"kv_cache_spec": "KV-cache spec MambaSpec"}
    records[0]["kv_cache_groups"][0].pop()
    _, trace = _convert(tmp_path, records)
    assert trace.meta["vllm_recording"]["unmodelled"] == {"kv_cache_spec": "KV-cache spec MambaSpec"}


def test_hybrid_config_names_mamba_groups_as_linear_attention_layers() -> None:
    mamba = ["MambaSpec", None, 96, 1, {"mamba_cache_mode": "none", "num_speculative_blocks": 0}]
    # Qwen3-Next's 3:1: three Mamba groups, then full attention; scheduled on lcm(96, 4) = 96.
    assert rc.hybrid_config([mamba] * 3 + [FULL], 96, max_model_len=96) == (
        {"layer_types": ["linear_attention"] * 3 + ["full_attention"], "block_size": 4}, {})
    spec2 = ["MambaSpec", None, 96, 1, {"mamba_cache_mode": "none", "num_speculative_blocks": 2}]
    assert rc.hybrid_config([spec2, FULL], 96, max_model_len=96, num_speculative_tokens=2) == (
        {"layer_types": ["linear_attention", "full_attention"], "block_size": 4}, {})
    sw = ["SlidingWindowSpec", 8, 4, 1]
    assert rc.hybrid_config([mamba, sw, FULL], 96, max_model_len=96) == (
        {"layer_types": ["linear_attention", "sliding_attention", "full_attention"], "sliding_window": 8,
         "block_size": 4}, {})
    # A Mamba and a full-attention group the grouping orders otherwise: two Mamba layers
    # to one full-attention layer are two Mamba groups, not [Mamba, FA, Mamba].
    assert rc.hybrid_config([mamba, FULL, mamba], 96, max_model_len=96) == (
        {}, {"kv_cache_groups": "groups ['MambaSpec', 'FullAttentionSpec', 'MambaSpec'] in an order "
                                "vLLM's grouping does not give"})
    # Prefix caching with mode "none": vLLM's MambaManager asserts; never recorded, still named.
    assert rc.hybrid_config([mamba, FULL], 96, max_model_len=96, enable_prefix_caching=True) == (
        {}, {"kv_cache_spec": "MambaSpec mamba_cache_mode 'none' with prefix caching (vLLM requires "
                              "'align' for it)"})


def test_vllm_tests_report_names_why_each_mamba_recording_was_not_replayed(tmp_path: Path) -> None:
    """``harness vllm-tests``' analysis of two recordings of one test: mode "none" checks clean
    and replays identically; "align" checks clean with the block rules skipped and is not
    replayed, the report naming why (``not_replayed``), never "N KV-cache groups"."""
    from harness.vllm_tests_report import analyse, render

    record_dir = tmp_path / "recordings"
    record_dir.mkdir()
    align = _records()
    align[0]["kv_cache_groups"][0][4]["mamba_cache_mode"] = "align"
    for name, records in (("00000.jsonl", _records()), ("00001.jsonl", align)):
        (record_dir / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    nodeid = "tests/v1/core/test_x.py::test_mamba"
    (record_dir / "manifest.jsonl").write_text("".join(
        json.dumps({"nodeid": nodeid, "file": f}) + "\n" for f in ("00000.jsonl", "00001.jsonl")))
    report = analyse({nodeid: "passed"}, {nodeid: "passed"}, record_dir, tmp_path / "traces", "0.33.0")
    assert (report["converted"], report["checkable"], report["clean"], report["violations"]) == (2, 2, 2, [])
    assert (report["replay_identical"], report["replay_diverged"]) == (1, 0)
    assert report["artefacts"] == {"unmodelled-kv_cache_spec": 1, "not-replayed-unmodelled": 1}
    assert report["not_replayed"] == [{"test": nodeid, "recording": "00001.jsonl",
                                       "reason": f"unmodelled: kv_cache_spec: 2 KV-cache groups ({ALIGN_WHY})"}]
    assert f"not replayed (1): unmodelled: kv_cache_spec: 2 KV-cache groups ({ALIGN_WHY})" in render(report)


def test_a_recording_without_a_complete_step_names_its_break_and_unmodelled_features(tmp_path: Path) -> None:
    """vLLM 0.33.0's ``test_mamba_align_*`` set ``need_mamba_block_aligned_split`` by hand before
    the first ``schedule()``: the recorder's protocol record ends the trace before any step, and
    the report says so (regression: "no complete step" alone; the align recordings'
    reasons were only in their traces)."""
    from harness.vllm_tests_report import analyse

    records = _records()
    first = next(i for i, r in enumerate(records) if r["t"] == "schedule")
    records.insert(first, {"t": "protocol", "step": 0, "what": "Scheduler.need_mamba_block_aligned_split set "
                                                                "to True by hand (vLLM derived False from the config)"})
    align = _records()
    align[0]["kv_cache_groups"][0][4]["mamba_cache_mode"] = "align"
    align.insert(first, dict(records[first]))
    record_dir = tmp_path / "recordings"
    record_dir.mkdir()
    for name, recs in (("00000.jsonl", records), ("00001.jsonl", align)):
        (record_dir / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    (record_dir / "manifest.jsonl").write_text("".join(
        json.dumps({"nodeid": "t.py::a", "file": f}) + "\n" for f in ("00000.jsonl", "00001.jsonl")))
    report = analyse({}, {}, record_dir, tmp_path / "traces", "0.33.0")
    assert report["artefacts"] == {"no-complete-step": 2}
    assert [r["reason"] for r in report["not_replayed"]] == [
        "no complete step (scheduler-flag-set-by-hand)",
        f"no complete step (scheduler-flag-set-by-hand); unmodelled: kv_cache_spec: 2 KV-cache groups ({ALIGN_WHY})"]


def test_the_recorder_writes_a_protocol_record_once_a_derived_flag_is_set_by_hand() -> None:
    from types import SimpleNamespace

    from harness.candidates.vllm.recording_scheduler import _Recorder

    written: list[dict] = []
    rec = SimpleNamespace(derived={"need_mamba_block_aligned_split": False}, steps=3, _write=written.append,
                          sched=SimpleNamespace(need_mamba_block_aligned_split=False))
    _Recorder._check_derived(rec)
    assert written == [] and rec.derived  # unchanged: nothing written
    rec.sched.need_mamba_block_aligned_split = True
    _Recorder._check_derived(rec)
    _Recorder._check_derived(rec)
    assert written == [{"t": "protocol", "step": 3, "what": "Scheduler.need_mamba_block_aligned_split set to "
                                                            "True by hand (vLLM derived False from the config)"}]
