"""``harness sweep``'s findings from a user trial (issue 25), one regression
test each, on exact output: a candidate's crash said only "ENGINE-CRASH ×1"
(its one line nowhere); no ``--step-timeout``; a refusal's reason was not in
the table; ``--versions 0.33.1`` went to PyPI; a path said only "unknown
scenario"; the table wrapped at 80 columns."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from harness.cli import main
from harness.sweep import Cell, sweep_local
from harness.sweep_cli import render

FORK = """\
import time
from reference.candidate import CandidateRefused
from reference.scheduler import Scheduler


class NoPriority(Scheduler):
    def __init__(self, config):
        if config.policy == "priority":
            raise CandidateRefused("this fork has no priority policy (policy='priority')")
        super().__init__(config)


class Hang(Scheduler):
    def schedule(self, throttle_prefills=False):
        self._n = getattr(self, "_n", 0) + 1
        while self._n == 3:
            time.sleep(0.05)
        return super().schedule(throttle_prefills)
"""


@pytest.fixture
def fork(tmp_path: Path, monkeypatch):
    """The module ``fork`` importable here and, through PYTHONPATH, in its candidate process."""
    (tmp_path / "fork.py").write_text(FORK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    yield tmp_path
    sys.modules.pop("fork", None)


def sweep(*args) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, ["sweep", *args])
    return res.exit_code, res.stdout, res.stderr


def rendered(results, scenarios, width: int = 80) -> str:
    for cells in results:
        for cell in cells:
            cell.seconds = 0.0  # the one column that is not the same from run to run
    out = io.StringIO()
    render(results, scenarios, Console(file=out, width=width, highlight=False, soft_wrap=True, emoji=False))
    return out.getvalue()


CRASH = ("candidate raised AssertionError in schedule() at step 148: out of KV blocks: the running loop "
         "would preempt r000025 (at harness/candidates/mutants/queues.py:249)")


def test_regression_sweep_shows_a_crash_one_line() -> None:
    """Regression: the crash was "ENGINE-CRASH ×1" and nothing more; the JSON's reason was empty."""
    results = sweep_local(["mutant:crash-in-schedule"], ["fcfs-tight"])
    assert results[0][0].reason == f"crashed: {CRASH}"
    assert rendered(results, ["fcfs-tight"]).splitlines() == [
        "sweep of 1 scenario",
        "candidate                  ran   clean   identical steps   first divergence   s",
        "───────────────────────────────────────────────────────────────────────────────",
        "mutant:crash-in-schedule   1/1       0     148/392 37.8%   fcfs-tight@148     0",
        f"mutant:crash-in-schedule fcfs-tight: ENGINE-CRASH ×1; crashed: {CRASH}",
        "sweep: 1 candidate x 1 scenario: 0 clean, 1 violating (exit 1)",
    ]
    code, out, _ = sweep("fcfs-tight", "--candidate", "mutant:crash-in-schedule", "--json")
    row = json.loads(out)["candidates"][0]
    assert (code, row["reason"], row["notes"]) == (
        1, f"fcfs-tight: crashed: {CRASH}", [f"fcfs-tight: ENGINE-CRASH ×1; crashed: {CRASH}"])


def test_regression_sweep_refusal_reason_is_in_the_table(fork) -> None:
    """Regression: a refused scenario showed as "(1 refused)", its reason nowhere."""
    code, out, _ = sweep("fcfs-tight", "priority-tight", "--candidate", "fork:NoPriority")
    lines = out.splitlines()
    assert code == 0
    assert lines[3].split()[:5] == ["fork:NoPriority", "1/2", "1", "392/392", "100.0%"]
    assert lines[4:] == [
        "fork:NoPriority priority-tight: refused: this fork has no priority policy (policy='priority')",
        "sweep: 1 candidate x 2 scenarios: 1 clean, 0 violating, 1 refused (exit 0)",
    ]


def test_regression_sweep_has_step_timeout(fork) -> None:
    """Regression: sweep had no --step-timeout: a hanging fork waited out the 60 s default per scenario."""
    code, out, _ = sweep("fcfs-tight", "--candidate", "fork:Hang", "--step-timeout", "1")
    assert code == 1
    assert out.splitlines()[-2:] == [
        "fork:Hang fcfs-tight: ENGINE-CRASH ×1; crashed: candidate raised StepTimeout in schedule() at step 2: "
        "no answer from schedule() within 1 s (--step-timeout; the candidate process was killed)",
        "sweep: 1 candidate x 1 scenario: 0 clean, 1 violating (exit 1)",
    ]


@pytest.mark.parametrize("value,message", [
    ("0", "Invalid value for '--step-timeout': 0.0 is not in the range x>0."),
    ("nan", "Invalid value for --step-timeout: nan is not a finite number of seconds"),
])
def test_sweep_step_timeout_refuses_a_bad_number(value, message) -> None:
    code, _, err = sweep("fcfs-tight", "--candidate", "reference", "--step-timeout", value)
    assert (code, err) == (2, f"error: {message} (main sweep --help)\n")


