"""The hybrid KV-cache manager (``reference.kv``): KV-cache groups from a
model's layer types, sliding-window block tables, the prefix hit across
groups, the config keys, and the whole manager against vLLM 0.33.0's own
``KVCacheManager``, operation by operation (``tests/hybrid_kv/hybrid_ops.py``):
identical per-group tables, hits, new blocks and free-queue orders."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from reference.config import ConfigError, EngineConfig
from reference.kv.kv_cache_manager import HybridKVCacheManager
from reference.kv.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    kv_cache_groups_for,
)
from reference.request import Request, RequestStatus, SamplingParams
from reference.scheduler import Scheduler
from hybrid_kv.cases import CASES
from hybrid_kv.hybrid_ops import run_ops

KV = Path(__file__).parent / "hybrid_kv"
SW, FA, LA = "sliding_attention", "full_attention", "linear_attention"


def reference_states(case: dict) -> list[dict]:
    bs = case["block_size"]
    def spec(w):
        if w == "mamba":
            return MambaSpec(case["max_model_len"], case.get("num_speculative_blocks", 0))
        return FullAttentionSpec(bs) if w is None else SlidingWindowSpec(bs, w)

    groups = [KVCacheGroupSpec((i,), spec(w)) for i, w in enumerate(case["groups"])]
    manager = HybridKVCacheManager(groups, num_gpu_blocks=case["num_gpu_blocks"],
                                   max_model_len=case["max_model_len"],
                                   max_in_flight_tokens=case["max_in_flight_tokens"],
                                   enable_caching=case.get("enable_caching", True))
    return run_ops(manager, lambda i, p: Request(i, list(p), SamplingParams(max_tokens=case["max_model_len"]),
                                                 block_size=bs),
                   case["ops"], block_ids=lambda m, r: [list(g) for g in m.get_block_ids_per_group(r)],
                   free_queue=lambda m: m.block_pool.free_block_queue.block_ids(),
                   running=RequestStatus.RUNNING, preempted=RequestStatus.PREEMPTED)


# -- groups from layer types ---------------------------------------------------
def test_alternating_layers_make_one_sliding_and_one_full_group() -> None:
    groups = kv_cache_groups_for((SW, FA, SW, FA), 16, 512)
    assert groups == (KVCacheGroupSpec((0, 2), SlidingWindowSpec(16, 512)),
                      KVCacheGroupSpec((1, 3), FullAttentionSpec(16)))


def test_five_local_to_one_global_make_five_sliding_groups_and_one_full() -> None:
    # vLLM _get_kv_cache_groups_uniform_page_size: 10 local, 2 global layers;
    # group size 2; the local bucket splits into 5 groups, layers[i::5].
    layer_types = (SW,) * 5 + (FA,) + (SW,) * 5 + (FA,)
    groups = kv_cache_groups_for(layer_types, 4, 6)
    assert [g.layer_ids for g in groups] == [(0, 6), (1, 7), (2, 8), (3, 9), (4, 10), (5, 11)]
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"]


def test_one_layer_type_is_one_group() -> None:
    assert kv_cache_groups_for((SW, SW), 4, 8) == (KVCacheGroupSpec((0, 1), SlidingWindowSpec(4, 8)),)


def test_mamba_layers_make_mamba_groups_of_one_max_model_len_block() -> None:
    # Qwen3-Next's 3:1: three Mamba buckets of one layer each, then full attention.
    assert kv_cache_groups_for((LA, LA, LA, FA), 4, None, max_model_len=96, num_speculative_tokens=2) == (
        KVCacheGroupSpec((0,), MambaSpec(96, 2)), KVCacheGroupSpec((1,), MambaSpec(96, 2)),
        KVCacheGroupSpec((2,), MambaSpec(96, 2)), KVCacheGroupSpec((3,), FullAttentionSpec(4)))
    assert EngineConfig(layer_types=(LA, FA), enable_prefix_caching=False, max_model_len=64).kv_cache_groups == (
        KVCacheGroupSpec((0,), MambaSpec(64)), KVCacheGroupSpec((1,), FullAttentionSpec(16)))


def test_a_mamba_layer_needs_prefix_caching_off_and_its_legacy_name_is_refused() -> None:
    # vLLM 0.33.0 turns prefix caching with Mamba layers into mamba_cache_mode "align": not modelled.
    with pytest.raises(ConfigError, match=r"^layer_types has linear_attention \(Mamba\) layers with "
                                          r"enable_prefix_caching: .*set enable_prefix_caching = false"):
        EngineConfig(layer_types=(LA, FA))
    with pytest.raises(ConfigError, match=r"^layer_types\[0\] 'mamba' is a legacy name: write 'linear_attention'"):
        EngineConfig(layer_types=("mamba", FA), enable_prefix_caching=False)


# -- config keys -----------------------------------------------------------------
def test_hybrid_config_keys_are_validated_at_the_edge() -> None:
    with pytest.raises(ConfigError, match=r"^layer_types has sliding_attention layers but sliding_window is not set$"):
        EngineConfig(layer_types=(SW, FA))
    with pytest.raises(ConfigError, match=r"^layer_types\[1\] 'full_atention' is not a layer type; did you mean "
                                          r"'full_attention', 'linear_attention' or 'sliding_attention'\?$"):
        EngineConfig(sliding_window=8, layer_types=(SW, "full_atention"))
    with pytest.raises(ConfigError, match=r"^sliding_window must be a positive integer, got 0$"):
        EngineConfig(sliding_window=0)
    with pytest.raises(ConfigError, match=r"^layer_types must be a non-empty list"):
        EngineConfig(layer_types=())


def test_hybrid_keys_are_left_out_at_default_and_round_trip() -> None:
    assert "sliding_window" not in EngineConfig().to_dict()
    assert "layer_types" not in EngineConfig().to_dict()
    config = EngineConfig.from_dict({"sliding_window": 8, "layer_types": [SW, FA]})
    assert config.layer_types == (SW, FA)
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert EngineConfig().with_overrides({"sliding_window": "8", "layer_types": "sliding_attention,full_attention"}) \
        == config
    assert [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups] == ["SlidingWindowSpec",
                                                                                 "FullAttentionSpec"]
    # A window alone: every layer a sliding-window layer, one group.
    assert EngineConfig(sliding_window=8).kv_cache_groups == (KVCacheGroupSpec((0,), SlidingWindowSpec(16, 8)),)
    assert EngineConfig().kv_cache_groups == ()


# -- the manager, exact values ------------------------------------------------------
def test_blocks_leaving_the_window_are_freed_and_nulled_on_the_processed_tokens() -> None:
    states = reference_states(CASES["swa-full"])
    # a: 16 of 22 prompt tokens computed, window 8, block 4: the next step
    # frees blocks before token 16 - 8 + 1 = 9, i.e. whole blocks 0-1, last first.
    assert states[0]["tables"]["a"] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert states[1]["tables"]["a"] == [[0, 0, 3, 4, 9, 10], [5, 6, 7, 8, 11, 12]]
    assert states[1]["free"][-2:] == [2, 1]  # hashed: to the tail, in the order freed
    assert states[3]["tables"]["a"] == [[0, 0, 0, 0, 9, 10], [5, 6, 7, 8, 11, 12]]


def test_blocks_a_step_in_flight_still_reads_stay_until_it_is_processed() -> None:
    # 22 computed, 6 of them in flight: the window is placed on the 16
    # processed tokens, so block 3 (tokens 8-11) stays; synchronously it goes.
    in_flight = reference_states(CASES["swa-full-in-flight"])
    assert in_flight[2]["tables"]["a"] == [[0, 0, 3, 4, 9, 10], [5, 6, 7, 8, 11, 12]]
    assert reference_states(CASES["swa-full"])[2]["tables"]["a"] == [[0, 0, 0, 4, 9, 10], [5, 6, 7, 8, 11, 12]]
    # Once those tokens are processed, the next allocation frees it.
    assert in_flight[4]["tables"]["a"] == [[0, 0, 0, 4, 9, 10], [5, 6, 7, 8, 11, 12]]


def test_hit_across_groups_is_the_longest_length_every_group_hits() -> None:
    states = reference_states(CASES["swa-full"])
    # b shares 20 tokens (5 blocks) with a. Full attention hits all 5; the
    # window needs the last cdiv(8 - 1, 4) = 2 blocks cached (blocks 3, 4:
    # ids 4 and 9), the rest come back as null blocks.
    assert states[4]["result"]["hit"] == [20, [[0, 0, 0, 4, 9], [5, 6, 7, 8, 11]]]
    # b resumed after preemption: 28 tokens, the window's tail 13, 14 still cached.
    assert states[8]["result"]["hit"] == [28, [[0, 0, 0, 0, 0, 13, 14], [5, 6, 7, 8, 11, 16, 17]]]


def test_a_mamba_group_takes_one_state_block_plus_speculative_ones_and_keeps_them() -> None:
    states = reference_states(CASES["mamba3-full-spec"])
    # Three Mamba groups with 2 speculative blocks: 3 blocks each at admission, full attention 4 for 16 tokens.
    assert states[0]["tables"]["a"] == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12, 13]]
    # 22 then 23 tokens: only full attention grows; no Mamba block is freed on the way.
    assert states[1]["result"]["new"] == [[], [], [], [14, 15]] and states[2]["result"]["new"] == [[], [], [], []]
    # Freed group after group, each tail first; caching off, so to the queue's head, last call first.
    assert states[5]["free"][:15] == [15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
    assert states[6]["tables"]["c"] == [[15, 14, 13], [12, 11, 10], [9, 8, 7], [6]]


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_vllm_0_33_0_recorded_states(name: str) -> None:
    recorded = json.loads((KV / "vllm_0_33_0_states.json").read_text())[name]
    assert reference_states(CASES[name]) == recorded


@pytest.mark.vllm
def test_reference_matches_vllm_0_33_0_live() -> None:
    from harness.candidates.vllm.env import env_python

    out = subprocess.run([str(env_python("0.33.0")), str(KV / "hybrid_ops.py"), "--all"],
                         input=json.dumps(CASES), capture_output=True, text=True, check=True, timeout=600)
    live = json.loads(out.stdout)
    for name, case in CASES.items():
        assert reference_states(case) == live[name], name


# -- the scheduler over a hybrid model ------------------------------------------------
def test_scheduler_builds_the_hybrid_manager_only_for_a_hybrid_config() -> None:
    assert type(Scheduler(EngineConfig()).kv_cache_manager).__name__ == "KVCacheManager"
    hybrid = Scheduler(EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=64, sliding_window=8,
                                    layer_types=(SW, FA)))
    assert type(hybrid.kv_cache_manager).__name__ == "HybridKVCacheManager"
    assert type(hybrid.kv_cache_manager.coordinator).__name__ == "HybridKVCacheCoordinator"


def test_a_hybrid_config_records_but_not_with_a_kv_connector() -> None:
    from reference.engine import check_workload_supported
    from reference.workload import Workload

    config = EngineConfig(block_size=4, num_gpu_blocks=64, max_model_len=64, sliding_window=8,
                          layer_types=(SW, FA))
    check_workload_supported(config, Workload("synthetic", "", {}, ()))  # per-group block ids: schema 9
    with pytest.raises(ConfigError, match=r"^sliding_window / layer_types \(a hybrid KV cache\) with "
                                          r"kv_connector is not modelled: the simulated connector's loads fill one "
                                          r"full-attention KV-cache group$"):
        check_workload_supported(config.with_overrides({"kv_connector": "true"}), Workload("synthetic", "", {}, ()))


HYBRID_REFUSAL = ("bad config: sliding_window / layer_types (a hybrid KV cache) with kv_connector is not "
                  "modelled: the simulated connector's loads fill one full-attention KV-cache group")


def test_regression_hybrid_config_error_in_fuzz_scenario_and_bisect_was_not_the_one_liner(tmp_path: Path) -> None:
    """Trial finding: ``harness fuzz --scenario`` and ``harness bisect`` of a
    hybrid scenario it cannot run (then any hybrid one; now one with a KV
    connector) printed "ConfigError: ..." (the last resort); now, as
    ``harness record SCENARIO``: ``FILE:LINE: bad config: ...``, exit 2."""
    from click.testing import CliRunner

    from harness.cli import main

    source = Path(__file__).resolve().parents[1] / "traces" / "scenarios" / "admit-all-that-fit.toml"
    text = source.read_text().replace("[config]\n", '[config]\nkv_connector = true\nsliding_window = 8\n'
                                                   'layer_types = ["full_attention", "sliding_attention"]\n', 1)
    scenario = tmp_path / "hybrid.toml"
    scenario.write_text(text)
    line = text.splitlines().index('layer_types = ["full_attention", "sliding_attention"]') + 1
    want = f"error: {scenario}:{line}: {HYBRID_REFUSAL}"
    for args in (["record", scenario, "-o", tmp_path / "h.parquet"], ["fuzz", "--scenario", scenario, "-o", tmp_path / "fz"],
                 ["bisect", scenario, "--versions", "0.29.0..0.33.0"]):
        r = CliRunner().invoke(main, [str(a) for a in args])
        assert (r.exit_code, r.output) == (2, want + "\n"), args
    assert not (tmp_path / "h.parquet").exists() and not (tmp_path / "fz").exists()


def test_regression_layer_types_empty_or_none_taken_silently_and_all_full_attention_refused(
        tmp_path: Path) -> None:
    """Trial finding: ``--set layer_types=`` and ``=none`` were accepted as
    no layer types; ``layer_types=full_attention`` (every layer full attention:
    one group, not hybrid) was refused as hybrid. Now: one line, exit 2; and the
    plain single-group config, recorded and conformant."""
    from click.testing import CliRunner

    from harness.cli import main

    out = tmp_path / "t.parquet"
    for value in ("", "none", " NONE "):
        r = CliRunner().invoke(main, ["record", "synthetic:3", "--set", f"layer_types={value}", "-o", str(out)])
        assert (r.exit_code, r.output) == (2, f"error: bad config: bad value for layer_types: {value!r}: give one "
                                              "layer type per layer, comma-separated (e.g. "
                                              "sliding_attention,full_attention), or leave layer_types out\n")
    assert not out.exists()
    for value in (FA, f"{FA},{FA}"):
        config = EngineConfig().with_overrides({"layer_types": value})
        assert config.kv_cache_groups == () and config.layer_types == tuple(value.split(","))
        assert type(Scheduler(config).kv_cache_manager).__name__ == "KVCacheManager"
    assert EngineConfig(sliding_window=8, layer_types=(FA,)).kv_cache_groups == ()  # no layer uses the window
    r = CliRunner().invoke(main, ["record", "synthetic:3", "--set", f"layer_types={FA}", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out)])
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (0, "conformant (profile 0.33.0)")


def test_scheduler_over_alternating_layers_shares_the_window_tail_and_frees_behind_it() -> None:
    # Window 8, block 4, layers [sliding, full]; b shares a's first 16 tokens.
    sched = Scheduler(EngineConfig(block_size=4, num_gpu_blocks=17, max_model_len=32, max_num_seqs=4,
                                   max_num_batched_tokens=16, sliding_window=8, layer_types=(SW, FA)))
    prompt = list(range(1, 21))
    sched.add_request(Request("a", prompt, SamplingParams(max_tokens=4), block_size=4))
    sched.add_request(Request("b", prompt[:16] + [90, 91, 92, 93], SamplingParams(max_tokens=4),
                              arrival_time=0.1, block_size=4))
    manager = sched.kv_cache_manager
    seen = []
    while sched.requests:
        out = sched.schedule()
        sched.update_from_output(out, {r: [7] for r in out.num_scheduled_tokens
                                       if r in sched.requests and not sched.requests[r].is_prefill_chunk})
        seen.append(([(s.request_id, s.kind, s.num_computed_tokens, s.num_scheduled_tokens,
                       s.num_prefix_hit_tokens) for s in out.scheduled],
                     {r: manager.get_block_ids_per_group(r) for r in sched.requests}, manager.num_free_blocks))
    assert seen[0] == ([("a", "new", 0, 16, 0)], {"a": ([1, 2, 3, 4], [5, 6, 7, 8]), "b": ([], [])}, 8)
    # b hits 16 tokens in both groups: the window's last two blocks (3, 4), nulls before them.
    assert seen[1] == ([("a", "running", 16, 4, 0), ("b", "new", 16, 4, 16)],
                       {"a": ([0, 0, 3, 4, 9], [5, 6, 7, 8, 10]), "b": ([0, 0, 3, 4, 11], [5, 6, 7, 8, 12])}, 6)
    # 20 tokens processed: the window of token 20 starts at 13, so table slot 2 (block 3,
    # tokens 8-11) leaves both tables and block 3 goes back to the pool.
    assert seen[2] == ([("a", "running", 20, 1, 0), ("b", "running", 20, 1, 0)],
                       {"a": ([0, 0, 0, 4, 9, 13], [5, 6, 7, 8, 10, 14]),
                        "b": ([0, 0, 0, 4, 11, 15], [5, 6, 7, 8, 12, 16])}, 3)
    assert len(seen) == 5 and seen[-1] == ([("a", "running", 22, 1, 0), ("b", "running", 22, 1, 0)], {}, 16)
