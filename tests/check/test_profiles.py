"""Semantics profiles (harness/check/profiles.py): which profile ``auto``
picks, that each knob changes what the model expects, and the CLI.

A 0.33.0 engine (the reference) checked under an older release's profile is
a deliberately mismatched engine: each knob must make a rule fire there, and
the safety profile must stay silent, since nothing unsafe happened."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from harness.check import PROFILES, ProfileError, check_steps
from harness.check.invariants import INVARIANTS, SAFETY_IDS, SEMANTICS_IDS
from harness.check.profiles import resolve
from harness.cli import main


@pytest.mark.parametrize("meta, name, reason", [
    ({"engine": "reference", "vllm_semantics": "0.33.0"}, "0.33.0", "the reference mirrors vLLM 0.33.0"),
    ({"engine": "mutant:leak-on-abort", "vllm_semantics": "0.33.0"}, "0.33.0",
     "a mutant of the reference mirrors vLLM 0.33.0"),
    ({"engine": "vllm@0.29.0"}, "0.29.0", "recorded by vLLM 0.29.0"),
    ({"engine": "vllm@0.25.0"}, "0.25.0", "recorded by vLLM 0.25.0"),
    ({"engine": "vllm@0.20.2"}, "0.20.2", "recorded by vLLM 0.20.2"),
    ({"engine": "vllm@0.31.0"}, "safety", "recorded by vLLM 0.31.0: no semantics profile was measured for it"),
    ({"engine": "mypkg.sched:make"}, "safety", "engine mypkg.sched:make is of unknown origin: safety invariants only"),
    ({}, "safety", "engine ? is of unknown origin: safety invariants only"),
])
def test_auto_picks_the_profile_of_the_engine_in_the_metadata(meta, name, reason) -> None:
    profile, why = resolve("auto", meta)
    assert (profile.name, why) == (name, reason)


def test_a_named_profile_overrides_the_metadata_and_an_unknown_one_is_refused() -> None:
    assert resolve("safety", {"engine": "reference", "vllm_semantics": "0.33.0"})[0].name == "safety"
    with pytest.raises(ProfileError, match=r"^unknown semantics '0.1.0': expected auto, 0.33.0, 0.29.0, "
                                           r"0.25.0, 0.20.2, fork, safety$"):
        resolve("0.1.0", {})


def test_every_profile_checks_every_safety_invariant_and_only_semantics_ids_are_optional() -> None:
    from harness.check.invariants import PROGRESS_IDS

    assert len(SAFETY_IDS) + len(PROGRESS_IDS) + len(SEMANTICS_IDS) == len(INVARIANTS)
    for profile in PROFILES.values():
        assert set(SAFETY_IDS) <= set(profile.checked)
        # The progress layer: every profile but safety.
        assert (set(PROGRESS_IDS) <= set(profile.checked)) == (profile.name != "safety")
    assert set(PROFILES["0.33.0"].checked) == set(INVARIANTS)
    assert set(PROFILES["safety"].checked) == set(SAFETY_IDS)
    # The fork gate: safety + progress, nothing of a version's design.
    assert set(PROFILES["fork"].checked) == set(SAFETY_IDS) | set(PROGRESS_IDS)


def test_free_queue_knob_a_0_33_engine_checked_as_0_20_2_allocates_off_the_head(scenario_rows) -> None:
    """0.33.0 frees unhashed blocks to the head; 0.20.2's model puts every
    freed block at the tail, so the reference's next allocation is not the
    head it expects."""
    config, rows = scenario_rows("no-prefix-caching")
    assert check_steps(config, rows).ok
    result = check_steps(config, rows, PROFILES["0.20.2"])
    assert result.by_invariant == {"ALLOC-FROM-HEAD": 1}
    assert result.violations[0].message.startswith("allocated block ")
    assert check_steps(config, rows, PROFILES["safety"]).ok


def test_cadence_knob_a_0_33_engine_checked_as_0_29_0_defers_without_a_reason(scenario_rows) -> None:
    """0.33.0 defers prefills on the local prefill_schedule_interval cadence;
    0.29.0 has none, so every deferral is unexplained there."""
    config, rows = scenario_rows("prefill-cadence")
    assert check_steps(config, rows).ok
    result = check_steps(config, rows, PROFILES["0.29.0"])
    assert set(result.by_invariant) == {"PREFILL-DEFER"}
    assert result.violations[0].message.startswith("defer_prefills True but the throttle")
    assert check_steps(config, rows, PROFILES["safety"]).ok


def test_0_25_0_is_0_29_0_but_for_min_tokens_first() -> None:
    """vLLM 0.25.0 (bench/semantics_versions.py --versions 0.25.0) keeps
    0.29.0's design but tests min_tokens first in check_stop, as 0.20.2 does
    (``sched/utils.py:100-101``; 0.29.0 tests it last, ``utils.py:122``)."""
    import dataclasses

    old, new = PROFILES["0.25.0"], PROFILES["0.29.0"]
    assert (old.versions, old.semantics) == (("0.25.0",), new.semantics)
    assert dataclasses.replace(old, name="0.29.0", versions=("0.29.0",), min_tokens_first=False) == new
    assert old.min_tokens_first and not new.min_tokens_first


def test_cli_check_semantics_names_the_profile_and_refuses_an_unknown_one() -> None:
    runner = CliRunner()
    r = runner.invoke(main, ["check", "traces/shared-prefix.parquet", "--semantics", "safety"])
    assert r.exit_code == 0
    assert " profile            safety (chosen with --semantics)" in r.output
    assert r.output.rstrip("\n").splitlines()[-1] == "conformant (profile safety)"
    r = runner.invoke(main, ["check", "traces/shared-prefix.parquet", "--semantics", "9.9.9"])
    assert r.exit_code == 2
    assert r.output.strip().splitlines()[-1].endswith(
        "unknown semantics '9.9.9': expected auto, 0.33.0, 0.29.0, 0.25.0, 0.20.2, fork, safety")
