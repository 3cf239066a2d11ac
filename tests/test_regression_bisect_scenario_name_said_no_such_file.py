"""Regression (new-user trial): `harness sweep priority-tight` takes a canonical scenario's name,
but `harness bisect priority-tight --versions 0.29.0,0.33.0` said only "error: priority-tight: no
such file". It now names the scenario's file, before any release runs (exit 2)."""

from __future__ import annotations

from click.testing import CliRunner

from harness.cli import main


def test_regression_bisect_scenario_name_said_no_such_file(tmp_path, monkeypatch) -> None:
    import os

    from harness.scenarios import DIRECTORY

    monkeypatch.chdir(tmp_path)
    path = os.path.relpath(DIRECTORY / "priority-tight.toml")
    for source in ("priority-tight", "priority-tight.toml"):
        r = CliRunner().invoke(main, ["bisect", source, "--versions", "0.29.0,0.33.0"])
        assert r.exit_code == 2, r.output
        assert r.output.strip().splitlines() == [
            f"error: {source}: no such file; the canonical scenario 'priority-tight' is {path}: "
            f"harness bisect {path} --versions ..."]
    r = CliRunner().invoke(main, ["bisect", "no-such-scenario", "--versions", "0.29.0,0.33.0"])
    assert r.exit_code == 2
    assert r.output.strip() == "error: no-such-scenario: no such file"
