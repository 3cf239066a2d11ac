"""The torch paged-attention runner: outputs unchanged by preemption, prefix
hits, chunked prefill, speculative decoding and async scheduling; KV
integrity; the KV-corrupting mutants caught by the model's output; batch
invariance; playback replay without torch; the CLI.

Everything runs on CPU in a few seconds per test (tiny scenarios, one torch
thread); tests marked ``cuda`` need a CUDA GPU (``bench/gpu_check.sh``).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Skips without torch; importing through the model module keeps torch's numpy warning quiet.
torch = pytest.importorskip("reference.runners.torch_model").torch

from click.testing import CliRunner

from harness.check import check_steps
from harness.cli import main
from harness.outputs import verify_outputs, verify_trace_outputs
from harness.trace.playback import load_recorded_outputs
from harness.trace.recorder import record
from harness.replay import replay
from harness.scenarios import SCENARIOS
from harness.trace import open_trace
from reference.config import EngineConfig
from reference.engine import Engine
from harness.candidates.mutants import MUTANTS
from reference.scheduler import Scheduler
from reference.runners.torch_model import (
    DenseSequence,
    SamplingRule,
    TinyModelConfig,
    TinyTransformer,
    dense_generate,
    greedy_sample,
)
from reference.runners.torch_runner import TorchRunnerFactory, compute_slot_mapping
from workloads import load_workload, synthetic

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT / ".." / "shared" / "data" / "mooncake-fast25" / "conversation_trace.jsonl"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model's ops are too small to split."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(TinyModelConfig(), "cpu")


def _run(workload, config, tmp_path: Path, *, candidate=Scheduler, integrity=True, device="cpu",
         name="run.parquet"):
    """Record ``workload`` with the torch runner; return (trace, factory, summary)."""
    factory = TorchRunnerFactory(device=device, kv_integrity=integrity)
    path = tmp_path / name
    summary = record(workload, config, path, candidate_factory=candidate, runner_factory=factory,
                     model=factory.metadata())
    return open_trace(path), factory, summary


def _streams(trace) -> dict[str, list[int]]:
    return load_recorded_outputs(trace).streams


def _scenario(name: str):
    sc = SCENARIOS[name]
    return sc.make_workload(), sc.engine_config()


def _mooncake_slice():
    """A prefix-heavy Mooncake slice: every conversation shares the first
    512-token block; prompts over 2048 tokens are rejected at arrival;
    outputs capped at 16 tokens to keep the test fast."""
    wl = load_workload(str(MOONCAKE), limit=48, time_scale=1000)
    wl = dataclasses.replace(wl, requests=tuple(dataclasses.replace(r, max_tokens=min(r.max_tokens, 16))
                                                for r in wl.requests))
    config = EngineConfig(block_size=16, max_model_len=2048, num_gpu_blocks=200, max_num_seqs=8,
                          max_num_batched_tokens=1024, scheduler_reserve_full_isl=False)
    return wl, config


# -- building blocks ------------------------------------------------------------------------

def test_slot_mapping_follows_the_block_table() -> None:
    positions = torch.arange(10)
    slots = compute_slot_mapping([7, 3, 5], positions, block_size=4)
    assert slots.tolist() == [28, 29, 30, 31, 12, 13, 14, 15, 20, 21]
    assert compute_slot_mapping([7], positions[:6], 4).tolist() == [28, 29, 30, 31, -1, -1]


def test_greedy_tie_rule_min_tokens_and_forced_eos() -> None:
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 0.0, 0.0]], dtype=torch.float64)
    assert greedy_sample(logits, [0, 1], SamplingRule()) == [1, 0]  # lowest id among equal maxima
    rule = SamplingRule(eos_token_id=1, ignore_eos=False, min_tokens=1, stop_token_ids=(2,))
    assert greedy_sample(logits, [0, 1], rule) == [3, 0]  # before min_tokens: EOS and stop masked
    forced = SamplingRule(eos_token_id=2, forced_eos_index=1)
    assert greedy_sample(logits, [0, 1], forced) == [1, 2]


def test_dense_sequence_is_chunking_invariant(model: TinyTransformer) -> None:
    """The same tokens in one chunk or many give bitwise-equal K/V and the
    same greedy tokens (float64 compute, fp32 storage)."""
    tokens = list(range(100, 190))
    whole, pieces = DenseSequence(model), DenseSequence(model, chunk=7)
    a = whole.extend(tokens)
    b = torch.cat([pieces.extend(tokens[:1]), pieces.extend(tokens[1:50]), pieces.extend(tokens[50:])])
    for layer in range(model.config.num_layers):
        assert torch.equal(whole.keys(layer), pieces.keys(layer))
        assert torch.equal(whole.values(layer), pieces.values(layer))
    assert (a - b).abs().max() < 1e-12
    assert a.argmax(-1).tolist() == b.argmax(-1).tolist()


def test_weights_are_a_function_of_the_seed() -> None:
    a, b = TinyTransformer(TinyModelConfig(seed=3)), TinyTransformer(TinyModelConfig(seed=3))
    c = TinyTransformer(TinyModelConfig(seed=4))
    assert torch.equal(a.lm_head, b.lm_head) and not torch.equal(a.lm_head, c.lm_head)
    with pytest.raises(ValueError, match="num_kv_heads"):
        TinyModelConfig(num_heads=4, num_kv_heads=3)


# -- the oracle on the presets ----------------------------------------------------------------

PRESETS = ["preemption-heavy", "spec-decode", "deferred-frees", "prefix-sharing"]


@pytest.mark.parametrize("name", PRESETS)
def test_outputs_equal_dense_forward_on_presets(name: str, tmp_path: Path) -> None:
    """Every request's tokens equal an unbatched dense forward; every K/V read
    matches the dense computation; the trace checks and replays (playback)."""
    wl, config = _scenario(name)
    trace, factory, summary = _run(wl, config, tmp_path)
    assert factory.num_findings == 0, factory.findings[0].describe()
    report = verify_trace_outputs(trace, "cpu")
    assert report.ok, report.mismatches[0].describe()
    assert report.requests >= 20 and report.tokens > 200
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.ok, result.by_invariant
    divergence, compared = replay(trace, Scheduler)
    assert divergence is None and compared == summary.steps
    # The preset really exercises its feature.
    if name == "preemption-heavy":
        assert summary.preemptions >= 10 and summary.prefix_hit_tokens > 0
    if name == "spec-decode":
        assert summary.draft_tokens > 100 and 0 < summary.rejected_draft_tokens < summary.draft_tokens
    if name == "deferred-frees":
        assert result.deferred_frees > 0 and summary.aborted > 0
    if name == "prefix-sharing":
        assert summary.prefix_hit_tokens > 400


@pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/data not present")
def test_outputs_equal_dense_forward_on_a_prefix_heavy_mooncake_slice(tmp_path: Path) -> None:
    wl, config = _mooncake_slice()
    trace, factory, summary = _run(wl, config, tmp_path)
    assert factory.num_findings == 0, factory.findings[0].describe()
    report = verify_trace_outputs(trace, "cpu")
    assert report.ok, report.mismatches[0].describe()
    assert report.requests == summary.finished >= 8
    assert summary.prefix_hit_tokens > 5000 and summary.preemptions > 0


def test_batch_invariance_two_batch_limits(tmp_path: Path) -> None:
    """The same workload at two batch limits (max_num_seqs, max_num_batched_tokens):
    different schedules, identical tokens for every request."""
    wl, config = _scenario("preemption-heavy")
    narrow = dataclasses.replace(config, max_num_seqs=2, max_num_batched_tokens=16)
    a, _, sa = _run(wl, config, tmp_path, integrity=False, name="wide.parquet")
    b, _, sb = _run(wl, narrow, tmp_path, integrity=False, name="narrow.parquet")
    assert sa.steps != sb.steps and sa.preemptions != sb.preemptions
    streams_a, streams_b = _streams(a), _streams(b)
    assert streams_a.keys() == streams_b.keys() and len(streams_a) == len(wl.requests)
    for req_id, tokens in streams_a.items():
        assert tokens == streams_b[req_id], req_id


# -- the KV-corrupting mutants ------------------------------------------------------------------

def _double_free_scenario():
    """Shared 16-token prefixes on a pool small enough that a block freed
    twice (so it sits in the free queue while still held) is reallocated
    while its holder still runs."""
    config = EngineConfig(block_size=4, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64,
                          num_gpu_blocks=40, scheduler_reserve_full_isl=False)
    wl = synthetic(num_requests=12, shared_prefix_len=16, shared_prefix_fraction=1.0, arrival_rate=40.0,
                   seed=0, prompt_len=(17, 40), output_len=(4, 24))
    return wl, config


MUTANT_CASES = {
    # mutant: (scenario, integrity finding kinds that must appear)
    "free-before-fence": (lambda: _scenario("deferred-frees"), {"overwritten-in-flight", "stale-read"}),
    "reuse-held-block": (lambda: _scenario("fcfs-tight"), {"double-write", "stale-read"}),
    "hit-evicted-block": (lambda: _scenario("preemption-heavy"), {"stale-read"}),
    "double-free-shared": (_double_free_scenario, {"stale-read"}),
}


@pytest.mark.parametrize("mutant", sorted(MUTANT_CASES))
def test_kv_corrupting_mutant_changes_the_output(mutant: str, tmp_path: Path, model) -> None:
    """Each KV-corrupting mutant gives the model wrong K/V: an integrity
    finding naming the block and its owner history, and tokens that differ
    from the dense forward."""
    make, kinds = MUTANT_CASES[mutant]
    wl, config = make()
    trace, factory, _ = _run(wl, config, tmp_path, candidate=MUTANTS[mutant])
    found = {k for r in factory.runners for k in r.findings_by_kind}
    assert kinds <= found, (mutant, found)
    first = factory.findings[0]
    assert first.block_id is not None and first.history, first.describe()
    assert f"block {first.block_id} owner history" in first.describe()
    report = verify_trace_outputs(trace, "cpu")
    assert not report.ok and not any(m.near_tie for m in report.mismatches)
    # Without integrity checks the run is the same and the output oracle alone catches it.
    plain_trace, plain, _ = _run(wl, config, tmp_path, candidate=MUTANTS[mutant], integrity=False,
                                 name="plain.parquet")
    assert plain.num_findings == 0 and _streams(plain_trace) == _streams(trace)
    assert not verify_trace_outputs(plain_trace, "cpu").ok


def test_reference_is_clean_on_the_mutant_scenarios(tmp_path: Path) -> None:
    wl, config = _double_free_scenario()
    trace, factory, summary = _run(wl, config, tmp_path)
    assert factory.num_findings == 0 and verify_trace_outputs(trace, "cpu").ok
    assert summary.prefix_hit_tokens > 0


def test_preempt_keeps_block_is_a_leak_not_a_corruption(tmp_path: Path) -> None:
    """preempt-keeps-block never hands the kept block to anyone else, so the
    KV stays right: outputs equal the dense forward and integrity is clean;
    only the scheduler invariant (PREEMPT-EFFECTS) catches it."""
    wl, config = _scenario("fcfs-tight")
    trace, factory, _ = _run(wl, config, tmp_path, candidate=MUTANTS["preempt-keeps-block"])
    assert factory.num_findings == 0
    assert verify_trace_outputs(trace, "cpu").ok
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert "PREEMPT-EFFECTS" in result.by_invariant


# -- playback, CLI, no torch ---------------------------------------------------------------------

def test_torch_trace_replays_without_torch(tmp_path: Path) -> None:
    """The trace holds the model's outputs: replay (playback) and check need no torch."""
    wl, config = _scenario("spec-decode")
    trace, _, _ = _run(wl, config, tmp_path, integrity=False)
    assert trace.meta["model"]["runner"] == "torch"
    code = ("import sys, json; sys.modules['torch'] = None\n"
            "from click.testing import CliRunner\nfrom harness.cli import main\n"
            f"r = CliRunner().invoke(main, ['replay', {str(trace.path)!r}, '--json'])\n"
            "print(r.exit_code); print(r.output)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    code_line, payload = out.stdout.split("\n", 1)
    assert code_line == "0", out.stdout + out.stderr
    assert json.loads(payload)["ok"] is True
    # A different candidate diverges from the recorded decisions.
    divergence, _ = replay(trace, MUTANTS["no-draft-rollback"])
    assert divergence is not None


def test_cli_record_verify_and_errors(tmp_path: Path) -> None:
    small = ["--set", "num_gpu_blocks=30", "--set", "max_model_len=96", "--set", "max_num_seqs=4",
             "--set", "block_size=4", "--set", "max_num_batched_tokens=64",
             "--set", "scheduler_reserve_full_isl=false"]
    runner = CliRunner()
    out = tmp_path / "t.parquet"
    r = runner.invoke(main, ["record", "synthetic:20", "-o", str(out), "--model", "torch", "--device", "cpu",
                             "--kv-integrity", "--verify-outputs", *small])
    assert r.exit_code == 0, r.output
    assert "every K/V read matched" in r.output and "all equal to a dense" in r.output
    r = runner.invoke(main, ["verify-outputs", str(out), "--device", "cpu", "--json"])
    assert r.exit_code == 0 and json.loads(r.output)["ok"] is True
    bad = tmp_path / "bad.parquet"
    r = runner.invoke(main, ["record", "synthetic:30", "-o", str(bad), "--model", "torch", "--device", "cpu",
                             "--kv-integrity", "--verify-outputs", "--engine", "mutant:reuse-held-block",
                             *small])
    assert r.exit_code == 1, r.output
    assert "KV integrity" in r.output and "owner history" in r.output and "OUTPUT MISMATCH" in r.output
    r = runner.invoke(main, ["verify-outputs", str(bad), "--device", "cpu"])
    assert r.exit_code == 1
    # Unusable: a scripted trace, torch-only flags without --model torch.
    scripted = tmp_path / "s.parquet"
    assert runner.invoke(main, ["record", "synthetic:3", "-o", str(scripted)]).exit_code == 0
    r = runner.invoke(main, ["verify-outputs", str(scripted)])
    assert r.exit_code == 2 and "not recorded with the torch model runner" in r.output
    r = runner.invoke(main, ["record", "synthetic:3", "-o", str(scripted), "--kv-integrity"])
    assert r.exit_code == 2 and "--model torch" in r.output
    if not torch.cuda.is_available():
        r = runner.invoke(main, ["record", "synthetic:3", "-o", str(scripted), "--model", "torch",
                                 "--device", "cuda"])
        assert r.exit_code == 2 and "CUDA is not available" in r.output


def test_harness_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "import harness.cli, harness.replay, harness.trace.playback, harness.outputs, reference.engine\n"
            "from harness.outputs import OutputsError, import_torch\n"
            "try:\n    import_torch()\nexcept OutputsError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert "pip install torch==2.13.0" in out.stdout


def test_engine_without_runner_factory_keeps_the_scripted_runner() -> None:
    wl, config = _scenario("fcfs-tight")
    engine = Engine(config)
    assert engine.runners[0].runner is engine.runner
    engine.run(wl)


def test_verify_outputs_reports_the_first_differing_index(model: TinyTransformer) -> None:
    wl = synthetic(num_requests=2, seed=1)
    spec = wl.requests[0]
    tokens, _ = dense_generate(model, spec.prompt_token_ids, 6, SamplingRule.from_spec(spec))
    wrong = tokens[:3] + [(tokens[3] + 1) % 512] + tokens[4:]
    report = verify_outputs(wl.requests, {spec.request_id: wrong}, model)
    assert report.requests == 1 and report.mismatches[0].index == 3
    assert report.mismatches[0].expected == tokens[3]


# -- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
def test_cuda_tokens_equal_cpu_tokens(tmp_path: Path) -> None:
    """Cross-device batch invariance: the preemption-heavy preset gives the
    same tokens on CUDA as on CPU, and the dense oracle agrees on CUDA."""
    wl, config = _scenario("preemption-heavy")
    cpu, _, _ = _run(wl, config, tmp_path, integrity=False, name="cpu.parquet")
    gpu, factory, _ = _run(wl, config, tmp_path, device="cuda", name="gpu.parquet")
    assert factory.num_findings == 0
    assert _streams(cpu) == _streams(gpu)
    assert verify_trace_outputs(gpu, "cuda").ok


@pytest.mark.cuda
@needs_cuda
def test_cuda_mutant_is_caught(tmp_path: Path) -> None:
    wl, config = _scenario("deferred-frees")
    trace, factory, _ = _run(wl, config, tmp_path, device="cuda", candidate=MUTANTS["free-before-fence"])
    assert "overwritten-in-flight" in {k for r in factory.runners for k in r.findings_by_kind}
    assert not verify_trace_outputs(trace, "cuda").ok
