"""Progress bars (harness/progress.py) show on a terminal only, never in piped
output or --json, and every command ends on a plain verdict line."""

from __future__ import annotations

import io
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from harness.check.invariants import INVARIANTS
from harness.cli import main
from harness.progress import every_steps, progress

ROOT = Path(__file__).resolve().parents[1]
TRACE = str(ROOT / "golden" / "preemption-heavy.parquet")


def test_progress_draws_on_a_terminal_only() -> None:
    shown = io.StringIO()
    with progress("checking x", 10, console=Console(file=shown, force_terminal=True, width=80)) as update:
        update(5)
    assert "checking x" in shown.getvalue()
    piped = io.StringIO()
    with progress("checking x", 10, console=Console(file=piped, force_terminal=False)) as update:
        update(5)
    assert piped.getvalue() == ""
    off = io.StringIO()
    with progress("checking x", 10, enabled=False,
                  console=Console(file=off, force_terminal=True)) as update:
        update(5)
    assert off.getvalue() == ""


def test_a_long_description_is_not_cut_on_an_80_column_terminal() -> None:
    """Regression (new-user trial): "replaying NAME on vllm@X" was cut to "replaying NAME on v…"
    because the bar kept rich's default 40 columns."""
    desc = "replaying azure-code-500.parquet on vllm@0.33.0,scheduler_cls=myfork.sched:Fair"
    shown = io.StringIO()
    with progress(desc, 12345, console=Console(file=shown, force_terminal=True, width=120)) as update:
        update(6000)
    assert desc in shown.getvalue()
    shown = io.StringIO()
    with progress(desc[:47], 12345, console=Console(file=shown, force_terminal=True, width=80)) as update:
        update(6000)
    assert desc[:47] in shown.getvalue() and "…" not in shown.getvalue()


def test_every_steps_updates_each_nth_step() -> None:
    seen: list[int] = []
    on_step = every_steps(lambda step: seen.append(step), n=4)
    for step in range(10):
        on_step(step, ["rows"], ["checkers"])
    assert seen == [0, 4, 8]


def test_piped_commands_print_no_progress_and_end_on_their_verdict() -> None:
    r = CliRunner().invoke(main, ["check", TRACE])
    assert r.exit_code == 0 and "checking" not in r.output
    assert r.output.splitlines()[-1] == "conformant (profile 0.33.0)"
    r = CliRunner().invoke(main, ["replay", TRACE])
    assert "replaying" not in r.output
    assert r.output.splitlines()[-1] == "conformant (profile 0.33.0): 230 steps replayed, identical decisions"
    r = CliRunner().invoke(main, ["diff", TRACE, TRACE])
    assert "comparing" not in r.output and r.exit_code == 0
    r = CliRunner().invoke(main, ["invariants"])
    safety = sum(inv.layer == "safety" for inv in INVARIANTS.values())
    semantics = sum(inv.layer == "semantics" for inv in INVARIANTS.values())
    assert r.output.splitlines()[-1] == (f"{len(INVARIANTS)} invariants: {safety} safety, "
                                         f"{len(INVARIANTS) - safety - semantics} progress, "
                                         f"{semantics} semantics")
    r = CliRunner().invoke(main, ["mutants", "--mutant", "preempt-head", "--scenario", "preemption-heavy"])
    assert "running mutants" not in r.output
    assert r.output.splitlines()[-1] == "1/1 mutants killed"


def test_regression_piped_tables_keep_names_whole() -> None:
    """Regression (issue 16): piped, rich assumes 80 columns and cut names in
    tables to "preempt-kee…"; the kill matrix and the catalogue keep them whole."""
    r = CliRunner().invoke(main, ["mutants", "--mutant", "preempt-keeps-drafts", "--scenario", "spec-decode"])
    assert "…" not in r.output
    assert "│ preempt-keeps-drafts │ PREEMPTED-NO-DRAFTS │" in r.output
    r = CliRunner().invoke(main, ["invariants"])
    assert "…" not in r.output
    assert all(f"│ {inv} " in r.output for inv in INVARIANTS)


def test_keep_words_whole_widens_a_table_past_a_narrow_console() -> None:
    from rich.table import Table

    from harness.richtext import keep_words_whole

    table = Table("name", "note")
    table.add_row("a-very-long-unbreakable-name", "short words wrap fine")
    out = io.StringIO()
    Console(file=out, width=20, soft_wrap=True).print(keep_words_whole(table))  # as the CLI's consoles
    assert "a-very-long-unbreakable-name" in out.getvalue() and "…" not in out.getvalue()
