"""Finding: a PRIORITY give-back leaves never-computed blocks in the prefix cache.

vLLM 0.33.0 (and the reference, which mirrors it) caches a request's newly
full blocks eagerly in ``allocate_slots``, at schedule time. When a
higher-priority request later in the same step needs blocks, the PRIORITY
give-back withdraws the earlier-scheduled victim (its chunk never runs) and
preempts it (``Scheduler.schedule``, running loop; spec 4.2). The blocks its
withdrawn chunk completed stay registered under their hashes. When the victim
resumes, its prefix lookup hits them: it skips tokens whose KV was never
written, and attends over garbage.

Found by a seeded search over small PRIORITY workloads once the checker
forgot the content of blocks registered by a withdrawn chunk
(HIT-UNCOMPUTED-BLOCK); shrunk by deleting requests to 8 of them. The
checker's witness names the block and the withdrawn request; real vLLM 0.33.0
makes identical decisions on the trace; the torch runner shows the wrong KV
(integrity finding) and the wrong tokens (output oracle).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from harness.check import check_steps
from harness.trace.recorder import record
from harness.trace import open_trace
from reference.config import EngineConfig
from reference.workload import Workload
from workloads import synthetic

CONFIG = EngineConfig(block_size=4, max_model_len=96, max_num_seqs=3, max_num_batched_tokens=64,
                      num_gpu_blocks=26, policy="priority", scheduler_reserve_full_isl=False,
                      long_prefill_token_threshold=6)
KEEP = ("r000002", "r000003", "r000004", "r000005", "r000006", "r000008", "r000009", "r000011")


def witness_workload() -> Workload:
    """Eight requests of a seeded synthetic PRIORITY workload (the shrunk witness)."""
    wl = synthetic(num_requests=12, priority_levels=3, arrival_rate=40.0, shared_prefix_len=16,
                   shared_prefix_fraction=0.5, seed=1265)
    return dataclasses.replace(wl, requests=tuple(r for r in wl.requests if r.request_id in KEEP))


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("finding") / "give-back.parquet"
    record(witness_workload(), CONFIG, path, seed=1265)
    return path


def test_reference_hits_a_block_its_withdrawn_chunk_never_computed(trace_path: Path) -> None:
    trace = open_trace(trace_path)
    result = check_steps(trace.meta["config"], trace.iter_steps())
    assert result.by_invariant == {"HIT-UNCOMPUTED-BLOCK": 1}
    (v,) = result.violations
    assert (v.step, v.request) == (49, "r000009")
    assert v.message.startswith("prefix hit on block 25, whose KV was never computed: a chunk of "
                                "r000009 cached it at allocation and was then withdrawn")
    # The witness history shows the withdrawal, then the resume that hits it.
    assert any("withdrawn" in line for line in v.history)


def test_regression_give_back_wording_names_the_configured_policy(trace_path: Path) -> None:
    """A trial: the witness said "withdrawn by a PRIORITY give-back" under FCFS
    too (a fork's give-back); it says what a give-back is and the policy the
    trace configured."""
    trace = open_trace(trace_path)
    (v,) = check_steps(trace.meta["config"], trace.iter_steps()).violations
    assert v.message == ("prefix hit on block 25, whose KV was never computed: a chunk of r000009 cached it "
                         "at allocation and was then withdrawn by a give-back (a victim scheduled earlier "
                         "this step, policy priority)")
    fcfs = check_steps({**trace.meta["config"], "policy": "fcfs"}, trace.iter_steps())
    (v,) = [v for v in fcfs.violations if v.invariant == "HIT-UNCOMPUTED-BLOCK"]
    assert v.message.endswith("withdrawn by a give-back (a victim scheduled earlier this step, policy fcfs)")


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_real_vllm_makes_the_same_decisions(trace_path: Path) -> None:
    from harness.candidates.resolve import resolve_candidate
    from harness.replay import replay

    divergence, compared = replay(open_trace(trace_path), resolve_candidate("vllm@0.33.0"))
    assert divergence is None and compared == open_trace(trace_path).summary["steps"]


def test_torch_runner_reads_garbage_and_samples_wrong_tokens(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from harness.outputs import verify_trace_outputs
    from reference.runners.torch_runner import TorchRunnerFactory

    factory = TorchRunnerFactory(device="cpu", kv_integrity=True)
    path = tmp_path / "torch.parquet"
    record(witness_workload(), CONFIG, path, seed=1265, runner_factory=factory, model=factory.metadata())
    assert factory.num_findings > 0
    assert any(f.request_id == "r000009" for f in factory.findings)
    report = verify_trace_outputs(open_trace(path), "cpu")
    assert not report.ok and "r000009" in {m.request_id for m in report.mismatches}
