"""Regression (never cry wolf): the fork gate failed a correct fork.

``harness replay golden/deferred-frees.parquet --candidate
forks.shortest_prompt_first:make --semantics fork`` (and ``golden check
--semantics fork``) reported the candidate's own run with ``PROGRESS-RUNNING at
step 114, request r000030: running with 1 token(s) to compute but not
scheduled, although the step left 64 token(s) of budget and 0 free block(s) (it
needed at most 0)``.

What vLLM 0.33.0 does there (``Scheduler.schedule()``'s running loop,
``vllm/v1/core/sched/scheduler.py``; the reference mirrors it and the fork
changes only ``add_request``): running is [r000025, r000032, r000030], async
scheduling, deferred frees, 0 free blocks. r000025 (63 prompt tokens, 9 of
max_tokens 11 outputs, 1 in flight, 72 computed) is not held by the async
max_tokens guard (72 + 2 - 1 = 73 < 63 + 11 = 74): it needs block 19 for token
73, allocate_slots fails, the victim ``running[-1]`` is r000030, scheduled in
step 113 whose batch is not processed (its free would be fenced), so the loop
breaks; r000030 is never reached. The fork is right; the rule was wrong: it took
r000025 as guarded (``num_output_tokens + placeholders + 1 >= max_tokens``,
9 + 1 + 1 >= 11, one placeholder wider than vLLM's condition), passed over it
and judged r000030. It now uses vLLM's exact condition
(``harness.check.progress.async_max_tokens_guard``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from forks import put_on_path
from harness.check.progress import async_max_tokens_guard
from harness.cli import main

REPO = Path(__file__).resolve().parents[1]
SPF = "forks.shortest_prompt_first:make"


def test_the_fork_gate_passes_the_fork_on_deferred_frees(monkeypatch) -> None:
    put_on_path(monkeypatch)
    r = CliRunner().invoke(main, ["replay", str(REPO / "golden" / "deferred-frees.parquet"), "--candidate", SPF,
                                  "--semantics", "fork"])
    assert r.exit_code == 0, r.output[-3000:]
    assert "PROGRESS-RUNNING" not in r.output
    assert r.output.splitlines()[-2:] == [
        f"own run: {SPF} re-run on the trace's workload, config and seed from step 0: 205 steps, no violation "
        "(profile fork)",
        "conformant (profile fork); decisions differ from step 3 (information: not held to a version's design)"]
    doc = json.loads(CliRunner().invoke(main, ["replay", str(REPO / "golden" / "deferred-frees.parquet"),
                                               "--candidate", SPF, "--semantics", "fork", "--json"]).output)
    assert (doc["ok"], doc["own_run"]["ok"], doc["own_run"]["steps"], doc["own_run"]["num_violations"]) == (
        True, True, 205, 0)


def test_the_witness_state_is_vllms_break_on_a_fenced_victim(tmp_path: Path, monkeypatch) -> None:
    """The own run's rows at steps 113-115: what vLLM's running loop does, step by step."""
    put_on_path(monkeypatch)
    out = tmp_path / "spf.parquet"
    r = CliRunner().invoke(main, ["record", str(REPO / "harness" / "scenarios" / "deferred-frees.toml"),
                                  "--engine", SPF, "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = [row for row in pq.read_table(out).to_pylist() if row["step"] in (113, 114, 115)]
    sched = [(row["step"], row["request_id"], row["schedule_kind"], row["num_computed_tokens"],
              row["num_scheduled_tokens"], len(row["block_ids"] or [])) for row in rows if row["kind"] == "schedule"]
    assert sched == [(113, "r000025", "running", 71, 1, 0),
                     (113, "r000032", "new", 0, 6, 2),     # the shorter prompt admitted first (the fork's policy)
                     (113, "r000030", "new", 0, 35, 9),    # 35 tokens in 9 blocks: its next token needs none
                     (115, "r000025", "running", 72, 1, 1),  # not guarded: it needed one more step, and block 19
                     (115, "r000030", "running", 35, 1, 0)]
    step_114 = [(row["kind"], row["num_free_blocks"], row["token_budget"], row["total_num_scheduled_tokens"])
                for row in rows if row["step"] == 114 and row["kind"] in ("schedule_begin", "preempt", "schedule_end")]
    assert step_114 == [("schedule_begin", 0, None, None), ("schedule_end", 0, 64, 0)]  # no preemption: the victim is fenced
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork"])
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (0, "conformant (profile fork)"), r.output[-2000:]


def test_the_guard_is_vllms_condition() -> None:
    """vLLM 0.33.0: num_computed_tokens + 2 - num_output_placeholders >= num_prompt_tokens + max_tokens."""
    def req(computed: int, placeholders: int, prompt: int, max_tokens: int) -> SimpleNamespace:
        return SimpleNamespace(num_computed_tokens=computed, placeholders=placeholders, num_prompt_tokens=prompt,
                               max_tokens=max_tokens)

    assert async_max_tokens_guard(req(72, 1, 63, 11)) is False  # r000025 at step 114: 73 < 74, vLLM tries it
    assert async_max_tokens_guard(req(73, 1, 63, 11)) is True   # r000025 at step 116: its last token in flight
    assert async_max_tokens_guard(req(6, 1, 6, 1)) is True      # r000032 at step 114: max_tokens 1 in flight
    assert async_max_tokens_guard(req(72, 0, 63, 11)) is False  # nothing in flight: never the guard


def test_golden_check_fork_passes_the_fork_on_every_golden(monkeypatch) -> None:
    put_on_path(monkeypatch)
    r = CliRunner().invoke(main, ["golden", "check", "--candidate", SPF, "--semantics", "fork"])
    assert r.exit_code == 0, r.output[-3000:]
    lines = r.output.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("FAIL")] == []
    assert lines[-1] == f"20 ok, 0 failed ({REPO / 'golden'}, candidate {SPF}, profile fork)"
    assert ("ok   deferred-frees        213 steps, decisions differ from step 3 (information); own run: 205 "
            "steps, no violation") in lines


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_vllm_with_the_same_policy_makes_the_forks_decisions(tmp_path: Path, monkeypatch) -> None:
    """vLLM 0.33.0's own AsyncScheduler with the same add_request change
    (tests/vllm_classes/fork_schedulers.py) replays the fork's own run of deferred-frees with
    identical decisions, step 114 (nothing scheduled, nothing preempted) included: the rows
    the rule fired on are vLLM's."""
    from harness.candidates.vllm.env import ensure_env

    ensure_env("0.33.0", log=lambda line: print(f"vllm-env: {line}", file=sys.stderr))
    put_on_path(monkeypatch, REPO / "tests" / "vllm_classes")
    out = tmp_path / "spf.parquet"
    r = CliRunner().invoke(main, ["record", str(REPO / "harness" / "scenarios" / "deferred-frees.toml"),
                                  "--engine", SPF, "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["replay", str(out), "--candidate",
                                  "vllm@0.33.0,scheduler_cls=fork_schedulers:ShortestPromptFirst"])
    assert (r.exit_code, r.output.splitlines()[-1]) == (
        0, "conformant (profile safety; a fork's trace: add --semantics fork for the progress rules): 205 steps "
           "replayed, identical decisions"), r.output[-3000:]
