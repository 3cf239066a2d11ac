"""Scenario ``[[actions]]``: prefix-cache resets and abort sets at a step.

Exact decisions on the reference (who is preempted, which blocks are freed,
what hits after a reset), the pool rule mirrored from vLLM 0.33.0
``BlockPool.reset_prefix_cache``, bad inputs (exit 2, ``file:line:
problem``), each new check firing on a doctored trace and on its mutant, and
replay: identical on the reference and (marked ``vllm``) on vllm@0.33.0.
"""

from __future__ import annotations

from reference.words import plural

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.check.checker import check_steps
from harness.cli import main
from harness.mutation import run_candidate
from harness.replay import replay, workload_from_trace
from harness.scenarios import ACTION_SCENARIOS
from harness.trace import SCHEMA_VERSION, open_trace
from harness.trace.recorder import record as record_trace, run_to_rows
from harness.candidates.mutants import MUTANTS_AND_TARGETS
from reference.block_pool import BlockPool
from reference.scheduler import Scheduler
from reference.workload import Action, WorkloadError
from workloads.scenario import load_scenario

SCENARIOS = Path(__file__).resolve().parents[1] / "traces" / "scenarios"
WHILE_RUNNING = SCENARIOS / "reset-prefix-cache-while-running.toml"
PREEMPT_RUNNING = SCENARIOS / "reset-prefix-cache-preempt-running.toml"


