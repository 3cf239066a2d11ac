"""Regression (new-user trial): a correct Scheduler subclass that keeps its
waiting queue shortest prompt first failed ``--semantics fork`` (the fork gate)
with ``STATE-CONTINUITY at step 0: waiting at step start ['r000001', 'r000000']
!= previous end + arrivals ['r000000', 'r000001']``: the checker took a
reordered waiting queue (the same requests) for a safety break. It is now
ADMISSION-ORDER (semantics: FCFS's arrival order is vLLM's design); a queue
that gains or loses a request stays STATE-CONTINUITY."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from forks import put_on_path
from harness.cli import main

def test_regression_fork_gate_failed_a_correct_shortest_prompt_first_scheduler(tmp_path: Path, monkeypatch) -> None:
    put_on_path(monkeypatch)
    out = tmp_path / "spf.parquet"
    r = CliRunner().invoke(main, ["record", str(Path(__file__).resolve().parents[1] / "harness" / "scenarios" / "fcfs-tight.toml"), "--engine", "forks.shortest_prompt_first:make", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork"])
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (0, "conformant (profile fork)"), r.output[-2000:]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "safety"])
    assert r.exit_code == 0, r.output[-2000:]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "0.33.0"])  # vLLM's FCFS design: a deviation
    assert r.exit_code == 1 and "STATE-CONTINUITY" not in r.output, r.output[-2000:]
    assert "ADMISSION-ORDER" in r.output and "is not FCFS order" in r.output, r.output[-3000:]
