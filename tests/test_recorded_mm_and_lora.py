"""Recorded encoder-input identifiers and LoRA adapters (config ``mm_identifiers``,
``max_loras``, ``lora_int_ids``): the reference takes vLLM's identifiers instead of
deriving them from the prompt tokens, and skips a waiting request whose adapter
would exceed ``max_loras`` (vLLM 0.33.0 ``Scheduler.schedule``). Exact values
throughout; each rule has a mutant (the config without it) that changes the
decisions.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.check.checker import check_steps
from harness.trace.recorder import record
from reference.config import ConfigError, EngineConfig
from reference.encoder_cache_manager import mm_identifier
from reference.output import EncoderPlan, ScheduledRequest, Skip
from reference.request import Request, SamplingParams
from reference.scheduler import MAX_LORAS_REACHED, Scheduler
from reference.workload import RequestSpec, Workload


def _config(**overrides) -> EngineConfig:
    values = dict(num_gpu_blocks=101, block_size=16, max_model_len=512, max_num_seqs=8,
                  max_num_batched_tokens=256)
    values.update(overrides)
    return EngineConfig(**values)


def _request(request_id: str, tokens: list[int], **kwargs) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4, ignore_eos=True), block_size=16, **kwargs)


# -- encoder-input identifiers ------------------------------------------------------------------

def test_recorded_identifiers_replace_the_derived_ones() -> None:
    derived = _request("a", list(range(100)), mm_positions=((10, 20),))
    assert derived.mm_hashes == (mm_identifier(list(range(10, 30))),)
    given = _request("a", list(range(100)), mm_positions=((10, 20), (40, 5)), mm_identifiers=("hash0_0", "x"))
    assert given.mm_hashes == ("hash0_0", "x")
    with pytest.raises(ValueError, match=r"^request a: 1 mm_identifiers for 2 mm_positions$"):
        _request("a", list(range(100)), mm_positions=((10, 20), (40, 5)), mm_identifiers=("x",))


def test_equal_identifiers_share_the_encoder_cache_whatever_the_tokens() -> None:
    """vLLM's test helpers name items ``hash{i}_{j}``: two requests whose items carry the same
    identifier share one cache entry (the second is a hit), though their tokens differ; with
    identifiers derived from the tokens (the mutant: no mm_identifiers) both are encoded."""
    def step(mm_identifiers):
        sched = Scheduler(_config(mm_identifiers=mm_identifiers, encoder_cache_size=1000,
                                  max_num_encoder_input_tokens=1000))
        for rid, base in (("a", 1000), ("b", 2000)):
            spec_ids = dict(mm_identifiers or ()).get(rid, ())
            sched.add_request(_request(rid, list(range(base, base + 60)), mm_positions=((0, 50),),
                                       mm_identifiers=spec_ids))
        out = sched.schedule()
        return [(e.request_id, e.encoder_input_ids) for e in out.events if isinstance(e, EncoderPlan)]

    assert step((("a", ("img",)), ("b", ("img",)))) == [("a", [0]), ("b", [])]
    assert step(None) == [("a", [0]), ("b", [0])]


def test_identifier_config_is_validated_and_left_out_at_its_default() -> None:
    with pytest.raises(ConfigError, match=r"^mm_identifiers: each item is \[request_id, \[identifier, \.\.\.\]\]"):
        _config(mm_identifiers=(("a", ()),))
    with pytest.raises(ConfigError, match=r"^mm_identifiers: each item"):
        _config(mm_identifiers=(("a", ("x",)), ("a", ("y",))))
    assert {"mm_identifiers", "max_loras", "lora_int_ids"}.isdisjoint(_config().to_dict())
    config = _config(mm_identifiers=(("a", ("x", "y")),), max_loras=2, lora_int_ids=(("a", 3),))
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# -- LoRA: max_loras ----------------------------------------------------------------------------

def _lora_run(max_loras, lora_int_ids):
    """Three waiting requests with adapters 1, 2, 3 (and a fourth without one); one step."""
    sched = Scheduler(_config(max_loras=max_loras, lora_int_ids=lora_int_ids))
    loras = dict(lora_int_ids or ())
    for i, rid in enumerate(("a", "b", "c", "d")):
        sched.add_request(_request(rid, list(range(100 * i, 100 * i + 20)), lora_int_id=loras.get(rid, 0)))
    out = sched.schedule()
    return ([(e.request_id, e.num_scheduled_tokens) for e in out.events if isinstance(e, ScheduledRequest)],
            [(e.request_id, e.reason) for e in out.events if isinstance(e, Skip)], sched)


def test_max_loras_skips_a_third_adapter_and_admits_a_shared_one() -> None:
    """vLLM 0.33.0: with max_loras 2, adapters 1 and 2 are admitted; c (adapter 3) is skipped;
    d (no adapter) and e (adapter 1, already scheduled) are not limited."""
    scheduled, skipped, sched = _lora_run(2, (("a", 1), ("b", 2), ("c", 3)))
    assert scheduled == [("a", 20), ("b", 20), ("d", 20)]
    assert skipped == [("c", MAX_LORAS_REACHED)]
    assert [r.request_id for r in sched.waiting] == ["c"]
    # Next step: the running requests still hold adapters 1 and 2 (scheduled or not): c waits.
    sched.add_request(_request("e", list(range(900, 920)), lora_int_id=1))
    out = sched.schedule()
    assert [(e.request_id, e.reason) for e in out.events if isinstance(e, Skip)] == [("c", MAX_LORAS_REACHED)]
    # (a, b and d wait for their first token: no update ran.)
    assert [e.request_id for e in out.events if isinstance(e, ScheduledRequest)] == ["e"]


def test_without_max_loras_every_adapter_is_admitted() -> None:
    """The mutant (no LoRA config): c is admitted."""
    scheduled, skipped, _ = _lora_run(None, None)
    assert scheduled == [("a", 20), ("b", 20), ("c", 20), ("d", 20)] and skipped == []


def test_lora_config_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"^max_loras must be a positive integer, got 0$"):
        _config(max_loras=0)
    with pytest.raises(ConfigError, match=r"^lora_int_ids: each item is \[request_id, lora_int_id >= 1\]"):
        _config(max_loras=1, lora_int_ids=(("a", 0),))
    with pytest.raises(ConfigError, match=r"^lora_int_ids \(LoRA requests\) need max_loras"):
        _config(lora_int_ids=(("a", 1),))


def _lora_trace(tmp_path, config: EngineConfig):
    specs = tuple(RequestSpec(rid, 0.0, tuple(range(100 * i, 100 * i + 20)), max_tokens=2, ignore_eos=True)
                  for i, rid in enumerate(("a", "b", "c")))
    path = tmp_path / "lora.parquet"
    record(Workload(source="synthetic", sha256="0" * 64, params={}, requests=specs), config, path)
    return path


def test_a_lora_skip_checks_clean_and_one_without_the_limit_is_flagged(tmp_path) -> None:
    """The checker accepts a skip for the LoRA limit only when max_loras adapters are running
    and the request's is not among them: the same rows under a config whose max_loras is 3 (the
    limit not reached) flag c's skip."""
    from harness.trace import open_trace

    loras = (("a", 1), ("b", 2), ("c", 3))
    path = _lora_trace(tmp_path, _config(max_loras=2, lora_int_ids=loras))
    trace = open_trace(path)
    assert check_steps(trace.config.to_dict(), trace.iter_steps()).ok
    looser = _config(max_loras=3, lora_int_ids=loras).to_dict()
    result = check_steps(looser, open_trace(path).iter_steps())
    # (c is skipped at steps 0 and 1, while a and b run; admitted at step 2.)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("STALE-OUTPUT", step, "c", f"skipped ({MAX_LORAS_REACHED}) without stale output in flight")
        for step in (0, 1)]


