"""Regressions (adversarial trial) of ``harness fuzz``'s output:

* ``-o PATH`` was not validated before fuzzing: a finding was lost to
  NotADirectoryError / FileExistsError when the witness came to be written.
  Now one line, exit 2, before any example runs.
* The finding's ``replay_command`` dropped ``--semantics``: the printed
  command must reproduce the run's verdict.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main

FUZZ = ["fuzz", "--candidate", "mutant:leak-on-abort", "--max-examples", "50", "--seed", "0"]


def _refused(out: str) -> list[str]:
    r = CliRunner().invoke(main, [*FUZZ, "-o", out])
    assert r.exit_code == 2, r.output
    assert "fuzzed" not in r.output  # nothing ran
    return r.output.strip().splitlines()


def test_regression_fuzz_output_path_checked_before_fuzzing(tmp_path: Path) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me\n")
    assert _refused(str(a_file)) == [
        f"error: {a_file}: -o names a file, not a folder (this command writes its files into a folder)"]
    assert _refused(str(a_file / "out")) == [f"error: {a_file / 'out'}: {a_file} is not a folder"]
    assert a_file.read_text() == "keep me\n"
    # A witness's name taken by a folder: it would be replaced at the end.
    out = tmp_path / "out"
    (out / "fuzz-mutant-leak-on-abort-seed0.json").mkdir(parents=True)
    assert _refused(str(out)) == [
        f"error: {out / 'fuzz-mutant-leak-on-abort-seed0.json'}: -o names a folder, not a regular file; "
        f"refusing to replace it"]
    assert _refused("") == ["error: -o: the output folder is empty"]


def test_regression_fuzz_replay_command_keeps_semantics(tmp_path: Path) -> None:
    out = tmp_path / "out"
    r = CliRunner().invoke(main, [*FUZZ, "--semantics", "safety", "-o", str(out)])
    assert r.exit_code == 1, r.output
    info = json.loads((out / "fuzz-mutant-leak-on-abort-seed0.json").read_text())
    trace = out / "fuzz-mutant-leak-on-abort-seed0.parquet"
    assert info["semantics"] == "safety"
    assert info["replay_command"] == f"harness replay {trace} --candidate mutant:leak-on-abort --semantics safety"
    assert f"replay: {info['replay_command']}" in r.output
    # The printed command reproduces the verdict, under the profile the run used.
    args = shlex.split(info["replay_command"])[1:]
    replay = CliRunner().invoke(main, [*args, "--json"])
    assert replay.exit_code == 1, replay.output
    assert json.loads(replay.output)["profile"] == "safety"
    assert "harness check T.parquet --semantics safety" in (out / "fuzz-mutant-leak-on-abort-seed0.toml").read_text()


def test_regression_fuzz_output_through_a_dangling_link_refused_up_front(tmp_path: Path) -> None:
    """Regression (new-user trial): ``-o`` a dangling symlink (or a folder under one) was accepted;
    the witness write then failed with "File exists" after the finding, exit 2 for exit 1."""
    from harness.paths import OutputPathError, check_output_folder

    (tmp_path / "dangle").symlink_to(tmp_path / "nowhere")
    for output in (tmp_path / "dangle", tmp_path / "dangle" / "sub"):
        with pytest.raises(OutputPathError, match="dangle is a dangling symbolic link"):
            check_output_folder(str(output))
    check_output_folder(str(tmp_path / "fresh" / "sub"))  # a folder still to create is fine


def test_regression_fuzz_auto_replay_command_names_the_reference_profile(tmp_path: Path, monkeypatch) -> None:
    """Regression (new-user trial): under ``auto`` fuzz holds a ``module:factory``
    candidate to the reference's profile, but ``replay``'s ``auto`` gives an engine
    of unknown origin safety only: the printed command replayed "conformant
    (profile safety)", exit 0, for a fuzz finding (ADMISSION-ORDER). The
    command now names the profile the run used."""
    from forks import put_on_path

    put_on_path(monkeypatch)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["fuzz", "--candidate", "forks.shortest_prompt_first:make", "--max-examples", "30", "--seed", "0",
                                  "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "FOUND violation: ADMISSION-ORDER" in r.output
    # ... and says the rule is a release's design, with the fork gate to use.
    assert ("  hint: ADMISSION-ORDER is a version-semantics rule (a release's design, not a safety or "
            "progress bug): for a fork whose policy differs on purpose, --semantics fork holds it to "
            "safety and progress only") in r.output
    info = json.loads((out / "fuzz-forks.shortest_prompt_first-make-seed0.json").read_text())
    assert info["replay_command"].endswith("--candidate forks.shortest_prompt_first:make --semantics 0.33.0")
    replay = CliRunner().invoke(main, [*shlex.split(info["replay_command"].split("harness ", 1)[1]), "--json"])
    assert replay.exit_code == 1, replay.output
    assert json.loads(replay.output)["profile"] == "0.33.0"


def test_fork_hint_only_when_every_fired_rule_is_semantics() -> None:
    from harness.check.invariants import fork_hint

    assert fork_hint(["ADMISSION-ORDER"]).startswith("ADMISSION-ORDER is a version-semantics rule")
    assert fork_hint(["MAX-NUM-SEQS"]) is None  # safety: a bug in any engine
    assert fork_hint(["ADMISSION-ORDER", "LIVENESS"]) is None  # progress fired too
    assert fork_hint(["NO-SUCH-RULE"]) is None
    assert fork_hint([]) is None
    assert fork_hint([], diverged=True, option="--harness-semantics fork") == (
        "the candidate decides differently from the reference: for a fork whose policy differs on purpose, "
        "--harness-semantics fork holds it to safety and progress only")
