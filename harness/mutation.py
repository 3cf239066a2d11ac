"""The mutation self-test: every mutant on every scenario, a kill matrix.

A mutant is *killed* when its intended invariant fires on at least one
scenario (other invariants firing too is fine). The clean reference must
violate nothing anywhere. This is what proves each checker can fire.

A scenario is a canonical one (``MUTATION_SCENARIOS``), a library one
(traces/scenarios/, by name) or a scenario file (``.toml``/``.json`` path):
``mutation_scenario``. When the scenarios were chosen (``harness mutants
--scenario``), a surviving mutant whose runs are row for row the clean
reference's on every chosen scenario is *not exercised* there (n/a: no
checker of the trace could tell it from a correct engine), not a survivor.
Without a choice every mutant must be killed somewhere: one that no
scenario exercises is a gap in the scenarios.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path
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
from harness.scenarios import ACTION_SCENARIOS, HYBRID_SCENARIOS, LORA_SCENARIOS, SCENARIOS, Scenario
from harness.richtext import keep_words_whole
from reference.words import did_you_mean

#: Every scenario the self-test may run: the canonical ones, then those with
#: actions (prefix-cache resets), which alone can kill the reset mutants, then
#: the hybrid models' (several KV-cache groups), which alone can kill the
#: sliding-window mutants, then the LoRA ones (max_loras), which alone can
#: kill ignore-max-loras.
MUTATION_SCENARIOS: dict[str, Scenario] = {**SCENARIOS, **ACTION_SCENARIOS, **HYBRID_SCENARIOS, **LORA_SCENARIOS}


class UnknownScenario(KeyError):
    """A ``--scenario`` that is no canonical or library scenario and no
    scenario file; ``str()`` is the one-line message."""

    def __str__(self) -> str:
        return str(self.args[0])


class FileScenario:
    """A scenario file (the library's, traces/scenarios/, or any path) as
    ``run_candidate`` runs it: its ``[[requests]]`` or ``[synthetic]``
    workload, ``[config]`` and seed (``workloads.scenario.load_scenario``,
    read once: ScenarioError, ``file:line: problem``, here)."""

    def __init__(self, name: str, path: Path) -> None:
        from workloads.scenario import load_scenario

        self.name, self.path = name, path
        self.loaded = load_scenario(path)
        self.seed = self.loaded.seed

    def make_workload(self):
        return self.loaded.workload

    def engine_config(self):
        return self.loaded.engine_config()


def library_folder() -> Path:
    """The scenario library: the checkout's traces/scenarios/, else the
    installed copy (as ``harness.conformance.LIBRARY``)."""
    checkout = Path(__file__).resolve().parents[1] / "traces" / "scenarios"
    return checkout if checkout.is_dir() else Path(__file__).resolve().parent / "library"


def mutation_scenario(name: str) -> Scenario | FileScenario:
    """``name`` as the self-test runs it: a canonical scenario
    (``MUTATION_SCENARIOS``), a library scenario (``<library>/<name>.toml``)
    or a scenario file path. UnknownScenario (naming both folders, with the
    close names of both) otherwise; ScenarioError for a file that does not
    load."""
    if name in MUTATION_SCENARIOS:
        return MUTATION_SCENARIOS[name]
    library = library_folder()
    if (library / f"{name}.toml").is_file():
        return FileScenario(name, library / f"{name}.toml")
    if name.lower().endswith((".toml", ".json")) and Path(name).is_file():
        return FileScenario(name, Path(name))
    library_names = sorted(p.stem for p in library.glob("*.toml")) if library.is_dir() else []
    if name.lower().endswith((".toml", ".json")):
        from reference.words import missing_file_hint

        raise UnknownScenario(f"no scenario file {name!r}{missing_file_hint(name)}")
    raise UnknownScenario(f"unknown scenario {name!r}"
                          + (did_you_mean(name, [*MUTATION_SCENARIOS, *library_names], list_whole=False)
                             or f": not a scenario of harness/scenarios/ or of the library ({_shown(library)}), "
                                f"nor a .toml file"))


def _shown(folder: Path) -> str:
    try:
        return str(folder.relative_to(Path.cwd())) + "/"
    except ValueError:
        return str(folder) + "/"


def _rows_digest(steps: list) -> str:
    """sha256 of a run's rows, step by step (two runs with the same digest
    decided the same, row for row)."""
    digest = hashlib.sha256()
    for step, rows in steps:
        digest.update(repr((step, rows)).encode())
    return digest.hexdigest()


@dataclass
class Cell:
    """One (candidate, scenario) run: its check result and how it ended
    ("" normally, "stalled", or the candidate's exception); ``refused``: the
    candidate's CandidateRefused text when it declined the scenario's config
    before deciding anything (not a crash: e.g. a vLLM release without an
    option the config sets); ``digest``: sha256 of the run's rows
    (``_rows_digest``: equal digests, the same trace)."""

    result: CheckResult
    ended: str = ""
    refused: str = ""
    digest: str = ""


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
    return Cell(check_steps(scenario.engine_config().to_dict(), steps, profile), ended, refused,
                _rows_digest(steps))


def kill_matrix(mutants: list[str] | None = None, scenarios: list[str] | None = None,
                on_cell: Callable[[str, str], object] | None = None) -> list[MatrixRow]:
    """Rows in ``MUTANTS_AND_TARGETS`` order (``on_cell(mutant, scenario)``
    after each run: progress). KeyError for an unknown name (UnknownScenario
    for a scenario: ``mutation_scenario``)."""
    names = mutants or list(MUTANTS_AND_TARGETS)
    chosen = {s: mutation_scenario(s) for s in (scenarios or MUTATION_SCENARIOS)}
    rows = []
    for name in names:
        cls, target = MUTANTS_AND_TARGETS[name]
        row = MatrixRow(name, target)
        for s, sc in chosen.items():
            row.cells[s] = run_candidate(cls, sc)
            if on_cell is not None:
                on_cell(name, s)
        rows.append(row)
    return rows


@dataclass
class MutationReport:
    """The self-test's outcome (``run_mutation``): the scenarios run, the
    clean reference's cell on each, and one row per mutant; ``chosen``:
    the scenarios were chosen (``--scenario``), so a mutant they do not
    exercise is n/a (``not_exercised``), not a survivor."""

    scenarios: list[str]
    clean: dict[str, Cell]
    rows: list[MatrixRow]
    chosen: bool = False

    @property
    def dirty(self) -> dict[str, dict[str, int]]:
        """Violations of the clean reference, by scenario then invariant (must be empty)."""
        return {s: c.result.by_invariant for s, c in self.clean.items() if not c.result.ok}

    def exercised(self, row: MatrixRow) -> bool:
        """Whether some scenario's run of ``row``'s mutant is not the clean
        reference's, row for row (or ended otherwise)."""
        return any((c.digest, c.ended) != (self.clean[s].digest, self.clean[s].ended)
                   for s, c in row.cells.items())

    @property
    def not_exercised(self) -> list[str]:
        """With chosen scenarios: the unkilled mutants whose every run is the
        clean reference's trace (n/a there); else none."""
        return [r.mutant for r in self.rows if self.chosen and not r.killed and not self.exercised(r)]

    @property
    def survivors(self) -> list[str]:
        """The mutants whose target invariant fired on no scenario, less the
        ``not_exercised`` ones."""
        na = set(self.not_exercised)
        return [r.mutant for r in self.rows if not r.killed and r.mutant not in na]

    @property
    def ok(self) -> bool:
        """Every mutant killed (or, with chosen scenarios, not exercised)
        and the reference clean everywhere."""
        return not self.survivors and not self.dirty

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of ``harness mutants --json``."""
        return {
            "ok": self.ok, "survivors": self.survivors, "not_exercised": self.not_exercised,
            "reference_violations": self.dirty,
            "matrix": {r.mutant: {"target": r.target, "layer": r.layer, "killed": r.killed,
                                  "exercised": self.exercised(r),
                                  "safety_catches": r.safety_catches,
                                  "cells": {s: {"target_hits": c.result.by_invariant.get(r.target, 0),
                                                "violations": c.result.by_invariant, "ended": c.ended}
                                            for s, c in r.cells.items()}} for r in self.rows}}


def run_mutation(mutants: list[str] | None = None, scenarios: list[str] | None = None,
                 on_cell: Callable[[str, str], object] | None = None) -> MutationReport:
    """Run the clean reference and then every mutant (``kill_matrix``) on
    every scenario (all of ``MUTANTS_AND_TARGETS`` / ``MUTATION_SCENARIOS``
    when None; ``scenarios`` given: a mutant they do not exercise is n/a);
    ``on_cell(mutant, scenario)`` after each run ("reference" for the clean
    runs). KeyError for an unknown name (UnknownScenario: ``mutation_scenario``)."""
    scenario_list = scenarios or list(MUTATION_SCENARIOS)
    clean = {}
    for s in scenario_list:
        clean[s] = run_candidate(Scheduler, mutation_scenario(s))
        if on_cell is not None:
            on_cell("reference", s)
    return MutationReport(scenario_list, clean, kill_matrix(mutants or None, scenario_list, on_cell),
                          chosen=bool(scenarios))


def render_matrix(report: MutationReport, console: Console) -> None:
    """Print the kill matrix, one row per mutant (readable at any terminal
    width): its target, the scenarios where it fired and how often, killed
    or SURVIVED; then the reference's violations, if any, and the count."""
    clean, rows, survivors, na = report.clean, report.rows, report.survivors, report.not_exercised
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
                      "[green]yes[/]" if r.killed else "[dim]n/a[/]" if r.mutant in na else "[bold red]SURVIVED[/]",
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
    if na:
        console.print(f"n/a: not exercised by {', '.join(report.scenarios)} (each run's trace is the "
                      f"reference's, row for row: no checker could tell it from a correct engine)", markup=False)
    console.print(f"{len(rows) - len(survivors) - len(na)}/{len(rows) - len(na)} "
                  + ("exercised mutants killed" if na else "mutants killed")
                  + (f"; {len(na)} n/a: {', '.join(na)}" if na else "")
                  + (f"; survivors: {', '.join(survivors)}" if survivors else ""), markup=False)
