"""Regression (adversarial trial, finding 6): NO-ADMIT-AFTER-PREEMPT was a
safety rule, but its reason is vLLM's design (spec 3.1 step 5: the waiting
loop runs only if the running loop preempted nothing; an anti-thrashing
choice): an admission in a step that preempted corrupts nothing. A correct
fork admitting under PRIORITY after a preemption
(``tests/forks/priority_admit_after_preempt.py``) failed the fork gate with
NO-ADMIT-AFTER-PREEMPT on golden priority-tight (first at step 48, r000016).
The rule is now in the semantics layer, checked under every
release's profile; re-admitting the step's own victim (mutant
admit-after-preempt) still fails the fork gate, by PREEMPT-EFFECTS."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _own_run(make, golden: str, semantics: str):
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN / f"{golden}.parquet")
    profile, _ = resolve(semantics, trace.meta)
    return own_run(trace, make, profile).result


def test_regression_the_rule_is_in_the_semantics_layer_of_every_release() -> None:
    from harness.check.invariants import INVARIANTS
    from harness.check.profiles import PROFILES
    from harness.check.result import SEMANTICS

    assert INVARIANTS["NO-ADMIT-AFTER-PREEMPT"].layer == SEMANTICS
    assert [name for name, p in PROFILES.items() if p.checks("NO-ADMIT-AFTER-PREEMPT")] == [
        "0.33.0", "0.29.0", "0.25.0", "0.20.2"]


def test_regression_a_fork_admitting_after_a_priority_preemption_passes_the_fork_gate(monkeypatch) -> None:
    from forks import put_on_path

    put_on_path(monkeypatch)
    out = CliRunner().invoke(main, ["replay", str(GOLDEN / "priority-tight.parquet"), "--candidate",
                                    "forks.priority_admit_after_preempt:make", "--semantics", "fork"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[-1] == ("conformant (profile fork); decisions differ from step 48 "
                                           "(information: not held to a version's design)")


def test_regression_vllm_gate_is_held_under_the_release_profile(monkeypatch) -> None:
    from forks import put_on_path
    from forks.priority_admit_after_preempt import make

    put_on_path(monkeypatch)
    result = _own_run(make, "priority-tight", "0.33.0")
    assert result.by_invariant == {"NO-ADMIT-AFTER-PREEMPT": 6, "PREFILL-DEFER": 1}
    first = result.violations[0]
    assert (first.invariant, first.step, first.request, first.message) == (
        "NO-ADMIT-AFTER-PREEMPT", 48, "r000016", "admitted (new) in a step that preempted ['r000014']")


def test_regression_re_admitting_the_steps_own_victim_still_fails_the_fork_gate() -> None:
    from harness.candidates.mutants import MUTANTS_AND_TARGETS

    result = _own_run(MUTANTS_AND_TARGETS["admit-after-preempt"][0], "preemption-heavy", "fork")
    assert result.by_invariant == {"PREEMPT-EFFECTS": 4, "STALE-OUTPUT": 154, "LIVENESS": 2}
    first = result.violations[0]
    assert (first.invariant, first.step, first.request, first.message) == (
        "PREEMPT-EFFECTS", 100, "r000025", "preempted in this step, but its status after schedule() is RUNNING")
