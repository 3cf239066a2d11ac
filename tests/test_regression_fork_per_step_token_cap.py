"""Regression (never cry wolf): a correct vLLM fork that sets its own token cap per step
failed the fork gate.

``harness golden check --candidate "vllm@0.33.0,scheduler_cls=myfork.sched:SloBudgetScheduler"
--semantics fork`` (a new user's trial) reported PROGRESS-ADMIT on 7 goldens, e.g. fcfs-roomy
step 11: "waiting (33 tokens) and not admitted, although the step left 32 token(s) of budget".
The fork (``tests/vllm_classes/slo_budget.py``) halves ``Scheduler.max_num_scheduled_tokens``
(64 -> 32 tokens) for a step when two or more running requests decode, then runs vLLM 0.33.0's
``Scheduler.schedule``, which takes that attribute as the step's token budget. The vLLM driver
read the attribute once at build (``driver_engine_core``) and recorded each step's
``token_budget`` as 64 - tokens scheduled, so a step that spent its whole halved cap (32 of 32)
showed 32 tokens left. It now reads the attribute every step (``driver_step.StepLoop.schedule``),
as the recording scheduler (``recording_scheduler.py``) already did.

The rule still fires on a fork that leaves budget unused: the vLLM fork
``SloBudgetLeavesBudgetScheduler`` below (it schedules on a quarter of the cap and leaves the
step's cap at the half), and the reference mutant admit-one-per-step in
``tests/test_fork_gate.py`` (``PROGRESS_CASES["PROGRESS-ADMIT"]``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from harness.cli import main

REPO = Path(__file__).resolve().parent.parent
CLASSES = Path(__file__).resolve().parent / "vllm_classes"
SKIP = os.environ.get("HARNESS_SKIP_VLLM") == "1"
SPEC = "vllm@0.33.0,scheduler_cls=slo_budget:SloBudgetScheduler"

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(SKIP, reason="HARNESS_SKIP_VLLM=1")]


def test_the_recorded_budget_is_the_forks_cap_of_that_step(classes_env, tmp_path: Path) -> None:
    out = tmp_path / "slo.parquet"
    r = CliRunner().invoke(main, ["record", str(REPO / "harness/scenarios/fcfs-roomy.toml"), "-o", str(out),
                                  "--engine", SPEC])
    assert r.exit_code == 0, r.output
    ends = {row["step"]: (row["token_budget"], row["total_num_scheduled_tokens"])
            for row in pq.read_table(out).to_pylist() if row["kind"] == "schedule_end"}
    assert len(ends) == 373
    # Steps 0-8: fewer than 2 decoding, the full cap 64; steps 9-12: halved to 32, all spent
    # (step 11 is the trial's witness: it was recorded with 64 - 32 = 32 tokens left).
    assert [ends[s] for s in range(14)] == [
        (25, 39), (63, 1), (63, 1), (63, 1), (63, 1), (63, 1), (63, 1), (63, 1), (38, 26),
        (32 - 32, 32), (32 - 32, 32), (32 - 32, 32), (32 - 32, 32), (32 - 10, 10)]
    # Every step's cap is the full 64 or the halved 32, never another value.
    assert sorted({budget + total for budget, total in ends.values()}) == [32, 64]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork"])
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (0, "conformant (profile fork)"), r.output[-2000:]


def test_the_fork_gate_passes_the_fork_on_fcfs_roomy(classes_env) -> None:
    r = CliRunner().invoke(main, ["replay", str(REPO / "golden/fcfs-roomy.parquet"), "--candidate", SPEC,
                                  "--semantics", "fork"])
    assert r.exit_code == 0, r.output[-3000:]
    assert "PROGRESS-ADMIT" not in r.output
    assert r.output.splitlines()[-2:] == [
        f"own run: {SPEC} re-run on the trace's workload, config and seed from step 0: 373 steps, no violation "
        "(profile fork)",
        "conformant (profile fork); decisions differ from step 9 (information: not held to a version's design)"]


def test_the_rule_still_fires_on_a_fork_that_leaves_its_cap_unused(classes_env, tmp_path: Path) -> None:
    out = tmp_path / "leaves.parquet"
    r = CliRunner().invoke(main, ["record", str(REPO / "harness/scenarios/fcfs-roomy.toml"), "-o", str(out),
                                  "--engine", SPEC.replace("SloBudgetScheduler", "SloBudgetLeavesBudgetScheduler")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork", "--json"])
    assert r.exit_code == 1, r.output[-2000:]
    payload = json.loads(r.output)
    assert payload["violations_by_invariant"] == {"PROGRESS-ADMIT": 4}
    first = payload["violations"][0]
    assert (first["step"], first["request"], first["message"]) == (
        22, "r000006", "waiting (20 tokens) and not admitted, although the step left 16 token(s) of budget, "
        "163 free block(s) (it needed at most 5) and 3 running (it has run 4 at once; max_num_seqs 4)")
