"""Regression (adversarial trial, finding 4): IDLE-ADMISSION (safety) read the
configured token budget, never the one the step recorded. A correct fork that
halves its budget every other step (``tests/forks/alternate_half_budget.py``)
leaves a 49-token prompt waiting one step at budget 48 with chunked prefill
off (as vLLM 0.33.0 ends its waiting loop on a prompt over the budget left),
admits it the next step, and every request finishes; the fork gate reported
IDLE-ADMISSION ×3 on golden no-chunked-prefill. The rule now reads the step's
``token_budget``; an engine that idles with its whole budget free
(``tests/forks/idle_stall.py``) still fails it, under safety alone too."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "no-chunked-prefill.parquet"


def _own_run(make, semantics: str):
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN)
    profile, _ = resolve(semantics, trace.meta)
    return own_run(trace, make, profile)


def test_regression_a_tighter_budget_on_some_steps_passes_the_fork_gate(monkeypatch) -> None:
    from forks import put_on_path

    put_on_path(monkeypatch)
    out = CliRunner().invoke(main, ["replay", str(GOLDEN), "--candidate", "forks.alternate_half_budget:make",
                                    "--semantics", "fork"])
    assert out.exit_code == 0, out.output
    assert out.output.splitlines()[-1].startswith("conformant (profile fork); decisions differ from step ")
    assert "IDLE-ADMISSION" not in out.output


def test_regression_the_halved_budget_is_what_the_idle_steps_recorded(monkeypatch) -> None:
    """The idle steps are there (the old rule's three witnesses); under the
    release's profile the fork's own accounting is BUDGET-LEFT's (semantics),
    never IDLE-ADMISSION."""
    from forks import put_on_path
    from forks.alternate_half_budget import make

    put_on_path(monkeypatch)
    assert _own_run(make, "safety").result.by_invariant == {}
    by_invariant = _own_run(make, "0.33.0").result.by_invariant
    assert "IDLE-ADMISSION" not in by_invariant and by_invariant.get("BUDGET-LEFT", 0) > 0, by_invariant


def test_regression_an_idle_stall_with_the_whole_budget_still_fails(monkeypatch) -> None:
    from forks import put_on_path
    from forks.idle_stall import make

    put_on_path(monkeypatch)
    run = _own_run(make, "safety")
    assert run.result.by_invariant == {"IDLE-ADMISSION": 10, "LIVENESS": 1}
    first = next(v for v in run.result.violations if v.invariant == "IDLE-ADMISSION")
    assert (first.step, first.request, first.message) == (
        0, "r000000", "nothing running, 1 waiting, and nothing admitted, although the step's token budget (96) "
                      "fits every waiting request: a request that fits an empty engine must be admitted")