@pytest.mark.parametrize("versions,message", [
    ("0.33.1", "--versions 0.33.1: 0.33.1 is not a known vLLM release; did you mean '0.33.0'? "
               "(one newer than 0.33.0: build its env first, harness vllm-env 0.33.1)"),
    ("0.15.3", "--versions 0.15.3: 0.15.3 is not a known vLLM release; did you mean '0.15.1' or '0.15.0'?"),
    ("0.33.0,0.33.1", "--versions 0.33.0,0.33.1: 0.33.1 is not a known vLLM release; did you mean '0.33.0'? "
                      "(one newer than 0.33.0: build its env first, harness vllm-env 0.33.1)"),
    ("0.33.1,0.33.1", "--versions 0.33.1,0.33.1: 0.33.1 is not a known vLLM release; did you mean '0.33.0'? "
                      "(one newer than 0.33.0: build its env first, harness vllm-env 0.33.1)"),
])
def test_regression_sweep_unknown_release_is_refused_before_pypi(versions, message, tmp_path, monkeypatch) -> None:
    """Regression: --versions 0.33.1 tried a download from PyPI and came back as a row of failures."""
    monkeypatch.setenv("HARNESS_VLLM_ENVS", str(tmp_path))  # nothing built there: no network either way
    code, out, err = sweep("fcfs-tight", "--versions", versions)
    assert (code, out, err) == (2, "", f"error: {message}\n")
    assert list(tmp_path.iterdir()) == []  # no build log, no download


KNOWN = ("async-pipeline-3, async-spec-decode, async-tight, chunked-threshold, deferred-frees, dp2-throttle, "
         "encoder-inputs, eos-stop-abort, fcfs-roomy, fcfs-tight, kv-connector, no-chunked-prefill, "
         "no-prefix-caching, pipeline-3, preemption-heavy, prefill-cadence, prefix-sharing, priority-tight, "
         "spec-decode, spec-decode-priority; hybrid: hybrid-alternating, hybrid-five-to-one, hybrid-mamba")


@pytest.mark.parametrize("name,message", [
    ("harness/scenarios/fcfs-tight.toml",
     "harness/scenarios/fcfs-tight.toml: sweep takes the canonical scenarios by name; did you mean 'fcfs-tight'?"),
    ("mine.toml", "mine.toml: not a canonical scenario name (sweep compares each recording with the scenario's "
                  f"golden, which only the canonical ones have: {KNOWN}); a scenario file or trace of your "
                  "own: harness bisect mine.toml --versions A..B"),
    ("prio-tight", "unknown scenario 'prio-tight'; did you mean 'priority-tight' or 'fcfs-tight'?"),
    ("zzz", f"unknown scenario 'zzz' (known: {KNOWN})"),
])
def test_regression_sweep_path_or_unknown_scenario_has_a_hint(name, message) -> None:
    """Regression: a path said "unknown scenario 'x.toml'" and nothing more."""
    assert sweep(name, "--candidate", "reference") == (2, "", f"error: {message}\n")


def test_regression_sweep_table_fits_80_columns() -> None:
    """Regression: at 80 columns every cell wrapped (two or three lines a row).
    Release rows of a full sweep fit; long verdicts and reasons are notes under it."""
    names = ["chunked-threshold", "spec-decode-priority"]
    results = [
        [Cell("vllm@0.10.1.1", names[0], "ran", verdict="clean", steps=9, identical=0, golden_steps=9,
              first_divergence=0),
         Cell("vllm@0.10.1.1", names[1], "refused", reason="vLLM 0.10.1.1 has no SchedulerConfig option "
                                                           "scheduler_reserve_full_isl")],
        [Cell("vllm@0.33.0", n, "ran", verdict="clean", steps=4000, identical=4000, golden_steps=4000)
         for n in names],
        [Cell("vllm@0.24.0", names[0], "ran", verdict="SCHEDULED-SPAN ×7, STOP-RULES ×1",
              violations={"SCHEDULED-SPAN": 7, "STOP-RULES": 1}, steps=9, identical=3, golden_steps=9,
              first_divergence=3),
         Cell("vllm@0.24.0", names[1], "unavailable", reason="no env")],
    ]
    text = rendered(results, names)
    assert text.splitlines() == [
        "sweep of 2 scenarios",
        "candidate       ran   clean    identical steps   first divergence      s",
        "────────────────────────────────────────────────────────────────────────",
        "vllm@0.10.1.1   1/2       1           0/9 0.0%   chunked-threshold@0   0",
        "vllm@0.33.0     2/2       2   8000/8000 100.0%   none                  0",
        "vllm@0.24.0     1/2       0          3/9 33.3%   chunked-threshold@3   0",
        "vllm@0.10.1.1 spec-decode-priority: refused: vLLM 0.10.1.1 has no SchedulerConfig option "
        "scheduler_reserve_full_isl",
        "vllm@0.24.0 chunked-threshold: SCHEDULED-SPAN ×7, STOP-RULES ×1",
        "vllm@0.24.0 spec-decode-priority: unavailable: no env",
        "sweep: 3 candidates x 2 scenarios: 3 clean, 1 violating, 1 refused, 1 unavailable (exit 1)",
    ]
    assert max(len(line) for line in text.splitlines()[:6]) <= 80


def test_sweep_takes_the_hybrid_scenarios_by_name() -> None:
    """The three hybrid scenarios (harness/scenarios/hybrid/, golden/hybrid/) are swept when
    named: a sliding-window bug shows there (it never does on the canonical ones)."""
    code, out, _ = sweep("hybrid-alternating", "hybrid-mamba", "--candidate", "reference",
                         "--candidate", "mutant:free-window-ahead", "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["scenarios"] == ["hybrid-alternating", "hybrid-mamba"]
    cells = {(c["candidate"], c["scenario"]): (c["verdict"], c["violations"], c["identical"], c["golden_steps"])
             for c in doc["cells"]}
    assert cells == {
        ("reference", "hybrid-alternating"): ("clean", {}, 192, 192),
        ("reference", "hybrid-mamba"): ("clean", {}, 153, 153),
        ("mutant:free-window-ahead", "hybrid-alternating"): ("SLIDING-WINDOW-HELD ×178",
                                                             {"SLIDING-WINDOW-HELD": 178}, 6, 192),
        ("mutant:free-window-ahead", "hybrid-mamba"): ("clean", {}, 153, 153),
    }
