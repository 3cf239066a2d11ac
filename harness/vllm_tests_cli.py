"""``harness vllm-tests VERSION...``: vLLM's own scheduler tests, plain and recorded (own_tests.py),
one release after another or, with ``--ray``, one Ray task per release (vllm_tests_ray.py)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from harness.sweep_cli import join_ray, ray_option
from harness.vllm_tests_run import (OUTPUT_FILES, ReleaseRun, clear_stale_recordings, run_release,
                                    worst_exit)

__all__ = ["clear_stale_recordings", "vllm_tests"]

_err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
_out = Console(highlight=False, soft_wrap=True, emoji=False)


def _fail(message: str) -> None:
    _err.print(f"error: {message}", markup=False)
    sys.exit(2)


def release_verdict(run: ReleaseRun) -> str:
    """A release's closing line: what it found and where the report is."""
    if run.report is None:
        return f"vllm-tests {run.version}: error: {run.error}"
    r = run.report
    # A run that checked nothing says so (new-user trial: "0 checkable" then a clean-looking verdict).
    nothing = ("; nothing was checked: no recording had a complete step" if not r.get("checkable") else "")
    return (f"vllm-tests {run.version}: {len(r['broken_by_recorder'])} test(s) broken by the recorder, "
            f"{len(r['violations'])} unexplained violation(s){nothing}; "
            f"report in {Path(run.out_dir) / 'report.json'}")


def runs_verdict(runs: list[ReleaseRun]) -> str:
    """The closing line of a run of several releases."""
    code = worst_exit([r.exit for r in runs])
    counts = [f"{sum(r.exit == c for r in runs)} {word}" for c, word in
              ((0, "clean"), (1, "with findings"), (2, "unusable"))]
    return f"vllm-tests: {len(runs)} releases: {', '.join(counts)} (exit {code})"


@click.command("vllm-tests")
@click.argument("versions", nargs=-1, required=True, metavar="VERSION...")
@click.option("--files", "files", multiple=True, metavar="F",
              help="A test file of the release, relative to its source root (repeatable; default "
                   "tests/v1/core/test_scheduler.py and tests/v1/core/test_prefix_caching.py).")
@click.option("-k", "k", default=None, metavar="EXPR", help="pytest's -k selection.")
@click.option("-o", "out_dir", default=None, type=click.Path(file_okay=False),
              help="Folder for the recordings, traces, JUnit files and report.json (several "
                   "releases: one subfolder DIR/VERSION each; default: a new temporary folder per "
                   "release, named at the end).")
@ray_option("each release")
@click.option("--json", "as_json", is_flag=True,
              help="Print the report as one JSON object (several releases: one object with ok, exit, "
                   "runner and releases, a report each).")
