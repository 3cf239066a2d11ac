"""``harness sweep`` (issue 25, harness/sweep.py, harness/sweep_cli.py): two
canonical scenarios across the reference and a mutant, the fidelity and
verdicts exact; the arguments' errors one line, exit 2.
(The Ray runner is tested in tests/test_ray_fuzz_and_sweep.py, on its one cluster.)"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.sweep import Cell, SweepError, candidate_specs, scenario_names, sweep_exit, sweep_local

SCENARIOS = ["fcfs-tight", "priority-tight"]
SPECS = ["reference", "mutant:ignore-max-num-seqs"]

# (candidate, scenario, status, verdict, violations, profile, steps, identical, golden steps, first divergence)
EXPECTED = [
    ("reference", "fcfs-tight", "ran", "clean", {}, "0.33.0", 392, 392, 392, None),
    ("reference", "priority-tight", "ran", "clean", {}, "0.33.0", 221, 221, 221, None),
    ("mutant:ignore-max-num-seqs", "fcfs-tight", "ran", "clean", {}, "0.33.0", 392, 392, 392, None),
    ("mutant:ignore-max-num-seqs", "priority-tight", "ran", "MAX-NUM-SEQS ×2", {"MAX-NUM-SEQS": 2}, "0.33.0",
     221, 213, 221, 206),
]


def test_sweep_local_cells_exact() -> None:
    results = sweep_local(SPECS, SCENARIOS)
    assert [c.outcome()[:-1] for cells in results for c in cells] == EXPECTED
    assert sweep_exit(results) == 1


def test_cli_sweep_table_json_and_exit() -> None:
    res = CliRunner().invoke(main, ["sweep", *SCENARIOS, *(a for s in SPECS for a in ("--candidate", s))])
    assert res.exit_code == 1, res.output
    assert res.output.splitlines()[-1] == "sweep: 2 candidates x 2 scenarios: 3 clean, 1 violating (exit 1)"
    assert "priority-tight@206" in res.output and "613/613" in res.output and "605/613" in res.output
    res = CliRunner().invoke(main, ["sweep", "fcfs-tight", "--candidate", "reference", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output)
    assert (report["ok"], report["exit"], report["runner"], report["scenarios"]) == (True, 0, "local", ["fcfs-tight"])
    assert [(r["candidate"], r["ran"], r["identical"], r["golden_steps"], r["clean"], r["first_divergence"])
            for r in report["candidates"]] == [("reference", 1, 392, 392, 1, None)]


@pytest.mark.parametrize("args,message", [
    (["priority-tigt", "--candidate", "reference"], "did you mean 'priority-tight'?"),
    (["fcfs-tight"], "name the candidates: --versions A..B and/or --candidate SPEC"),
    (["fcfs-tight", "--candidate", "mutant:nope"], "--candidate mutant:nope: unknown mutant 'nope'"),
    (["fcfs-tight", "--versions", "0.33.0..0.20.2"], "0.33.0 is newer than 0.20.2"),
    (["fcfs-tight", "--versions", "0.15.3"], "0.15.3 is not a known vLLM release"),
    (["--candidate", "reference", "--bogus"], "error: No such option '--bogus'."),
])
def test_cli_sweep_bad_arguments_one_line_exit_2(args, message) -> None:
    res = CliRunner().invoke(main, ["sweep", *args])
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_candidate_specs_and_scenario_names() -> None:
    assert candidate_specs(["reference"], "0.20.2..0.22.0") == [
        "reference", "vllm@0.20.2", "vllm@0.21.0", "vllm@0.22.0"]
    assert candidate_specs([], "0.33.0") == ["vllm@0.33.0"]
    assert candidate_specs([], "0.25.0..0.25.0") == ["vllm@0.25.0"]
    assert candidate_specs(["vllm@0.29.0"], "0.25.0,0.29.0") == ["vllm@0.29.0", "vllm@0.25.0"]
    with pytest.raises(SweepError, match="names no release"):
        candidate_specs([], "0.12.1..0.12.2")
    assert scenario_names(["fcfs-tight", "fcfs-tight"]) == ["fcfs-tight"]
    assert len(scenario_names([])) == 20


def test_sweep_exit_order() -> None:
    ok = Cell("a", "s", "ran", verdict="clean")
    bad = Cell("a", "s", "ran", verdict="X ×1", violations={"X": 1})
    refused = Cell("b", "s", "refused", reason="no")
    unavailable = Cell("c", "s", "unavailable", reason="no env")
    assert sweep_exit([[ok], [refused, ok]]) == 0  # a refusal is information
    assert sweep_exit([[ok], [refused]]) == 2  # regression: a candidate that ran nothing exited 0
    assert sweep_exit([[ok], [bad]]) == 1
    assert sweep_exit([[bad], [unavailable]]) == 2
    assert sweep_exit([[Cell("d", "s", "failed"), ok]]) == 1


def test_cli_sweep_markdown_is_the_fidelity_table() -> None:
    """``--markdown``: the table of docs/explanation/releases.md (bench/vllm_fidelity.py prints it from
    the sweep's --json) alone on stdout, so ``--markdown > table.md`` writes a table; the verdict line
    on stderr (regression: it ended up in the file). The first column is "candidate" (regression: it read
    "release" above rows for the reference and a mutant)."""
    res = CliRunner().invoke(main, ["sweep", *SCENARIOS, *(a for s in SPECS for a in ("--candidate", s)),
                                    "--markdown"])
    assert res.exit_code == 1, res.output
    assert res.stdout.splitlines() == [
        "| candidate | scenarios run (refused) | steps identical | without the capacity guard | verdicts "
        "| first divergences |",
        "|---|---|---|---|---|---|",
        "| reference | 2 (0) | 613/613 = 100.0% | 100.0% | 2 clean | none |",
        "| mutant:ignore-max-num-seqs | 2 (0) | 605/613 = 98.7% | 98.7% | 1 clean; MAX-NUM-SEQS ×2 "
        "| priority-tight@206 |",
    ]
    assert res.stderr.splitlines()[-1] == "sweep: 2 candidates x 2 scenarios: 3 clean, 1 violating (exit 1)"
    res = CliRunner().invoke(main, ["sweep", "fcfs-tight", "--candidate", "reference", "--markdown", "--json"])
    assert (res.exit_code, res.output) == (2, "error: --json and --markdown: choose one\n")
