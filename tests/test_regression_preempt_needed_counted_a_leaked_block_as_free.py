"""Regression (new-user trial, "block leaked on abort"): a fork whose aborts
leave one block held (``tests/forks/leak_on_abort.py``) got, besides the
BLOCK-CONSERVATION it deserves, ``PROGRESS-PREEMPT-NEEDED at step 91, request
r000035: preempted ['r000036'] to schedule it, but it was given 1 new block(s)
and 2 were free before the first preemption``, at a step whose
``schedule_begin`` row says 1 free block (r000034 then took it). The model was
right about what a correct engine would hold; the witness was wrong to judge
the engine with it: two leaked blocks were in the model's free queue, never in
the engine's. The progress rules now count free blocks as the rows say
(``ProgressStep.free_excess``)."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "eos-stop-abort.parquet"


def test_the_leak_is_block_conservation_alone() -> None:
    from forks.leak_on_abort import make
    from harness.check.profiles import resolve
    from harness.replay import own_run
    from harness.trace import open_trace

    trace = open_trace(GOLDEN)
    run = own_run(trace, make, resolve("fork", trace.meta)[0])
    assert (run.ended, run.steps, run.result.by_invariant) == ("", 111, {"BLOCK-CONSERVATION": 276})
    first = run.result.violations[0]
    assert (first.invariant, first.step, first.message) == (
        "BLOCK-CONSERVATION", 19, "at schedule_begin: 21 free + 17 held != 39 usable blocks "
                                  "(the trace implies 22 free); since update_end at step 18 (11 free) the "
                                  "engine's count changed by +10, the trace's events by +11 (abort r000004 "
                                  "freed 11 blocks, 11 back to the free queue (+11)): 1 block fewer came back "
                                  "than the trace frees")


def test_the_step_the_witness_misread(tmp_path: Path, monkeypatch) -> None:
    """Step 91 of the fork's own run: 1 free block at the start (the model's
    queue had 3: two leaked), r000034 takes it, r000036 is preempted and
    r000035 gets 1 block: the preemption was needed."""
    from click.testing import CliRunner

    from forks import put_on_path
    from harness.cli import main

    put_on_path(monkeypatch)
    out = tmp_path / "leak.parquet"
    scenario = Path(__file__).resolve().parents[1] / "harness" / "scenarios" / "eos-stop-abort.toml"
    r = CliRunner().invoke(main, ["record", str(scenario), "--engine", "forks.leak_on_abort:make", "-o", str(out)])
    assert r.exit_code == 0, r.output
    rows = [(row["kind"], row["request_id"], row["num_free_blocks"], len(row["block_ids"] or []))
            for row in pq.read_table(out).to_pylist()
            if row["step"] == 91 and row["kind"] in ("schedule_begin", "schedule", "preempt", "schedule_end")]
    assert rows == [("schedule_begin", None, 1, 0), ("schedule", "r000033", None, 0),
                    ("schedule", "r000034", None, 1), ("preempt", "r000036", None, 16),
                    ("schedule", "r000035", None, 1), ("schedule_end", None, 15, 0)]
    r = CliRunner().invoke(main, ["check", str(out), "--semantics", "fork"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        "276 violations of 1 invariant: BLOCK-CONSERVATION ×276 (profile fork)")
    assert "PROGRESS-PREEMPT-NEEDED" not in r.output
