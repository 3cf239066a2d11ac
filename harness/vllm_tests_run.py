"""One release's run of ``harness vllm-tests``: fetch and prepare its tests, run
them plain and injected, analyse the recordings, write ``report.json``.

``run_release`` is the whole of it, the same code for the local run (one
release after another) and for a Ray task (``harness.vllm_tests_ray``, one task
per release); its result, ``ReleaseRun``, is either the report or the one line
saying why the release's tests could not be fetched or run.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

Log = Callable[[str], None]

#: Exit codes of a release, and their order of severity in a run of several
#: (the most severe is the command's): nothing found < a finding < unusable.
EXIT_CLEAN, EXIT_FOUND, EXIT_UNUSABLE = 0, 1, 2

#: The files the injected recorder writes in ``-o``'s recordings/ (``NNNNN.jsonl``, one per
#: scheduler, ``NNNNN.dpR.jsonl`` per data-parallel rank, and ``manifest.jsonl``).
_RECORDING_NAME = re.compile(r"(\d{5}(\.dp\d+)?|manifest)\.jsonl")

#: What a run writes directly in its output folder (checked before anything runs).
OUTPUT_FILES = ("report.json", "plain.xml", "injected.xml")


@dataclass
class ReleaseRun:
    """One release's outcome: ``report`` (``vllm_tests_report.analyse``'s dict,
    with the CPU seconds of both pytest runs and ``out_dir``) and ``exit``
    (0 nothing found, 1 a test broken by the recorder, an unexplained
    violation or a recorder error), or ``error`` (one line) and ``exit`` 2: the
    release's tests could not be fetched, prepared or run."""

    version: str
    exit: int
    out_dir: str
    report: dict[str, Any] | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The release's entry of a several-release ``--json``: the report's
        keys (or ``version``, ``out_dir``), plus ``exit`` and ``error``."""
        head = dict(self.report) if self.report is not None else {"version": self.version,
                                                                 "out_dir": self.out_dir}
        return {**head, "exit": self.exit, "error": self.error}


def report_exit(report: dict[str, Any]) -> int:
    """1 if the report holds a finding (a test broken by the recorder, an
    unexplained violation, a recorder error), else 0."""
    found = report["broken_by_recorder"] or report["violations"] or report["recorder_errors"]
    return EXIT_FOUND if found else EXIT_CLEAN


def worst_exit(codes: list[int]) -> int:
    """The most severe of ``codes`` (0 < 1 < 2); 0 for none."""
    return max(codes, default=EXIT_CLEAN)


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


def write_report(out: Path, report: dict[str, Any]) -> None:
    """``out/report.json`` (written to a temporary file, then renamed)."""
    tmp = out / f".report.{os.getpid()}.json"
    tmp.write_text(json.dumps(report, indent=1, sort_keys=True))
    os.replace(tmp, out / "report.json")


def run_release(version: str, files: list[str], k: str | None, out: Path, log: Log = lambda _: None,
                *, build_env: bool = False) -> ReleaseRun:
    """vLLM ``version``'s test ``files`` (paths in its source tree; ``k``:
    pytest's ``-k``) run plain and injected in its env, every recording
    converted, checked and replayed (``vllm_tests_report.analyse``), the report
    written to ``out/report.json`` beside the JUnit files, ``recordings/`` and
    ``traces/``. ``build_env``: build the release's env when missing (a Ray
    node); otherwise a missing env is the error "build it with harness
    vllm-env". Never raises for the release's failures (they are the result's
    ``error``); ``log`` gets progress lines (a few seconds apart)."""
    from harness.candidates.vllm import own_tests
    from harness.candidates.vllm.env import VLLMEnvError, ensure_env, is_ready
    from harness.vllm_tests_report import analyse

    def unusable(message: str) -> ReleaseRun:
        return ReleaseRun(version, EXIT_UNUSABLE, str(out), error=" ".join(message.split()))

    try:
        if build_env and not is_ready(version):
            log(f"no vLLM {version} env here: building it (35-90 s)")
            try:
                ensure_env(version, log=log)
            except VLLMEnvError as exc:
                return unusable(f"no env for vLLM {version} and it could not be built: {exc}")
        root = own_tests.prepare(version, log)
        missing = [f for f in files if not (root / f).is_file()]
        if missing:
            return unusable(f"vLLM {version}'s sdist has no {', '.join(missing)}")
        out.mkdir(parents=True, exist_ok=True)
        record_dir = out / "recordings"
        clear_stale_recordings(record_dir)
        plain = own_tests.run_pytest(version, root, files, k, None, out / "plain.xml", log, "plain")
        injected = own_tests.run_pytest(version, root, files, k, record_dir, out / "injected.xml",
                                        log, "injected")
    except own_tests.OwnTestsError as exc:
        return unusable(str(exc))
    report = analyse(plain.outcomes, injected.outcomes, record_dir, out / "traces", version, log,
                     plain_messages=plain.messages)
    report.update(plain_cpu_s=round(plain.cpu_s, 1), injected_cpu_s=round(injected.cpu_s, 1),
                  out_dir=str(out))
    write_report(out, report)
    return ReleaseRun(version, report_exit(report), str(out), report=report)
