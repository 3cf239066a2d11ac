"""``harness golden check --semantics`` (the fork gate on the goldens, as the
pytest plugin's ``--harness-semantics``): under fork or safety a decision that
differs from a golden's is information and the candidate's own run of that
golden's inputs is checked under the profile instead; under auto (the
default) every difference fails as before."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from harness.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def run(*args: object) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def test_a_different_victim_passes_the_fork_gate_with_the_differences_as_information() -> None:
    code, out = run("golden", "check", "--dir", GOLDEN, "--candidate", "mutant:lifo-priority-victim",
                    "--semantics", "fork")
    assert code == 0, out
    lines = out.splitlines()
    assert [line for line in lines if "information" in line] == [
        "ok   priority-tight        221 steps, decisions differ from step 3 (information); own run: 228 "
        "steps, no violation",
        "ok   spec-decode-priority  134 steps, decisions differ from step 5 (information); own run: 135 "
        "steps, no violation",
        "ok   encoder-inputs        485 steps, decisions differ from step 9 (information); own run: 484 "
        "steps, no violation"]
    assert lines[0] == "ok   fcfs-tight            392 steps, 392 replayed identically"
    assert lines[-1] == f"20 ok, 0 failed ({GOLDEN}, candidate mutant:lifo-priority-victim, profile fork)"
    # auto (the default): the same differences fail.
    code, out = run("golden", "check", "--dir", GOLDEN, "--candidate", "mutant:lifo-priority-victim")
    assert code == 1
    assert out.splitlines()[-2:] == [
        # Regression (new-user trial): a correct fork's differences failed with no word of the fork gate.
        "hint: the candidate decides differently from the reference: for a fork whose policy differs on "
        "purpose, --semantics fork holds it to safety and progress only",
        f"17 ok, 3 failed ({GOLDEN}, candidate mutant:lifo-priority-victim)"]


def test_a_safety_bug_fails_the_fork_gate_on_its_own_runs() -> None:
    code, out = run("golden", "check", "--dir", GOLDEN, "--candidate", "mutant:ignore-max-num-seqs",
                    "--semantics", "fork")
    assert code == 1, out
    lines = out.splitlines()
    failed = {line.split()[1]: line.split("  ", 2)[-1].strip() for line in lines if line.startswith("FAIL ")}
    assert sorted(failed) == sorted(["fcfs-roomy", "priority-tight", "no-chunked-prefill", "eos-stop-abort",
                                     "preemption-heavy", "pipeline-3", "prefill-cadence", "deferred-frees",
                                     "kv-connector", "encoder-inputs"])
    assert failed["fcfs-roomy"] == ("the candidate's own run (profile fork): 6 violations (MAX-NUM-SEQS ×6), "
                                    "first MAX-NUM-SEQS at step 10 (r000004): admitted with 4 running = "
                                    "max_num_seqs 4")
    assert failed["encoder-inputs"].startswith("the candidate's own run (profile fork): 193 violations "
                                               "(MAX-NUM-SEQS ×193), first MAX-NUM-SEQS at step 3 (r000006)")
    assert lines[-1] == f"10 ok, 10 failed ({GOLDEN}, candidate mutant:ignore-max-num-seqs, profile fork)"


def test_hybrid_goldens_catch_a_sliding_window_bug_under_safety() -> None:
    hybrid = GOLDEN / "hybrid"
    code, out = run("golden", "check", "--hybrid", "--dir", hybrid, "--candidate", "mutant:free-window-ahead",
                    "--semantics", "safety")
    assert code == 1, out
    assert out.splitlines() == [
        "FAIL hybrid-alternating  the candidate's own run (profile safety): 178 violations "
        "(SLIDING-WINDOW-HELD ×178), first SLIDING-WINDOW-HELD at step 1 (r000000): group 0: freed block 16 "
        "as out of the window of token 64, but the window reads slot 15",
        "FAIL hybrid-five-to-one  the candidate's own run (profile safety): 1545 violations "
        "(SLIDING-WINDOW-HELD ×1545), first SLIDING-WINDOW-HELD at step 1 (r000000): group 0: freed block 8 "
        "as out of the window of token 32, but the window reads slot 7",
        "ok   hybrid-mamba        153 steps, 153 replayed identically",
        f"1 ok, 2 failed ({hybrid}, candidate mutant:free-window-ahead, profile safety)"]


def test_unknown_semantics_exits_2_with_did_you_mean() -> None:
    assert run("golden", "check", "--semantics", "frok") == (
        2, "error: unknown semantics 'frok'; did you mean 'fork'?\n")
    assert run("golden", "check", "--hybrid", "--semantics", "0.1.0") == (
        2, "error: unknown semantics '0.1.0': expected auto, 0.33.0, 0.29.0, 0.25.0, 0.20.2, fork, safety\n")


def test_regression_a_crashing_factory_is_a_crash_not_a_divergence_with_a_fork_hint(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """A factory raising on every config read "candidate diverges at step 0 ...
    field exception" under the hint to try --semantics fork (adversarial
    trial): no semantics excuses a crash."""
    import os
    import sys

    (tmp_path / "refuse_all.py").write_text(
        "def make(config):\n    raise ValueError('unsupported config: ' + config.policy)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    code, out = run("golden", "check", "--dir", GOLDEN, "--candidate", "refuse_all:make")
    assert code == 1, out
    lines = out.splitlines()
    assert lines[0] == ("FAIL fcfs-tight            the candidate raised ValueError at step 0: unsupported config: "
                        "fcfs (the golden run did not)")
    assert not any(line.startswith("hint:") for line in lines), out
    assert lines[-1] == f"0 ok, 20 failed ({GOLDEN}, candidate refuse_all:make)"
