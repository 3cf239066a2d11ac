"""Doctored-trace tests of the budget family (harness/check/budget.py)."""

from __future__ import annotations

from harness.check import check_steps


def test_budget_left_fires_when_the_budget_left_is_inconsistent(scenario_rows, first_row) -> None:
    config, rows = scenario_rows("fcfs-roomy")
    step, end = first_row(rows, "schedule_end", lambda row: row["total_num_scheduled_tokens"] > 0)
    total = end["total_num_scheduled_tokens"]
    budget = config["max_num_batched_tokens"]
    assert end["token_budget"] == budget - total
    end["token_budget"] += 1
    result = check_steps(config, rows)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations] == [
        ("BUDGET-LEFT", step, None, f"budget left {budget - total + 1} != {budget} - {total}")]


def test_budget_tokens_silent_on_a_fork_with_a_tighter_internal_token_cap(scenario_rows) -> None:
    """Issue 23: a fork whose own cap is 8 tokens under max_num_batched_tokens
    leaves 8 tokens less every step. BUDGET-TOKENS (safety) holds; the
    "budget left" clause is BUDGET-LEFT, vLLM's accounting, a semantics rule
    (checked under a release's profile, not under safety or the fork gate)."""
    from harness.check.profiles import PROFILES

    config, rows = scenario_rows("fcfs-roomy")
    ends = [row for _, events in rows for row in events if row["kind"] == "schedule_end"]
    for end in ends:
        end["token_budget"] -= 8
    assert check_steps(config, rows, PROFILES["safety"]).ok
    result = check_steps(config, rows)
    assert result.by_invariant == {"BUDGET-LEFT": len(ends)}



# -- MAX-LORAS ------------------------------------------------------------------------------------
def _lora_run(candidate, **overrides):
    """(check result, number of skips for the adapter limit, rows per step, config dict) of
    ``candidate`` on the LoRA
    scenario (harness/scenarios/lora/lora-adapters.toml, config ``overrides`` on top of its own),
    recorded in memory: what the mutation self-test runs."""
    from harness.check import check_steps
    from harness.scenarios import LORA_SCENARIOS
    from harness.trace.recorder import run_to_rows
    from reference.config import EngineConfig
    from reference.scheduler import MAX_LORAS_REACHED

    scenario = LORA_SCENARIOS["lora-adapters"]
    config = EngineConfig.from_dict({**scenario.config, **overrides})
    rows: list = []
    run_to_rows(scenario.make_workload(), config, seed=scenario.seed, candidate_factory=candidate,
                on_step_rows=lambda step, step_rows: rows.append((step, step_rows)))
    skips = sum(row["kind"] == "skip" and row["message"] == MAX_LORAS_REACHED for _, r in rows for row in r)
    return check_steps(config.to_dict(), rows), skips, rows, config.to_dict()


def test_max_loras_fires_on_the_mutant_that_ignores_the_adapter_limit() -> None:
    """ignore-max-loras admits whatever the adapter: adapters 1 to 4 run together with max_loras
    2 (21 steps from step 3). The witness names the step, each adapter with its first scheduled
    request (config lora_int_ids: r000000 1, r000001 4, r000002 3, r000003 2) and max_loras; no
    other rule fires (a skip for the limit is never made, so none needs an excuse)."""
    from harness.candidates.mutants import MUTANTS

    result, skips, _, _ = _lora_run(MUTANTS["ignore-max-loras"])
    assert (result.by_invariant, skips) == ({"MAX-LORAS": 21}, 0)
    assert [(v.invariant, v.step, v.request, v.message) for v in result.violations[:2]] == [
        ("MAX-LORAS", step, None, "4 LoRA adapters scheduled: 1 (r000000), 2 (r000003), 3 (r000002), "
                                  "4 (r000001); max_loras 2") for step in (3, 4)]


def test_max_loras_silent_on_the_reference_and_on_correct_engines() -> None:
    """The reference (vLLM 0.33.0's waiting loop: a request whose adapter would be a third one
    scheduled is skipped) is clean on the LoRA scenario, as are its async scheduler and other
    limits (1, 3; with 4, the scenario's every adapter, nothing is skipped): the figures are the
    skips for the limit each made. Real vLLM 0.33.0
    with adapters: tests/test_vllm_recording_encoder.py checks its recording clean."""
    from reference.scheduler import Scheduler

    found = {}
    for name, overrides in (("reference", {}), ("async", {"async_scheduling": True}),
                            ("max_loras 1", {"max_loras": 1}), ("max_loras 3", {"max_loras": 3}),
                            ("max_loras 4", {"max_loras": 4})):
        result, skips, _, _ = _lora_run(Scheduler, **overrides)
        found[name] = (result.by_invariant, skips)
    assert found == {"reference": ({}, 70), "async": ({}, 70), "max_loras 1": ({}, 241),
                     "max_loras 3": ({}, 16), "max_loras 4": ({}, 0)}



def test_max_loras_silent_without_a_lora_config() -> None:
    """The mutant's rows checked under the scenario's config less max_loras and lora_int_ids (no
    LoRA: every request is adapter-less) violate nothing: the rule reads only the config."""
    from harness.candidates.mutants import MUTANTS
    from harness.check import check_steps

    result, _, rows, config = _lora_run(MUTANTS["ignore-max-loras"])
    assert result.by_invariant == {"MAX-LORAS": 21}
    del config["max_loras"], config["lora_int_ids"]
    assert check_steps(config, rows).by_invariant == {}