def record(path: Path, out: Path, *extra: str) -> Path:
    r = CliRunner().invoke(main, ["record", str(path), "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


def rows_of(trace: Path, *kinds: str) -> list[tuple]:
    """(step, kind, request, status, message, running, block_ids, hit) of the rows of ``kinds``."""
    return [(r["step"], r["kind"], r["request_id"], r["status"], r["message"], r["running"], r["block_ids"],
             r["num_prefix_hit_tokens"])
            for r in pq.read_table(trace).to_pylist() if r["kind"] in kinds]


def scenario_steps(path: Path, factory=Scheduler) -> tuple[dict, list]:
    sc = load_scenario(path)
    steps: list = []
    run_to_rows(sc.workload, sc.engine_config(), seed=sc.seed, candidate_factory=factory,
                on_step_rows=lambda s, rows: steps.append((s, rows)))
    return sc.engine_config().to_dict(), steps


# -- the pool rule (vLLM BlockPool.reset_prefix_cache) ------------------------------
def test_block_pool_reset_refuses_while_held_and_keeps_the_free_queue_order() -> None:
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h1", b"h2"], 0, 2)
    assert pool.reset_prefix_cache() is False  # 2 blocks held: nothing changes
    assert pool.get_cached_block(b"h1") is blocks[0]
    pool.free_blocks(blocks[::-1])  # hashed: to the tail, tail block first
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h1") is None and pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)
    # The queue is untouched: the next allocations still come from its head
    # (3, 4, 5), the formerly cached blocks 2, 1 last.
    assert [b.block_id for b in pool.get_new_blocks(5)] == [3, 4, 5, 2, 1]


# -- exact decisions ---------------------------------------------------------------
def test_reset_refused_while_held_then_succeeds_and_the_next_request_recomputes(tmp_path: Path) -> None:
    out = record(WHILE_RUNNING, tmp_path / "t.parquet")
    assert rows_of(out, "reset_prefix_cache", "preempt") == [
        (1, "reset_prefix_cache", None, "refused", None, ["A"], None, None),  # A holds [1, 2, 3]
        (2, "reset_prefix_cache", None, "succeeded", None, [], None, None),   # B arrived, holds nothing
    ]
    sched = [(s, rid, hit, blocks) for s, kind, rid, _, _, _, blocks, hit in rows_of(out, "schedule") if hit is not None
             and blocks]
    # B (same 40-token prompt as A) hits nothing after the reset and reuses A's
    # freed blocks from the queue head; C then hits the 32 tokens B cached.
    assert sched == [(0, "A", 0, [1, 2, 3]), (2, "B", 0, [3, 4, 5]), (4, "C", 32, [3, 4, 5])]
    r = CliRunner().invoke(main, ["check", str(out)])
    assert r.exit_code == 0 and r.output.rstrip().endswith("conformant (profile 0.33.0)"), r.output


def test_forced_reset_preempts_running_tail_first_and_the_step_still_admits(tmp_path: Path) -> None:
    out = record(PREEMPT_RUNNING, tmp_path / "t.parquet")
    assert rows_of(out, "abort", "reset_prefix_cache", "preempt") == [
        (3, "abort", "C", "FINISHED_ABORTED", None, None, [6, 5], None),
        (3, "reset_prefix_cache", None, "succeeded", "reset_running_requests", ["A", "B"], None, None),
        (3, "preempt", "B", "RUNNING", None, None, [4, 2, 1], None),
        (3, "preempt", "A", "RUNNING", None, None, [3, 2, 1], None),
    ]
    step3 = dict(open_trace(out).iter_steps())[3]  # whole queues (schema 8 stores changes)
    begin = next(r for r in step3 if r["kind"] == "schedule_begin")
    assert (begin["running"], begin["waiting"], begin["num_free_blocks"]) == ([], ["A", "B"], 31)
    # Both re-admitted in the same step (the reset's preemptions are not the
    # step's): A recomputes from 0 on fresh blocks (not the pre-reset 1, 2),
    # B hits the blocks A just cached.
    assert [(r["request_id"], r["schedule_kind"], r["num_prefix_hit_tokens"], r["block_ids"])
            for r in step3 if r["kind"] == "schedule"] == [("A", "resumed", 0, [3, 4, 6]),
                                                           ("B", "resumed", 32, [3, 4, 7])]
    end = next(r for r in step3 if r["kind"] == "schedule_end")
    assert sorted(end["preempted_req_ids"]) == ["A", "B"]
    assert open_trace(out).meta["schema_version"] == SCHEMA_VERSION


def test_actions_replay_identically_on_the_reference_and_diverge_on_a_mutant(tmp_path: Path) -> None:
    for path in (WHILE_RUNNING, PREEMPT_RUNNING):
        out = record(path, tmp_path / f"{path.stem}.parquet")
        trace = open_trace(out)
        wl = workload_from_trace(trace)
        assert wl.actions == load_scenario(path).workload.actions
        steps = {"reset-prefix-cache-while-running": 6, "reset-prefix-cache-preempt-running": 7}[path.stem]
        assert replay(trace, Scheduler) == (None, steps)
    divergence, _ = replay(open_trace(tmp_path / f"{PREEMPT_RUNNING.stem}.parquet"),
                           MUTANTS_AND_TARGETS["reset-preempts-head"][0])
    assert divergence is not None and divergence.step == 3


def test_an_action_in_an_idle_stretch_applies_at_the_next_step_run(tmp_path: Path) -> None:
    src = tmp_path / "idle.toml"
    src.write_text(BASE + REQ.format(rid="A", extra="arrival_step = 0\nmax_tokens = 1")
                   + REQ.format(rid="B", extra="arrival_step = 10\nmax_tokens = 1")
                   + '[[actions]]\nstep = 4\nkind = "reset_prefix_cache"\n')
    out = record(src, tmp_path / "t.parquet")
    assert rows_of(out, "reset_prefix_cache") == [(10, "reset_prefix_cache", None, "succeeded", None, [], None,
                                                   None)]


def test_abort_action_ignores_requests_already_ended(tmp_path: Path) -> None:
    src = tmp_path / "abort.toml"
    src.write_text(BASE + REQ.format(rid="A", extra="arrival_step = 0\nmax_tokens = 1")
                   + REQ.format(rid="B", extra="arrival_step = 0\nmax_tokens = 8\nignore_eos = true")
                   + '[[actions]]\nstep = 2\nkind = "abort"\nrequest_ids = ["A", "B"]\n')
    out = record(src, tmp_path / "t.parquet")
    assert [(s, k, rid, st) for s, k, rid, st, *_ in rows_of(out, "abort", "finish")] == [
        (0, "finish", "A", "FINISHED_LENGTH_CAPPED"), (2, "abort", "B", "FINISHED_ABORTED")]


# -- bad input -------------------------------------------------------------------------
BASE = "format_version = 1\n[config]\nnum_gpu_blocks = 16\nblock_size = 16\nmax_model_len = 128\n"
REQ = '[[requests]]\nrequest_id = "{rid}"\nprompt_len = 8\n{extra}\n'
ONE = BASE + REQ.format(rid="A", extra="arrival_step = 2")  # lines 1-9; [[actions]] at 10


@pytest.mark.parametrize("body, line, problem", [
    (ONE + '[[actions]]\nstep = 3\nkind = "reset_prefix_cache"\ncolour = 1\n', 13, "actions[0]: unknown key 'colour'"),
    (ONE + '[[actions]]\nstep = 3\nkind = "flush"\n', 12, "kind must be one of reset_prefix_cache, abort"),
    (ONE + '[[actions]]\nstep = 3\nkind = "abort"\nrequest_ids = ["Z"]\n', 13, "unknown request 'Z'"),
    (ONE + '[[actions]]\nstep = 1\nkind = "abort"\nrequest_ids = ["A"]\n', 11, "step 1 is in the past for 'A'"),
    (ONE + '[[actions]]\nstep = 3\nkind = "abort"\n', 10, "an abort action needs request_ids"),
    (ONE + '[[actions]]\nstep = 3\nkind = "abort"\nrequest_ids = ["A"]\nreset_running_requests = true\n', 14,
     "'reset_running_requests' does not apply to kind 'abort'"),
    (ONE + '[[actions]]\nstep = 3\nkind = "reset_prefix_cache"\nrequest_ids = ["A"]\n', 13,
     "'request_ids' does not apply to kind 'reset_prefix_cache'"),
    (ONE + '[[actions]]\nstep = -1\nkind = "reset_prefix_cache"\n', 11, "-1 is less than the minimum of 0"),
    (ONE + '[[actions]]\nstep = 1.5\nkind = "reset_prefix_cache"\n', 11, "1.5 is not of type 'integer'"),
    (ONE + '[[actions]]\nkind = "reset_prefix_cache"\n', 10, "'step' is a required property"),
    (ONE.replace("block_size = 16\n", "block_size = 16\nasync_scheduling = true\n")
     + '[[actions]]\nstep = 3\nkind = "reset_prefix_cache"\nreset_running_requests = true\n', 14,
     "reset_running_requests needs a synchronous engine"),
])
def test_bad_actions_exit_2_with_file_line_problem(refused_scenario, body: str, line: int, problem: str) -> None:
    refused_scenario(body, line, problem)


def test_action_dataclass_refuses_bad_values() -> None:
    with pytest.raises(WorkloadError, match="kind must be one of"):
        Action(0, "flush")
    with pytest.raises(WorkloadError, match="step must be an int >= 0"):
        Action(-1, "reset_prefix_cache")
    with pytest.raises(WorkloadError, match="takes request_ids"):
        Action(0, "abort")
    assert Action.from_dict(Action(3, "abort", request_ids=("A",)).to_dict()) == Action(3, "abort",
                                                                                       request_ids=("A",))


# -- the checks fire ---------------------------------------------------------------------
def _doctor(steps: list, step: int, kind: str, change) -> list:
    out = []
    for s, rows in steps:
        rows = [dict(r) for r in rows]
        if s == step:
            for r in rows:
                if r["kind"] == kind:
                    change(r)
                    break
        out.append((s, rows))
    return out


def test_reset_checks_fire_on_doctored_traces() -> None:
    config, steps = scenario_steps(WHILE_RUNNING)
    assert check_steps(config, steps).ok
    # The refused reset at step 1 (A holds 3 blocks) claimed to succeed.
    bad = check_steps(config, _doctor(steps, 1, "reset_prefix_cache", lambda r: r.update(status="succeeded")))
    assert bad.by_invariant.get("RESET-ONLY-WHEN-FREE") == 1
    # The successful one at step 2 claimed refused (nothing held).
    bad = check_steps(config, _doctor(steps, 2, "reset_prefix_cache", lambda r: r.update(status="refused")))
    assert bad.by_invariant.get("RESET-ONLY-WHEN-FREE") == 1
    config, steps = scenario_steps(PREEMPT_RUNNING)
    assert check_steps(config, steps).ok
    # The forced reset's victims in head-first order.
    swapped = []
    for s, rows in steps:
        rows = [dict(r) for r in rows]
        if s == 3:
            idx = [i for i, r in enumerate(rows) if r["kind"] == "preempt"]
            rows[idx[0]], rows[idx[1]] = rows[idx[1]], rows[idx[0]]
        swapped.append((s, rows))
    assert check_steps(config, swapped).by_invariant.get("RESET-PREEMPTS-RUNNING") == 1


@pytest.mark.parametrize("mutant, scenario", [
    ("reset-while-held", WHILE_RUNNING),
    ("reset-keeps-cache", WHILE_RUNNING),
    ("reset-keeps-cache", PREEMPT_RUNNING),
    ("reset-preempts-head", PREEMPT_RUNNING),
])
def test_each_reset_mutant_is_killed_by_a_scenario_file(mutant: str, scenario: Path) -> None:
    cls, target = MUTANTS_AND_TARGETS[mutant]
    config, steps = scenario_steps(scenario, cls)
    assert check_steps(config, steps).by_invariant.get(target, 0) >= 1
    clean_config, clean = scenario_steps(scenario)
    assert check_steps(clean_config, clean).ok


def test_the_action_scenario_kills_the_reset_mutants_and_is_clean_on_the_reference() -> None:
    sc = ACTION_SCENARIOS["prefix-reset"]
    assert run_candidate(Scheduler, sc).result.ok
    hits = {m: run_candidate(MUTANTS_AND_TARGETS[m][0], sc).result.by_invariant.get(MUTANTS_AND_TARGETS[m][1], 0)
            for m in ("reset-while-held", "reset-keeps-cache", "reset-preempts-head")}
    assert hits == {"reset-while-held": 1, "reset-keeps-cache": 21, "reset-preempts-head": 1}


def test_every_trace_is_written_in_the_current_schema_with_the_scenario_columns(tmp_path: Path) -> None:
    """One schema going forward: a plain recording has the scenario columns
    too (null), as a scenario recording does."""
    from harness.scenarios import SCENARIOS
    sc = SCENARIOS["fcfs-tight"]
    out = tmp_path / "plain.parquet"
    record_trace(sc.make_workload(), sc.engine_config(), out, seed=sc.seed)
    trace = open_trace(out)
    assert trace.meta["schema_version"] == SCHEMA_VERSION == 8
    names = set(pq.read_schema(out).names)
    assert {"arrival_step", "after", "abort_step", "output_token_ids", "draft_acceptance_pattern",
            "request_data_ids"} <= names
    arrivals = pq.read_table(out, filters=[("kind", "=", "arrival")]).to_pylist()
    assert {r["arrival_step"] for r in arrivals} == {None}


# -- real vLLM -------------------------------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_actions_replay_identically_on_vllm(tmp_path: Path) -> None:
    for path, steps in ((WHILE_RUNNING, 6), (PREEMPT_RUNNING, 7)):
        out = record(path, tmp_path / f"{path.stem}.parquet")
        r = CliRunner().invoke(main, ["replay", str(out), "--candidate", "vllm@0.33.0"])
        assert r.exit_code == 0, (path.name, r.output)
        assert f"conformant (profile 0.33.0): {plural(steps, 'step')} replayed, identical decisions" in r.output, path.name


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_the_action_scenario_replays_identically_on_vllm(tmp_path: Path) -> None:
    """40 synthetic requests, a refused reset, an abort action (one running, one
    waiting) and two forced resets: vLLM 0.33.0 takes the same decisions."""
    from harness.trace.recorder import record as record_workload
    sc = ACTION_SCENARIOS["prefix-reset"]
    out = tmp_path / "t.parquet"
    summary = record_workload(sc.make_workload(), sc.engine_config(), out, seed=sc.seed)
    assert (summary.steps, summary.aborted, summary.preemptions) == (230, 2, 3)
    assert [(s, status) for s, _, _, status, *_ in rows_of(out, "reset_prefix_cache")] == [
        (5, "refused"), (12, "succeeded"), (25, "succeeded")]
    r = CliRunner().invoke(main, ["replay", str(out), "--candidate", "vllm@0.33.0"])
    assert r.exit_code == 0 and "conformant (profile 0.33.0): 230 steps replayed, identical decisions" in r.output, r.output


def test_abort_action_on_a_request_not_yet_arrived_aborts_it_on_arrival(tmp_path: Path) -> None:
    """Regression: an abort action naming an `after` request that had not arrived yet was
    dropped silently (Q then ran to the end); it now applies when Q arrives, as Q's own
    abort_step would, on the reference and identically on replay."""
    src = tmp_path / "late.toml"
    src.write_text('''format_version = 1
[config]
num_gpu_blocks = 16
block_size = 16
max_model_len = 128
[[requests]]
request_id = "A"
prompt_len = 8
max_tokens = 5
ignore_eos = true
arrival_step = 0
[[requests]]
request_id = "Q"
prompt_len = 8
max_tokens = 4
after = "A finishes"
[[actions]]
step = 2
kind = "abort"
request_ids = ["Q"]
''')
    out = tmp_path / "late.parquet"
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = [(row["step"], row["kind"], row["request_id"]) for row in pq.read_table(out).to_pylist()
            if row["kind"] in ("arrival", "abort", "finish")]
    assert rows == [(0, "arrival", "A"), (4, "finish", "A"), (5, "arrival", "Q"), (5, "abort", "Q")]
    assert replay(open_trace(out), Scheduler)[0] is None
