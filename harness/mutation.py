"""The mutation self-test: every mutant on every scenario, a kill matrix.

A mutant is *killed* when its intended invariant fires on at least one
scenario (other invariants firing too is fine). The clean reference must
violate nothing anywhere. This is what proves each checker can fire.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reference.candidate import CandidateError, CandidateFactory
from reference.engine import EngineStalled
from harness.candidates.mutants import MUTANTS_AND_TARGETS

from harness.check import CheckResult, check_steps
from harness.trace.recorder import run_to_rows
from harness.scenarios import SCENARIOS, Scenario


@dataclass
class Cell:
    """One (candidate, scenario) run: its check result and how it ended
    ("" normally, "stalled", or the candidate's exception)."""

    result: CheckResult
    ended: str = ""


@dataclass
class MatrixRow:
    mutant: str
    target: str
    cells: dict[str, Cell] = field(default_factory=dict)

    @property
    def killed(self) -> bool:
        return any(c.result.by_invariant.get(self.target) for c in self.cells.values())


def run_candidate(factory: CandidateFactory, scenario: Scenario) -> Cell:
    """Run ``scenario`` on ``factory`` in memory and check every invariant."""
    steps: list = []
    ended = ""
    try:
        run_to_rows(scenario.make_workload(), scenario.engine_config(), seed=scenario.seed,
                    candidate_factory=factory, on_step_rows=lambda s, rows: steps.append((s, rows)))
    except EngineStalled:
        ended = "stalled"
    except CandidateError as exc:
        ended = str(exc)
    return Cell(check_steps(scenario.engine_config().to_dict(), steps), ended)


def kill_matrix(mutants: list[str] | None = None,
                scenarios: list[str] | None = None) -> list[MatrixRow]:
    """Rows in ``MUTANTS_AND_TARGETS`` order. KeyError for an unknown name."""
    names = mutants or list(MUTANTS_AND_TARGETS)
    chosen = [SCENARIOS[s] for s in (scenarios or SCENARIOS)]
    rows = []
    for name in names:
        cls, target = MUTANTS_AND_TARGETS[name]
        row = MatrixRow(name, target)
        for sc in chosen:
            row.cells[sc.name] = run_candidate(cls, sc)
        rows.append(row)
    return rows
