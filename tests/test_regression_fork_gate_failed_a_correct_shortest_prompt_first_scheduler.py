"""Regression (new-user trial): a correct Scheduler subclass that keeps its
waiting queue shortest prompt first failed ``--semantics fork`` (the fork gate)
with ``STATE-CONTINUITY at step 0: waiting at step start ['r000001', 'r000000']
!= previous end + arrivals ['r000000', 'r000001']``: the checker took a
reordered waiting queue (the same requests) for a safety break. It is now
ADMISSION-ORDER (semantics: FCFS's arrival order is vLLM's design); a queue
that gains or loses a request stays STATE-CONTINUITY."""

from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

SPF = '''
from reference.scheduler import Scheduler


class ShortestPromptFirst(Scheduler):
    """New requests wait shortest prompt first (ties: arrival); preempted ones
    still go to the head. Correct, not FCFS."""

    def add_request(self, request):
        super().add_request(request)
        queue = self.waiting._queue
        queue.remove(request)
        at = next((i for i, r in enumerate(queue) if r.num_computed_tokens == 0
                   and r.status.name == "WAITING" and len(r.prompt_token_ids) > len(request.prompt_token_ids)),
                  len(queue))
        queue.insert(at, request)


def make(config):
    return ShortestPromptFirst(config)
'''


def test_regression_fork_gate_failed_a_correct_shortest_prompt_first_scheduler(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "spf_sched.py").write_text(SPF)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "spf_sched", raising=False)
    out = tmp_path / "spf.parquet"
    r = CliRunner().invoke(main, ["record", str(Path(__file__).resolve().parents[1] / "harness" / "scenarios" / "fcfs-tight.toml"), "--engine", "spf_sched:make", "-o", str(out)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork"])
    assert (r.exit_code, r.output.strip().splitlines()[-1]) == (0, "conformant (profile fork)"), r.output[-2000:]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "safety"])
    assert r.exit_code == 0, r.output[-2000:]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "0.33.0"])  # vLLM's FCFS design: a deviation
    assert r.exit_code == 1 and "STATE-CONTINUITY" not in r.output, r.output[-2000:]
    assert "ADMISSION-ORDER" in r.output and "is not FCFS order" in r.output, r.output[-3000:]
