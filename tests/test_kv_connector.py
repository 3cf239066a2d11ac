"""The simulated KV connector and async KV loading (spec 7.2, 10.2).

``Scheduler`` is driven directly: an async-load admission takes blocks and
enters WAITING_FOR_REMOTE_KVS without running; a ``KVConnectorOutput`` with
``finished_recving`` makes it promotable at the next ``schedule()``. Every test
asserts exact block ids, token counts and queue orders. Names follow vLLM's
tests (``tests/v1/kv_connector/unit/``) where one exists.
"""

from __future__ import annotations


import pyarrow.parquet as pq
import pytest

from harness.check import check_steps
from harness.trace.recorder import record
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from reference.config import ConfigError, EngineConfig
from reference.kv_connector import KVConnectorOutput, held_prefix_tokens
from reference.output import Promotion, RemoteLoad, ScheduledRequest, Skip
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler

BS = 4


def make_scheduler(**overrides) -> Scheduler:
    config = dict(num_gpu_blocks=21, block_size=BS, max_model_len=64, max_num_seqs=4,
                  max_num_batched_tokens=64, kv_connector=True, kv_store_fraction=1.0)
    config.update(overrides)
    return Scheduler(EngineConfig(**config))


def make_request(request_id: str, num_tokens: int, base: int, max_tokens: int = 4) -> Request:
    return Request(request_id, list(range(base, base + num_tokens)), SamplingParams(max_tokens=max_tokens),
                   block_size=BS)


def test_held_prefix_is_whole_blocks_by_content() -> None:
    prompt = list(range(100, 110))  # two full blocks and a partial one
    assert held_prefix_tokens(prompt, BS, 1.0) == 8
    assert held_prefix_tokens(prompt, BS, 0.0) == 0
    # Content-defined: the same prefix is held the same way in any prompt.
    partial = held_prefix_tokens(list(range(0, 400)), BS, 0.5)
    assert partial % BS == 0 and held_prefix_tokens(list(range(0, 400)) + [7], BS, 0.5) == partial


