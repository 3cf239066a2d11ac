"""The progress layer and the fork gate (issue 23): `harness invariants --layer
progress`, each progress rule's mutant on its library scenario, `replay` and
`fuzz` under `--semantics fork`, a refused drawn config as a skip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.check import check_steps
from harness.check.profiles import PROFILES
from harness.cli import main
from harness.trace.recorder import run_to_rows
from reference.candidate import CandidateRefused
from reference.scheduler import Scheduler
from workloads.scenario import load_scenario

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "traces" / "scenarios"

#: Each progress rule, the mutant only it catches, its library scenario and
#: the mutant's witnesses there (the reference is silent on every one).
PROGRESS_CASES = {
    "PROGRESS-RUNNING": ("skip-running-tail", "running-skipped-with-room", 4),
    "PROGRESS-ADMIT": ("admit-one-per-step", "admit-all-that-fit", 3),
    "PROGRESS-PREEMPT-NEEDED": ("eager-preempt", "preempt-only-when-full", 1),
    "PROGRESS-PREEMPT-FREES": ("preempt-fenced", "preempt-fenced-victim", 2),
    "PROGRESS-AFTER-PREEMPT": ("stop-after-preempt", "running-after-preemption", 1),
}


def _fork_check(factory, scenario: str):
    sc = load_scenario(LIBRARY / f"{scenario}.toml")
    steps: list = []
    run_to_rows(sc.workload, sc.engine_config(), seed=sc.seed, candidate_factory=factory,
                on_step_rows=lambda s, rows: steps.append((s, rows)))
    return check_steps(sc.engine_config().to_dict(), steps, PROFILES["fork"])


def test_invariants_lists_the_progress_layer_with_public_reports() -> None:
    result = CliRunner().invoke(main, ["invariants", "--layer", "progress", "--json"])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    assert [r["id"] for r in rows] == list(PROGRESS_CASES)
    for row in rows:
        assert row["layer"] == "progress"
        assert "vllm-project/vllm#" in row["why"] or "vllm-fork#" in row["why"], row["id"]
        # Every profile but safety checks it; fork is safety + progress.
        assert row["profiles"] == [p for p in PROFILES if p != "safety"]


@pytest.mark.parametrize("rule", sorted(PROGRESS_CASES))
def test_each_progress_rule_catches_its_mutant_on_its_scenario(rule: str) -> None:
    from harness.candidates.mutants import MUTANTS

    mutant, scenario, count = PROGRESS_CASES[rule]
    assert _fork_check(Scheduler, scenario).ok
    assert _fork_check(MUTANTS[mutant], scenario).by_invariant == {rule: count}


def test_replay_under_the_fork_gate_reports_a_differing_decision_as_information() -> None:
    """A different PRIORITY victim is a decision, not a failure, under the
    fork gate (exit 0); under the release's profile it is a divergence."""
    golden = str(REPO / "golden" / "priority-tight.parquet")
    fork = CliRunner().invoke(main, ["replay", golden, "--candidate", "mutant:lifo-priority-victim",
                                     "--semantics", "fork"])
    assert fork.exit_code == 0, fork.output
    assert fork.output.splitlines()[-1] == ("conformant (profile fork); decisions differ from step 3 "
                                            "(information: not held to a version's design)")
    auto = CliRunner().invoke(main, ["replay", golden, "--candidate", "mutant:lifo-priority-victim"])
    assert auto.exit_code == 1
    assert auto.output.splitlines()[-1] == "not conformant (profile 0.33.0); first divergence at step 3"
    # Regression (new-user trial): a divergence-only failure names the fork gate.
    assert ("hint: the candidate decides differently from the reference: for a fork whose policy differs on "
            "purpose, --semantics fork holds it to safety and progress only") in auto.output.splitlines()


def _refuses_async(config):
    if config.async_scheduling:
        raise CandidateRefused("a synchronous Scheduler subclass: no async scheduling")
    return Scheduler(config)


def test_fuzz_counts_a_refused_drawn_config_as_a_skip_not_a_finding() -> None:
    """Issue 23: fuzz drew an async config for a plain Scheduler subclass, the
    driver refused it, and fuzz reported the refusal as a found exception."""
    from harness.fuzz.run import fuzz

    result = fuzz(_refuses_async, max_examples=4, seed=0, async_spec=True)
    assert not result.found
    assert (result.examples, result.refused) == (4, 4)
    assert result.refusal == "a synchronous Scheduler subclass: no async scheduling"


class HalfTokenCap(Scheduler):
    """A correct fork: its own token cap is half of max_num_scheduled_tokens
    (never under what a step must fit: a whole prompt without chunked
    prefill, a decode with its drafts)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        cap = self.max_num_scheduled_tokens // 2
        if not config.enable_chunked_prefill:
            cap = max(cap, config.max_model_len)
        self.max_num_scheduled_tokens = min(self.max_num_scheduled_tokens,
                                            max(cap, 1 + config.num_speculative_tokens))


def test_fuzz_under_the_fork_gate_finds_only_violations() -> None:
    """A tighter internal token cap: the default fuzz reports it (the budget
    left is not vLLM's, BUDGET-LEFT); under --semantics fork nothing is found."""
    from harness.fuzz.run import fuzz, fuzz_profile

    found = fuzz(HalfTokenCap, max_examples=10, seed=2).failure
    assert found.kind == "violation" and "BUDGET-LEFT" in found.invariants
    assert not fuzz(HalfTokenCap, max_examples=40, seed=2, profile=fuzz_profile("fork")).found
