"""Issue 27: "did you mean" on every mistyped key or name (close matches, not
the whole list), through the one helper ``reference.words.did_you_mean``."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.candidates.resolve import CandidateSpecError, resolve_candidate
from harness.candidates.vllm.spec import VLLMSpecError, split_spec
from harness.check.profiles import ProfileError, resolve
from harness.cli import main
from reference.words import close_matches, did_you_mean, plural
from workloads.scenario import ScenarioError, load_scenario


# -- the helper ------------------------------------------------------------------------------

def test_did_you_mean_gives_close_matches_a_short_list_whole_and_nothing_for_a_long_one() -> None:
    keys = ["max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_gpu_blocks", "block_size",
            "policy", "enable_prefix_caching", "enable_chunked_prefill", "async_scheduling"]
    assert did_you_mean("max_num_seq", keys) == "; did you mean 'max_num_seqs'?"
    assert did_you_mean("Policy", keys) == "; did you mean 'policy'?"  # case folded, first
    assert did_you_mean("zzz", keys) == ""  # 9 names: not listed
    assert did_you_mean("zzz", ["fcfs", "priority"]) == "; known: fcfs, priority"
    assert did_you_mean("zzz", ["fcfs", "priority"], list_whole=False) == ""
    assert did_you_mean("arival_step", ["arrival_step", "arrival_time", "abort_step", "prompt_len"]) == \
        "; did you mean 'arrival_step', 'arrival_time' or 'abort_step'?"
    assert did_you_mean("fcsf", ["fcfs", "priority"], quote=False) == "; did you mean fcfs?"


def test_a_version_is_close_only_to_its_own_series() -> None:
    assert close_matches("0.33.1", ["0.29.0", "0.30.0", "0.33.0"]) == ["0.33.0"]
    assert close_matches("0.30.1", ["0.29.0", "0.33.0"]) == []
    assert close_matches("0.33", ["0.33.0", "safety"]) == ["0.33.0"]


def test_plural() -> None:
    assert [plural(n, "preemption") for n in (0, 1, 2)] == ["0 preemptions", "1 preemption", "2 preemptions"]
    assert plural(1, "witness") == "1 witness" and plural(3, "witness") == "3 witnesses"
    assert plural(2, "query", "queries") == "2 queries"


# -- config keys: --set and a scenario's [config] -------------------------------------------

def test_bad_set_key_suggests_the_close_key_not_all_30(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["record", "synthetic:2", "--set", "max_num_seq=4", "-o", str(tmp_path / "t.parquet")])
    assert (r.exit_code, r.output) == (2, "error: bad config: unknown config key 'max_num_seq'; "
                                          "did you mean 'max_num_seqs'?\n")


SCENARIO = '[config]\nnum_gpu_blocks = 16\n{config}\n[[requests]]\nrequest_id = "A"\nprompt_len = 8\n{req}\n'


def _load(tmp_path: Path, text: str) -> str:
    src = tmp_path / "s.toml"
    src.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(src)
    return str(info.value).replace(str(src), "s.toml")


def test_scenario_config_typo_suggests_the_key_at_its_line(tmp_path: Path) -> None:
    # The line is the typo's, not that of max_num_seqs (which the suggestion names).
    text = SCENARIO.format(config="max_num_seqs = 2\nmax_num_seq = 4", req="arrival_step = 0")
    assert _load(tmp_path, text) == ("s.toml:4: bad config: unknown config key 'max_num_seq'; "
                                     "did you mean 'max_num_seqs'?")


def test_scenario_singular_request_table_is_named_not_got_neither(tmp_path: Path) -> None:
    text = SCENARIO.format(config="", req="arrival_step = 0").replace("[[requests]]", "[[request]]")
    assert _load(tmp_path, text) == "s.toml:4: unknown key 'request'; did you mean [[requests]]?"


def test_scenario_request_key_typo_suggests(tmp_path: Path) -> None:
    text = SCENARIO.format(config="", req="arival_step = 0")
    assert _load(tmp_path, text) == ("s.toml:7: requests[0]: unknown key 'arival_step'; did you mean "
                                     "'arrival_step', 'arrival_time' or 'abort_step'?")


def test_scenario_action_key_typo_suggests(tmp_path: Path) -> None:
    text = (SCENARIO.format(config="", req="arrival_step = 0")
            + '[[actions]]\nstep = 1\nkind = "abort"\nrequest_id = ["A"]\n')
    assert _load(tmp_path, text) == "s.toml:11: actions[0]: unknown key 'request_id'; did you mean 'request_ids'?"


# -- names: candidates, mutants, scenarios, profiles, vLLM options and versions -------------

@pytest.mark.parametrize("spec, message", [
    ("refrence", "unknown candidate 'refrence'; did you mean 'reference'? ('reference', 'mutant:NAME', "
                 "'vllm@VERSION' or 'package.module:factory')"),
    ("lifo", "unknown candidate 'lifo': use 'reference', 'mutant:NAME', 'vllm@VERSION' or "
             "'package.module:factory'"),
    ("mutant:leak-on-finsh", "unknown mutant 'leak-on-finsh'; did you mean 'leak-on-finish' or 'leak-on-abort'?"),
    ("mutant:zzz", "unknown mutant 'zzz' (`harness mutants --list` lists them)"),
])
def test_bad_candidate_names(spec: str, message: str) -> None:
    with pytest.raises(CandidateSpecError) as info:
        resolve_candidate(spec)
    assert str(info.value) == message


def test_mutants_command_suggests_mutant_and_scenario() -> None:
    r = CliRunner().invoke(main, ["mutants", "--mutant", "leak-on-abrt"])
    assert (r.exit_code, r.output) == (2, "error: Invalid value for --mutant: unknown mutant 'leak-on-abrt'; did "
                                          "you mean 'leak-on-abort' or 'leak-on-finish'? (main mutants --help)\n")
    r = CliRunner().invoke(main, ["mutants", "--scenario", "fcfs-tihgt"])
    assert r.exit_code == 2 and "unknown scenario 'fcfs-tihgt'; did you mean 'fcfs-tight'?" in r.output


def test_golden_update_suggests_the_scenario(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["golden", "update", "--dir", str(tmp_path), "--scenario", "fcfs-tihgt"])
    assert (r.exit_code, r.output) == (2, "error: unknown scenario 'fcfs-tihgt'; did you mean 'fcfs-tight'?\n")


@pytest.mark.parametrize("name, message", [
    ("saftey", "unknown semantics 'saftey'; did you mean 'safety'?"),
    ("0.33", "unknown semantics '0.33'; did you mean '0.33.0'?"),
    ("0.1.0", "unknown semantics '0.1.0': expected auto, 0.33.0, 0.29.0, 0.25.0, 0.20.2, fork, safety"),
])
def test_bad_semantics(name: str, message: str) -> None:
    with pytest.raises(ProfileError) as info:
        resolve(name, {})
    assert str(info.value) == message


def test_vllm_spec_option_typo_suggests() -> None:
    with pytest.raises(VLLMSpecError) as info:
        split_spec("vllm@0.33.0,schedulr_cls=a:B")
    assert str(info.value) == "'vllm@0.33.0,schedulr_cls=a:B': unknown option 'schedulr_cls'; did you mean 'scheduler_cls'?"


def test_unbuilt_vllm_release_suggests_a_built_one_of_its_series(tmp_path: Path, monkeypatch) -> None:
    from harness.candidates.vllm import env

    root = tmp_path / "envs"
    (root / "0.33.0" / "bin").mkdir(parents=True)
    (root / "0.33.0" / "bin" / "python").touch()
    (root / "0.33.0" / env.MARKER).write_text(
        '{"version": "0.33.0", "pins_sha256": "%s"}' % env._pins_sha256())
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(root))
    with pytest.raises(CandidateSpecError) as info:
        resolve_candidate("vllm@0.33.1")
    assert str(info.value) == (f"candidate 'vllm@0.33.1': the vLLM 0.33.1 env is not built ({root}/0.33.1); "
                               f"run `harness vllm-env 0.33.1` if PyPI has it (the newest release known here "
                               f"is 0.33.0); or did you mean vllm@0.33.0 (built)?")
    with pytest.raises(CandidateSpecError) as info:
        resolve_candidate("vllm@0.30.0")
    assert str(info.value).endswith("run `harness vllm-env 0.30.0` (built here: 0.33.0)")


def test_regression_replay_suggested_building_a_release_that_never_was(tmp_path: Path, monkeypatch) -> None:
    """Trial finding: ``--candidate vllm@0.30.1`` said "run `harness vllm-env
    0.30.1`" (no such release). A version below the newest known release that
    is not one of them is named so; the suggestion is a known release of its
    series, a built one first."""
    from harness.candidates.vllm import env

    root = tmp_path / "envs"
    (root / "0.14.0" / "bin").mkdir(parents=True)
    (root / "0.14.0" / "bin" / "python").touch()
    (root / "0.14.0" / env.MARKER).write_text('{"version": "0.14.0", "pins_sha256": "%s"}' % env._pins_sha256())
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(root))
    for spec, message in (
            ("vllm@0.30.1", "0.30.1 is not a vLLM release (known: 0.10.0 to 0.33.0); did you mean vllm@0.30.0? "
                            "(`harness vllm-env 0.30.0` builds it)"),
            ("vllm@0.14.2", "0.14.2 is not a vLLM release (known: 0.10.0 to 0.33.0); did you mean vllm@0.14.0 "
                            "(built)?"),
            ("vllm@0.10.1.2", "0.10.1.2 is not a vLLM release (known: 0.10.0 to 0.33.0); did you mean "
                              "vllm@0.10.1.1? (`harness vllm-env 0.10.1.1` builds it)")):
        r = CliRunner().invoke(main, ["replay", str(Path(__file__).resolve().parents[1] / "golden" / "async-tight.parquet"),
                                      "--candidate", spec])
        assert (r.exit_code, r.output) == (2, f"error: Invalid value: candidate {spec!r}: {message} "
                                              f"(main replay --help)\n"), r.output


# -- plurals in CLI output ---------------------------------------------------------------------

def test_record_summary_says_1_request_and_1_preemption_not_1_preemptions(tmp_path: Path) -> None:
    # Issue 27: "1 preemptions". Two 40-token prompts in 5 usable blocks of 16: the second preempts once.
    src = tmp_path / "s.toml"
    src.write_text('[config]\nnum_gpu_blocks = 6\nblock_size = 16\nmax_model_len = 80\n\n'
                   '[[requests]]\nrequest_id = "A"\nprompt_len = 40\nmax_tokens = 20\narrival_step = 0\n\n'
                   '[[requests]]\nrequest_id = "B"\nprompt_len = 20\nmax_tokens = 20\narrival_step = 0\n')
    r = CliRunner().invoke(main, ["record", str(src), "-o", str(tmp_path / "t.parquet")])
    assert r.exit_code == 0, r.output
    line = r.output.strip().splitlines()[-1]
    assert ", 1 preemption, " in line, line
    r = CliRunner().invoke(main, ["record", "synthetic:1", "-o", str(tmp_path / "one.parquet")])
    assert r.output.strip().splitlines()[-1].startswith(f"recorded {tmp_path / 'one.parquet'}: 11 steps, 1 request (")


def test_unknown_invariant_id_suggests() -> None:
    from harness.check.invariants import describe, family_of

    with pytest.raises(KeyError) as info:
        describe("MAX-NUM-SEQ")
    assert info.value.args[0] == "unknown invariant 'MAX-NUM-SEQ'; did you mean 'MAX-NUM-SEQS'?"
    with pytest.raises(KeyError) as info:
        family_of("zzz")
    assert info.value.args[0] == "unknown invariant 'zzz' (`harness invariants` lists them)"


def test_bisect_versions_not_a_release_suggests_and_counts_in_the_singular() -> None:
    from harness.bisect.core import BisectError, parse_versions

    with pytest.raises(BisectError) as info:
        parse_versions("0.29.1,0.33.0")
    assert str(info.value) == "--versions 0.29.1,0.33.0: 0.29.1 is not a vLLM release; did you mean '0.29.0'?"
    with pytest.raises(BisectError) as info:
        parse_versions("0.33.0")
    assert str(info.value) == "--versions 0.33.0: names 1 release; bisect needs two or more"
    assert parse_versions("0.33.0,0.33.5") == ["0.33.0", "0.33.5"]  # newer than the list: allowed


def test_scenario_after_names_an_unknown_request_suggests(tmp_path: Path) -> None:
    text = ('[config]\nnum_gpu_blocks = 16\nmax_model_len = 128\n\n'
            '[[requests]]\nrequest_id = "prefill-1"\nprompt_len = 8\narrival_step = 0\n\n'
            '[[requests]]\nrequest_id = "B"\nprompt_len = 8\nafter = "prefil-1 finishes"\n')
    assert _load(tmp_path, text) == ("s.toml:13: requests[1]: after names unknown request 'prefil-1'; "
                                     "did you mean 'prefill-1'?")


def test_scenario_extract_unknown_request_suggests(tmp_path: Path) -> None:
    r = CliRunner().invoke(main, ["scenario", "extract", "traces/shared-prefix.parquet", "--requests", "r00001",
                                  "-o", str(tmp_path / "s.toml")])
    assert r.exit_code == 2
    assert r.output == ("error: traces/shared-prefix.parquet: no request 'r00001' in the trace (6 requests); "
                        "did you mean 'r000001', 'r000005' or 'r000004'?\n")


def test_workload_spec_and_missing_files_suggest(tmp_path: Path) -> None:
    def record(workload: str) -> str:
        r = CliRunner().invoke(main, ["record", workload, "-o", str(tmp_path / "t.parquet")])
        assert r.exit_code == 2
        return r.output

    assert record("synthtic:5") == "error: unrecognised workload spec 'synthtic:5'; did you mean 'synthetic:5'?\n"
    (tmp_path / "azure-code.csv").write_text("x")
    assert record(str(tmp_path / "azure_code.csv")) == \
        f"error: {tmp_path / 'azure_code.csv'}: workload file not found; did you mean 'azure-code.csv'?\n"
    assert record(str(tmp_path / "zzz.csv")) == f"error: {tmp_path / 'zzz.csv'}: workload file not found\n"
    assert record("harness/scenarios/fcfs-tigt.toml") == (
        "error: harness/scenarios/fcfs-tigt.toml: no such scenario file; did you mean 'fcfs-tight.toml' "
        "or 'async-tight.toml'?\n")  # stems compared: ".toml" no longer makes 'fcfs-roomy' close


def test_regression_the_fewest_edits_rank_first() -> None:
    """New-user trial: difflib ranked r000034 over r000004 for ``r00004``."""
    from reference.words import close_matches, edit_distance

    ids = [f"r{i:06d}" for i in range(40)]
    assert close_matches("r00004", ids) == ["r000004", "r000034", "r000024"]  # r000034: a 3 more, at the edge of 0000
    assert close_matches("r0000004", ids) == ["r000004", "r000000", "r000034"]
    assert (edit_distance("r00004", "r000004"), edit_distance("kitten", "sitting"), edit_distance("", "ab")) == (1, 3, 2)
