"""Regression (issue 22, last gap: "Replay identical on every trace that checks
clean"): vLLM 0.33.0's own ``tests/v1/core/test_prefix_replay.py`` starts async
KV-connector loads on a hybrid KV cache (a full-attention group and a
``SlidingWindowMLASpec`` group with bounded replay). Its 4 recordings with a
complete step checked clean but were "not replayed (4): unmodelled:
kv_connector: a KV connector (MockKVConnector)": a ``kv_load`` row carried
the full-attention group's blocks only, so the converter kept the
connector's answers out ("the connector's loads are modelled for one group")
and the reference refused a hybrid config with a connector that loads.

What vLLM 0.33.0 allocates for a load (``kv_cache_coordinator.py::
allocate_new_computed_blocks``, ``single_type_kv_cache_manager.py::
add_local_computed_blocks``, ``allocate_external_computed_blocks``): every
group's hit, then in every group blocks for the loaded tokens; a window
group's slots wholly before the window of the token after the load hold the
null block. At promotion (``Scheduler._update_waiting_for_remote_kv``) a load
that did not restore the window is replayed over its last window. The
recorder now writes each group's table on ``kv_load`` (``block_ids`` hits
first, as an admission's) and each group's freed blocks on ``kv_promote`` and
``kv_free``; the converter passes them to the trace (schema 9); the
reference's rows carry them; the checker follows every group (the load's
tables, the promotion's replay, the admission after it growing each group's
table, the in-flight prefills' reservation capped per window group).

The three recordings (``harness vllm-tests 0.33.0 --files
tests/v1/core/test_prefix_replay.py -k "async_remote or whole_blocks or
carrying_window"``): "load" (test_async_remote_kv_hit_replays_after_load, 64
external tokens), "load-cut" (test_remote_kv_hit_is_taken_in_whole_blocks: 63
offered, cut to 48) and "load-window" (test_kv_load_carrying_window_does_not_replay
[63-True]: the load restores the window, no cut, no replay). Each test stops
after its second ``schedule()``: the trace keeps the load's step; vLLM's second
step (the promotion and admission) is compared with the reference's below.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm import recording_convert as rc
from harness.check.checker import check_trace, unjudged_rules
from harness.fuzz import FuzzCase, run_case
from harness.replay import replay, workload_from_trace
from harness.trace.reader import open_trace
from reference.config import ConfigError, EngineConfig
from reference.engine import check_config_supported
from reference.scheduler import Scheduler
from reference.workload import RequestSpec

DATA = Path(__file__).resolve().parent / "data"
#: name -> (tokens the connector offered, external tokens loaded, the load's
#: group tables, vLLM's second step: the promoted num_computed_tokens, tokens
#: scheduled, each group's table).
LOADS = {
    "load": (64, 64, [[1, 2, 3, 4], [0, 0, 5, 6]],
             (32, 68, [[1, 2, 3, 4, 7, 8, 9], [0, 0, 5, 6, 10, 11, 12]])),
    "load-cut": (63, 48, [[1, 2, 3], [0, 4, 5]],
                 (16, 84, [[1, 2, 3, 6, 7, 8, 9], [0, 4, 5, 10, 11, 12, 13]])),
    "load-window": (63, 63, [[1, 2, 3, 4], [0, 0, 5, 6]],
                    (63, 37, [[1, 2, 3, 4, 7, 8, 9], [0, 0, 5, 6, 10, 11, 12]])),
}


def _convert(tmp_path: Path, name: str):
    summary = rc.convert(DATA / f"vllm-0.33.0-prefix-replay-{name}.jsonl", tmp_path / f"{name}.parquet")
    return summary, open_trace(tmp_path / f"{name}.parquet")


@pytest.mark.parametrize("name", sorted(LOADS))
def test_vllms_loads_convert_check_clean_and_replay_identically(tmp_path: Path, name: str) -> None:
    offered, external, tables, _ = LOADS[name]
    summary, trace = _convert(tmp_path, name)
    assert summary["steps"] == 1
    assert not any("not replayable" in w for w in summary["warnings"]), summary["warnings"]
    config = trace.meta["config"]
    assert config["kv_connector_matches"] == [["r000000", [[offered, True]]]]
    assert config["kv_connector_outputs"] == [[0, ["r000000"], []]]
    rows = [(r["kind"], r.get("num_external_tokens"), r["block_ids"], r["group_block_ids"])
            for _, rs in trace.iter_steps() for r in rs if r["kind"] == "kv_load"]
    assert rows == [("kv_load", external, [b for g in tables for b in g if b], tables)]
    assert unjudged_rules(trace.meta) == {}  # every rule judged
    for semantics in ("auto", "safety"):
        assert check_trace(trace, semantics).by_invariant == {}, semantics
    assert replay(trace, resolve_candidate("reference")) == (None, 1)


@pytest.mark.parametrize("name", sorted(LOADS))
def test_the_reference_promotes_and_admits_as_vllm_did(tmp_path: Path, name: str) -> None:
    """vLLM's second step (recorded, cut from the trace: the test ends before
    its update) is the reference's: the promotion's replay, the admission's
    tables."""
    _, trace = _convert(tmp_path, name)
    computed, scheduled, tables = LOADS[name][3]
    recorded = [json.loads(line) for line in
                (DATA / f"vllm-0.33.0-prefix-replay-{name}.jsonl").read_text().splitlines()]
    events = next(r for r in recorded if r["t"] == "schedule" and r["step"] == 1)["output"]["events"]
    assert [(e["type"], e["num_computed_tokens"], e.get("num_scheduled_tokens"), e["group_block_ids"])
            for e in events] == [("kv_promote", computed, None, [[], []]),
                                 ("schedule", computed, scheduled, tables)]
    case = FuzzCase(dict(trace.meta["config"]), tuple(workload_from_trace(trace).requests))
    run = run_case(Scheduler, case)
    assert run.ended == "" and run.result.by_invariant == {}, run.result.violations[:3]
    step1 = [(r["kind"], r["num_computed_tokens"], r.get("num_scheduled_tokens"), r["group_block_ids"])
             for s, rows in run.steps if s == 1 for r in rows if r["kind"] in ("kv_promote", "schedule")]
    assert step1 == [("kv_promote", computed, None, [[], []]), ("schedule", computed, scheduled, tables)]


def _case(bounded: bool) -> FuzzCase:
    """``a`` prefills 200 tokens in chunks of 64 while ``b`` loads 64 of its
    100 tokens asynchronously (reported done in the first step's output)."""
    def one(rid: str, prompt: tuple[int, ...]) -> RequestSpec:
        return RequestSpec(request_id=rid, arrival_time=0.0, prompt_token_ids=prompt, max_tokens=2,
                           ignore_eos=True)

    config = {"num_gpu_blocks": 60, "block_size": 16, "max_model_len": 256, "max_num_seqs": 4,
              "max_num_batched_tokens": 128, "long_prefill_token_threshold": 64, "sliding_window": 32,
              "layer_types": ["full_attention", "sliding_attention"], "swa_bounded_replay": bounded,
              "enable_prefix_caching": True, "kv_connector": True,
              "kv_connector_matches": [["a", [[0, False]]], ["b", [[64, True]]]],
              "kv_connector_outputs": [[0, ["b"], []]]}
    return FuzzCase(config, (one("a", (7,) * 200), one("b", (0,) * 100)))


def _rows(run, rid: str) -> list[tuple]:
    return [(s, r["kind"], r.get("num_computed_tokens"), r.get("num_scheduled_tokens"), r.get("reserved_blocks"),
             r["group_block_ids"]) for s, rows in run.steps for r in rows
            if r.get("request_id") == rid and r["kind"] in ("kv_load", "kv_promote", "schedule", "finish")]


@pytest.mark.parametrize("bounded", [True, False])
def test_a_load_beside_an_inflight_prefill_every_group_followed(bounded: bool) -> None:
    run = run_case(Scheduler, _case(bounded))
    assert run.ended == "" and run.result.by_invariant == {}, run.result.violations[:3]
    # The reservation: a still needs cdiv(200, 16) - 4 = 9 full-attention blocks and
    # min(13, cap 11) - 4 = 7 window blocks (cap: cdiv(31 + 128, 16) + 1).
    load = (0, "kv_load", 0, None, 16, [[9, 10, 11, 12], [0, 0, 13, 14]])
    if bounded:  # promoted 32 tokens back (the window replayed), then 64 + 4 tokens
        assert _rows(run, "b") == [
            load, (1, "kv_promote", 32, None, None, [[], []]),
            (1, "schedule", 32, 64, None, [[9, 10, 11, 12, 21, 22], [0, 0, 13, 14, 23, 24]]),
            (2, "schedule", 96, 4, None, [[14], [13]]), (3, "schedule", 100, 1, None, [[], []]),
            (3, "finish", None, None, None, [[14, 22, 21, 12, 11, 10, 9], [13, 24, 23]])]
    else:  # a plain window: the loaded 64 tokens kept
        assert _rows(run, "b") == [
            load, (1, "kv_promote", 64, None, None, [[], []]),
            (1, "schedule", 64, 36, None, [[9, 10, 11, 12, 23, 24, 25], [0, 0, 13, 14, 26, 27, 28]]),
            (2, "schedule", 100, 1, None, [[], []]),
            (2, "finish", None, None, None, [[25, 24, 23, 12, 11, 10, 9], [28, 27, 26]])]


def _edited(run, kind: str, edit) -> list:
    steps = []
    for s, rows in run.steps:
        steps.append((s, [edit(dict(r)) if r.get("kind") == kind and r.get("request_id") == "b" else r
                          for r in rows]))
    return steps


def test_the_checker_fires_on_a_load_or_promotion_that_leaves_vllms() -> None:
    from harness.check.checker import check_steps

    case = _case(True)
    run = run_case(Scheduler, case)

    def first(steps) -> tuple:
        v = check_steps(case.engine_config().to_dict(), steps).violations[0]
        return v.invariant, v.step, v.request

    # The reservation ignores the window group's admission cap (13 - 4 = 9 for it).
    assert first(_edited(run, "kv_load", lambda r: {**r, "reserved_blocks": 18})) == ("REMOTE-KV-RESERVATION", 0, "b")
    # The load's window group leaves a slot the window reads null (13 never taken).
    assert first(_edited(run, "kv_load", lambda r: {**r, "block_ids": [9, 10, 11, 12, 14],
                                                    "group_block_ids": [[9, 10, 11, 12], [0, 0, 0, 14]]})) == (
        "SLIDING-WINDOW-HELD", 0, "b")
    # The load's full-attention table is a block short of its 64 tokens.
    assert first(_edited(run, "kv_load", lambda r: {**r, "block_ids": [9, 10, 11, 12, 13],
                                                    "group_block_ids": [[9, 10, 11], [0, 0, 12, 13]]})) == (
        "BLOCKS-COVER", 0, "b")
    # The promotion does not replay the window: b resumes at its 64 loaded tokens.
    assert first(_edited(run, "kv_promote", lambda r: {**r, "num_computed_tokens": 64})) == (
        "REMOTE-KV-LOADING", 1, "b")


def test_what_stays_refused_on_a_hybrid_kv_cache(tmp_path: Path) -> None:
    config = EngineConfig.from_dict(_case(True).config)
    check_config_supported(config)  # a recorded connector that loads: followed
    with pytest.raises(ConfigError, match=r"^sliding_window / layer_types \(a hybrid KV cache\) with kv_connector "
                                          r"is not modelled: the simulated connector's loads fill one "
                                          r"full-attention KV-cache group$"):
        check_config_supported(EngineConfig.from_dict(
            {k: v for k, v in _case(True).config.items() if not k.startswith("kv_connector_")}))
    with pytest.raises(ConfigError, match=r"reports invalid blocks is not modelled"):
        check_config_supported(EngineConfig.from_dict({**_case(True).config,
                                                       "kv_connector_outputs": [[0, ["b"], [9]]]}))
    # A recording made before the recorder wrote each group's blocks of a load.
    records = [json.loads(line) for line in
               (DATA / "vllm-0.33.0-prefix-replay-load.jsonl").read_text().splitlines()]
    for rec in records:
        for event in (rec.get("output") or {}).get("events", ()):
            if event["type"] in ("kv_load", "kv_promote"):
                del event["group_block_ids"]
    src = tmp_path / "old.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = rc.convert(src, tmp_path / "old.parquet")
    assert ("the KV connector's recorded answers are not replayable: a hybrid KV cache (1 load decision "
            "recorded without each group's blocks)") in summary["warnings"]
    assert open_trace(tmp_path / "old.parquet").config.kv_connector_matches is None
    # Loads beside Mamba groups (vLLM schedules them on the groups' common block size).
    mamba = {**_case(True).config, "layer_types": ["full_attention", "linear_attention"],
             "swa_bounded_replay": False, "sliding_window": None, "enable_prefix_caching": False}
    with pytest.raises(ConfigError, match=r"^linear_attention \(Mamba\) layers with a recorded KV connector that "
                                          r"loads are not modelled"):
        check_config_supported(EngineConfig.from_dict(mamba))
