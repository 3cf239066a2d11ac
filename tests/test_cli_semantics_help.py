"""Regression (new-user trial): `harness report --help` listed `auto|safety|VERSION` for
--semantics although `fork` is accepted, and `replay --help` listed fork twice ("or a
profile: 0.33.0, 0.29.0, 0.25.0, 0.20.2, fork"). Every command's --semantics help now
comes from ``harness.cli_common.semantics_help``."""

from __future__ import annotations

import click
import pytest

from harness.cli import main
from harness.cli_common import AUTO_TRACE, SEMANTICS_METAVAR, semantics_help

COMMANDS = [("check",), ("replay",), ("report",), ("export",), ("fuzz",), ("golden", "check"), ("serve-record",)]


def _semantics(path: tuple[str, ...]) -> click.Option:
    command = main
    for name in path:
        command = command.get_command(click.Context(command), name)
    [option] = [p for p in command.params if p.name == "semantics"]
    return option


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_every_semantics_option_names_fork_once_and_every_release(path) -> None:
    option = _semantics(path)
    assert (option.metavar, option.default) == (SEMANTICS_METAVAR, "auto") == ("auto|safety|fork|VERSION", "auto")
    assert option.help.count("'fork' (the fork gate") == 1 and "0.20.2, fork" not in option.help
    assert "'safety' (the safety invariants only), 'fork' (the fork gate: safety + progress, no version's " \
           "design) or a release's profile: 0.33.0, 0.29.0, 0.25.0, 0.20.2." in option.help


def test_the_trace_commands_say_a_forks_trace_is_checked_under_safety() -> None:
    for path in [("check",), ("replay",)]:
        assert _semantics(path).help == semantics_help(AUTO_TRACE)
    for path in [("report",), ("export",)]:
        assert _semantics(path).help == semantics_help(AUTO_TRACE, "Its violations are marked.")
    assert AUTO_TRACE.endswith("safety only for an engine of unknown origin, a module:factory fork's trace "
                               "included: add 'fork' for the progress rules")


def test_regression_a_forks_trace_under_auto_says_how_to_add_the_progress_rules(tmp_path, monkeypatch) -> None:
    """New-user trial: `harness check` of a module:factory fork's trace used profile safety
    (auto, by design: docs/explanation/invariants.md), so a progress bug passed unless the user
    knew of --semantics fork. The verdict line now says so; --semantics safety does not. (The re-appended
    tail's order is RUNNING-ORDER, a semantics rule: safety is silent.)"""
    from click.testing import CliRunner

    from harness.check.profiles import resolve
    from harness.report import FORK_TRACE_REASON

    assert FORK_TRACE_REASON in resolve("auto", {"engine": "mysjf:make"})[1]
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "skipper.py").write_text(SKIPPER)
    trace = tmp_path / "skip.parquet"
    r = CliRunner().invoke(main, ["record", "harness/scenarios/fcfs-roomy.toml", "--engine", "skipper:make",
                                  "-o", str(trace)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["check", str(trace)])
    assert (r.exit_code, r.output.splitlines()[-1]) == (
        0, "conformant (profile safety; a fork's trace: add --semantics fork for the progress rules)")
    r = CliRunner().invoke(main, ["check", str(trace), "--semantics", "safety"])
    assert (r.exit_code, r.output.splitlines()[-1]) == (0, "conformant (profile safety)")
    r = CliRunner().invoke(main, ["check", str(trace), "--semantics", "fork"])
    assert (r.exit_code, r.output.splitlines()[-1]) == (1, "18 violations of 1 invariant: PROGRESS-RUNNING ×18 "
                                                           "(profile fork)")


#: A progress bug no safety invariant sees: every 5th step the tail running request is left out.
SKIPPER = '''
from reference.scheduler import Scheduler


class Skip(Scheduler):
    def schedule(self, throttle_prefills=False):
        self._calls = getattr(self, "_calls", 0) + 1
        if self._calls % 5 or len(self.running) < 2:
            return super().schedule(throttle_prefills)
        tail = self.running.pop()
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.running.append(tail)


def make(config):
    return Skip(config)
'''