def vllm_tests(versions: tuple[str, ...], files: tuple[str, ...], k: str | None, out_dir: str | None,
               ray_address: str | None, as_json: bool) -> None:
    """Run vLLM VERSION's own scheduler tests (from its sdist on PyPI, fetched without building
    it, hash-checked, cached beside the vLLM envs) twice in its env: plain, and with the
    recording scheduler injected into every Scheduler/AsyncScheduler the tests build. Every
    recording is converted, checked under auto and safety, and replayed on the reference when
    the release's profile was measured on it. A test passing plain and failing injected is a
    recorder defect (listed, exit 1); so is an unexplained violation. Exit 2: the release's
    tests cannot be fetched or run. Build the env first: `harness vllm-env VERSION` (with
    --ray, a node lacking it builds it). Several releases run one after another, or in
    parallel with --ray, each with its own report; the exit is the worst of theirs."""
    from harness.candidates.vllm import own_tests
    from harness.candidates.vllm.env import check_version

    chosen = list(dict.fromkeys(versions))  # a release named twice runs once
    if ray_address is not None and re.fullmatch(r"\d+(\.\d+)+", ray_address):
        _fail(f"--ray {ray_address}: that is a release, not a Ray address; put --ray after the "
              f"releases, or write --ray=ADDRESS")
    for version in chosen:
        try:
            check_version(version)
        except Exception as exc:  # one line, as every command's bad input
            _fail(str(exc))
    several = len(chosen) > 1
    if out_dir is not None:
        # Absolute: pytest runs in the sdist's folder, where a relative --junitxml or recordings
        # folder would land (regression: test_regression_vllm_tests_relative_out_dir_lost_results).
        root = Path(out_dir).resolve()
        outs = [root / v for v in chosen] if several else [root]
        from harness.paths import OutputPathError, check_output_folder

        try:  # before the sdists are fetched and the tests run (minutes)
            for out in outs:
                check_output_folder(str(out), OUTPUT_FILES)
                check_output_folder(str(out / "recordings"))
        except OutputPathError as exc:
            _fail(str(exc))
    else:
        outs = [Path(tempfile.mkdtemp(prefix=f"vllm-tests-{v}-")) for v in chosen]
    chosen_files = list(files) or list(own_tests.DEFAULT_FILES)

    def log(version: str, line: str) -> None:
        if not as_json:
            _err.print(f"[dim]vllm-tests:[/] {escape(f'{version}: ' if several else '')}{escape(line)}")

    if ray_address is None:
        runs = [run_release(v, chosen_files, k, out, lambda line, v=v: log(v, line))
                for v, out in zip(chosen, outs)]
        runner = "local"
    else:
        runs = _run_on_ray(ray_address, chosen, chosen_files, k, outs, log, as_json)
        runner = "Ray " + ("local cluster" if ray_address == "local" else ray_address)
    code = worst_exit([r.exit for r in runs])
    if not several:
        run = runs[0]
        if run.report is None:
            _fail(run.error or "?")
        if as_json:
            print(json.dumps(run.report, sort_keys=True))
        else:
            _print_release(run)
        sys.exit(code)
    if as_json:
        print(json.dumps({"ok": code == 0, "exit": code, "runner": runner,
                          "releases": [r.to_dict() for r in runs]}, sort_keys=True))
    else:
        for run in runs:
            _print_release(run)
        _out.print(runs_verdict(runs), style="bold red" if code else "bold green", markup=False)
    sys.exit(code)


def _print_release(run: ReleaseRun) -> None:
    """A release's table and lists (``vllm_tests_report.render``) and its verdict line."""
    from harness.vllm_tests_report import render

    for line in render(run.report) if run.report is not None else []:
        _out.print(line, markup=False)
    _out.print(release_verdict(run), style="bold red" if run.exit else "bold green", markup=False)


def _run_on_ray(ray_address: str, versions: list[str], files: list[str], k: str | None, outs: list[Path],
                log, as_json: bool) -> list[ReleaseRun]:
    """The releases as Ray tasks on the cluster at ``ray_address`` (``local``:
    a local cluster started for the run), with a line as each one ends."""
    from harness.candidates.vllm.env import envs_root, is_ready
    from harness.vllm_tests_ray import vllm_tests_ray

    if ray_address == "local":  # this machine's env root is the nodes'
        to_build = [v for v in versions if not is_ready(v)]
        if to_build and not as_json:
            _err.print(f"vllm-tests: building the vLLM env of {len(to_build)} release(s) not yet built "
                       f"under {envs_root()}: {', '.join(to_build)} (35-90 s and 16-170 MB each)",
                       markup=False)
    elif not as_json:
        _err.print(f"vllm-tests: on Ray at {ray_address}, a node lacking a release's vLLM env builds it "
                   f"first (35-90 s and 16-170 MB each, under that node's HARNESS_VLLM_ENVS)", markup=False)

    def done(i: int, run: ReleaseRun) -> None:
        log(versions[i], f"done (exit {run.exit})" + (f": {run.error}" if run.error else ""))

    with contextlib.ExitStack() as stack:
        join_ray(stack, ray_address, _err, enabled=not as_json)
        return vllm_tests_ray(versions, files, k, outs, log=log, on_release=done)