def test_regression_mm_identifiers_count_mismatch_is_one_line_exit_2(tmp_path) -> None:
    """Adversarial trial: a trace whose config gives a request 5 encoder-input
    identifiers for its 6 ``mm_positions`` items crashed ``check``, ``replay``
    and ``report`` with a bare "ValueError: zip() argument 2 is shorter",
    naming no file, and ``check --json`` printed nothing. Now: the file and
    the key, exit 2, and the JSON object."""
    import json as _json

    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from harness.cli import main
    from harness.trace import SUMMARY_KEY, open_trace
    from harness.trace.reader import METADATA_KEY
    from harness.trace.writer import reseal
    from reference.config import EngineConfig

    src = Path(__file__).resolve().parents[1] / "golden" / "encoder-inputs.parquet"
    first = next(e for _, events in open_trace(src).iter_steps() for e in events
                 if e["kind"] == "arrival" and e["mm_positions"])
    n = len(first["mm_positions"])
    kv = dict(pq.ParquetFile(src).metadata.metadata)
    kv.pop(b"ARROW:schema", None)
    meta = _json.loads(kv[METADATA_KEY])
    meta["config"]["mm_identifiers"] = [[first["request_id"], [f"item{i}" for i in range(n - 1)]]]
    meta["config_fingerprint"] = EngineConfig.from_dict(meta["config"]).fingerprint()
    kv[METADATA_KEY] = _json.dumps(meta, sort_keys=True).encode()
    summary = _json.loads(kv[SUMMARY_KEY])
    summary.pop("trace_sha256", None)
    kv[SUMMARY_KEY] = _json.dumps(summary, sort_keys=True).encode()
    path = tmp_path / "mismatch.parquet"
    pq.write_table(pq.read_table(src).replace_schema_metadata(kv), path)
    reseal(path, path)
    why = (f"{path}: bad config in metadata: mm_identifiers: request {first['request_id']} has {n - 1} "
           f"identifier(s) for {n} mm_positions item(s)")
    for args in (["check", str(path)], ["replay", str(path), "--candidate", "reference"]):
        result = CliRunner().invoke(main, args)
        assert (result.exit_code, result.output.strip()) == (2, f"error: {why}"), args
    result = CliRunner().invoke(main, ["check", str(path), "--json"])
    assert result.exit_code == 2
    assert _json.loads(result.output.splitlines()[0]) == {"ok": False, "exit": 2, "error": why}


