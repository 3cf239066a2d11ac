"""Issue 7: property-based fuzzing (harness/fuzz/, `harness fuzz`, also
with --workers), the scripted proposer's draft acceptance patterns, and
stateful tests of the block pool / KV-cache manager and of the scheduler."""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harness.cli import main
from harness.fuzz import (KNOWN_REFERENCE_FINDINGS, MM_ITEM_BASE, FuzzCase, evaluate, fuzz, fuzz_cases,
                          known_reference_finding, mm_item_tokens, run_case)
from harness.trace.recorder import record
from harness.trace import open_trace
from reference.engine import Engine, EngineSummary
from reference.workload import RequestSpec, Workload
from reference.config import ConfigError, EngineConfig
from reference.kv_cache_manager import KVCacheManager
from reference.runners.scripted import RequestScript, ScriptedModelRunner
from harness.candidates.mutants import MUTANTS_AND_TARGETS
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler
from workloads.scenario import load_scenario

# The cases asserted here are hypothesis's shrinks run to their end: no wall-clock bound on
# shrinking (fuzz's default, SHRINK_BUDGET_S, cut one short on a loaded machine: 8 requests, not 2).
fuzz = functools.partial(fuzz, shrink_budget_s=None)

REGRESSIONS = Path(__file__).parent / "regressions"
# Known reference findings passed over by ``fuzz(None, max_examples=300,
# seed=S, known=known_reference_finding)``, by seed (exact counts).
KNOWN_BY_SEED = {28: {"give-back-uncomputed-hit": 2, "kv-failed-load-wedge": 1},
                 30: {"kv-spec-reservation-wedge": 5}}

# Mutants the fuzzer finds quickly at seed 0 (60 examples, known reference
# findings passed over): (examples until the first failure, requests in the
# shrunk witness). Exact: they change only when the strategy (or the mutant)
# does. (Re-pinned when the KV connector and encoder inputs joined the
# strategy, which shifted hypothesis's draws: leak-on-abort 5 -> 3 examples,
# free-unhashed-to-tail 2 -> 1 requests, ignore-prefill-cadence (5, 1) ->
# (7, 3), hit-evicted-block 5 -> 4 requests; the others are unchanged.)
FOUND_QUICKLY = {"leak-on-finish": (1, 1), "leak-on-abort": (3, 1), "budget-overrun": (1, 1),
                 "over-allocate": (1, 1), "free-unhashed-to-tail": (3, 1), "forget-finished-ids": (3, 2),
                 "no-stop-on-max-tokens": (2, 1), "ignore-prefill-cadence": (7, 3),
                 "drafts-on-prefill": (5, 1), "hit-evicted-block": (3, 4)}

# The mutants of the KV connector and of encoder inputs: (hypothesis seed,
# example budget) -> (examples until the first failure, requests in the
# shrunk witness). Seed 0 with 60 examples finds the four KV-connector ones
# and no-encoder-cache-check; ignore-encoder-budget and evict-newest-first
# need more (seed 0: none within 200 examples, evict-newest-first at 556 of
# 1500 with 11 requests), so they use the seed where a short run finds them.
# no-encoder-give-back is not in the table: its trigger (a PRIORITY give-back
# of a victim that encoded an input, then a later running request needing
# that budget, all in one step) was not generated in 1500 examples at any of
# seeds 0-9; the hand-built scenario of tests/test_encoder.py catches it.
NEW_MUTANTS = {"free-while-loading": ((0, 60), (10, 3)), "cache-before-load": ((0, 60), (10, 7)),
               "no-load-reservation": ((0, 60), (38, 2)), "promote-early": ((0, 60), (38, 1)),
               "no-encoder-cache-check": ((0, 60), (11, 3)), "ignore-encoder-budget": ((15, 150), (3, 2)),
               "evict-newest-first": ((9, 150), (79, 2))}


def test_reference_survives_fuzzing():
    """300 examples at seed 0: no failure of the reference but the known
    findings (``known_reference_finding``: they mirror vLLM 0.33.0 and have
    their own tests), which are passed over; anything else fails. At this
    seed none of them comes up either."""
    result = fuzz(None, max_examples=300, seed=0, known=known_reference_finding)
    assert result.failure is None, result.failure and result.failure.to_dict()
    assert result.examples == 300
    assert result.known == {}
    # At other seeds the known findings do come up, and only they.
    for seed, known in KNOWN_BY_SEED.items():
        result = fuzz(None, max_examples=300, seed=seed, known=known_reference_finding)
        assert result.failure is None, result.failure and result.failure.to_dict()
        assert result.known == known


