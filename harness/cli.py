"""The ``harness`` command line: the ``main`` group and where each command lives.

Exit codes for every command: 0 ok, 1 invariant violation or divergence,
2 unusable input (missing, not Parquet, truncated, unknown schema version,
missing column, bad config or workload; an unsealed trace under
``--require-sealed``), with a one-line message naming the file and the
problem; ``check`` and ``replay`` also 3: an incomplete run (salvaged,
crashed, stalled) with no violation in the steps it has (``--allow-incomplete``: 0).

Thin by design: each command module parses its options, calls one function of
the module that owns the work and prints what comes back; errors become exit
codes there. Imports go one way: this module imports the command modules, they
import ``harness.cli_common`` (consoles, exit codes, shared options), none
imports this one.

- ``harness.record_cli``: record, verify-outputs
- ``harness.check_cli``: check (one trace or a corpus), invariants
- ``harness.replay_cli``: replay, diff
- ``harness.golden_cli``: scenario extract, golden check|update, mutants
- ``harness.fuzz_cli``: fuzz
- ``harness.vllm_env_cli``: vllm-env
- ``harness.convert_cli``: convert (a vLLM recording into a trace)
- ``harness.salvage_cli``, ``harness.sweep_cli``, ``harness.vllm_tests_cli``,
  ``harness.bisect.cli``, ``harness.view.cli`` (report, export),
  ``harness.serve.cli`` (model tiny, serve-record)
"""

from __future__ import annotations

import io
import sys

import click

from harness.bisect.cli import bisect
from harness.check_cli import check, invariants
from harness.convert_cli import convert_cmd
from harness.fuzz_cli import fuzz
from harness.golden_cli import golden, mutants, scenario
from harness.record_cli import record, verify_outputs_cmd
from harness.replay_cli import diff, replay
from harness.salvage_cli import salvage_cmd
from harness.serve.cli import register as register_serve
from harness.signals import HarnessGroup
from harness.sweep_cli import sweep
from harness.view.cli import register as register_views
from harness.vllm_env_cli import vllm_env
from harness.vllm_tests_cli import vllm_tests


@click.group(cls=HarnessGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="sched-harness")
def main() -> None:
    """Record, check and replay step traces of LLM-serving schedulers.

    The reference engine mirrors vLLM 0.33.0's v1 scheduler and KV-cache
    manager. Exit codes: 0 ok, 1 violation or divergence, 2 unusable input,
    3 (check, replay) an incomplete run with no violation in the steps it has,
    130 interrupted (SIGINT), 143 terminated (SIGTERM).
    """
    # A file name that is not UTF-8 (held by Python with lone surrogates)
    # is printed as \xNN, never a UnicodeEncodeError ending the command after
    # its work (adversarial trial: `check bad\xffname.parquet`).
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and stream.errors == "strict":
            stream.reconfigure(errors="backslashreplace")


for _command in (record, verify_outputs_cmd, check, invariants, replay, diff, scenario, golden, mutants,
                 vllm_env, fuzz, salvage_cmd, convert_cmd, bisect, sweep, vllm_tests):
    main.add_command(_command)
register_views(main)  # report, export
register_serve(main)  # model tiny, serve-record

if __name__ == "__main__":
    main(prog_name="harness")
