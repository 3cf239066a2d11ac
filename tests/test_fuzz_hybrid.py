"""Issue 28: the fuzzer draws hybrid models (``fuzz_cases(hybrid=True)``,
``harness fuzz --hybrid``): sliding-window and Mamba groups beside full
attention, pools sized by the start-up check over every group. The reference
stays clean on them, and a fuzz run finds each hybrid mutant (which the
goldens alone killed before). The default strategy draws none of them, so
every seed's examples, and the figures tests/test_fuzz.py pins, are unchanged."""

from __future__ import annotations

import collections
import functools

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings

from harness.candidates.mutants import MUTANTS_AND_TARGETS
from harness.cli import main
from harness.fuzz import FuzzCase, evaluate, fuzz, fuzz_cases, known_reference_finding, run_case
from harness.fuzz.strategies import HYBRID_SHAPES
from reference.config import EngineConfig
from reference.kv.kv_cache_spec import max_memory_usage_blocks_from_groups
from reference.scheduler import Scheduler

# The cases asserted here are hypothesis's shrinks run to their end: no wall-clock bound on
# shrinking (fuzz's default, SHRINK_BUDGET_S, cut one short on a loaded machine: 8 requests, not 2).
fuzz = functools.partial(fuzz, shrink_budget_s=None)

# Hybrid mutants found by `fuzz(..., hybrid=True)` at seed 0: (examples until the first
# failure, requests in the shrunk witness, the failure's kind, the invariants it fired). Exact:
# they change only when the strategy (or the mutant) does. mamba-extra-state-block holds a
# second state block per Mamba group, so on a pool of exactly one max_model_len request's need
# it cannot admit that request: hypothesis shrinks to that stall (the reference runs it).
HYBRID_MUTANTS = {
    "keep-skipped-blocks": (8, 1, "violation", {"SLIDING-WINDOW-FREE": 1}),
    "free-window-ahead": (5, 1, "violation", {"SLIDING-WINDOW-HELD": 2}),
    "mamba-free-state": (13, 1, "violation", {"MAMBA-STATE-HELD": 6}),
    "mamba-extra-state-block": (11, 1, "stall", {"IDLE-ADMISSION": 1, "LIVENESS": 1}),
}


def test_every_hybrid_draw_is_valid_sized_by_the_pool_check_and_runs_clean_on_the_reference():
    """300 derandomised hybrid cases: valid configs of every shape, each pool
    one max_model_len request's need over the groups plus 0-8 spare blocks,
    Mamba with prefix caching off, no KV connector; each runs clean on the
    reference, and together they reach window frees, prefix hits,
    preemptions, drafts, batches in flight, data parallelism, encoder inputs."""
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=300, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases(hybrid=True))
    def prop(case: FuzzCase) -> None:
        c = case.config
        config = EngineConfig(**c)
        assert config.kv_cache_groups and not c.get("kv_connector")
        layer_types = tuple(c["layer_types"]) if "layer_types" in c else None
        assert layer_types in HYBRID_SHAPES
        seen[layer_types] += 1
        if layer_types and "linear_attention" in layer_types:
            assert not c["enable_prefix_caching"] and "sliding_window" not in c
        need = sum(max_memory_usage_blocks_from_groups(
            config.kv_cache_groups, max_model_len=config.max_model_len,
            max_in_flight_tokens=config.max_concurrent_batches * config.max_num_batched_tokens))
        assert config.num_gpu_blocks - 1 - need in (0, 1, 2, 3, 5, 8)
        run = run_case(Scheduler, case)
        assert run.ended == "" and run.result.by_invariant == {}, (run.ended, run.result.by_invariant)
        kinds = {r["kind"] for _, rows in run.steps for r in rows}
        seen.update(k for k in ("skipped_free", "preempt") if k in kinds)
        if any(r["kind"] == "schedule" and r["num_prefix_hit_tokens"] for _, rows in run.steps for r in rows):
            seen["prefix hit"] += 1
        seen.update(name for name, on in (("drafts", c["num_speculative_tokens"]),
                                          ("batches in flight", config.max_concurrent_batches > 1),
                                          ("data parallel", c["data_parallel_size"] > 1),
                                          ("encoder inputs", any(r.mm_positions for r in case.requests))) if on)

    prop()
    assert {shape: seen[shape] for shape in HYBRID_SHAPES} == {
        HYBRID_SHAPES[0]: 32, HYBRID_SHAPES[1]: 35, HYBRID_SHAPES[2]: 70, None: 76,
        HYBRID_SHAPES[4]: 53, HYBRID_SHAPES[5]: 34}
    assert {k: seen[k] for k in ("skipped_free", "prefix hit", "preempt", "drafts", "batches in flight",
                                 "data parallel", "encoder inputs")} == {
        "skipped_free": 124, "prefix hit": 51, "preempt": 7, "drafts": 150, "batches in flight": 67,
        "data parallel": 72, "encoder inputs": 76}


def test_the_default_strategy_draws_no_hybrid_model():
    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(fuzz_cases())
    def prop(case: FuzzCase) -> None:
        assert "sliding_window" not in case.config and "layer_types" not in case.config

    prop()


def test_reference_survives_hybrid_fuzzing():
    result = fuzz(None, max_examples=300, seed=0, known=known_reference_finding, hybrid=True)
    assert result.failure is None, result.failure and result.failure.to_dict()
    assert (result.examples, result.known) == (300, {})


@pytest.mark.parametrize("name", sorted(HYBRID_MUTANTS))
def test_hybrid_fuzzing_finds_each_hybrid_mutant(name):
    cls, target = MUTANTS_AND_TARGETS[name]
    result = fuzz(cls, max_examples=60, seed=0, known=known_reference_finding, hybrid=True)
    assert result.found, f"{name} not found in 60 hybrid examples"
    assert (result.examples, len(result.case.requests), result.failure.kind,
            result.failure.invariants) == HYBRID_MUTANTS[name]
    assert result.case.engine_config().kv_cache_groups
    if result.failure.kind == "violation":
        assert target in result.failure.invariants
    else:  # the stall: with spare blocks for its extra state blocks, the rule itself fires
        roomy = FuzzCase({**result.case.config, "num_gpu_blocks": result.case.config["num_gpu_blocks"] + 8},
                         result.case.requests, result.case.seed)
        assert evaluate(cls, roomy).invariants == {target: 3}  # one per Mamba group
    # The witness fails the mutant deterministically and not the reference.
    assert evaluate(cls, result.case) is not None
    assert evaluate(None, result.case) is None
    again = fuzz(cls, max_examples=60, seed=0, known=known_reference_finding, hybrid=True)
    assert again.case.to_dict() == result.case.to_dict()


def test_cli_fuzz_hybrid(tmp_path):
    res = CliRunner().invoke(main, ["fuzz", "--hybrid", "--candidate", "mutant:free-window-ahead",
                                    "--max-examples", "20", "--seed", "0", "-o", str(tmp_path)])
    assert res.exit_code == 1, res.output
    assert "FOUND violation: SLIDING-WINDOW-HELD" in res.output
    assert "sliding_window=2 layer_types=sliding_attention,full_attention" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"fuzz-mutant-free-window-ahead-seed0.{ext}" for ext in ("json", "parquet", "toml")]
    res = CliRunner().invoke(main, ["fuzz", "--hybrid", "--scenario", "x.toml", "--candidate", "reference",
                                    "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--hybrid does not apply to --scenario" in res.output
