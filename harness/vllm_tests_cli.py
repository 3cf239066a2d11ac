"""``harness vllm-tests VERSION``: vLLM's own scheduler tests, plain and recorded (own_tests.py)."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

_err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
_out = Console(highlight=False, soft_wrap=True, emoji=False)


@click.command("vllm-tests")
@click.argument("version")
@click.option("--files", "files", multiple=True, metavar="F",
              help="A test file of the release, relative to its source root (repeatable; default "
                   "tests/v1/core/test_scheduler.py and tests/v1/core/test_prefix_caching.py).")
@click.option("-k", "k", default=None, metavar="EXPR", help="pytest's -k selection.")
@click.option("-o", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for the recordings, traces, JUnit files and report.json "
                   "(default: a new temporary folder, named at the end).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def vllm_tests(version: str, files: tuple[str, ...], k: str | None, out_dir: str | None,
               as_json: bool) -> None:
    """Run vLLM VERSION's own scheduler tests (from its sdist on PyPI, fetched without building
    it, hash-checked, cached beside the vLLM envs) twice in its env: plain, and with the
    recording scheduler injected into every Scheduler/AsyncScheduler the tests build. Every
    recording is converted, checked under auto and safety, and replayed on the reference when
    the release's profile was measured on it. A test passing plain and failing injected is a
    recorder defect (listed, exit 1); so is an unexplained violation. Exit 2: the release's
    tests cannot be fetched or run. Build the env first: `harness vllm-env VERSION`."""
    from harness.candidates.vllm import own_tests
    from harness.candidates.vllm.env import check_version
    from harness.vllm_tests_report import analyse, render

    def log(line: str) -> None:
        if not as_json:
            _err.print(f"[dim]vllm-tests:[/] {escape(line)}")

    try:
        check_version(version)
    except Exception as exc:  # one line, as every command's bad input
        _err.print(f"error: {exc}", markup=False)
        sys.exit(2)
    if out_dir is not None:
        from harness.paths import OutputPathError, check_output_folder

        try:  # before the sdist is fetched and the tests run (minutes)
            check_output_folder(out_dir, ("report.json", "plain.xml", "injected.xml"))
            check_output_folder(str(Path(out_dir) / "recordings"))
        except OutputPathError as exc:
            _err.print(f"error: {exc}", markup=False)
            sys.exit(2)
    # Absolute: pytest runs in the sdist's folder, where a relative --junitxml or recordings
    # folder would land (regression: test_regression_vllm_tests_relative_out_dir_lost_results).
    out = Path(out_dir).resolve() if out_dir else Path(tempfile.mkdtemp(prefix=f"vllm-tests-{version}-"))
    chosen = list(files) or list(own_tests.DEFAULT_FILES)
    try:
        root = own_tests.prepare(version, log)
        missing = [f for f in chosen if not (root / f).is_file()]
        if missing:
            _err.print(f"error: vLLM {version}'s sdist has no {', '.join(missing)}", markup=False)
            sys.exit(2)
        out.mkdir(parents=True, exist_ok=True)
        record_dir = out / "recordings"
        clear_stale_recordings(record_dir)
        plain = own_tests.run_pytest(version, root, chosen, k, None, out / "plain.xml", log, "plain")
        injected = own_tests.run_pytest(version, root, chosen, k, record_dir, out / "injected.xml",
                                        log, "injected")
    except own_tests.OwnTestsError as exc:
        _err.print(f"error: {exc}", markup=False)
        sys.exit(2)
    report = analyse(plain.outcomes, injected.outcomes, record_dir, out / "traces", version, log)
    report.update(plain_cpu_s=round(plain.cpu_s, 1), injected_cpu_s=round(injected.cpu_s, 1),
                  out_dir=str(out))
    tmp = out / f".report.{os.getpid()}.json"
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(tmp, out / "report.json")
    found = bool(report["broken_by_recorder"] or report["violations"] or report["recorder_errors"])
    if as_json:
        print(json.dumps(report, sort_keys=True))
    else:
        for line in render(report):
            _out.print(line, markup=False)
        verdict = (f"vllm-tests {version}: {len(report['broken_by_recorder'])} test(s) broken by the "
                   f"recorder, {len(report['violations'])} unexplained violation(s); report in "
                   f"{out / 'report.json'}")
        _out.print(verdict, style="bold red" if found else "bold green", markup=False)
    sys.exit(1 if found else 0)


#: The files the injected recorder writes in ``-o``'s recordings/ (``NNNNN.jsonl``, one per
#: scheduler, ``NNNNN.dpR.jsonl`` per data-parallel rank, and ``manifest.jsonl``).
_RECORDING_NAME = re.compile(r"(\d{5}(\.dp\d+)?|manifest)\.jsonl")


def clear_stale_recordings(record_dir: Path) -> list[str]:
    """Remove a previous run's recordings from ``record_dir`` (the names the
    recorder writes, nothing else); returns the names removed.

    Regression (adversarial trial): every entry of ``-o DIR/recordings`` was
    unlinked, so ``-o`` naming a folder of one's own lost its recordings/
    files (and a subfolder there ended the run with a traceback)."""
    removed = []
    if record_dir.is_dir():
        for stale in sorted(record_dir.iterdir()):
            if _RECORDING_NAME.fullmatch(stale.name) and stale.is_file() and not stale.is_symlink():
                stale.unlink()
                removed.append(stale.name)
    return removed