def test_generated_configs_are_valid_and_small():
    from harness.fuzz import fuzz_cases

    @settings(max_examples=50, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @__import__("hypothesis").given(fuzz_cases())
    def prop(case: FuzzCase) -> None:
        EngineConfig(**case.config)
        assert 1 <= len(case.requests) <= 12
        assert all(len(r.prompt_token_ids) <= 64 for r in case.requests)
        assert len({r.request_id for r in case.requests}) == len(case.requests)
        c = case.config
        assert not (c["async_scheduling"] and c["num_speculative_tokens"])
        assert FuzzCase.from_dict(json.loads(json.dumps(case.to_dict()))) == case
        if c.get("kv_connector"):
            assert c["defer_block_free"] or case.engine_config().max_concurrent_batches == 1
            assert c["kv_load_failure_rate"] < 1.0 or c["kv_load_failure_policy"] == "fail"
            assert c["block_size"] > 1 or all(len(r.prompt_token_ids) > 1 for r in case.requests)
        for r in case.requests:
            for offset, length in r.mm_positions:
                # An item starts at a block boundary +-1 and holds a catalogue item's tokens.
                assert offset % c["block_size"] in {0, 1, c["block_size"] - 1}
                k = (r.prompt_token_ids[offset] - MM_ITEM_BASE) // 1000
                assert list(r.prompt_token_ids[offset:offset + length]) == mm_item_tokens(k, length)

    prop()


def test_fuzz_strategy_covers_the_kv_connector_and_encoder_inputs():
    """The generated cases reach every dimension of issue 7's remote-KV and
    encoder-input part (400 derandomised examples)."""
    seen: set[str] = set()

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @__import__("hypothesis").given(fuzz_cases())
    def prop(case: FuzzCase) -> None:
        c = case.config
        if not c.get("kv_connector"):
            seen.add("kv off")
        else:
            seen.add("kv on")
            fraction = c["kv_store_fraction"]
            seen.add("store whole" if fraction == 1.0 else "store partial" if fraction else "store empty")
            seen.add(f"load steps {c['kv_load_steps']}")
            rate = c["kv_load_failure_rate"]
            seen.add("no failures" if rate == 0 else "high failure rate" if rate >= 0.75 else "failures")
            seen.add(f"policy {c['kv_load_failure_policy']}")
            if case.engine_config().max_concurrent_batches > 1:
                seen.add("kv with batches in flight")
            if c["async_scheduling"]:
                seen.add("kv with async scheduling")
        items = [(r, p) for r in case.requests for p in r.mm_positions]
        if items:
            seen.add("encoder inputs")
            contents = [tuple(r.prompt_token_ids[o:o + n]) for r, (o, n) in items]
            if any(contents.count(x) > 1 and len({r.request_id for r, (o, n) in items
                                                  if r.prompt_token_ids[o:o + n] == x}) > 1
                   for x in contents):
                seen.add("item shared between requests")
            if c["max_num_encoder_input_tokens"] is not None \
                    and c["max_num_encoder_input_tokens"] < max(n for _, (_, n) in items) * 2:
                seen.add("budget below two items")
            if c["encoder_cache_size"] is not None \
                    and c["encoder_cache_size"] < sum(n for _, (_, n) in items):
                seen.add("cache below all items")
            if c["disable_chunked_mm_input"]:
                seen.add("disable_chunked_mm_input")
            bs = c["block_size"]
            seen.update(f"item at boundary {d:+d}" for _, (o, _) in items
                        for d in (-1, 0, 1) if bs > 2 and o % bs == d % bs)
        # Aborts that land while a load is in flight (the blocks wait for the transfer).
        if c.get("kv_connector") and any(r.abort_time is not None for r in case.requests) \
                and "abort while loading" not in seen:
            steps = run_case(Scheduler, case).steps
            if any(row["kind"] == "kv_free" for _, rows in steps for row in rows):
                seen.add("abort while loading")

    prop()
    assert seen == {"kv off", "kv on", "store whole", "store partial", "store empty", "load steps 1",
                    "load steps 2", "load steps 3", "load steps 4", "no failures", "failures",
                    "high failure rate", "policy recompute", "policy fail", "kv with batches in flight",
                    "kv with async scheduling", "encoder inputs", "item shared between requests",
                    "budget below two items", "cache below all items", "disable_chunked_mm_input",
                    "item at boundary -1", "item at boundary +0", "item at boundary +1",
                    "abort while loading"}


@pytest.mark.parametrize("name", sorted(FOUND_QUICKLY))
def test_fuzz_finds_mutant(name):
    cls, _target = MUTANTS_AND_TARGETS[name]
    result = fuzz(cls, max_examples=60, seed=0, known=known_reference_finding)
    assert result.found, f"{name} not found in 60 examples"
    assert result.failure.kind != "reference-violation", result.failure.to_dict()
    # Found early and shrunk to a small witness.
    assert (result.examples, len(result.case.requests)) == FOUND_QUICKLY[name]
    # The minimal case really fails, deterministically.
    assert evaluate(cls, result.case) is not None


@pytest.mark.parametrize("name", sorted(NEW_MUTANTS))
def test_fuzz_finds_kv_connector_and_encoder_mutant(name):
    (seed, budget), expected = NEW_MUTANTS[name]
    cls, _target = MUTANTS_AND_TARGETS[name]
    result = fuzz(cls, max_examples=budget, seed=seed, known=known_reference_finding)
    assert result.found, f"{name} not found in {budget} examples at seed {seed}"
    assert result.failure.kind != "reference-violation", result.failure.to_dict()
    assert (result.examples, len(result.case.requests)) == expected
    c = result.case.config
    if name in ("free-while-loading", "cache-before-load", "no-load-reservation", "promote-early"):
        assert c["kv_connector"]
    else:
        assert any(r.mm_positions for r in result.case.requests)
    assert evaluate(cls, result.case) is not None


def test_fuzz_is_deterministic():
    cls = MUTANTS_AND_TARGETS["ignore-max-num-seqs"][0]
    a, b = fuzz(cls, max_examples=60, seed=3), fuzz(cls, max_examples=60, seed=3)
    assert a.found and b.found
    assert a.case == b.case and a.examples == b.examples


def test_cli_writes_replayable_trace(tmp_path):
    runner = CliRunner()
    out = tmp_path / "out"
    res = runner.invoke(main, ["fuzz", "--candidate", "mutant:leak-on-abort", "--max-examples", "50",
                               "--seed", "0", "-o", str(out)])
    assert res.exit_code == 1, res.output
    traces = list(out.glob("*.parquet"))
    assert len(traces) == 1
    info = json.loads(next(out.glob("*.json")).read_text())
    assert info["candidate"] == "mutant:leak-on-abort"
    assert info["replay_command"] in res.output
    assert info["num_requests"] >= 1 and info["num_steps"] >= 1
    replay = runner.invoke(main, ["replay", str(traces[0]), "--candidate", "mutant:leak-on-abort"])
    assert replay.exit_code == 1, replay.output
    # A divergence-only mutant: the trace is the reference's, and replaying it diverges.
    out2 = tmp_path / "out2"
    res = runner.invoke(main, ["fuzz", "--candidate", "mutant:lifo-priority-victim",
                               "--max-examples", "60", "--seed", "25", "-o", str(out2)])
    assert res.exit_code == 1, res.output
    trace = next(out2.glob("*.parquet"))
    replay = runner.invoke(main, ["replay", str(trace), "--candidate", "mutant:lifo-priority-victim"])
    assert replay.exit_code == 1 and "DIVERGENCE" in replay.output, replay.output


def test_cli_reference_clean(tmp_path):
    res = CliRunner().invoke(main, ["fuzz", "--max-examples", "20", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "nothing found" in res.output


@pytest.mark.parametrize("args", [
    ["--max-examples", "0"],
    ["--max-examples", "x"],
    ["--candidate", "mutant:no-such-mutant"],
    ["--time-budget", "-1"],
    ["--workers", "x"],
    ["--workers", "-1"],
    ["--workers", "257"],
    ["--workers", "1.5"],
    [],  # -o missing
])
def test_cli_bad_arguments_exit_2(tmp_path, args):
    if args:
        args = args + ["-o", str(tmp_path / "o")]
    res = CliRunner().invoke(main, ["fuzz", *args])
    assert res.exit_code == 2, res.output


def test_cli_time_budget(tmp_path):
    res = CliRunner().invoke(main, ["fuzz", "--max-examples", "100000", "--time-budget", "0.5",
                                    "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "time budget" in res.output


def test_fuzz_found_spec_decode_with_pipelining_livelock_is_now_refused():
    """Regression (found by `harness fuzz`, seed 0, example ~935): speculative
    decoding with two batches in flight stored drafts for a batch whose
    successor was already scheduled; the drafts landed on the wrong positions,
    num_computed_tokens ran past the tokens and the request livelocked. The
    combination is not modelled (vLLM pipelines spec decode only through the
    async scheduler's placeholders, which are: reference.async_spec), so the
    config (two batches by pipelining, no async scheduling) is refused."""
    case = json.loads((REGRESSIONS / "fuzz-reference-liveness-spec-pipeline.json").read_text())
    with pytest.raises(ConfigError, match="speculative decoding with pipeline_parallel_size > 1 is not modelled"):
        EngineConfig.from_dict(case["scenario"]["config"])


# ----------------------------------------------------------------- stateful

BLOCK_SIZE = 2
NUM_BLOCKS = 12
# Two prompt "families": requests of one family share prefixes (prefix hits).
FAMILIES = [[10 + i for i in range(16)], [50 + i for i in range(16)]]


class KVCacheMachine(RuleBasedStateMachine):
    """Allocates, grows, frees and prefix-hits small fake requests on a tiny
    pool and checks the pool's bookkeeping after every rule."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=16,
                                 enable_caching=True)
        self.live: dict[str, Request] = {}
        self.counter = 0

    def _new_request(self, family: int, length: int) -> Request:
        self.counter += 1
        return Request(f"q{self.counter}", FAMILIES[family][:length], SamplingParams(max_tokens=4),
                       block_size=BLOCK_SIZE)

    @rule(family=st.integers(0, 1), length=st.integers(1, 12), use_hit=st.booleans())
    def admit(self, family: int, length: int, use_hit: bool) -> None:
        req = self._new_request(family, length)
        hits, hit_tokens = self.kv.get_computed_blocks(req) if use_hit else ([], 0)
        n = req.num_tokens - hit_tokens
        blocks = self.kv.allocate_slots(req, n, num_new_computed_tokens=hit_tokens,
                                        new_computed_blocks=hits, has_scheduled_reqs=False)
        if blocks is None:
            assert req.request_id not in self.kv.req_to_blocks
            return
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit_tokens + n
        self.live[req.request_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra=st.integers(1, 3))
    def grow(self, data, extra: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        room = 16 - req.num_tokens
        if room <= 0:
            return
        n = min(extra, room)
        for k in range(n):  # decode tokens appended as output
            req.append_output_token_ids(3000 + k + req.num_tokens)
        # compute them (the new tokens need slots)
        blocks = self.kv.allocate_slots(req, n)
        if blocks is not None:
            req.num_computed_tokens += n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live.pop(rid)
        req.status = RequestStatus.FINISHED_STOPPED
        table = self.kv.get_block_ids(rid)
        freed = self.kv.free(req)
        assert freed == table[::-1]

    @invariant()
    def conservation(self) -> None:
        pool = self.kv.block_pool
        held = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
        assert pool.get_num_free_blocks() + held == NUM_BLOCKS - 1

    @invariant()
    def free_queue_iff_unreferenced(self) -> None:
        pool = self.kv.block_pool
        free = set(pool.free_block_queue.block_ids())
        for b in pool.blocks:
            if b.is_null:
                assert b.block_id not in free
            else:
                assert (b.block_id in free) == (b.ref_cnt == 0), b

    @invariant()
    def ref_counts_match_tables(self) -> None:
        pool = self.kv.block_pool
        owners: dict[int, int] = {}
        for rid, table in self.kv.req_to_blocks.items():
            assert len({b.block_id for b in table}) == len(table)
            for b in table:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == owners.get(b.block_id, 0), b
        # Shared only if it is a cached (hashed) full block.
        for block_id, count in owners.items():
            if count > 1:
                assert pool.blocks[block_id].block_hash is not None

    @invariant()
    def hashes_map_back(self) -> None:
        pool = self.kv.block_pool
        for h, bucket in pool.cached_block_hash_to_block.items():
            assert bucket
            for block_id, block in bucket.items():
                assert block is pool.blocks[block_id] and block.block_hash == h
        for b in pool.blocks:
            if b.block_hash is not None:
                assert b.block_id in pool.cached_block_hash_to_block[b.block_hash]
        # A live request's registered blocks carry its own chained hashes.
        for rid, req in self.live.items():
            table = self.kv.req_to_blocks[rid]
            for i in range(self.kv.num_cached_block.get(rid, 0)):
                assert table[i].block_hash == req.block_hashes[i]


KVCacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None,
                                            database=None, derandomize=True)
TestKVCacheStateful = KVCacheMachine.TestCase


def test_fuzz_found_shared_prefix_block_in_two_deferred_frees_false_alarm():
    """Regression (found by `harness fuzz --seed 3`): two aborted requests
    sharing a prefix block deferred their frees behind the same fence; the
    checker gave both entries one reference, so the shared block returned to
    its free queue when the first drained and the next allocation looked out
    of order (a false ALLOC-FROM-HEAD). Each deferred entry now holds its own."""
    case = FuzzCase.from_dict(json.loads(
        (REGRESSIONS / "fuzz-checker-shared-block-two-deferred-frees.json").read_text())["scenario"])
    assert evaluate(None, case) is None


def test_fuzz_found_false_stall_after_a_step_that_only_preempted():
    """Regression (found by `harness fuzz --seed 2`): under PRIORITY a request
    preempted itself and the other running one was a deferred prefill chunk,
    so the step scheduled nothing; the engine took that for a permanent stall,
    although the next step (no decode left to protect) runs the prefill."""
    case = FuzzCase.from_dict(json.loads(
        (REGRESSIONS / "fuzz-engine-false-stall-after-self-preemption.json").read_text())["scenario"])
    assert evaluate(None, case) is None


def test_fuzz_finding_priority_tie_preemption_livelock():
    """A finding (`harness fuzz --seed 6`), shared by real vLLM 0.33.0 (see
    tests/test_vllm.py): two requests of equal priority and arrival time whose
    prompts do not fit the pool together, caching off, one token per step.
    The PRIORITY victim is the first running request with the largest
    (priority, arrival_time): the older one, which restarts from zero; the two
    preempt each other forever. LIVENESS reports it."""
    case = FuzzCase.from_dict(json.loads(
        (REGRESSIONS / "fuzz-finding-priority-tie-preemption-livelock.json").read_text())["scenario"])
    failure = evaluate(None, case)
    assert failure is not None and failure.kind == "reference-violation"
    assert set(failure.to_dict()["invariants"]) == {"LIVENESS"}


def _regression(name: str) -> FuzzCase:
    return FuzzCase.from_dict(json.loads((REGRESSIONS / name).read_text())["scenario"])


def _rows(case: FuzzCase) -> list[dict]:
    return [row for _, rows in run_case(Scheduler, case).steps for row in rows]


def test_fuzz_found_invalid_block_of_a_load_aborted_while_loading_false_alarm():
    """Regression (found while extending the strategy to the KV connector): r000001
    was aborted while its KV load was in flight, then the load failed and its
    block was reported invalid. The checker scanned only the live loading
    requests and called it a block "that belongs to no KV load in flight"
    (REMOTE-KV-LOADING). vLLM scans only the waiting requests, so the failure
    of a load whose request is gone changes nothing; the checker now counts
    the blocks of loads whose request finished while loading."""
    case = _regression("fuzz-checker-invalid-block-of-a-load-aborted-while-loading.json")
    kinds = [(row["kind"], row.get("request_id")) for row in _rows(case)]
    assert kinds.index(("abort", "r000001")) < kinds.index(("kv_invalid", None)) \
        < kinds.index(("kv_free", "r000001"))
    assert evaluate(None, case) is None


def test_fuzz_found_idle_admission_false_alarm_while_an_aborted_load_holds_blocks():
    """Regression (found while extending the strategy): r000000 was aborted
    while loading, so its 2 blocks stay held until its transfer reports done;
    with nothing running, r000001's 5-block load did not fit the 4 free
    blocks. The checker took the engine for empty (IDLE-ADMISSION); it now
    exempts steps where such a load holds blocks, as it did for deferred frees."""
    case = _regression("fuzz-checker-idle-admission-while-an-aborted-load-holds-blocks.json")
    rows = _rows(case)
    assert [r["step"] for r in rows if r["kind"] == "kv_free"] == [1]
    assert [r["step"] for r in rows if r["kind"] == "kv_load" and r["request_id"] == "r000001"] == [2]
    assert evaluate(None, case) is None


def test_fuzz_found_false_stall_when_the_only_victim_waits_for_its_fence():
    """Regression (found while extending the strategy; the KV connector forces
    deferred frees with batches in flight): two batches in flight, both
    running requests need a block at step 4 and none is free; the victim was
    scheduled in the batch still in flight, so its free would wait for the
    fence and the running loop gives up (vLLM 0.33.0). The engine took the
    empty step for a stall (EngineStalled, LIVENESS), although processing that
    batch makes the victim freeable: the next step preempts it and both finish."""
    case = _regression("fuzz-engine-false-stall-victim-behind-its-fence.json")
    rows = _rows(case)
    empty = [r["step"] for r in rows if r["kind"] == "schedule_end" and not r["total_num_scheduled_tokens"]]
    preempted = [(r["step"], r["request_id"]) for r in rows if r["kind"] == "preempt"]
    assert 4 in empty and preempted[0] == (5, "r000001")
    assert sorted(r["request_id"] for r in rows if r["kind"] == "finish") == ["r000000", "r000001"]
    assert evaluate(None, case) is None


def test_fuzz_finding_kv_failed_load_wedge():
    """A finding (`harness fuzz --seed 8 --max-examples 300 --report-known`),
    mirroring vLLM 0.33.0's scheduler (being confirmed on real vLLM): one
    2-token prompt, block size 1, 3 usable blocks, the whole prompt held by the
    store. Its load (2 blocks) fails at the first block, so nothing is valid;
    the promotion frees both blocks and the request, still at the head of the
    KV-holding queue, is looked up again. The new async load must leave the
    reservation of ``_inflight_prefills``, and that set still holds the
    request itself (2 blocks to go): 2 + 2 > 3 free blocks, so it is refused,
    every step: EngineStalled, IDLE-ADMISSION and LIVENESS. (With more
    requests, finished loads queued behind it add their reservation too: the
    10-request synthetic repro, seed 268, stalls the same way.)"""
    info = json.loads((REGRESSIONS / "fuzz-finding-kv-failed-load-wedge.json").read_text())
    case = FuzzCase.from_dict(info["scenario"])
    run = run_case(Scheduler, case)
    assert run.ended.startswith("stalled: step 1:") and "nothing scheduled" in run.ended
    rows = [row for _, rows in run.steps for row in rows]
    assert [(r["kind"], r.get("block_ids")) for r in rows if r["kind"].startswith("kv_")] == [
        ("kv_load", [1, 2]), ("kv_invalid", [1]), ("kv_finished", None), ("kv_promote", [2, 1])]
    failure = evaluate(None, case)
    assert failure.invariants == {"IDLE-ADMISSION": 1, "LIVENESS": 1}
    assert known_reference_finding(case, failure) == "kv-failed-load-wedge"


def test_fuzz_finding_kv_spec_reservation_wedge():
    """A finding (`harness fuzz --seed 10 --max-examples 300 --report-known`):
    with speculative decoding, vLLM 0.33.0 admits an async KV load only if it
    leaves the in-flight prefills' reservation plus one speculative step of
    blocks for the load itself (``_spec_decode_step_blocks``, scheduler.py);
    the config check only asks that one max_model_len sequence fit the pool.
    Here a 2-token prompt held whole needs 2 blocks + 2 (1 + 1 draft token, 1-token
    blocks) of the 3 usable ones, so the load is refused every step and, as
    the store always offers it, the request is never admitted: EngineStalled
    at step 0, IDLE-ADMISSION and LIVENESS. Read from vLLM 0.33.0's source; not
    yet run on real vLLM."""
    info = json.loads((REGRESSIONS / "fuzz-finding-kv-spec-reservation-wedge.json").read_text())
    case = FuzzCase.from_dict(info["scenario"])
    run = run_case(Scheduler, case)
    assert run.ended.startswith("stalled: step 0:") and run.result.remote_kv_loads == 0
    failure = evaluate(None, case)
    assert failure.invariants == {"IDLE-ADMISSION": 1, "LIVENESS": 1}
    assert known_reference_finding(case, failure) == "kv-spec-reservation-wedge"
    # Without the draft tokens the same load fits and the request finishes.
    plain = dataclasses.replace(case, config={**case.config, "num_speculative_tokens": 0})
    assert evaluate(None, plain) is None


def test_known_reference_findings_are_recognised_exactly():
    """Each known finding's witness is named; a failure of another kind, other
    invariants, or a mechanism the names do not cover, is not."""
    tie = _regression("fuzz-finding-priority-tie-preemption-livelock.json")
    failure = evaluate(None, tie)
    assert known_reference_finding(tie, failure) == "priority-tie-preemption-livelock"
    assert known_reference_finding(tie, dataclasses.replace(failure, kind="violation")) is None
    assert known_reference_finding(tie, dataclasses.replace(failure, invariants={"LIVENESS": 2, "FREE-ORDER": 1})) is None
    untied = FuzzCase(tie.config, tuple(dataclasses.replace(r, priority=i) for i, r in enumerate(tie.requests)))
    assert known_reference_finding(untied, failure) is None
    wedge = _regression("fuzz-finding-kv-failed-load-wedge.json")
    failure = evaluate(None, wedge)
    assert known_reference_finding(wedge, dataclasses.replace(failure, invariants={"LIVENESS": 1})) is None
    no_kv = FuzzCase({**wedge.config, "kv_connector": False}, wedge.requests, wedge.seed)
    assert known_reference_finding(no_kv, failure) is None
    # The HIT-UNCOMPUTED-BLOCK finding (tests/test_finding_give_back_uncomputed_hit.py) by its invariant.
    hit = FuzzCase({**tie.config, "policy": "priority"}, tie.requests)
    from harness.fuzz import Failure
    assert known_reference_finding(hit, Failure("reference-violation", "", {"HIT-UNCOMPUTED-BLOCK": 1})) \
        == "give-back-uncomputed-hit"
    assert set(KNOWN_REFERENCE_FINDINGS) == {"give-back-uncomputed-hit", "priority-tie-preemption-livelock",
                                             "kv-failed-load-wedge", "kv-spec-reservation-wedge"}
    for path in KNOWN_REFERENCE_FINDINGS.values():
        assert (Path(__file__).parent.parent / path).exists()


# ----------------------------------------------------------------- stateful: the scheduler

EOS = 2  # the scripted model emits it where a request's script says; never in a prompt

@st.composite
def _machine_configs(draw) -> EngineConfig:
    """Small synchronous configs (one batch in flight), 2-token blocks, max_model_len 16,
    pools of 8 to 11 usable blocks, no full-sequence admission gate."""
    spec = draw(st.sampled_from([0, 0, 2]))
    seqs = draw(st.integers(1, 3))
    return EngineConfig(
        num_gpu_blocks=draw(st.integers(9, 12)), block_size=2, max_model_len=16, max_num_seqs=seqs,
        max_num_batched_tokens=draw(st.integers(max(seqs, 1 + spec), 12)),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_prefix_caching=draw(st.booleans()),
        scheduler_reserve_full_isl=False,  # the admission gate would make preemptions rare
        num_speculative_tokens=spec,
        draft_acceptance_pattern=draw(st.sampled_from(["random", "cycle", "none"])),
        prefill_schedule_interval=draw(st.sampled_from([1, 2])))


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the reference Scheduler directly with the scripted model runner:
    add requests (shared-prefix families, EOS scripts, priorities), abort them,
    step (schedule, run, update, propose drafts) with or without the prefill
    throttle, and checks the scheduler's state after every rule."""

    scheduler_class = Scheduler

    @initialize(config=_machine_configs())
    def setup(self, config: EngineConfig) -> None:
        self.config = config
        self.sched = self.scheduler_class(config)
        self.runner = ScriptedModelRunner(seed=0)
        self.counter = 0
        self.ended = 0             # finished + aborted
        self.outputs: dict[str, int] = {}  # output tokens seen per live request
        self.unreported: set[str] = set()  # ended since the last schedule()
        self.max_tokens: dict[str, int] = {}

    @rule(family=st.integers(0, 1), length=st.integers(1, 15), max_tokens=st.integers(1, 8),
          priority=st.integers(0, 1), eos_at=st.sampled_from([None, None, 1, 3]))
    def add(self, family: int, length: int, max_tokens: int, priority: int, eos_at) -> None:
        rid = f"r{self.counter:06d}"
        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=eos_at is None, eos_token_id=EOS)
        self.sched.add_request(Request(rid, FAMILIES[family][:length], params, arrival_time=self.counter,
                                       priority=priority if self.config.policy == "priority" else 0,
                                       block_size=self.config.block_size))
        self.runner.add_request(rid, RequestScript(length, eos_at, EOS))
        self.outputs[rid] = 0
        self.max_tokens[rid] = max_tokens

    @precondition(lambda self: self.sched.requests)
    @rule(which=st.integers(0, 15))
    def abort(self, which: int) -> None:
        if which >= len(self.sched.requests):  # mostly nothing: aborts would empty the pool
            return
        rid = sorted(self.sched.requests)[which]
        finished = self.sched.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
        assert [f.request_id for f in finished] == [rid]
        self.runner.finish(rid)
        self._ended([rid])

    @precondition(lambda self: self.sched.requests)
    @rule(throttle=st.booleans())
    def step(self, throttle: bool) -> None:
        sched, config = self.sched, self.config
        num_tokens = {rid: r.num_tokens for rid, r in sched.requests.items()}
        running_before = [r.request_id for r in sched.running]
        output = sched.schedule(throttle)
        victims = [p.request_id for p in output.preemptions]
        # Only running requests are preempted; FCFS takes them from the running
        # tail and puts them back at the head of waiting.
        assert set(victims) <= set(running_before)
        if config.policy == "fcfs" and victims:
            assert victims == running_before[::-1][:len(victims)], (victims, running_before)
            assert [r.request_id for r in sched.waiting][:len(victims)] == victims[::-1]
        # The worker hears of every request that ended since the last step.
        assert output.finished_req_ids == self.unreported
        self.unreported = set()
        bs = config.block_size
        for s in output.scheduled:
            table = sched.kv_cache_manager.get_block_ids(s.request_id)
            end = s.num_computed_tokens + s.num_scheduled_tokens
            # Blocks cover the scheduled tokens; admissions get exactly that many.
            assert len(table) >= -(-end // bs)
            if s.kind != "running":
                assert len(table) == -(-end // bs), (s, table)
            if s.spec_token_ids:  # drafts only on decodes, right after the last token
                assert end == num_tokens[s.request_id] + len(s.spec_token_ids), s
        # Only RUNNING requests hold scheduled tokens; budget and seat limits.
        for rid, n in output.num_scheduled_tokens.items():
            assert sched.requests[rid].status == RequestStatus.RUNNING, rid
            assert n >= 1
        assert output.total_num_scheduled_tokens == sum(output.num_scheduled_tokens.values())
        assert output.total_num_scheduled_tokens + output.token_budget == config.token_budget
        assert len(output.num_scheduled_tokens) <= config.max_num_seqs
        if output.preemptions:  # a step that preempted admits nothing
            assert all(s.kind == "running" for s in output.scheduled)
        sampled = self.runner.execute(output)
        update = sched.update_from_output(output, sampled)
        for fin in update.finished:
            assert fin.num_output_tokens <= self.max_tokens[fin.request_id]
            self.runner.finish(fin.request_id)
        self._ended([f.request_id for f in update.finished])
        if config.num_speculative_tokens:
            done = {f.request_id for f in update.finished}
            sched.update_draft_token_ids(self.runner.propose_drafts(
                [s.request_id for s in output.scheduled if s.request_id not in done],
                config.num_speculative_tokens, config.draft_acceptance_rate,
                config.draft_acceptance_pattern))
        for rid, req in sched.requests.items():  # output tokens never disappear
            assert req.num_output_tokens >= self.outputs[rid]
            self.outputs[rid] = req.num_output_tokens

    def _ended(self, ids: list[str]) -> None:
        for rid in ids:
            del self.outputs[rid]
        self.ended += len(ids)
        self.unreported.update(ids)

    @invariant()
    def block_conservation(self) -> None:
        pool = self.sched.kv_cache_manager.block_pool
        held = sum(1 for b in pool.blocks if b.ref_cnt > 0 and not b.is_null)
        assert pool.get_num_free_blocks() + held == self.config.num_gpu_blocks - 1

    @invariant()
    def ref_counts_match_live_tables(self) -> None:
        kv = self.sched.kv_cache_manager
        owners: dict[int, int] = {}
        for rid, table in kv.req_to_blocks.items():
            if table:
                # Only running requests hold blocks (no connector, no deferred frees).
                assert rid in self.sched.requests and self.sched.requests[rid].status == RequestStatus.RUNNING
            for b in table:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for b in kv.block_pool.blocks:
            if not b.is_null:
                assert b.ref_cnt == owners.get(b.block_id, 0), b

    @invariant()
    def queues_partition_the_live_requests(self) -> None:
        sched = self.sched
        running = [r.request_id for r in sched.running]
        waiting = [r.request_id for r in sched.waiting]
        assert len(set(running)) == len(running) and len(set(waiting)) == len(waiting)
        assert not set(running) & set(waiting)
        assert set(running) | set(waiting) == set(sched.requests) == set(self.outputs)
        assert not list(sched.kv_holding_waiting)
        assert len(running) <= self.config.max_num_seqs
        assert sched.get_num_unfinished_requests() == self.counter - self.ended
        for r in sched.running:
            assert r.status == RequestStatus.RUNNING
            # Synchronous: every computed token has a slot, and nothing is computed past the tokens.
            assert r.num_computed_tokens <= r.num_tokens
            assert len(sched.kv_cache_manager.get_block_ids(r.request_id)) * self.config.block_size \
                >= r.num_computed_tokens
        for r in sched.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0 and not r.spec_token_ids
        for r in sched.requests.values():  # stop rules: nothing past max_tokens / max_model_len
            assert r.num_output_tokens <= r.sampling_params.max_tokens
            assert r.num_tokens <= self.config.max_model_len
            if r.spec_token_ids:  # drafts only for decodes (all tokens but the last computed)
                assert r.num_computed_tokens == r.num_tokens - 1, r.request_id

    @invariant()
    def cached_blocks_hold_their_own_prefix(self) -> None:
        kv = self.sched.kv_cache_manager
        for rid, req in self.sched.requests.items():
            table = kv.req_to_blocks.get(rid, [])
            for i in range(kv.num_cached_block.get(rid, 0)):
                assert table[i].block_hash == req.block_hashes[i], (rid, i)


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                              database=None, derandomize=True,
                                              suppress_health_check=list(HealthCheck))
TestSchedulerStateful = SchedulerMachine.TestCase

# Mutants the machine catches without shrinking (the synchronous ones it
# misses break rules it does not check: free-queue order, prefill cadence and
# throttle, the long-prefill threshold, PRIORITY victim choice; the trace
# checker does).
MACHINE_CATCHES = ["admission-preempts", "admit-after-preempt", "budget-overrun", "double-free-shared",
                   "drafts-on-prefill", "forget-finished-ids", "hit-evicted-block", "ignore-max-num-seqs",
                   "leak-on-abort", "leak-on-finish", "no-draft-rollback", "no-give-back",
                   "no-stop-on-max-tokens", "over-allocate", "preempt-head", "preempt-keeps-block",
                   "preempt-waiting", "reuse-held-block", "reverse-running-order"]


@pytest.mark.parametrize("name", MACHINE_CATCHES)
def test_scheduler_machine_catches_mutant(name):
    machine = type(f"Machine_{name}", (SchedulerMachine,),
                   {"scheduler_class": MUTANTS_AND_TARGETS[name][0]})
    machine.TestCase.settings = settings(
        max_examples=100, stateful_step_count=50, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck), phases=[Phase.generate], report_multiple_bugs=False)
    with pytest.raises(AssertionError):
        machine.TestCase().runTest()


# ----------------------------------------------------------------- draft acceptance patterns

def _pattern_run(pattern: str) -> tuple[EngineSummary, list[int], list[int]]:
    """One 8-token prompt, 12 output tokens, 3 drafts per step, a roomy pool:
    the summary, the rejected drafts of each verifying step, the output tokens."""
    spec = RequestSpec("r000000", 0.0, tuple(range(100, 108)), max_tokens=12, ignore_eos=True)
    config = EngineConfig(num_gpu_blocks=17, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, num_speculative_tokens=3,
                          draft_acceptance_pattern=pattern)
    rejected: list[int] = []
    tokens: list[int] = []

    def on_step(rec) -> None:
        if rec.update is not None:
            if rec.update.num_draft_tokens:
                assert rec.update.num_draft_tokens == 3
                rejected.append(rec.update.num_rejected_draft_tokens)
            tokens.extend(rec.update.new_token_ids.get("r000000", []))
    workload = Workload(source="test", sha256="0" * 64, params={}, requests=(spec,))
    return Engine(config, seed=0).run(workload, on_step=on_step), rejected, tokens


# pattern: steps, draft tokens, rejected drafts, rejected per verifying step.
# The prefill step samples token 1; each verifying step adds its accepted
# drafts plus one token, until 12 (a step's tokens past max_tokens are cut).
PATTERN_COUNTS = {
    "random": (7, 18, 13, [3, 3, 3, 3, 1, 0]),   # draft_acceptance_rate 0.7, seed 0
    "all": (4, 9, 0, [0, 0, 0]),                  # 1 + 4 + 4 + 4 (3 cut)
    "none": (12, 33, 33, [3] * 11),               # 1 + 11 x 1
    "prefix-0": (12, 33, 33, [3] * 11),           # = none
    "prefix-1": (7, 18, 12, [2] * 6),             # 1 + 6 x 2 (1 cut)
    "prefix-2": (5, 12, 4, [1] * 4),              # 1 + 4 x 3 (1 cut)
    "prefix-3": (4, 9, 0, [0, 0, 0]),             # = all
    "prefix-7": (4, 9, 0, [0, 0, 0]),             # more than the drafts: all
    "cycle": (6, 15, 9, [3, 2, 1, 0, 3]),         # rejection at draft 0, 1, 2, none, 0
}


@pytest.mark.parametrize("pattern", sorted(PATTERN_COUNTS))
def test_draft_acceptance_pattern_exact_counts(pattern):
    steps, drafts, rejected, per_step = PATTERN_COUNTS[pattern]
    summary, got_per_step, tokens = _pattern_run(pattern)
    assert (summary.steps, summary.draft_tokens, summary.rejected_draft_tokens) == (steps, drafts, rejected)
    assert got_per_step == per_step
    assert summary.finished == 1
    # Drafts change how fast tokens come, never which: the scripted model's 12.
    assert tokens == _pattern_run("all")[2] and len(tokens) == 12


def test_draft_acceptance_pattern_validated_and_recorded(tmp_path):
    with pytest.raises(ConfigError, match=r"draft_acceptance_pattern must be one of random, all, none, "
                                          r"prefix-N, cycle .* got 'prefix-x'"):
        EngineConfig(draft_acceptance_pattern="prefix-x")
    for bad in ("Random", "prefix-", "prefix--1", "prefix-01", "", 3, None):
        with pytest.raises(ConfigError, match="draft_acceptance_pattern"):
            EngineConfig(draft_acceptance_pattern=bad)
    assert EngineConfig().with_overrides({"draft_acceptance_pattern": "prefix-2"}).draft_acceptance_pattern \
        == "prefix-2"
    # The default is left out of the serialised config: traces recorded
    # before the key existed keep their fingerprint, a missing key means "random".
    default = EngineConfig()
    assert "draft_acceptance_pattern" not in default.to_dict()
    assert EngineConfig.from_dict(default.to_dict()) == default
    cycle = EngineConfig(num_speculative_tokens=2, draft_acceptance_pattern="cycle")
    assert cycle.to_dict()["draft_acceptance_pattern"] == "cycle"
    assert cycle.fingerprint() != dataclasses.replace(cycle, draft_acceptance_pattern="random").fingerprint()
    # Recorded in the trace metadata, and the trace replays identically.
    path = tmp_path / "cycle.parquet"
    spec = RequestSpec("r000000", 0.0, tuple(range(100, 108)), max_tokens=12, ignore_eos=True)
    config = EngineConfig(num_gpu_blocks=17, block_size=4, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=64, num_speculative_tokens=3, draft_acceptance_pattern="cycle")
    record(Workload(source="test", sha256="0" * 64, params={}, requests=(spec,)), config, path)
    trace = open_trace(path)
    assert trace.meta["config"]["draft_acceptance_pattern"] == "cycle" and trace.config == config
    res = CliRunner().invoke(main, ["replay", str(path)])
    assert res.exit_code == 0 and "conformant" in res.output, res.output


def test_fuzz_strategy_generates_every_draft_pattern():
    from harness.fuzz import DRAFT_BEHAVIOURS, fuzz_cases

    seen: set[str] = set()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @__import__("hypothesis").given(fuzz_cases())
    def prop(case: FuzzCase) -> None:
        c = case.config
        if c["num_speculative_tokens"]:
            seen.add(c["draft_acceptance_pattern"])
        else:
            assert c["draft_acceptance_pattern"] == "random"

    prop()
    assert seen == {p for _, p in DRAFT_BEHAVIOURS} == {"random", "cycle", "prefix-1", "prefix-2"}


# ----------------------------------------------------------------- parallel fuzzing

def test_worker_seeds_and_example_shares():
    from harness.fuzz import split_examples, worker_seed

    assert worker_seed(0, 0) == 0 and worker_seed(7, 0) == 7  # worker 0: the run's own seed
    assert worker_seed(0, 1) == 2430097083777867444
    assert len({worker_seed(5, i) for i in range(64)}) == 64
    assert split_examples(200, 3) == [67, 67, 66]
    assert split_examples(40, 2) == [20, 20]
    assert split_examples(2, 4) == [1, 1]  # never more workers than examples
    with pytest.raises(ValueError):
        split_examples(0, 2)


def test_one_worker_is_the_plain_in_process_fuzz():
    from harness.fuzz import WorkerProgress, fuzz_parallel

    states = []
    result = fuzz_parallel("mutant:leak-on-finish", workers=1, max_examples=50, seed=0,
                           on_progress=states.append)
    plain = fuzz(MUTANTS_AND_TARGETS["leak-on-finish"][0], max_examples=50, seed=0)
    assert [w.worker for w in result.workers] == [0] and result.workers[0].seed == 0
    assert result.workers[0].result.case == plain.case and result.examples == plain.examples == 1
    assert states[-1] == [WorkerProgress(examples=1, share=50, shrinking=True, done=True)]
    with pytest.raises(ValueError, match="workers must be an integer in 1..256"):
        fuzz_parallel("reference", workers=0)


def test_cli_workers_2_finds_mutant_writes_each_witness_deterministically(tmp_path):
    """Two spawned workers (seeds 0 and worker_seed(0, 1), 20 examples each)
    both find the mutant and shrink to different scenarios; both are written,
    and the API run with the same arguments finds the same two."""
    from harness.fuzz import fuzz_parallel

    out = tmp_path / "out"
    res = CliRunner().invoke(main, ["fuzz", "--candidate", "mutant:drafts-on-prefill", "--workers", "2",
                                    "--max-examples", "40", "--seed", "0", "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert "on 2 workers" in res.output and "FOUND by 2 of 2 workers, 2 distinct" in res.output
    names = sorted(p.name for p in out.iterdir())
    assert names == [f"fuzz-mutant-drafts-on-prefill-seed0-worker{i}of2.{ext}"
                     for i in (0, 1) for ext in ("json", "parquet", "toml")]
    infos = [json.loads((out / f"fuzz-mutant-drafts-on-prefill-seed0-worker{i}of2.json").read_text())
             for i in (0, 1)]
    assert [(i["worker"], i["workers"], i["worker_max_examples"], i["found_by_workers"]) for i in infos] \
        == [(0, 2, 20, [0]), (1, 2, 20, [1])]
    assert [i["worker_seed"] for i in infos] == [0, 2430097083777867444]
    assert [(i["examples_before_failure"], i["num_requests"]) for i in infos] == [(4, 1), (7, 1)]
    assert all(i["replay_command"] in res.output for i in infos)
    assert [(Path(i["scenario_file"]).name, i["scenario_warnings"]) for i in infos] == \
        [(f"fuzz-mutant-drafts-on-prefill-seed0-worker{i}of2.toml", []) for i in (0, 1)]
    assert "smallest: worker 0" in res.output  # 1 request each: the fewer prompt tokens, then the lower index
    # Same seed, same result: the API run, in new processes, finds the same cases.
    again = fuzz_parallel("mutant:drafts-on-prefill", workers=2, max_examples=40, seed=0, skip_known=True)
    assert [w.result.case for w in again.workers] == [FuzzCase.from_dict(i["scenario"]) for i in infos]
    assert [w.result.examples for w in again.workers] == [4, 7] and again.smallest().worker == 0
    # A witness replays as a failure.
    replay = CliRunner().invoke(main, ["replay", infos[1]["trace"], "--candidate", "mutant:drafts-on-prefill"])
    assert replay.exit_code == 1, replay.output


def test_cli_workers_2_reference_clean(tmp_path):
    res = CliRunner().invoke(main, ["fuzz", "--workers", "2", "--max-examples", "20", "-o", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "fuzzed reference: 20 examples on 2 workers" in res.output and "nothing found" in res.output
    assert not (tmp_path / "o").exists()


def test_workers_auto_means_every_available_cpu():
    from harness.cli_common import _Workers
    from harness.fuzz import MAX_WORKERS, available_cpus

    assert _Workers().convert("auto", None, None) == _Workers().convert("0", None, None) \
        == min(available_cpus(), MAX_WORKERS)
    assert _Workers().convert("3", None, None) == 3


CAP_SCENARIO = """format_version = 1
description = "six requests at step 0 on a 2-sequence cap"
[config]
num_gpu_blocks = 64
block_size = 16
max_model_len = 128
max_num_seqs = 2
""" + "".join(f'[[requests]]\nrequest_id = "{r}"\nprompt_len = 8\nmax_tokens = 3\nignore_eos = true\n'
              f'arrival_step = 0\n' for r in "ABCDEF")


def test_fuzz_scenario_shrinks_a_bug_report_to_the_fewest_requests(tmp_path):
    """``harness fuzz --scenario FILE``: the file and subsets of its requests. A cap of 2
    broken by the ignore-max-num-seqs mutant needs 3 requests: the six shrink to three,
    written as a scenario file that re-records to the same violation; the reference,
    on the same file, finds nothing."""
    src = tmp_path / "cap.toml"
    src.write_text(CAP_SCENARIO)
    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["fuzz", "--candidate", "mutant:ignore-max-num-seqs", "--scenario", str(src),
                                    "--max-examples", "50", "-o", str(out)])
    assert res.exit_code == 1, res.output
    assert "shrunk to 3 requests" in res.output
    (witness,) = out.glob("*.toml")
    assert len(load_scenario(witness).workload.requests) == 3
    rerecorded = tmp_path / "w.parquet"
    assert CliRunner().invoke(main, ["record", str(witness), "--engine", "mutant:ignore-max-num-seqs",
                                     "-o", str(rerecorded)]).exit_code == 0
    check = CliRunner().invoke(main, ["check", str(rerecorded), "--json"])
    assert check.exit_code == 1 and json.loads(check.output)["violations_by_invariant"] == {"MAX-NUM-SEQS": 4}
    clean = CliRunner().invoke(main, ["fuzz", "--scenario", str(src), "--max-examples", "30",
                                      "-o", str(tmp_path / "r")])
    assert clean.exit_code == 0 and clean.output.strip().endswith("nothing found")


def test_fuzz_scenario_refuses_actions_and_bad_files(tmp_path):
    src = tmp_path / "act.toml"
    src.write_text('format_version = 1\n[[requests]]\nrequest_id = "A"\nprompt_len = 8\narrival_step = 0\n'
                   '[[actions]]\nstep = 1\nkind = "reset_prefix_cache"\n')
    res = CliRunner().invoke(main, ["fuzz", "--scenario", str(src), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert res.output == f"error: {src}: --scenario takes no [[actions]] yet (subsets of requests only)\n"
    src.write_text('format_version = 1\n[[requests]]\nrequest_id = "A"\ncolour = 1\n')
    res = CliRunner().invoke(main, ["fuzz", "--scenario", str(src), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and f"{src}:4: requests[0]: unknown key 'colour'" in res.output


def test_regression_the_replay_hint_keeps_pythonpath_for_a_user_candidate(monkeypatch) -> None:
    """Regression (a new user's walkthrough, issue 16): the fuzz witness's
    `replay:` hint dropped PYTHONPATH, so a `module:factory` candidate could
    not be found when the printed command was pasted into a new shell."""
    from harness.fuzz.witness import _pythonpath_prefix

    monkeypatch.setenv("PYTHONPATH", "/home/me/my sched")
    assert _pythonpath_prefix("mysched.core:make") == "PYTHONPATH='/home/me/my sched' "
    assert _pythonpath_prefix("mutant:leak-on-abort") == ""
    assert _pythonpath_prefix("reference") == ""
    monkeypatch.delenv("PYTHONPATH")
    assert _pythonpath_prefix("mysched.core:make") == ""


def test_regression_the_witness_scenario_header_keeps_pythonpath(monkeypatch, tmp_path) -> None:
    """Regression (new-user trial): the witness scenario file's ``Re-run:`` header had no PYTHONPATH
    for a ``module:factory`` candidate, unlike the JSON's commands, so pasting it failed."""
    from harness.fuzz.witness import write_failure

    cls = MUTANTS_AND_TARGETS["ignore-max-num-seqs"][0]
    result = fuzz(cls, max_examples=60, seed=0, known=known_reference_finding)
    monkeypatch.setenv("PYTHONPATH", "/home/me/my sched")
    _trace, json_path, command, toml = write_failure(tmp_path, "mysched.core:make", cls, result, 0)
    header = toml.read_text().split("\n")[2]
    assert header.startswith("# Re-run: PYTHONPATH='/home/me/my sched' harness record "
                             "fuzz-mysched.core-make-seed0.toml --engine mysched.core:make -o T.parquet"), header
    assert command.startswith("PYTHONPATH='/home/me/my sched' harness replay ")
    assert json.loads(json_path.read_text())["record_command"].startswith("PYTHONPATH='/home/me/my sched' ")


def test_regression_time_budget_overshoot_no_calls_after_the_stop(monkeypatch):
    """Regression (issue 16): the stop at the end of --time-budget was an
    Exception, which hypothesis took for a failure and shrank, calling the
    property again and again after the budget was spent (about 1 s over
    here). On a fake clock that advances 1 s per example, a 2.5 s budget
    runs exactly 3 examples and reads the clock once more (the elapsed
    time), nothing after."""
    import harness.fuzz.run as run_module

    clock = {"t": 0.0, "reads": 0, "stopped_at": None}

    class FakeTime:
        @staticmethod
        def monotonic() -> float:
            clock["reads"] += 1
            if clock["t"] > 2.5 and clock["stopped_at"] is None:
                clock["stopped_at"] = clock["reads"]
            return clock["t"]

    def one_second_example(factory, case, profile=None):
        clock["t"] += 1.0
        return None

    monkeypatch.setattr(run_module, "time", FakeTime)
    monkeypatch.setattr(run_module, "evaluate", one_second_example)
    result = run_module.fuzz(None, max_examples=1000, seed=0, time_budget_s=2.5)
    assert (result.examples, result.budget_exhausted, result.elapsed_s) == (3, True, 3.0)
    assert clock["reads"] - clock["stopped_at"] == 1


def test_regression_time_budget_counts_a_spawned_workers_start_up(monkeypatch):
    """Regression (issue 16): each spawned worker got the whole budget from
    its own start, after its imports (a 5 s budget on 2 workers took 12 s);
    it now gets what is left of the run's deadline."""
    import queue
    import time

    import harness.fuzz.parallel as parallel

    seen = {}

    def fake_fuzz(factory, *, time_budget_s, **kwargs):
        seen["budget"] = time_budget_s
        return parallel.FuzzResult(0, 0.0, budget_exhausted=True)

    monkeypatch.setattr(parallel, "fuzz", fake_fuzz)
    q = queue.Queue()
    parallel._fuzz_worker("reference", 0, 0, 10, time.time() + 10.0, q)
    assert 9.0 < seen["budget"] <= 10.0
    parallel._fuzz_worker("reference", 0, 0, 10, time.time() - 5.0, q)
    assert seen["budget"] == 0.0
    parallel._fuzz_worker("reference", 0, 0, 10, None, q)
    assert seen["budget"] is None
    assert [m[0] for m in (q.get(), q.get(), q.get())] == ["done", "done", "done"]


def test_plain_fuzz_and_check_never_import_ray(tmp_path):
    """Ray is an optional extra: without --ray, neither command imports it."""
    code = ("import sys; from click.testing import CliRunner; from harness.cli import main; "
            f"r = CliRunner().invoke(main, ['fuzz', '--workers', '2', '--max-examples', '2', '-o', {str(tmp_path)!r}]); "
            "assert r.exit_code == 0, r.output; "
            "r = CliRunner().invoke(main, ['check', 'golden/', '--json']); "
            "assert r.exit_code == 0, r.output; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], check=True)
    assert out.stdout.strip() == "[]"


def test_run_case_closes_every_candidate_it_built_even_one_that_raised():
    # issue 24: a vllm@ candidate's driver goes back to the pool when its example
    # ends (close), not whenever the garbage collector reaches the candidate.
    closed: list[str] = []

    class Raising(Scheduler):
        def schedule(self, *args, **kwargs):
            raise RuntimeError("boom")

    def make(kind):
        def factory(config):
            candidate = (Raising if kind == "raises" else Scheduler)(config)
            candidate.close = lambda: closed.append(kind)
            return candidate
        return factory

    case = FuzzCase({"num_gpu_blocks": 16, "block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 16,
                     "max_model_len": 32},
                    (RequestSpec("r000000", 0.0, (1, 2, 3, 4, 5), 3),), 0)
    from harness.fuzz.run import run_case

    ok = run_case(make("fine"), case)
    assert ok.ended == "" and ok.result.ok
    crashed = run_case(make("raises"), case)
    assert crashed.ended.startswith("crashed") or "ENGINE-CRASH" in crashed.result.by_invariant
    assert closed == ["fine", "raises"]


def test_fuzz_calls_a_factorys_prestart_before_the_first_example_and_survives_its_failure():
    """``fuzz`` starts a candidate's processes first (``vllm@``: ``prestart_in_background``), so
    they start while hypothesis draws; a prestart that raises is left to the first candidate."""
    cls = MUTANTS_AND_TARGETS["ignore-max-num-seqs"][0]
    calls: list[str] = []

    def factory(config):
        calls.append("candidate")
        return cls(config)

    def prestart():
        calls.append("prestart")
        raise RuntimeError("no env")

    factory.prestart = prestart
    result = fuzz(factory, max_examples=3, seed=0, known=known_reference_finding)
    assert result.examples >= 1 and calls[0] == "prestart" and calls.count("prestart") == 1
    assert calls.count("candidate") >= result.examples
