"""How the ``harness`` command ends: signals, usage errors, stray exceptions.

``HarnessGroup`` is the click group class of ``harness.cli.main``. Around
every command it:

* installs handlers for SIGINT and SIGTERM (what Ctrl-C, CI and ``timeout``
  send) that raise ``reference.candidate.UserInterrupt``: the one
  KeyboardInterrupt the engine's candidate guard lets through, so a
  candidate's own ``raise KeyboardInterrupt`` stays a crash. The exception
  unwinds normally: trace writers discard their temp files, fuzz workers
  and candidate processes are stopped by their ``finally`` blocks. The
  command then exits 130 (SIGINT) or 143 (SIGTERM), ``128 + signal``, with
  one line ``interrupted by SIGINT`` (but ``harness fuzz`` interrupted while
  it shrinks a failure reports the smallest so far and exits 1:
  ``harness.fuzz.run.fuzz``). The previous handlers come back after
  the command (tests call it in-process);
* prints a click usage error (unknown option, bad value) as one line,
  ``error: <message> (harness CMD --help)``, exit 2, instead of click's
  three;
* turns any exception that escapes a command into one line, ``error:
  <Type>: <text>``, exit 2 (unusable input the command did not foresee);
  ``HARNESS_TRACEBACK=1`` re-raises it with its traceback for debugging.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import click

from reference.candidate import UserInterrupt

EXIT_UNUSABLE = 2


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise UserInterrupt(signum)


@contextlib.contextmanager
def user_interrupts() -> Iterator[None]:
    """SIGINT and SIGTERM raise UserInterrupt inside the block (main thread
    only: elsewhere signals cannot be handled and nothing changes)."""
    saved: dict[int, Any] = {}
    try:
        for signum in (signal.SIGINT, signal.SIGTERM):
            try:
                saved[signum] = signal.signal(signum, _raise_interrupt)
            except ValueError:  # not the main thread
                break
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _say(message: str) -> None:
    click.echo(f"error: {message}", err=True)


class _Interrupted(Exception):
    """Carries an interrupt past click's ``main`` (which would print a blank
    line and "Aborted!" for a KeyboardInterrupt)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class HarnessGroup(click.Group):
    """The ``harness`` group: one-line errors and signal exits (module docstring)."""

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command; an interrupt leaves as ``_Interrupted``."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _Interrupted(exc.signum if isinstance(exc, UserInterrupt) else signal.SIGINT) from None

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        """Run the command line; always ends in ``sys.exit`` with the command's code."""
        try:
            with user_interrupts():
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.NoArgsIsHelpError as exc:
            # A bare group (`harness`, `harness golden`): its help as --help
            # prints it, not flattened into one "error: Usage: ..." line of
            # 1,500 characters (new-user trial); exit 2 as click's own.
            click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message(), err=True)
            sys.exit(EXIT_UNUSABLE)
        except click.UsageError as exc:
            command = exc.ctx.command_path if exc.ctx is not None else (prog_name or "harness")
            _say(f"{_one_line(exc.format_message())} ({command} --help)")
            sys.exit(EXIT_UNUSABLE)
        except click.ClickException as exc:
            _say(_one_line(exc.format_message()))
            sys.exit(exc.exit_code if exc.exit_code != 1 else EXIT_UNUSABLE)
        except (_Interrupted, click.Abort, KeyboardInterrupt) as exc:
            cause = exc if isinstance(exc, (UserInterrupt, _Interrupted)) else (exc.__cause__ or exc.__context__)
            signum = cause.signum if isinstance(cause, (UserInterrupt, _Interrupted)) else signal.SIGINT
            click.echo(f"interrupted by {signal.Signals(signum).name}", err=True)
            sys.exit(128 + signum)
        except SystemExit:
            raise
        except Exception as exc:
            if os.environ.get("HARNESS_TRACEBACK"):
                raise
            text = _one_line(str(exc))[:300]
            _say(f"{type(exc).__name__}" + (f": {text}" if text else ""))
            sys.exit(EXIT_UNUSABLE)
        sys.exit(rv if isinstance(rv, int) else 0)
