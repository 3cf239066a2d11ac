"""The catalogue: every invariant is shown to fire, and each id has one home.

Scheduler bugs are shown by the mutants (harness mutants). ARRIVAL-ADMISSIBLE,
SPEC-ACCEPTANCE and DP-ROUTING guard the engine around the scheduler (input
processor, model runner, DP coordinator), so they are shown on doctored
traces (tests/check/test_queues.py, test_spec_decode.py, test_data_parallel.py).
"""

from __future__ import annotations

from pathlib import Path

from harness.check import invariants
from harness.check.invariants import FAMILIES, INVARIANTS, family_of
from harness.mutation import kill_matrix

CHECK = Path(invariants.__file__).parent


def test_every_invariant_is_shown_to_fire() -> None:
    # Doctored-trace tests: tests/check/test_queues.py, test_spec_decode.py, test_data_parallel.py.
    fired = {"ARRIVAL-ADMISSIBLE", "SCHEDULED-ONCE", "SPEC-ACCEPTANCE", "DP-ROUTING",
             "STOP-MIN-TOKENS",  # + test_lifecycle.py: a 0.33.0 engine checked under 0.20.2
             "BUDGET-LEFT",  # tests/check/test_budget.py
             # Issue 26: cross-row consistency of the update's rows (test_lifecycle.py doctors them).
             "OUTPUT-COUNT", "OUTPUT-ORDER"}
    for row in kill_matrix():
        for cell in row.cells.values():
            fired |= set(cell.result.by_invariant)
    assert sorted(set(INVARIANTS) - fired) == []


def test_each_id_lives_in_the_one_family_module_that_checks_it() -> None:
    """From an id, one file: its family module holds the entry and every check
    naming it; no other module of harness/check names it in a check."""
    # + 3 prefix-cache reset, ENGINE-CRASH, 3 observed (schema 6), BUDGET-LEFT, 5 progress,
    # OUTPUT-COUNT and OUTPUT-ORDER (issue 26), SLIDING-WINDOW-HELD and -FREE, MAMBA-STATE-HELD
    # and -BLOCKS (issue 28), MAX-LORAS, BLOCKS-EXACT (BLOCKS-COVER's "no more" half, semantics)
    assert sum(len(f.INVARIANTS) for f in FAMILIES) == len(INVARIANTS) == 68
    for inv_id in INVARIANTS:
        home = family_of(inv_id).rsplit(".", 1)[1] + ".py"
        naming = sorted(p.name for p in CHECK.glob("*.py") if f'"{inv_id}"' in p.read_text())
        assert [n for n in naming if n not in ("invariants.py", "profiles.py")] == [home], (inv_id, naming)


def test_family_of_names_the_module() -> None:
    assert family_of("PRIORITY-GIVE-BACK") == "harness.check.preemption"
    assert family_of("ALLOC-FROM-HEAD") == "harness.check.blocks"
    assert family_of("ENCODER-CACHE") == "harness.check.encoder"


def test_root_cause_first_orders_one_requests_witnesses_cause_first() -> None:
    """Issue 23: several ids for one request in one step list the decision
    rule before the bookkeeping that notices its effects, and progress last;
    other groups keep their places (the order the checks ran)."""
    from harness.check.invariants import root_cause_first
    from harness.check.result import Violation

    found = [Violation("PROGRESS-RUNNING", 3, "A", ""), Violation("COMPUTED-CONTINUITY", 3, "A", ""),
             Violation("BUDGET-TOKENS", 3, None, ""), Violation("SCHEDULED-NOT-PREEMPTED", 3, "A", ""),
             Violation("PREFILL-DEFER", 4, "B", ""), Violation("NO-ADMIT-AFTER-PREEMPT", 4, "B", "")]
    assert [(v.invariant, v.step, v.request) for v in root_cause_first(found)] == [
        ("SCHEDULED-NOT-PREEMPTED", 3, "A"), ("COMPUTED-CONTINUITY", 3, "A"), ("PROGRESS-RUNNING", 3, "A"),
        ("BUDGET-TOKENS", 3, None), ("NO-ADMIT-AFTER-PREEMPT", 4, "B"), ("PREFILL-DEFER", 4, "B")]
