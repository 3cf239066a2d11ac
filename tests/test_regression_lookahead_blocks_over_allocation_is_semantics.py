"""Regression (adversarial trial, finding 2): BLOCKS-COVER (safety) fired on a
correct engine that holds more blocks than its tokens need.

A fork reserving a block of look-ahead slots for running requests
(``num_lookahead_tokens=block_size`` to ``allocate_slots``), and vLLM 0.33.0's
own ``Scheduler`` with ``num_lookahead_tokens = 4`` (what vLLM derives for an
EAGLE drafter), got "table has 11 blocks for 40 tokens, needs 10" on every
golden under ``--semantics fork``. A table that covers more than it needs
writes nothing out of bounds: BLOCKS-COVER now asks for at least the blocks of
computed + scheduled tokens; holding exactly what vLLM allocates (those tokens
plus ``num_lookahead_tokens``, config key of the same name) is BLOCKS-EXACT, a
semantics rule. The recorder writes vLLM's ``Scheduler.num_lookahead_tokens``,
the reference allocates it and the checker (BLOCKS-EXACT, the progress
bounds) counts it, so a vLLM run with a drafter's look-ahead checks clean and
replays identically. ``tests/data/vllm-0.33.0-lookahead-4.jsonl`` was made by
``tests/data/record_lookahead.py`` (vLLM 0.33.0, look-ahead 4).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from forks import REPO, put_on_path
from harness.candidates.resolve import resolve_candidate
from harness.candidates.vllm.recording_convert import convert
from harness.check.checker import check_trace, unjudged_rules
from harness.check.invariants import INVARIANTS
from harness.cli import main
from harness.replay import replay
from harness.trace.reader import open_trace

RECORDING = Path(__file__).resolve().parent / "data" / "vllm-0.33.0-lookahead-4.jsonl"
SCENARIO = str(REPO / "harness" / "scenarios" / "fcfs-tight.toml")


def _record(tmp_path: Path, engine: str) -> str:
    out = str(tmp_path / "run.parquet")
    r = CliRunner().invoke(main, ["record", SCENARIO, "--engine", engine, "-o", out])
    assert r.exit_code == 0, r.output
    return out


def _check(path: str, semantics: str) -> tuple[int, list[str]]:
    r = CliRunner().invoke(main, ["check", path, "--semantics", semantics])
    return r.exit_code, r.output.strip().splitlines()


def test_the_rules_layers() -> None:
    assert (INVARIANTS["BLOCKS-COVER"].layer, INVARIANTS["BLOCKS-EXACT"].layer) == ("safety", "semantics")


def test_the_lookahead_fork_passes_the_fork_gate_on_every_golden(monkeypatch) -> None:
    put_on_path(monkeypatch)
    r = CliRunner().invoke(main, ["golden", "check", "--candidate", "forks.lookahead:make", "--semantics", "fork"])
    assert r.exit_code == 0, r.output[-3000:]
    assert r.output.strip().splitlines()[-1].startswith("20 ok, 0 failed"), r.output[-3000:]


def test_the_semantics_rule_fires_under_0_33_0_on_the_fork(tmp_path: Path, monkeypatch) -> None:
    put_on_path(monkeypatch)
    path = _record(tmp_path, "forks.lookahead:make")
    code, lines = _check(path, "0.33.0")
    assert code == 1 and lines[-1] == "155 violations of 1 invariant: BLOCKS-EXACT ×155 (profile 0.33.0)"
    assert ("VIOLATION BLOCKS-EXACT at step 1, request r000000: table has 11 blocks for 40 tokens, "
            "this version allocates 10 (it held 10)") in lines
    for semantics in ("safety", "fork"):
        code, lines = _check(path, semantics)
        assert (code, lines[-1]) == (0, f"conformant (profile {semantics})")


def test_an_engine_with_too_few_blocks_is_still_caught_by_blocks_cover(tmp_path: Path, monkeypatch) -> None:
    put_on_path(monkeypatch)
    path = _record(tmp_path, "forks.broken_blocks:too_few")
    code, lines = _check(path, "safety")
    assert code == 1 and lines[-1] == "367 violations of 1 invariant: BLOCKS-COVER ×367 (profile safety)"
    assert "VIOLATION BLOCKS-COVER at step 2, request r000000: table has 10 blocks for 41 tokens, needs 11" in lines


def test_vllms_recording_with_a_lookahead_of_4_checks_clean_and_replays(tmp_path: Path) -> None:
    summary = convert(RECORDING, tmp_path / "l4.parquet")
    assert (summary["steps"], summary["finished"], summary["preemptions"], summary["warnings"]) == (25, 3, 1, [])
    trace = open_trace(tmp_path / "l4.parquet")
    assert trace.meta["config"]["num_lookahead_tokens"] == 4
    assert unjudged_rules(trace.meta) == {}
    for semantics in ("auto", "0.33.0", "safety"):
        assert check_trace(trace, semantics).by_invariant == {}, semantics
    assert replay(trace, resolve_candidate("reference")) == (None, 25)


def test_without_the_recorded_lookahead_the_semantics_rule_fires(tmp_path: Path) -> None:
    """The same recording read as if vLLM had no look-ahead: its tables are a
    block longer than 0.33.0's exact count (and the progress bounds too short);
    nothing unsafe."""
    convert(RECORDING, tmp_path / "l0.parquet", overrides={"num_lookahead_tokens": 0})
    trace = open_trace(tmp_path / "l0.parquet")
    result = check_trace(trace, "0.33.0")
    assert result.by_invariant == {"BLOCKS-EXACT": 6, "PROGRESS-ADMIT": 3}
    first = result.violations[0]
    assert (first.invariant, first.step, first.request, first.message) == (
        "BLOCKS-EXACT", 0, "r000000", "table has 3 blocks for 30 tokens, this version allocates 2 (it held 0)")
    assert check_trace(trace, "safety").by_invariant == {}


@pytest.mark.vllm
@pytest.mark.skipif(os.environ.get("HARNESS_SKIP_VLLM") == "1", reason="HARNESS_SKIP_VLLM=1")
def test_vllm_replays_the_recording_with_its_lookahead(tmp_path: Path) -> None:
    """The driver gives vLLM's Scheduler the config's num_lookahead_tokens."""
    import gc

    convert(RECORDING, tmp_path / "l4.parquet")
    result = replay(open_trace(tmp_path / "l4.parquet"), resolve_candidate("vllm@0.33.0"))
    gc.collect()
    assert result == (None, 25)
