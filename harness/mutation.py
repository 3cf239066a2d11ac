"""The mutation self-test: every mutant on every scenario, a kill matrix.

A mutant is *killed* when its intended invariant fires on at least one
scenario (other invariants firing too is fine). The clean reference must
violate nothing anywhere. This is what proves each checker can fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from reference.candidate import CandidateCrash, CandidateError, CandidateFactory, CandidateRefused
from reference.engine import EngineStalled
from reference.scheduler import Scheduler
from harness.candidates.mutants import MUTANTS_AND_TARGETS

from harness.check import CheckResult, check_steps
from harness.check.invariants import INVARIANTS, SAFETY_IDS
from harness.check.profiles import Profile
from harness.trace.recorder import run_to_rows
from harness.scenarios import ACTION_SCENARIOS, HYBRID_SCENARIOS, SCENARIOS, Scenario
from harness.richtext import keep_words_whole

#: Every scenario the self-test may run: the canonical ones, then those with
#: actions (prefix-cache resets), which alone can kill the reset mutants, then
#: the hybrid models' (several KV-cache groups), which alone can kill the
#: sliding-window mutants.
MUTATION_SCENARIOS: dict[str, Scenario] = {**SCENARIOS, **ACTION_SCENARIOS, **HYBRID_SCENARIOS}


@dataclass
class Cell:
    """One (candidate, scenario) run: its check result and how it ended
    ("" normally, "stalled", or the candidate's exception); ``refused``: the
    candidate's CandidateRefused text when it declined the scenario's config
    before deciding anything (not a crash: e.g. a vLLM release without an
    option the config sets)."""

    result: CheckResult
    ended: str = ""
    refused: str = ""


@dataclass
class MatrixRow:
    mutant: str
    target: str
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return any(c.result.by_invariant.get(self.target) for c in self.cells.values())

    @property
    def layer(self) -> str:
        """The target invariant's layer (safety or semantics)."""
        return INVARIANTS[self.target].layer

    @property
    def safety_catches(self) -> list[str]:
        """The safety invariants that fired on some scenario: what still catches
        this mutant under ``--semantics safety`` (that profile checks the same
        model with the semantics rules left out), in listing order."""
        fired = {i for c in self.cells.values() for i in c.result.by_invariant}
        return [i for i in SAFETY_IDS if i in fired]


def run_candidate(factory: CandidateFactory, scenario: Scenario, profile: Profile | None = None) -> Cell:
    """Run ``scenario`` on ``factory`` in memory and check every invariant
    ``profile`` holds (default: the reference's)."""
    steps: list = []
    ended = refused = ""
    try:
        run_to_rows(scenario.make_workload(), scenario.engine_config(), seed=scenario.seed,
                    candidate_factory=factory, on_step_rows=lambda s, rows: steps.append((s, rows)))
    except EngineStalled:
        ended = "stalled"
    except CandidateError as exc:
        ended = str(exc)
        if not isinstance(exc, CandidateCrash) and isinstance(exc.__cause__, CandidateRefused):
            refused = " ".join(str(exc.__cause__).split())
    return Cell(check_steps(scenario.engine_config().to_dict(), steps, profile), ended, refused)


def kill_matrix(mutants: list[str] | None = None, scenarios: list[str] | None = None,
                on_cell: Callable[[str, str], object] | None = None) -> list[MatrixRow]:
    """Rows in ``MUTANTS_AND_TARGETS`` order (``on_cell(mutant, scenario)``
    after each run: progress). KeyError for an unknown name."""
    names = mutants or list(MUTANTS_AND_TARGETS)
    chosen = [MUTATION_SCENARIOS[s] for s in (scenarios or MUTATION_SCENARIOS)]
    rows = []
    for name in names:
        cls, target = MUTANTS_AND_TARGETS[name]
        row = MatrixRow(name, target)
        for sc in chosen:
            row.cells[sc.name] = run_candidate(cls, sc)
            if on_cell is not None:
                on_cell(name, sc.name)
        rows.append(row)
    return rows


@dataclass
class MutationReport:
    """The self-test's outcome (``run_mutation``): the scenarios run, the
    clean reference's cell on each, and one row per mutant."""

    scenarios: list[str]
    clean: dict[str, Cell]
    rows: list[MatrixRow]

    @property
    def dirty(self) -> dict[str, dict[str, int]]:
        """Violations of the clean reference, by scenario then invariant (must be empty)."""
        return {s: c.result.by_invariant for s, c in self.clean.items() if not c.result.ok}

    @property
    def survivors(self) -> list[str]:
        """The mutants whose target invariant fired on no scenario."""
        return [r.mutant for r in self.rows if not r.killed]

    @property
    def ok(self) -> bool:
        """Every mutant killed and the reference clean everywhere."""
        return not self.survivors and not self.dirty

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``harness mutants --json``."""
        return {
            "ok": self.ok, "survivors": self.survivors, "reference_violations": self.dirty,
            "matrix": {r.mutant: {"target": r.target, "layer": r.layer, "killed": r.killed,
                                  "safety_catches": r.safety_catches,
                                  "cells": {s: {"target_hits": c.result.by_invariant.get(r.target, 0),
                                                "violations": c.result.by_invariant, "ended": c.ended}
                                            for s, c in r.cells.items()}} for r in self.rows}}


def run_mutation(mutants: list[str] | None = None, scenarios: list[str] | None = None,
                 on_cell: Callable[[str, str], object] | None = None) -> MutationReport:
    """Run the clean reference and then every mutant (``kill_matrix``) on
    every scenario (all of ``MUTANTS_AND_TARGETS`` / ``MUTATION_SCENARIOS``
    when None); ``on_cell(mutant, scenario)`` after each run ("reference"
    for the clean runs). KeyError for an unknown name."""
    scenario_list = scenarios or list(MUTATION_SCENARIOS)
    clean = {}
    for s in scenario_list:
        clean[s] = run_candidate(Scheduler, MUTATION_SCENARIOS[s])
        if on_cell is not None:
            on_cell("reference", s)
    return MutationReport(scenario_list, clean, kill_matrix(mutants or None, scenario_list, on_cell))


def render_matrix(report: MutationReport, console: Console) -> None:
    """Print the kill matrix, one row per mutant (readable at any terminal
    width): its target, the scenarios where it fired and how often, killed
    or SURVIVED; then the reference's violations, if any, and the count."""
    clean, rows, survivors = report.clean, report.rows, report.survivors
    table = Table("mutant", "target invariant", "layer", "fired on (scenario: times)", "killed",
                  "caught under --semantics safety by")
    clean_cells = [s for s in report.scenarios if not clean[s].result.ok]
    table.add_row("[dim]reference[/]", "[dim](none)[/]", "",
                  "clean on every scenario" if not clean_cells else
                  f"[red]violations on {', '.join(clean_cells)}[/]", "", "")
    for r in rows:
        hits = [f"{s}: {r.cells[s].result.by_invariant.get(r.target, 0)}"
                + ("*" if r.cells[s].ended else "")
                for s in report.scenarios if r.cells[s].result.by_invariant.get(r.target)]
        table.add_row(r.mutant, r.target, r.layer, ", ".join(hits) or "-",
                      "[green]yes[/]" if r.killed else "[bold red]SURVIVED[/]",
                      ", ".join(r.safety_catches)
                      # Regression: a mutant no chosen scenario reaches (--scenario kv-connector)
                      # was labelled semantics-only whatever its layer.
                      or (("- (a progress fault: caught under --semantics fork)" if r.layer == "progress"
                           else "- (a semantics-only fault)") if r.killed else "-"))
    console.print(keep_words_whole(table))
    console.print("times the target invariant fired per scenario; * = the run ended early "
                  "(stalled or the candidate raised)")
    if report.dirty:
        console.print(f"[bold red]the reference violates invariants:[/] {report.dirty}")
    console.print(f"{len(rows) - len(survivors)}/{len(rows)} mutants killed"
                  + (f"; survivors: {', '.join(survivors)}" if survivors else ""))