def test_config_ids_of_no_request_in_the_whole_trace_are_a_one_line_warning(tmp_path) -> None:
    """Request ids in config mm_identifiers / lora_int_ids that no row of the trace has passed
    silently. Now one warning line per key (the count and the smallest id), not a violation;
    none for a trace cut at a step (truncated: the later requests are legitimately absent), and
    none when every id arrives."""
    from click.testing import CliRunner

    from harness.cli import main

    config = _config(max_loras=2, lora_int_ids=(("a", 1), ("b", 2), ("c", 3), ("ghost", 1), ("zz", 2)),
                     mm_identifiers=(("nobody", ("img",)),))
    path = _lora_trace(tmp_path, config)
    from harness.trace import open_trace

    result = check_steps(config.to_dict(), open_trace(path).iter_steps())
    assert result.ok and result.notes == [
        "warning: config mm_identifiers names 1 request id no row of the trace has, e.g. 'nobody' (ignored)",
        "warning: config lora_int_ids names 2 request ids no row of the trace has, e.g. 'ghost' (ignored)"]
    assert check_steps(config.to_dict(), open_trace(path).iter_steps(), truncated=True).notes == []
    clean = _config(max_loras=2, lora_int_ids=(("a", 1), ("b", 2), ("c", 3)))
    assert check_steps(clean.to_dict(), open_trace(_lora_trace(tmp_path / "x", clean)).iter_steps()).notes == []
    out = CliRunner().invoke(main, ["check", str(path)])
    assert out.exit_code == 0, out.output
    assert [line for line in out.output.splitlines() if line.startswith("warning")] == [
        "warning: config mm_identifiers names 1 request id no row of the trace has, e.g. 'nobody' (ignored)",
        "warning: config lora_int_ids names 2 request ids no row of the trace has, e.g. 'ghost' (ignored)"]