def test_async_load_admission_promotion_and_whole_prompt_recompute() -> None:
    """A held 8-token prompt: load (blocks, no tokens), then promotion to
    num_tokens - 1 and a 1-token step that samples (test_basic_lifecycle)."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 8, 100))
    out = sched.schedule()
    assert out.events == [RemoteLoad("a", 0, 8, [1, 2], 0)]
    assert out.num_scheduled_tokens == {} and sched.running == []
    request = sched.requests["a"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 8
    assert sched.snapshot().waiting == ("a",) and sched.kv_cache_manager.num_free_blocks == 18
    sched.update_from_output(out, {}, KVConnectorOutput())
    out = sched.schedule()  # not reported yet: skipped, blocks kept
    assert out.events == [Skip("a", "waiting for remote KV")]
    result = sched.update_from_output(out, {}, KVConnectorOutput(("a",)))
    assert result.finished_recving == ["a"]
    out = sched.schedule()
    assert out.events == [Promotion("a", RequestStatus.WAITING, 7, False),
                          ScheduledRequest("a", "new", 7, 1, 0, [1, 2])]
    # The loaded blocks are cached at promotion: a twin prompt hits them.
    twin = make_request("b", 9, 100)
    sched.add_request(twin)
    assert sched.kv_cache_manager.get_computed_blocks(twin)[1] == 8


def test_abort_request_waiting_for_remote_kvs_keeps_blocks_until_transfer_done() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 8, 100))
    out = sched.schedule()
    (fin,) = sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert fin.freed_block_ids == [] and sched.kv_cache_manager.num_free_blocks == 18
    assert sched.get_num_unfinished_requests() == 0 and list(sched.kv_pending_free) == ["a"]
    result = sched.update_from_output(out, {}, KVConnectorOutput(("a",)))
    assert [(f.request_id, f.freed_block_ids) for f in result.kv_freed] == [("a", [2, 1])]
    assert sched.kv_cache_manager.num_free_blocks == 20


def test_failed_load_recompute_keeps_valid_prefix() -> None:
    """Block 2 (the second loaded block) failed: promotion resumes from 4 tokens."""
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, 100))
    out = sched.schedule()
    assert out.events == [RemoteLoad("a", 0, 8, [1, 2], 0)]
    result = sched.update_from_output(out, {}, KVConnectorOutput(("a",), frozenset({2})))
    assert result.invalid_block_ids == [2] and result.finished == []
    out = sched.schedule()
    assert out.events == [Promotion("a", RequestStatus.WAITING, 4, True),
                          ScheduledRequest("a", "new", 4, 6, 0, [1, 2, 3])]


def test_failed_load_with_nothing_valid_frees_and_looks_up_again() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, 100))
    out = sched.schedule()
    sched.update_from_output(out, {}, KVConnectorOutput(("a",), frozenset({1})))
    out = sched.schedule()
    # Nothing valid: every block freed (tail first), then a fresh lookup starts
    # a new load. vLLM quirk: "a" is still in _inflight_prefills, so its new
    # load reserves its own remaining 3 blocks too.
    assert out.events == [Promotion("a", RequestStatus.WAITING, 0, True, [2, 1]),
                          RemoteLoad("a", 0, 8, [2, 1], 3)]


def test_failed_load_policy_fail_finishes_with_error_and_frees_after_transfer() -> None:
    sched = make_scheduler(kv_load_failure_policy="fail")
    sched.add_request(make_request("a", 10, 100))
    out = sched.schedule()
    result = sched.update_from_output(out, {}, KVConnectorOutput(("a",), frozenset({2})))
    assert [(f.request_id, f.status, f.freed_block_ids) for f in result.finished] == [
        ("a", RequestStatus.FINISHED_ERROR, [])]
    assert [(f.request_id, f.freed_block_ids) for f in result.kv_freed] == [("a", [2, 1])]


def test_async_load_reservation_prevents_wedge() -> None:
    """A 40-token prompt is prefilling in chunks (it still needs 5 more
    blocks); a 24-token load would leave 4 free blocks, so it waits
    (test_async_load_reservation_prevents_wedge_e2e)."""
    sched = make_scheduler(num_gpu_blocks=16, max_model_len=48, max_num_batched_tokens=12,
                           kv_store_fraction=0.0, long_prefill_token_threshold=8,
                           scheduler_reserve_full_isl=False)
    sched.add_request(make_request("a", 40, 100))
    sched.schedule()  # alone: no threshold, 12 tokens, 3 blocks
    sched.connector.fraction = 1.0  # from now on the store holds every prompt
    sched.add_request(make_request("b", 24, 500))
    out = sched.schedule()
    # a: 8 more tokens (5 blocks, 10 free); b's 6 blocks would leave 4 < the
    # 10 - 5 = 5 blocks a still needs: no load, and b waits.
    assert [(e.request_id, e.num_scheduled_tokens) for e in out.events] == [("a", 8)]
    assert sched.requests["b"].status == RequestStatus.WAITING
    assert sched._inflight_prefill_reserved_blocks() == 5
    assert sched.kv_cache_manager.num_free_blocks == 10


def test_connector_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="kv_load_failure_policy"):
        EngineConfig(kv_connector=True, kv_load_failure_policy="retry")
    with pytest.raises(ConfigError, match="kv_store_fraction"):
        EngineConfig(kv_connector=True, kv_store_fraction=1.5)
    with pytest.raises(ConfigError, match="defer_block_free"):
        EngineConfig(kv_connector=True, async_scheduling=True)
    with pytest.raises(ConfigError, match="defer_block_free"):
        EngineConfig(kv_connector=True, pipeline_parallel_size=2)
    # Off by default, and left out of the metadata then (old fingerprints hold).
    assert "kv_connector" not in EngineConfig().to_dict()


def test_kv_connector_golden_counts(tmp_path) -> None:
    scenario = SCENARIOS["kv-connector"]
    path = tmp_path / "kv.parquet"
    summary = record(scenario.make_workload(), scenario.engine_config(), path, seed=scenario.seed)
    assert (summary.remote_kv_loads, summary.failed_kv_loads, summary.aborted) == (24, 9, 15)
    trace = open_trace(path)
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.ok and (result.remote_kv_loads, result.failed_kv_loads) == (24, 9)
    kinds = pq.read_table(path, columns=["kind"]).column("kind").to_pylist()
    assert {k: kinds.count(k) for k in ("kv_load", "kv_promote", "kv_invalid", "kv_finished", "kv_free")} == {
        "kv_load": 24, "kv_promote": 22, "kv_invalid": 7, "kv_finished": 24, "kv_free": 2}


def test_schema_3_trace_still_reads(tmp_path, schema3_copy) -> None:
    """Traces written before the KV connector and encoder inputs (schema 3)
    lack their columns: they read with those columns null and check clean."""
    golden = SCENARIOS["fcfs-tight"]
    path = tmp_path / "new.parquet"
    record(golden.make_workload(), golden.engine_config(), path, seed=golden.seed)
    trace = open_trace(schema3_copy(path, tmp_path / "old.parquet"))
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.ok and result.steps == 392


def test_empty_batch_carrying_finished_loads_is_not_a_stall() -> None:
    """Engine bug (stall detector): with two batches in flight, a step that
    schedules nothing may launch an empty batch whose KV-connector output
    reports a load done; the detector counted only batches with scheduled
    tokens as work in flight and raised EngineStalled at step 1 (seen on the
    Azure KV preset with async scheduling: 424 requests never finished)."""
    from reference.engine import Engine
    from reference.workload import RequestSpec, Workload

    workload = Workload(source="synthetic", sha256="0" * 64, params={},
                        requests=(RequestSpec("r0", 0.0, tuple(range(100, 108)), max_tokens=3),))
    config = EngineConfig(num_gpu_blocks=21, block_size=BS, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, kv_connector=True, kv_store_fraction=1.0,
                          kv_load_steps=2, async_scheduling=True,
                          defer_block_free=True)
    summary = Engine(config).run(workload)
    assert (summary.finished, summary.remote_kv_loads, summary.stalled) == (1, 1, None)
