"""EngineConfig's parallelism keys as vLLM has them: ``pipeline_parallel_size``
and ``async_scheduling`` set, ``max_concurrent_batches`` derived
(``VllmConfig.max_concurrent_batches`` in vLLM 0.33.0), refused as a user key,
and still read from older traces, goldens and fuzz regressions."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.fuzz import FuzzCase
from harness.replay import replay
from harness.scenarios import SCENARIOS
from harness.trace import METADATA_KEY, SUMMARY_KEY, TraceError, open_trace
from harness.candidates.resolve import resolve_candidate
from reference.config import (ConfigError, EngineConfig, derive_max_concurrent_batches,
                              pipeline_parallel_size_for, upgrade_config_keys)

REPO = Path(__file__).resolve().parent.parent
GOLDEN = REPO / "golden"
REGRESSIONS = Path(__file__).parent / "regressions"


# (pipeline_parallel_size, async_scheduling) -> batches in flight, as vLLM
# 0.33.0's VllmConfig.max_concurrent_batches with the V1 model runner.
DERIVATION = {
    (1, False): 1, (2, False): 2, (3, False): 3, (4, False): 4,
    (1, True): 2, (2, True): 2, (3, True): 3, (4, True): 4,
}


@pytest.mark.parametrize(("pp", "async_scheduling"), sorted(DERIVATION))
def test_max_concurrent_batches_is_derived_as_vllm_does(pp: int, async_scheduling: bool) -> None:
    expected = DERIVATION[(pp, async_scheduling)]
    assert derive_max_concurrent_batches(pp, async_scheduling) == expected
    config = EngineConfig(pipeline_parallel_size=pp, async_scheduling=async_scheduling)
    assert config.max_concurrent_batches == expected
    # Recorded under that name (the checker reads it) and read back to the same config.
    assert config.to_dict()["max_concurrent_batches"] == expected
    assert EngineConfig.from_dict(config.to_dict()) == config


def test_pipeline_parallel_size_is_stored_only_where_the_count_does_not_give_it_back() -> None:
    # Async + PP 2 derives 2, which an older trace's count reads as PP 1.
    ambiguous = EngineConfig(pipeline_parallel_size=2, async_scheduling=True)
    data = ambiguous.to_dict()
    assert (data["max_concurrent_batches"], data["pipeline_parallel_size"]) == (2, 2)
    assert list(data).index("pipeline_parallel_size") == list(data).index("max_concurrent_batches") + 1
    for pp, async_scheduling in [(1, False), (3, False), (1, True), (3, True)]:
        assert "pipeline_parallel_size" not in EngineConfig(
            pipeline_parallel_size=pp, async_scheduling=async_scheduling).to_dict()
    assert ambiguous.fingerprint() != EngineConfig(async_scheduling=True).fingerprint()


def test_inverse_of_the_derivation() -> None:
    assert [pipeline_parallel_size_for(n, False) for n in (1, 2, 3, 5)] == [1, 2, 3, 5]
    assert [pipeline_parallel_size_for(n, True) for n in (2, 3, 5)] == [1, 3, 5]
    with pytest.raises(ConfigError, match=r"^max_concurrent_batches 1 with async_scheduling: vLLM "
                                          r"always runs 2 or more batches in flight"):
        pipeline_parallel_size_for(1, True)
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ConfigError, match=r"^max_concurrent_batches must be an integer >= 1"):
            pipeline_parallel_size_for(bad, False)


def test_async_scheduling_alone_is_accepted() -> None:
    config = EngineConfig().with_overrides({"async_scheduling": "true"})
    assert (config.async_scheduling, config.pipeline_parallel_size, config.max_concurrent_batches) \
        == (True, 1, 2)
    deferred = EngineConfig().with_overrides({"async_scheduling": "true", "defer_block_free": "true"})
    assert deferred.max_concurrent_batches == 2
    assert EngineConfig().with_overrides({"pipeline_parallel_size": "3"}).max_concurrent_batches == 3


REFUSAL = ("max_concurrent_batches is not a config key: as in vLLM it is derived from "
           "pipeline_parallel_size and async_scheduling (async_scheduling=true gives 2, "
           "pipeline_parallel_size=N gives N)")


def test_max_concurrent_batches_is_refused_as_a_user_key() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig().with_overrides({"max_concurrent_batches": "2"})
    assert str(info.value) == REFUSAL
    with pytest.raises(TypeError):
        EngineConfig(max_concurrent_batches=2)  # type: ignore[call-arg]


def test_cli_refuses_max_concurrent_batches_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "t.parquet"
    result = CliRunner().invoke(main, ["record", "synthetic:5", "-o", str(out),
                                       "--set", "max_concurrent_batches=2"])
    assert result.exit_code == 2
    assert result.output == f"error: bad config: {REFUSAL}\n"
    assert not out.exists()


def test_parallelism_values_are_validated() -> None:
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ConfigError, match=r"^pipeline_parallel_size must be an integer >= 1, got "):
            EngineConfig(pipeline_parallel_size=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^async_scheduling must be true or false, got 'yes'"):
        EngineConfig(async_scheduling="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^defer_block_free needs more than one batch in flight "
                                          r"\(async_scheduling=true or pipeline_parallel_size >= 2"):
        EngineConfig(defer_block_free=True)
    assert EngineConfig(pipeline_parallel_size=2, defer_block_free=True).max_concurrent_batches == 2
    # Async scheduling with drafts is modelled (reference.async_spec); pipelining is not.
    assert EngineConfig(num_speculative_tokens=2, async_scheduling=True).max_concurrent_batches == 2
    for async_scheduling in (False, True):
        with pytest.raises(ConfigError, match=r"^speculative decoding with pipeline_parallel_size > 1 "
                                              r"is not modelled \(use async_scheduling=true with "
                                              r"pipeline_parallel_size 1\)$"):
            EngineConfig(num_speculative_tokens=2, pipeline_parallel_size=2,
                         async_scheduling=async_scheduling)


def test_old_config_dicts_map_to_the_vllm_keys() -> None:
    old = {"num_gpu_blocks": 40, "max_concurrent_batches": 3, "async_scheduling": True}
    assert upgrade_config_keys(old) == {"num_gpu_blocks": 40, "pipeline_parallel_size": 3,
                                        "async_scheduling": True}
    assert list(upgrade_config_keys(old)) == ["num_gpu_blocks", "pipeline_parallel_size",
                                              "async_scheduling"]
    assert upgrade_config_keys({"max_concurrent_batches": 2, "async_scheduling": True}) == \
        {"pipeline_parallel_size": 1, "async_scheduling": True}
    assert upgrade_config_keys({"max_concurrent_batches": 2}) == {"pipeline_parallel_size": 2}
    assert EngineConfig.from_dict({"max_concurrent_batches": 2}).pipeline_parallel_size == 2
    # Both stored: they must agree.
    assert EngineConfig.from_dict({"max_concurrent_batches": 2, "pipeline_parallel_size": 2,
                                   "async_scheduling": True}).pipeline_parallel_size == 2
    with pytest.raises(ConfigError, match=r"^max_concurrent_batches 3 does not match "
                                          r"pipeline_parallel_size 2 with async_scheduling=False "
                                          r"\(which derive 2\)$"):
        EngineConfig.from_dict({"max_concurrent_batches": 3, "pipeline_parallel_size": 2})
    with pytest.raises(ConfigError, match="max_concurrent_batches 1 with async_scheduling"):
        EngineConfig.from_dict({"max_concurrent_batches": 1, "async_scheduling": True})
    with pytest.raises(ConfigError, match=r"^unknown config key 'batches' \(no key is close; 42 keys: "
                                          r"EngineConfig in reference/config.py\)$"):
        EngineConfig.from_dict({"batches": 2})


# Goldens recorded before pipeline_parallel_size existed, storing the old key.
OLD_GOLDENS = {"pipeline-3": (3, False, 3), "async-pipeline-3": (3, True, 3),
               "async-tight": (1, True, 2), "deferred-frees": (1, True, 2), "fcfs-tight": (1, False, 1)}


@pytest.mark.parametrize("name", sorted(OLD_GOLDENS))
def test_old_traces_storing_max_concurrent_batches_still_read(name: str) -> None:
    pp, async_scheduling, batches = OLD_GOLDENS[name]
    trace = open_trace(GOLDEN / f"{name}.parquet")
    stored = trace.meta["config"]
    assert stored["max_concurrent_batches"] == batches and "pipeline_parallel_size" not in stored
    assert (trace.config.pipeline_parallel_size, trace.config.async_scheduling,
            trace.config.max_concurrent_batches) == (pp, async_scheduling, batches)
    # The scenario, now written in vLLM's keys, serialises to the golden's bytes.
    scenario = SCENARIOS[name]
    assert "max_concurrent_batches" not in scenario.config
    assert trace.config == scenario.engine_config()
    assert scenario.engine_config().to_dict() == stored
    assert scenario.engine_config().fingerprint() == trace.meta["config_fingerprint"]


def test_old_trace_replays_with_its_batches_in_flight() -> None:
    trace = open_trace(GOLDEN / "async-pipeline-3.parquet")
    divergence, steps = replay(trace, resolve_candidate("reference"))
    assert divergence is None and steps == trace.summary["steps"] == 183


def _rewrite_config(path: Path, out: Path, **changes) -> Path:
    """A copy of ``path`` whose metadata config has ``changes`` applied."""
    source = pq.ParquetFile(path)
    table = source.read()
    meta = dict(table.schema.metadata)
    info = json.loads(meta[METADATA_KEY])
    info["config"].update(changes)
    meta[METADATA_KEY] = json.dumps(info, sort_keys=True).encode()
    with pq.ParquetWriter(out, table.schema.with_metadata(meta)) as writer:
        writer.write_table(table.replace_schema_metadata(meta))
        writer.add_key_value_metadata({SUMMARY_KEY: source.metadata.metadata[SUMMARY_KEY]})
    return out


def test_trace_whose_stored_count_contradicts_its_parallelism_is_refused(tmp_path: Path) -> None:
    bad = _rewrite_config(GOLDEN / "pipeline-3.parquet", tmp_path / "bad.parquet",
                          pipeline_parallel_size=2)
    with pytest.raises(TraceError) as info:
        open_trace(bad)
    assert str(info.value) == (f"{bad}: bad config in metadata: max_concurrent_batches 3 does not "
                               f"match pipeline_parallel_size 2 with async_scheduling=False "
                               f"(which derive 2)")


def test_old_fuzz_regression_reads_with_the_vllm_keys() -> None:
    data = json.loads((REGRESSIONS / "fuzz-checker-shared-block-two-deferred-frees.json").read_text())
    assert data["scenario"]["config"]["max_concurrent_batches"] == 2
    case = FuzzCase.from_dict(data["scenario"])
    assert "max_concurrent_batches" not in case.config
    assert (case.config["pipeline_parallel_size"], case.config["async_scheduling"]) == (2, False)
    assert case.engine_config().max_concurrent_batches == 2
    assert FuzzCase.from_dict(json.loads(json.dumps(case.to_dict()))) == case


@pytest.mark.parametrize("key, raw, words", [("num_gpu_blocks", "abc", "an integer"),
                                             ("watermark", "x", "a number"),
                                             ("async_scheduling", "maybe", "a boolean"),
                                             ("max_num_scheduled_tokens", "1.5", "an integer or none")])
def test_bad_set_value_names_the_type_in_words(key: str, raw: str, words: str) -> None:
    """Regression: the message read "'abc' is not a int"."""
    with pytest.raises(ConfigError) as info:
        EngineConfig().with_overrides({key: raw})
    assert str(info.value) == f"bad value for {key}: {raw!r} is not {words}"
