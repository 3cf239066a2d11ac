"""vLLM's own scheduler tests as the field corpus, per release (issue 22): ``harness vllm-tests``
on whole test files, with the figures the docs quote.

    HARNESS_VLLM_ENVS=... .venv/bin/python bench/vllm_own_tests.py [VERSION ...] \\
        [--files tests/v1/core/test_scheduler.py ...] [-k EXPR] [-o DIR] [--from DIR] [--smoke]

Default: 0.33.0 on every file of its ``tests/v1/core`` that builds a scheduler
(``own_tests.scheduler_test_files``: a ``create_scheduler*(`` or ``Scheduler(`` call; found in each
release's own tests, which differ from release to release; ``--files`` chooses instead). The envs must
exist: ``harness vllm-env VERSION``. For each release it prints the per-file table of
``harness vllm-tests``, the totals against the goals of issue 22 (no test broken by the recorder, at
least 90 % of recordings converted, no unexplained violation, replay identical on every clean trace)
and the CPU seconds of the plain and the injected pytest runs (their ratio: what the recorder costs
on vLLM's own tests). ``--smoke`` (what tests/test_bench_smoke.py runs; needs the 0.33.0 env and its
sdist, cached or fetched): 0.33.0 on two tests of ``test_scheduler.py``, in a temporary folder.
``--from DIR``: no pytest run; the analysis (convert, check, replay) is redone with this checkout's
code on what ``harness vllm-tests VERSION -o DIR/VERSION`` left there (its JUnit files, recordings
and report.json, whose pytest CPU seconds are quoted). A goal missed is a figure, not a failure:
the exit is 0 when every release ran, 2 when one could not. The figures go to the
``vllm_own_tests`` section of docs/benchmarks.md (bench/page.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/page.py
import page  # noqa: E402

#: The smoke run's selection: two of 0.33.0's scheduler tests (a preemption mid-step, a prefix-cache reset).
SMOKE_SELECTION = "test_preempt_during_execution or test_scheduler_reset_prefix_cache"


def _default_files(version: str) -> list[str] | str:
    """Every file of the release's ``tests/v1/core`` that builds a scheduler, or why
    there is none (no sdist cached and none fetched)."""
    from harness.candidates.vllm import own_tests

    try:
        root = own_tests.extract_tests(version, own_tests.fetch_sdist(version))
    except own_tests.OwnTestsError as exc:
        return str(exc)
    return own_tests.scheduler_test_files(root) or f"no file of vLLM {version}'s tests/v1/core builds a scheduler"


def _run(version: str, files: list[str], select: str, out: Path) -> dict | str:
    """``harness vllm-tests VERSION -o OUT --json``: its report, or why there is none.
    No ``files``: every file of the release's tests/v1/core that builds a scheduler."""
    if not files:
        found = _default_files(version)
        if isinstance(found, str):
            return found
        files = found
    # This checkout's harness (``-m`` from REPO), whichever venv runs the bench.
    cmd = [sys.executable, "-m", "harness.cli", "vllm-tests", version, "-o", str(out.resolve()), "--json"]
    for f in files:
        cmd += ["--files", f]
    if select:
        cmd += ["-k", select]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode not in (0, 1):
        return f"harness vllm-tests exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    return json.loads(proc.stdout)


def _reanalyse(version: str, out: Path) -> dict | str:
    """The report of an earlier ``harness vllm-tests VERSION -o OUT``, analysed again."""
    from harness.candidates.vllm import own_tests
    from harness.vllm_tests_report import analyse

    saved = out / "report.json"
    if not saved.is_file() or not (out / "injected.xml").is_file():
        return f"{out}: no report.json and injected.xml (run `harness vllm-tests {version} -o {out}`)"
    old = json.loads(saved.read_text())
    root = own_tests.extract_tests(version, own_tests.sdist_path(version))
    plain = own_tests._junit_outcomes(out / "plain.xml", root)
    injected = own_tests._junit_outcomes(out / "injected.xml", root)
    started = time.process_time()
    report = analyse(plain, injected, out / "recordings", out / "traces", version)
    report.update(plain_cpu_s=old["plain_cpu_s"], injected_cpu_s=old["injected_cpu_s"],
                  analysis_cpu_s=round(time.process_time() - started, 1))
    return report


def _not_replayed(report: dict) -> str:
    """Why clean traces were not replayed: a feature the reference cannot re-drive
    (``not-replayed-unmodelled``), or no semantics profile measured for the release."""
    unmodelled = report["artefacts"].get("not-replayed-unmodelled", 0)
    unprofiled = report["clean"] - report["replay_identical"] - report["replay_diverged"] - unmodelled
    parts = ([f"{unmodelled} not replayed: an unmodelled feature"] if unmodelled else []) + (
        [f"{unprofiled} not replayed: no semantics profile measured for {report['version']}"]
        if unprofiled else [])
    return f"; {', '.join(parts)}" if parts else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=["0.33.0"])
    parser.add_argument("--files", nargs="*", default=[])
    parser.add_argument("-k", dest="select", default="", help="pytest's -k selection")
    parser.add_argument("-o", "--out", default="/tmp/vllm-own-tests")
    parser.add_argument("--from", dest="reuse", default=None, metavar="DIR",
                        help="Analyse DIR/VERSION again (no pytest run).")
    parser.add_argument("--smoke", action="store_true",
                        help=f"the test suite's run: 0.33.0, test_scheduler.py -k '{SMOKE_SELECTION}'")
    args = parser.parse_args()
    if args.smoke:
        from harness.candidates.vllm.own_tests import OwnTestsError, fetch_sdist

        args.versions, args.files, args.select = ["0.33.0"], ["tests/v1/core/test_scheduler.py"], SMOKE_SELECTION
        args.out, args.reuse = tempfile.mkdtemp(prefix="vllm-own-tests-"), None
        try:
            fetch_sdist("0.33.0")
        except OwnTestsError as exc:  # no index reachable and nothing cached: nothing to run
            print(f"skipped: {exc}")
            return 0
    print(f"# bench/vllm_own_tests.py {' '.join(sys.argv[1:])} on {platform.node()} "
          f"({platform.processor() or platform.machine()})")
    worst = 0
    for version in args.versions:
        where = Path(args.reuse or args.out) / version
        report = _reanalyse(version, where) if args.reuse else _run(version, args.files, args.select, where)
        if isinstance(report, str):
            print(f"vLLM {version}: {report}")
            worst = 2
            continue
        from harness.vllm_tests_report import render

        for line in render(report):
            print(line.replace(f"{where}/recordings/", ""))  # a refusal names its file: no machine path
        rec = report["recordings"] or 1
        print(f"goals {version}: broken_by_recorder {len(report['broken_by_recorder'])} (goal 0); "
              f"converted {report['converted']}/{report['recordings']} = {100 * report['converted'] / rec:.0f} % "
              f"(goal >= 90 %); unexplained violations {len(report['violations'])} (goal 0); replay "
              f"{report['replay_identical']} identical, {report['replay_diverged']} diverged of "
              f"{report['clean']} clean (goal: all identical){_not_replayed(report)}")
        ratio = report["injected_cpu_s"] / report["plain_cpu_s"] if report["plain_cpu_s"] else float("nan")
        print(f"cpu {version}: plain pytest {report['plain_cpu_s']} s, injected {report['injected_cpu_s']} s "
              f"(x{ratio:.2f})" + (f"; analysis {report['analysis_cpu_s']} s" if "analysis_cpu_s" in report
                                   else ""))
    return worst


if __name__ == "__main__":
    sys.exit(page.run(main, "vllm_own_tests"))
